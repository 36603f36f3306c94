"""bitsandbytes' two schemes (`llmq quantize --method bnb-nf4 / bnb-int8`) keep bitsandbytes' own conventions, since
its checkpoints are read by transformers, vLLM and TGI with its kernels: 4-bit codes looked up in a 16-entry table
(NF4) times one absmax per block of the flattened weight; LLM.int8's rows scaled by SCB / 127 and its activations
quantized per row from float16, with outlier columns kept in floating point.
"""

from __future__ import annotations

import torch

from .int_fp8 import INT8_MAX

INV_127, INV_127_SQ = 7.874015718698502e-3, 6.200124e-05  # bitsandbytes' LLM.int8 constants: 1/127 and 1/127^2


def _blockwise(v: torch.Tensor, absmax: torch.Tensor, blocksize: int) -> torch.Tensor:
    """Flat values v times absmax[i // blocksize] (the last block may be short), in float32."""
    n = v.numel()
    v = torch.nn.functional.pad(v.float(), (0, -n % blocksize)).view(-1, blocksize) * absmax.float().view(-1, 1)
    return v.reshape(-1)[:n]


def dequantize_blockwise(q: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, blocksize: int) -> torch.Tensor:
    """bitsandbytes' 8-bit blockwise codes (its double-quantized absmax): code[q] * absmax[block], float32, flat."""
    return _blockwise(code.float()[q.reshape(-1).long()], absmax, blocksize)


def dequantize_4bit(packed: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, blocksize: int,
                    shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """bitsandbytes' 4-bit weight (NF4 / FP4) as real values: code[q] * absmax[block] in float32, then `dtype`.
    packed holds two codes per byte, the first in the high nibble, over the flattened weight; block b covers
    elements [b * blocksize, (b + 1) * blocksize) of it."""
    n = 1
    for d in shape:
        n *= d
    b = packed.reshape(-1).view(torch.uint8)
    code, idx = code.float(), torch.arange(256, device=b.device)
    pairs = torch.stack([code[idx >> 4], code[idx & 15]], -1)  # byte -> (high, low) values: one gather per byte
    return _blockwise(pairs[b.long()].reshape(-1)[:n], absmax, blocksize).reshape(shape).to(dtype)


def llm_int8_dequantize(q: torch.Tensor, scb: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An LLM.int8 weight's real values q * SCB / 127 (per row), computed as bitsandbytes does."""
    return (q.float() * scb.float().view(-1, 1) * INV_127).to(dtype)


def llm_int8_activations(x: torch.Tensor, threshold: float
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """LLM.int8's activation quantization, as bitsandbytes computes it: x [M, K] is cast to float16; entries with
    |x| >= threshold (threshold > 0) are outliers, zeroed before the per-row absmax `row` is taken; x_q =
    round(x * 127 / row). Returns (x_q as float32 integers with the outlier columns zeroed, row [M],
    outlier column indices or None). The caller adds x[:, cols] @ W[:, cols].T in floating point."""
    xh = x.to(torch.float16)
    cols = None
    if threshold > 0:
        out = xh.abs() >= threshold
        cols = out.any(0).nonzero().view(-1)
        xh = xh.masked_fill(out, 0)
    row = xh.abs().amax(1).float()
    q = torch.round(xh * (INT8_MAX / row.unsqueeze(-1)))
    q = torch.nan_to_num(q, nan=0.0)  # an all-zero row: 0 * inf
    if cols is not None and cols.numel():
        q[:, cols] = 0
    return q, row, cols
