"""Linear layers whose activations are quantized too, as the serving engines compute them.

W8A8: activations quantized to int8 per token (or with the static input scale); the int8 x int8 products run on
torch._int_mm on CUDA (decode batches padded to its 17-row minimum) and, on CPU, for up to 8 rows (decode)
through the int8-weight kernel with integer-valued activations (exact in bfloat16, but its bfloat16 output rounds
the sums to 2^-8 relative); else in float32.
FP8: torch._scaled_mm where the GPU has FP8 tensor cores, otherwise the weight is dequantized on the fly and
quantized activations are reproduced exactly (quantize to e4m3 and back) so numerics match the FP8 kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ... import quant
from .linear import LinearBase, aligned, grouped, kernel_runs, set_buffer


class W8A8Linear(LinearBase):
    max_kernel_rows = 8

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, input_scale: torch.Tensor | None,
                 bias: torch.Tensor | None, compute_dtype: torch.dtype):
        super().__init__()
        n, k = q.shape
        self.out_features, self.in_features = n, k
        set_buffer(self, "q", aligned(q.to(torch.int8)))
        set_buffer(self, "scale", grouped(scale, n)[:, 0].contiguous())  # per output channel (or per tensor)
        set_buffer(self, "input_scale", input_scale.float().reshape(()) if input_scale is not None else None)
        set_buffer(self, "bias", bias.to(compute_dtype) if bias is not None else None)
        self.cuda_int_mm = q.device.type == "cuda" and n % 8 == 0 and k % 8 == 0
        self.cpu_kernel = q.device.type == "cpu" and kernel_runs(
            lambda: torch.ops.aten._weight_int8pack_mm(torch.zeros(1, k, dtype=torch.bfloat16), self.q,
                                                       torch.ones(n, dtype=torch.bfloat16)))
        if self.cpu_kernel:
            set_buffer(self, "ones", torch.ones(n, dtype=torch.bfloat16))

    def _int_matmul(self, xq: torch.Tensor) -> torch.Tensor:
        """xq [M, K] (int8 values as floats) times q.T, as float32 sums."""
        m = xq.shape[0]
        if self.cuda_int_mm:  # it wants more than 16 rows: decode batches are padded with zero rows
            xi = xq.to(torch.int8)
            return torch._int_mm(F.pad(xi, (0, 0, 0, 17 - m)) if m <= 16 else xi, self.q.t())[:m].float()
        if self.cpu_kernel and m <= self.max_kernel_rows:  # integer activations are exact in bfloat16
            return torch.ops.aten._weight_int8pack_mm(xq.to(torch.bfloat16), self.q, self.ones).float()
        return F.linear(xq, self.q.float())  # |sums| < 2^24 for K < 1040 stay exact in float32; beyond ~1e-7

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        xq, xs = quant.quantize_tokens(x2, self.input_scale, fp8=False)
        y = self._int_matmul(xq) * xs * self.scale
        return self._finish(y, x.dtype).view(*shape[:-1], self.out_features)


class FP8Linear(LinearBase):
    def __init__(self, w: torch.Tensor, scale: torch.Tensor, input_scale: torch.Tensor | None, act_quant: bool,
                 bias: torch.Tensor | None, compute_dtype: torch.dtype):
        super().__init__()
        n, k = w.shape
        self.out_features, self.in_features = n, k
        set_buffer(self, "w", w.to(quant.FP8))
        set_buffer(self, "scale", grouped(scale, n)[:, 0].contiguous())
        set_buffer(self, "input_scale", input_scale.float().reshape(()) if input_scale is not None else None)
        set_buffer(self, "bias", bias.to(compute_dtype) if bias is not None else None)
        self.act_quant = act_quant
        self.scaled_mm = (w.device.type == "cuda" and act_quant and torch.cuda.get_device_capability(w.device) >= (8, 9)
                          and n % 16 == 0 and k % 16 == 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.scaled_mm:
            xq, xs = quant.quantize_tokens(x2, self.input_scale, fp8=True)
            y = torch._scaled_mm(xq, self.w.t(), scale_a=xs.contiguous(), scale_b=self.scale.view(1, -1),
                                 out_dtype=torch.bfloat16)
        else:
            if self.act_quant:
                xq, xs = quant.quantize_tokens(x2, self.input_scale, fp8=True)
                x2 = (xq.float() * xs).to(x.dtype)
            y = F.linear(x2, self.w.to(x.dtype)) * self.scale.to(x.dtype)
        return self._finish(y, x.dtype).view(*shape[:-1], self.out_features)
