"""GGML block weights (`llmq quantize --grid q4_k / iq4_xs`), computed from llama.cpp's dequantized values.

Q4KLinear: on CPUs with AVX512-BF16 the layer holds the codes packed in 4 bits with each group's float32 step and min
(cpu_kernels.q4k_linear: bfloat16(x) times the exact s * n - mn, float32 sums). Elsewhere it keeps the codes (a
byte each) with their fp16 super-block d / dmin and 6-bit sub-block sc / m, and each forward dequantizes the weight
(`llmq.quant.dequantize_q4_k`: bit for bit llama.cpp's dequantize_row_q4_K in float32) for the BLAS matmul.

IQ4Linear (GGML's IQ4_XS, and IQ4_NL, its fallback): a 16-value table times a step per 32 inputs, which is what
cpu_kernels.table_linear computes for bitsandbytes' NF4; with the table IQ4_VALUES, the weight's float32 steps
(IQ4Weight.steps: IQ4_XS's d * (ls - 32), IQ4_NL's d) and no rounding of the weight (every product is exact), it is
F.linear in float32 on llama.cpp's dequantized weight, up to summation order. Where the kernel does not fit, each
forward dequantizes (`llmq.quant.dequantize_iq4`) for the BLAS matmul.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ... import quant
from . import cpu_kernels
from .linear import LinearBase, set_buffer
from .stack import FusedLinear, Kind, table_spec


class Q4KLinear(LinearBase):
    def __init__(self, qw, bias: torch.Tensor | None, dtype: torch.dtype, device):
        super().__init__()
        self.out_features, self.in_features = n, k = qw.q.shape
        set_buffer(self, "bias", bias.to(device=device, dtype=dtype) if bias is not None else None)
        self.kernel = torch.device(device).type == "cpu" and cpu_kernels.q4k_fits(n, k)
        if self.kernel:
            s, mins = quant.q4_k_scale_min(qw.d, qw.dmin, qw.sc, qw.m)
            for name, t in zip(("lb_codes", "lb_s", "lb_m"), cpu_kernels.pack_q4k(qw.q, s, mins)):
                set_buffer(self, name, t)
        else:
            for name in ("q", "d", "dmin", "sc", "m"):
                set_buffer(self, name, getattr(qw, name).to(device))

    def fused_spec(self) -> FusedLinear | None:
        """What forward runs on a decode batch, for a cpu_kernels DecoderStack (None: no kernel it has)."""
        return FusedLinear(Kind.Q4K, (self.lb_codes, self.lb_s, self.lb_m), quant.Q4K_SUB) if self.kernel else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.kernel:
            y = cpu_kernels.q4k_linear(x2, self.lb_codes, self.lb_s, self.lb_m)
        else:
            y = F.linear(x2, quant.dequantize_q4_k(self.q, self.d, self.dmin, self.sc, self.m, x.dtype))
        return self._finish(y, x.dtype).view(*shape[:-1], self.out_features)


class IQ4Linear(LinearBase):
    def __init__(self, qw, bias: torch.Tensor | None, dtype: torch.dtype, device):
        super().__init__()
        self.out_features, self.in_features = n, k = qw.q.shape
        set_buffer(self, "bias", bias.to(device=device, dtype=dtype) if bias is not None else None)
        self.kernel = torch.device(device).type == "cpu" and cpu_kernels.table_fits(n, k, quant.IQ4_BLOCK)
        if self.kernel:
            set_buffer(self, "lb_codes", cpu_kernels.pack_codes(qw.q, 4))
            set_buffer(self, "lb_s", cpu_kernels.pack_scales(qw.steps()).float())
            set_buffer(self, "values", quant.IQ4_VALUES.clone())
        else:
            set_buffer(self, "q", qw.q.to(device))
            set_buffer(self, "steps", qw.steps().to(device))

    def fused_spec(self) -> FusedLinear | None:
        """What forward runs on a decode batch, for a cpu_kernels DecoderStack (None: no kernel it has)."""
        return table_spec(self.lb_codes, self.lb_s, self.values, quant.IQ4_BLOCK, torch.float32) \
            if self.kernel else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.kernel:
            y = cpu_kernels.table_linear(x2, self.lb_codes, self.lb_s, self.values, quant.IQ4_BLOCK, torch.float32)
        else:
            y = F.linear(x2, quant.dequantize_iq4(self.q, self.steps, x.dtype))
        return self._finish(y, x.dtype).view(*shape[:-1], self.out_features)
