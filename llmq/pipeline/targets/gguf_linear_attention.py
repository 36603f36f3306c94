"""A hybrid model's Gated DeltaNet layers (Arch.linear_attention) as llama.cpp's `qwen35` reads them.

ggml broadcasts the key heads over the value heads tiled (k0, k1, ..., k0, k1, ...) where Hugging Face groups each
key head's value heads together (k0's, then k1's), so every value-head-indexed dimension moves into tiled order:
in_proj_qkv's v rows, in_proj_z's, in_proj_a's and in_proj_b's rows, the convolution's v channels, the decay's A and
dt bias, and out_proj's columns (quantized groups move whole: a value head spans whole groups). The decay is stored
as A = -exp(A_log), the dt bias as `ssm_dt.bias`, the convolution as [channels, kernel], all in float32 as llama.cpp's
converter writes them; the gated norm's weight as it is (it scales by w, not 1 + w).
"""

from __future__ import annotations

import gguf
import torch
from gguf import MODEL_TENSOR as MT

from ...models.reader import CheckpointReader, LinearWeights
from ...models.sharding import split_cols, split_rows


def tiled(key_heads: int, per_key: int, width: int) -> torch.Tensor:
    """Source index of each position of a value-head-major dimension (value heads of `width`) in tiled order."""
    return torch.arange(key_heads * per_key * width).reshape(key_heads, per_key, width).transpose(0, 1).flatten()


def reorder_linear_attention(src: CheckpointReader, i: int, lin: dict[str, LinearWeights]) -> dict[str, torch.Tensor]:
    """Layer i's Gated DeltaNet linears moved into tiled order in `lin`; its other tensors under llama.cpp's names,
    reordered and converted (name -> float32 tensor)."""
    s, la = src.spec, src.arch.linear_attention
    kh, per_key = s.linear_key_heads, s.linear_value_heads // s.linear_key_heads
    qk = 2 * kh * s.linear_key_dim
    values = tiled(kh, per_key, s.linear_value_dim)
    heads = tiled(kh, per_key, 1)
    channels = torch.cat([torch.arange(qk), qk + values])
    if per_key > 1:
        lin["in_proj_qkv"] = split_rows(lin["in_proj_qkv"], channels)
        lin["in_proj_z"] = split_rows(lin["in_proj_z"], values)
        lin["in_proj_a"] = split_rows(lin["in_proj_a"], heads)
        lin["in_proj_b"] = split_rows(lin["in_proj_b"], heads)
        lin["out_proj"] = split_cols(lin["out_proj"], values)
    t = {p.removeprefix(f"{la.module}."): x.float() for p, x in src.layer_tensors(i).items()}
    converted = {"conv1d.weight": t["conv1d.weight"].reshape(s.linear_conv_dim, -1)[channels],
                 "A_log": -t["A_log"].exp()[heads], "dt_bias": t["dt_bias"][heads], "norm.weight": t["norm.weight"]}
    out = {}
    for path, (member, suffix) in la.gguf_tensors.items():
        out[gguf.TENSOR_NAMES[MT[member]].format(bid=i) + suffix] = converted[path]
    return out
