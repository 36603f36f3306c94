"""The quality of a `--target gguf` file as llama.cpp's CPU backend computes it, modelled, beside llmq's own.

The same integers do not give the same logits in the two engines: llama.cpp multiplies each weight by activations
rounded to the weight type's vec_dot_type (Q8_0 blocks for Q8_0 / Q4_0 / MXFP4, Q8_K for the k-quants, F16 / BF16 for
16-bit weights: quant.ggml_activations), where llmq's runtime multiplies 16-bit or float32 activations. So the build
measures both on the same held-out windows (the quantize probe's text) against the source model run by llmq's
runtime in float32: the artifact as llmq's runtime computes it, and the file as llama.cpp computes it, each linear's
weight being what the file's blocks decode to (gguf-py's decoders of the very bytes the writer packs: fp16 block
scales, NVFP4's float32 output scale) times the rounded activations (GgmlLinear). Attention, norms, rotary and the
KV cache are the runtime's float32 ones: llama.cpp's F16 KV cache is not modelled, so a gap that remains between this
number and `llama-perplexity --kl-divergence` is there, or in its F16 reference run.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import gguf
import torch
import torch.nn.functional as F
from torch import nn

from ... import quant
from ...errors import LlmqError
from ...models.linear_weights import LinearWeights
from ...models.reader import CheckpointReader
from ...models.sharding import RankWeights
from ...runtime.model_runner import rank_weights, score_in_process
from .gguf_blocks import Rounding, block_type, dense_array, pack_blocks

ARITHMETIC = ("modelled llama.cpp CPU arithmetic: the GGUF blocks as they decode, activations rounded per weight type "
              "as ggml-cpu's vec_dot_type (Q8_0 / Q8_K / F16 / BF16); attention and KV cache float32 (llama.cpp's "
              "F16 KV cache not modelled)")


@dataclasses.dataclass
class GgmlWeights(LinearWeights):
    """A linear as llama.cpp computes with it: the GGUF tensor's decoded values (weight, float32), its GGML type and
    the float32 multiplier of its output (NVFP4's `.scale`), if any."""

    ggml_type: str = "F32"
    output_scale: float | None = None


def file_weights(lw: LinearWeights) -> GgmlWeights:
    """What the GGUF writer makes of `lw`, decoded as llama.cpp decodes it."""
    if lw.qw is None:
        _, qtype = dense_array(lw.weight)
        return GgmlWeights(lw.name, weight=lw.weight.float(), bias=lw.bias, ggml_type=qtype.name)
    qtype = block_type(lw.qw, lw.name)
    rounding = Rounding()
    w = gguf.quants.dequantize(pack_blocks(lw.qw, qtype, rounding), qtype)
    g = getattr(lw.qw, "global_scale", None)
    return GgmlWeights(lw.name, weight=torch.from_numpy(w).reshape(lw.shape), bias=lw.bias, ggml_type=qtype.name,
                       output_scale=float(rounding.reciprocal(g.reshape(1))) if g is not None else None)


class GgmlLinear(nn.Module):
    """One matmul node per part (llama.cpp's q, k and v are separate tensors), each on its activations as ggml-cpu
    rounds them for that part's type; float32 products and biases."""

    def __init__(self, parts: list[GgmlWeights]):
        super().__init__()
        self.parts = parts
        self.bias = None   # the runtime adds a row-parallel bias itself; the parts carry theirs

    @property
    def nbytes(self) -> int:
        """Bytes of the decoded weights (what the runtime's layers report; a mixture of experts sums them)."""
        return sum(p.weight.numel() * p.weight.element_size() for p in self.parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1]).float()
        outs = []
        for p in self.parts:
            y = F.linear(quant.ggml_activations(x2, p.ggml_type), p.weight)
            if p.output_scale is not None:
                y = y * p.output_scale
            outs.append(y + p.bias.float() if p.bias is not None else y)
        return torch.cat(outs, -1).reshape(*x.shape[:-1], -1)


def file_rank(src: CheckpointReader) -> RankWeights:
    """The model's weights as the GGUF file holds them: every linear decoded (GgmlWeights), an INT8 embedding table
    as its Q8_0 rows decode (a 16-bit one is looked up exactly as stored, as llama.cpp's get_rows does)."""
    rw = rank_weights(src, None, 0)
    embed = rw.embed if rw.embed.qw is None else LinearWeights(rw.embed.name, weight=file_weights(rw.embed).weight)
    return dataclasses.replace(rw, layers=[{n: file_weights(lw) for n, lw in layer.items()} for layer in rw.layers],
                               embed=embed, lm_head=file_weights(rw.lm_head))


def modelled_quality(src: CheckpointReader, base: CheckpointReader, tokens: int) -> dict:
    """KLD / top-1 of the artifact (llmq's runtime) and of its GGUF file (modelled llama.cpp CPU arithmetic) against
    `base` (llmq's runtime, float32), on the same ~`tokens` held-out tokens; skipped where memory cannot hold it."""
    from ...models.load import load_tokenizer
    from ...runtime.worker import available_memory
    from ..quantize.calib import load_probe_text
    from ..quantize.probe import ProbeAccumulator

    s = src.spec
    need = 6 * s.num_parameters() + 3 * 4 * tokens * s.vocab_size   # float32 weights as computed, 16-bit as read
    have = available_memory(torch.device("cpu"))
    if need > have:
        return {"skipped": f"modelling llama.cpp's arithmetic in float32 needs about {need / 2**30:.1f} GiB, "
                           f"{have / 2**30:.1f} GiB are available"}
    if src.spec.vocab_size != base.spec.vocab_size:
        raise LlmqError(f"{src.path}: its vocabulary ({src.spec.vocab_size}) is not its source model's "
                        f"({base.spec.vocab_size})")
    probe = load_probe_text(load_tokenizer(src.path), tokens)
    ids = torch.stack(probe.samples)

    def logits(reader: CheckpointReader, rw: RankWeights, linear_module=None) -> torch.Tensor:
        with torch.no_grad():
            return score_in_process([rw], reader.config, s.num_heads, s.num_kv_heads, ids,
                                    linear_module=linear_module)

    ref = logits(base, rank_weights(base, None, 0))
    out: dict[str, Any] = {"text": probe.source, "tokens": int(ids.numel()), "windows": int(ids.shape[0])}
    for key, (rw, module) in (("llmq_runtime", (rank_weights(src, None, 0), None)),
                              ("llama_cpp_modelled", (file_rank(src), GgmlLinear))):
        acc = ProbeAccumulator()
        acc.add(ref, logits(src, rw, module))
        r = acc.result()
        out[key] = {"kld_mean": r["kld_mean"], "kld_max": r["kld_max"], "top1": r["top1"]}
    out["llama_cpp_modelled"]["arithmetic"] = ARITHMETIC
    return out
