"""llama.cpp's importance-matrix file beside the GGUF: the calibration statistics `llmq quantize` kept, under
llama.cpp's tensor names, so `llama-quantize --imatrix` can quantize with llmq's calibration. A second file with
its own format (`llama-imatrix`'s), written only where the artifact has statistics.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

from ...models import importance
from ...models.arch import MLP, expert_role
from ...models.reader import CheckpointReader
from .gguf_tensors import gguf_name


def imatrix_entries(src: CheckpointReader, stats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """{llama.cpp tensor name: mean squared input [matrices, in]} of the linears `stats` has: one matrix per
    tensor, one per expert for a merged expert tensor; a fused group (Phi-3's attn_qkv) under its fused name."""
    arch, s = src.arch, src.spec
    out: dict[str, torch.Tensor] = {}
    fused = {r: g for g, (_, roles) in arch.fused.items() for r in roles}
    for i in range(s.num_layers):
        for role in s.roles():
            if role.startswith("experts."):
                continue
            group = fused.get(role)
            key = f"{arch.prefix(i)}.{arch.fused[group][0]}" if group else arch.linear(i, role)
            if key in stats:
                out[f"{gguf_name(group or role, arch, i)}.weight"] = stats[key].float().view(1, -1)
        for role in MLP if s.num_experts else ():
            keys = [arch.linear(i, expert_role(e, role)) for e in range(s.num_experts)]
            if all(k in stats for k in keys):
                out[f"{gguf_name(role, arch, i)}.weight"] = torch.stack([stats[k].float() for k in keys])
    return out


def write_imatrix(src: CheckpointReader, path: Path) -> dict | None:
    """llama.cpp's importance-matrix file, as `llama-imatrix` writes it (GGUF: `<tensor>.in_sum2` sums of squared
    inputs [matrices, in] and `<tensor>.counts` [matrices, 1], F32; general.type imatrix, the datasets, chunk count
    and size), from the calibration statistics `llmq quantize` kept: `llama-quantize --imatrix` then quantizes with
    llmq's calibration. None when the artifact has none (round-to-nearest, or not a quantized artifact)."""
    got = importance.read(src.path)
    if got is None:
        return None
    stats, meta = got
    entries = imatrix_entries(src, stats)
    tokens = meta["tokens"]
    w = gguf.GGUFWriter(None, src.arch.gguf_arch, use_temp_file=True)
    w.add_type("imatrix")
    w.add_array("imatrix.datasets", [f"llmq quantize calibration: {meta['source']}"])
    w.add_uint32("imatrix.chunk_count", meta["windows"])
    w.add_uint32("imatrix.chunk_size", meta["window"])
    for name, mean in sorted(entries.items()):
        w.add_tensor(f"{name}.in_sum2", (mean.double() * tokens).float().numpy())
        w.add_tensor(f"{name}.counts", np.full((mean.shape[0], 1), tokens, np.float32))
    w.write_header_to_file(path)
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {"file": path.name, "tensors": len(entries), "tokens": tokens, "windows": meta["windows"]}
