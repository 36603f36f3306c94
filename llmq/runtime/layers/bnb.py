"""The runtime's layers for bitsandbytes' schemes (`llmq quantize --method bnb-nf4 / bnb-int8`), computing what
bitsandbytes computes on them.

- NF4Linear: the packed 4-bit codes and the float32 block absmax (double quantization undone once, at load) stay in
  memory: 0.5 + 4 / blocksize bytes per weight. On CPUs with AVX-512, where each row holds whole blocks, the codes
  are repacked in llmq's INT4 tiles and computed by cpu_kernels.table_linear: each weight code[q] * absmax rounded to
  the checkpoint's dtype, as bitsandbytes' dequantize returns it, float32 sums. Elsewhere each forward dequantizes
  the weight with bitsandbytes' own dequantize kernel where bitsandbytes is installed (its CPU library, or CUDA) and
  each row holds whole blocks, else with `quant.dequantize_4bit`: the same float32 values bit for bit, the torch one
  about 20x slower. Then one matmul in the compute dtype.
  bitsandbytes' fused CPU GEMV (AVX512-BF16 only) is not used: it rounds absmax and activations to bfloat16.
- LLMInt8Linear: bitsandbytes' MatMul8bitLt: activations per row on the int8 grid (from float16), columns holding an
  outlier (|x| >= threshold) computed in floating point against their dequantized weight columns, the int8
  products through W8A8Linear's kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ... import quant
from ...models import bnbformat
from . import cpu_kernels, stack
from .act_quant import W8A8Linear
from .linear import LinearBase, set_buffer


class NF4Linear(LinearBase):
    def __init__(self, w: bnbformat.NF4Weight, bias: torch.Tensor | None, compute_dtype: torch.dtype, device):
        super().__init__()
        self.out_features, self.in_features = w.shape
        self.blocksize, self.quant_type, self.weight_dtype = w.blocksize, w.state["quant_type"], w.dtype
        set_buffer(self, "packed", w.packed.to(device).view(torch.uint8))
        set_buffer(self, "absmax", w.absmax().to(device))
        set_buffer(self, "code", w.code.to(device))
        set_buffer(self, "bias", bias.to(device=device, dtype=compute_dtype) if bias is not None else None)
        n, k = self.out_features, self.in_features
        self.table = torch.device(device).type == "cpu" and self.weight_dtype in cpu_kernels._ROUNDING and \
            cpu_kernels.table_fits(n, k, self.blocksize)
        if self.table:   # codes in llmq's INT4 tiles (bitsandbytes packs the first of two in the high nibble)
            b = self.packed.reshape(-1)
            codes = torch.stack([b >> 4, b & 15], -1).reshape(-1)[:n * k].view(n, k)
            set_buffer(self, "lb_codes", cpu_kernels.pack_codes(codes, 4))
            set_buffer(self, "lb_s", cpu_kernels.pack_scales(self.absmax.float().view(n, k // self.blocksize)).float())
            set_buffer(self, "code", self.code.float())
            for name in ("packed", "absmax"):
                self._buffers.pop(name)
        # bitsandbytes 0.50's CPU dequantize kernel misplaces blocks that straddle two rows (its reference and CUDA
        # kernels do not), so it is used only where each row holds whole blocks
        self.ops = bnbformat.kernels() if self.in_features % self.blocksize == 0 and not self.table else None
        if self.ops is not None:
            try:
                self._bnb_dequantize()
            except (RuntimeError, NotImplementedError, ValueError):
                self.ops = None

    def _bnb_dequantize(self) -> torch.Tensor:
        return self.ops.dequantize_4bit.default(self.packed, self.absmax, self.blocksize, self.quant_type,
                                                [self.out_features, self.in_features], self.weight_dtype)

    def dequantized(self) -> torch.Tensor:
        if self.ops is not None:
            return self._bnb_dequantize()
        return quant.dequantize_4bit(self.packed, self.absmax, self.code, self.blocksize,
                                     (self.out_features, self.in_features), self.weight_dtype)

    def fused_spec(self) -> stack.FusedLinear | None:
        """What forward runs on a decode batch, for a cpu_kernels DecoderStack (None: no kernel it has)."""
        return stack.table_spec(self.lb_codes, self.lb_s, self.code, self.blocksize, self.weight_dtype) \
            if self.table else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        if not self.table:
            return F.linear(x, self.dequantized().to(x.dtype), bias)
        shape = x.shape
        y = cpu_kernels.table_linear(x.reshape(-1, shape[-1]), self.lb_codes, self.lb_s, self.code, self.blocksize,
                                     self.weight_dtype).to(x.dtype)
        return (y + bias if bias is not None else y).view(*shape[:-1], self.out_features)


class LLMInt8Linear(W8A8Linear):
    """self.scale holds SCB (each row's absmax); threshold 0 quantizes every column."""

    def __init__(self, w: bnbformat.Int8Weight, bias: torch.Tensor | None, compute_dtype: torch.dtype, device):
        super().__init__(w.q.to(device), w.scb.to(device), None, bias.to(device) if bias is not None else None,
                         compute_dtype)
        self.threshold = w.threshold

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        xq, row, cols = quant.llm_int8_activations(x2, self.threshold)
        y = self._int_matmul(xq) * (row.unsqueeze(-1) * self.scale) * quant.INV_127_SQ
        if self.bias is not None:
            y = y + self.bias
        y = y.to(x.dtype)
        if cols is not None and cols.numel():
            y = y.addmm(x2[:, cols], quant.llm_int8_dequantize(self.q[:, cols], self.scale, x.dtype).t())
        return y.view(*shape[:-1], self.out_features)
