"""GGML k-quant weights (`llmq quantize --grid q4_k`): Q4_K, computed as llama.cpp dequantizes it.

The layer keeps the codes (one byte a weight) with their fp16 super-block d / dmin and 6-bit sub-block sc / m, and
each forward dequantizes the weight into the compute dtype (`llmq.quant.dequantize_q4_k`: bit for bit llama.cpp's
dequantize_row_q4_K in float32) and runs the BLAS matmul. No dedicated kernel yet: it is the reference path, what the
quantize probe and the GGUF export are checked against, not a fast one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ... import quant
from .linear import LinearBase, set_buffer


class Q4KLinear(LinearBase):
    def __init__(self, qw, bias: torch.Tensor | None, dtype: torch.dtype, device):
        super().__init__()
        self.out_features, self.in_features = qw.q.shape
        for name in ("q", "d", "dmin", "sc", "m"):
            set_buffer(self, name, getattr(qw, name).to(device))
        set_buffer(self, "bias", bias.to(device=device, dtype=dtype) if bias is not None else None)

    def weight(self, dtype: torch.dtype) -> torch.Tensor:
        return quant.dequantize_q4_k(self.q, self.d, self.dmin, self.sc, self.m, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = F.linear(x.reshape(-1, shape[-1]), self.weight(x.dtype))
        return self._finish(y, x.dtype).view(*shape[:-1], self.out_features)
