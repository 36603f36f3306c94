"""Block FP8 (DeepSeek-V3, the Qwen3 FP8 releases; compressed-tensors' FP8_BLOCK: weights strategy "block" with
block_structure [128, 128], activations strategy "group" with group_size 128, dynamic): one float32 weight scale per
128 x 128 block, block amax / 448, the weight rounded once from its exact quotient as per-channel FP8 is; shapes that
128 does not divide get ceil-many blocks, the last ones partial (scale [ceil(N / 128), ceil(K / 128)], the weight
itself unpadded, as compressed-tensors pads only while it computes and vLLM allocates). Activations: per token and per
group of 128 input columns (the last group partial), scale group amax / 448 and quotient in float32, as vLLM's
per-token-group quantization kernel computes them.
"""

from __future__ import annotations

import torch

from .int_fp8 import absmax_scale, to_fp8

FP8_BLOCK = 128  # block FP8's weight block edge and activation group width


def _expand(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """Per-block values [ceil(N / bn), ceil(K / bk)] repeated over their blocks and cut to `shape` [N, K]."""
    return scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:shape[0], :shape[1]]


def _block_amax(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """max |x| per block of x [N, K], partial edge blocks included (zero padding changes no maximum)."""
    n, k = x.shape
    xp = torch.nn.functional.pad(x.abs(), (0, -k % block[1], 0, -n % block[0]))
    return xp.view(xp.shape[0] // block[0], block[0], xp.shape[1] // block[1], block[1]).amax((1, 3))


def fp8_block_quantize(w: torch.Tensor, block: tuple[int, int] = (FP8_BLOCK, FP8_BLOCK)
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Block FP8 of w [N, K]: (float8_e4m3fn [N, K], float32 scales [ceil(N / bn), ceil(K / bk)] = block amax / 448),
    each value rounded once from its exact quotient (float64 holds it)."""
    scale = absmax_scale(_block_amax(w.float(), block), fp8=True)
    q = to_fp8(w.double(), _expand(scale, tuple(w.shape), block).double())
    return q, scale


def dequantize_fp8_blocks(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = (FP8_BLOCK, FP8_BLOCK),
                          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A block-FP8 weight's real values q * scale[block], computed in float32, then `dtype`."""
    return (q.float() * _expand(scale.float(), tuple(q.shape), block)).to(dtype)


def quantize_token_groups(x: torch.Tensor, group: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations x [M, K] in float8 per token and group of `group` columns: (float8_e4m3fn [M, K], float32 scales
    [M, ceil(K / group)] = group amax / 448), the quotient in float32."""
    xf = x.float()
    s = absmax_scale(_block_amax(xf, (1, group)), fp8=True)
    return to_fp8(xf, _expand(s, tuple(xf.shape), (1, group))), s
