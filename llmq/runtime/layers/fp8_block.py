"""Block FP8 (W8A8: a float32 scale per 128 x 128 weight block, activations quantized per token per group of 128).

Elsewhere than a Hopper GPU the layer reproduces the kernels' numbers: the activations are rounded to E4M3 with their
per-group scales exactly as `llmq.quant` (and vLLM's kernel) computes them, dequantized, and multiplied in float32 by
the weight dequantized block by block, which equals a float64 dequantize-then-matmul within float32 rounding. On
Hopper (compute capability 9.x) with 128-aligned shapes it runs torch's blockwise-scaled GEMM
(`torch.nn.functional.scaled_mm`, BlockWise1x128 activations x BlockWise128x128 weights, cuBLASLt from CUDA 12.9), if a
probe call at load succeeds; that path has not been run on a GPU here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ... import quant
from .linear import LinearBase, _buffer, _probe


class BlockFP8Linear(LinearBase):
    def __init__(self, qw, bias: torch.Tensor | None, dtype: torch.dtype, device):
        super().__init__()
        self.out_features, self.in_features = n, k = qw.q.shape
        self.block = tuple(qw.block)
        _buffer(self, "w", qw.q.to(device=device, dtype=quant.FP8))
        _buffer(self, "scale", qw.scale.to(device=device, dtype=torch.float32))
        _buffer(self, "bias", bias.to(device=device, dtype=dtype) if bias is not None else None)
        self.scaled_mm = False
        if self.w.device.type == "cuda" and self.block == (128, 128) and n % 128 == 0 and k % 128 == 0 and \
                torch.cuda.get_device_capability(self.w.device)[0] == 9 and hasattr(F, "scaled_mm"):
            kb = k // 128
            l4 = -(-kb // 4) * 4  # the kernel reads the weight scales' K-block dimension padded to a multiple of 4
            _buffer(self, "scale_b", F.pad(self.scale, (0, l4 - kb), value=1.0).contiguous().t())  # [L4, N/128]
            self.scaled_mm = _probe(lambda: self._scaled_mm(torch.zeros(1, k, device=self.w.device)))
            if not self.scaled_mm:
                self._buffers.pop("scale_b")

    def _scaled_mm(self, x: torch.Tensor) -> torch.Tensor:
        xq, xs = quant.quantize_token_groups(x, self.block[1])
        st = F.ScalingType
        return F.scaled_mm(xq, self.w.t(), xs.t().contiguous().t(), st.BlockWise1x128,   # scale_a stride [1, M]
                           self.scale_b, st.BlockWise128x128, output_dtype=torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.scaled_mm:
            y = self._scaled_mm(x2)
        else:
            xq, xs = quant.quantize_token_groups(x2, self.block[1])
            xd = quant.dequantize_fp8_blocks(xq, xs, (1, self.block[1]))
            y = F.linear(xd, quant.dequantize_fp8_blocks(self.w, self.scale, self.block))
        return self._finish(y, x.dtype).view(*shape[:-1], self.out_features)
