"""Block FP8 (W8A8: a float32 scale per 128 x 128 weight block, activations quantized per token per group of 128).

Elsewhere than a Hopper GPU the layer reproduces the kernels' numbers: the activations are rounded to E4M3 with their
per-group scales exactly as `llmq.quant` (and vLLM's kernel) computes them, dequantized, and multiplied in float32 by
the weight dequantized block by block, which equals a float64 dequantize-then-matmul within float32 rounding; on CPUs
with AVX512-VBMI and -BF16 from the packed bytes (cpu_kernels.fp8_linear: the same rounding and exact products,
float32 sums; a decode step's DecoderStack runs it too). On Hopper (compute capability 9.x) with 128-aligned shapes it
runs torch's blockwise-scaled GEMM (`torch.nn.functional.scaled_mm`, BlockWise1x128 activations x BlockWise128x128
weights, cuBLASLt from CUDA 12.9), if a probe call at load succeeds (else `fallback_reason` says why). cuBLASLt wants
the token count a multiple of 4: decode batches are padded with zero rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ... import quant
from . import cpu_kernels
from .linear import LinearBase, one_line, set_buffer
from .stack import FusedLinear, Kind


class BlockFP8Linear(LinearBase):
    def __init__(self, qw, bias: torch.Tensor | None, dtype: torch.dtype, device):
        super().__init__()
        self.out_features, self.in_features = n, k = qw.q.shape
        self.block = tuple(qw.block)
        set_buffer(self, "bias", bias.to(device=device, dtype=dtype) if bias is not None else None)
        self.packed = torch.device(device).type == "cpu" and cpu_kernels.fp8_fits(n, k, self.block[1])
        if self.packed:
            for name, t in zip(("lb_codes", "lb_s"), cpu_kernels.pack_fp8(qw.q.to(quant.FP8), qw.scale, self.block)):
                set_buffer(self, name, t)
        else:
            set_buffer(self, "w", qw.q.to(device=device, dtype=quant.FP8))
            set_buffer(self, "scale", qw.scale.to(device=device, dtype=torch.float32))
        self.scaled_mm, self.fallback_reason = False, None
        if not self.packed and self.w.device.type == "cuda" and self.block == (128, 128) and n % 128 == 0 and \
                k % 128 == 0 and torch.cuda.get_device_capability(self.w.device)[0] == 9 and hasattr(F, "scaled_mm"):
            self.register_buffer("scale_b", scaled_mm_weight_scales(self.scale), persistent=False)  # kept transposed
            try:
                blockwise_scaled_mm(torch.zeros(1, k, device=self.w.device), self.w, self.scale_b)
                self.scaled_mm = True
            except (RuntimeError, NotImplementedError, TypeError, ValueError) as e:
                self.fallback_reason = one_line(e)
                self._buffers.pop("scale_b")

    @classmethod
    def joined(cls, parts: list[LinearBase], bias: torch.Tensor | None) -> BlockFP8Linear | None:
        """Column-parallel packed block-FP8 layers as one (q / k / v whose widths end inside a 128-row block, as
        SmolLM2's 960 do: one block-scale grid cannot hold them, but the kernel's scales are per row, so the packed
        parts concatenate): one kernel call a step instead of one a part, and a DecoderStack takes the layer. bias:
        the parts' biases concatenated (loader.build_linear's). None unless every part is a packed block-FP8 layer of
        one group width."""
        packed = [p for p in parts if isinstance(p, BlockFP8Linear) and p.packed]
        if len(packed) < len(parts) or len({p.block for p in packed}) > 1:
            return None
        layer = cls.__new__(cls)
        LinearBase.__init__(layer)
        layer.out_features, layer.in_features = sum(p.out_features for p in packed), packed[0].in_features
        layer.block, layer.packed, layer.scaled_mm, layer.fallback_reason = packed[0].block, True, False, None
        set_buffer(layer, "bias", bias)
        set_buffer(layer, "lb_codes", torch.cat([p.lb_codes for p in packed]))
        set_buffer(layer, "lb_s", torch.cat([p.lb_s for p in packed]))
        return layer

    def fused_spec(self) -> FusedLinear | None:
        """What forward runs on a decode batch, for a cpu_kernels DecoderStack: the packed weight on fp8_linear."""
        return FusedLinear(Kind.FP8, (self.lb_codes, self.lb_s), self.block[1]) if self.packed else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.scaled_mm:
            y = blockwise_scaled_mm(x2, self.w, self.scale_b)
        elif self.packed:
            y = cpu_kernels.fp8_linear(x2, self.lb_codes, self.lb_s, self.block[1])
        else:
            xq, xs = quant.quantize_token_groups(x2, self.block[1])
            xd = quant.dequantize_fp8_blocks(xq, xs, (1, self.block[1]))
            y = F.linear(xd, quant.dequantize_fp8_blocks(self.w, self.scale, self.block))
        return self._finish(y, x.dtype).view(*shape[:-1], self.out_features)


def scaled_mm_weight_scales(scale: torch.Tensor) -> torch.Tensor:
    """Weight block scales [N / 128, K / 128] as torch's BlockWise128x128 operand wants them: [L4, N / 128] with
    strides [1, L4], L4 = K / 128 rounded up to a multiple of 4 (padded with ones)."""
    kb = scale.shape[1]
    return F.pad(scale.float(), (0, -kb % 4), value=1.0).contiguous().t()


def blockwise_scaled_mm(x: torch.Tensor, w: torch.Tensor, scale_b: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w.T on torch's blockwise-scaled FP8 GEMM: x quantized per token per 128 columns (BlockWise1x128,
    scales [M, K / 128] with strides [1, M]), w [N, K] float8 with scale_b from scaled_mm_weight_scales;
    bfloat16 out."""
    m = x.shape[0]
    xq, xs = quant.quantize_token_groups(F.pad(x, (0, 0, 0, -m % 4)), quant.FP8_BLOCK)   # zero rows: scale eps, q 0
    sa = torch.empty_strided(xs.shape, (1, xs.shape[0]), device=xs.device).copy_(xs)
    st = F.ScalingType
    return F.scaled_mm(xq, w.t(), sa, st.BlockWise1x128, scale_b, st.BlockWise128x128,
                       output_dtype=torch.bfloat16)[:m]
