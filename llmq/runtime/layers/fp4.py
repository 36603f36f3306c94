"""FP4 weights (NVFP4 / MXFP4) on the dense path.

An E2M1 value times its block's E4M3 or E8M0 scale has at most 6 significant bits, so it is exact in bfloat16: the
layer holds that product as a bfloat16 weight and computes with the dense layer (on x86 CPUs with AVX-512, llmq's
16-bit kernel with float32 arithmetic). NVFP4's global scale divides the output instead of every weight: the result
differs from the dequantize-then-matmul reference (`llmq.quant.dequantize_fp4`) only by float32 rounding. No FP4
tensor-core path: Blackwell's native FP4 GEMMs are out of reach here.
W4A4 (FP4 activations, `qw.dynamic`): the input is first rounded as the serving kernels round it
(`llmq.quant.fp4_activations`: E2M1 value x block scale, exact in bfloat16, so the same matmul stays exact in its
operands) and the output is divided by NVFP4's input global scale as well as the weight's.
"""

from __future__ import annotations

import torch

from ... import quant
from .linear import DenseLinear, LinearBase, _buffer


class FP4Linear(LinearBase):
    def __init__(self, qw, bias: torch.Tensor | None, dtype: torch.dtype, device):
        super().__init__()
        w = quant.dequantize_fp4(qw.q.to(device), qw.scale.to(device))   # without the global scale: exact ...
        self.dense = DenseLinear(w.to(torch.bfloat16), None, dtype)      # ... in bfloat16 too
        self.out_features, self.in_features = w.shape
        g = qw.global_scale
        _buffer(self, "global_scale", g.float().reshape(()).to(device) if g is not None else None)
        self.act = qw.fp4 if qw.dynamic else None   # W4A4: activations rounded to this FP4 format first
        ig = qw.input_global_scale
        _buffer(self, "input_global_scale", ig.float().reshape(1).to(device) if ig is not None else None)
        _buffer(self, "bias", bias.to(device=device, dtype=dtype) if bias is not None else None)

    @property
    def nbytes(self) -> int:
        return self.dense.nbytes + (self.bias.numel() * self.bias.element_size() if self.bias is not None else 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.global_scale
        if self.act:   # W4A4: the input as the FP4 kernel rounds it; its global scale divides the output too
            xq, ga = quant.fp4_activations(x, self.act, self.input_global_scale)
            x, g = xq.to(x.dtype), (g if ga is None else ga * g if g is not None else ga)
        y = self.dense(x)
        if g is not None:
            y = y.float() / g
        return self._finish(y, x.dtype)
