"""FP4 weights (NVFP4 / MXFP4).

An E2M1 value times its block's E4M3 or E8M0 scale has at most 6 significant bits: exact in bfloat16 and float32.
- On x86 CPUs with AVX-512 the weight stays packed (4.5 / 4.25 bits a weight, scales in bfloat16) and runs on llmq's
  kernel (cpu_kernels.fp4_linear): codes decoded exactly to float32 by a table in a register, float32 activations,
  sums and block scales, at every batch size and inside a decode step's DecoderStack (weight-only layers). The
  arithmetic of the dense path below, from a quarter of its bytes.
- Elsewhere on CPU (and wherever Triton cannot build the kernel) the dense path: the layer holds the exact products
  as a bfloat16 weight and computes with the dense layer.
- On CUDA the weight stays packed and runs on llmq's Triton kernels (fp4_triton), which decode the same exact
  products in registers.
Every path divides the output by NVFP4's global scale instead of every weight: the result differs from the
dequantize-then-matmul reference (`llmq.quant.dequantize_fp4`) only by float32 rounding. No FP4 tensor-core path:
Blackwell's native FP4 GEMMs are out of reach here.
W4A4 (FP4 activations, `qw.dynamic`): the input is first rounded as the serving kernels round it
(`llmq.quant.fp4_activations`: E2M1 value x block scale, exact in bfloat16, so the same matmul stays exact in its
operands) and the output is divided by NVFP4's input global scale as well as the weight's.
"""

from __future__ import annotations

import torch

from ... import quant
from . import cpu_kernels
from .linear import DenseLinear, LinearBase, one_line, set_buffer
from .stack import FusedLinear, Kind


class FP4Linear(LinearBase):
    def __init__(self, qw, bias: torch.Tensor | None, dtype: torch.dtype, device):
        super().__init__()
        self.out_features, self.in_features = qw.q.shape
        self.group = qw.group_size
        g = qw.global_scale
        set_buffer(self, "global_scale", g.float().reshape(()).to(device) if g is not None else None)
        self.act = qw.fp4 if qw.dynamic else None   # W4A4: activations rounded to this FP4 format first
        ig = qw.input_global_scale
        set_buffer(self, "input_global_scale", ig.float().reshape(1).to(device) if ig is not None else None)
        set_buffer(self, "bias", bias.to(device=device, dtype=dtype) if bias is not None else None)
        self.dense = None
        set_buffer(self, "divisor", None)   # the CPU kernel's output divisor, where that kernel runs
        self.fallback_reason = None   # why a CUDA layer runs the dense path (None: the kernel runs, or not CUDA)
        if torch.device(device).type == "cuda":
            set_buffer(self, "packed", quant.pack_fp4(qw.q.to(device)))
            set_buffer(self, "scale", qw.scale.to(device))
            self.fallback_reason = _probe_triton(self, dtype)
            if self.fallback_reason is None:
                return
            self._buffers.pop("packed")
            self._buffers.pop("scale")
        n, k = qw.q.shape
        if torch.device(device).type == "cpu" and cpu_kernels.fp4_fits(n, k, self.group):
            set_buffer(self, "lb_codes", cpu_kernels.pack_codes(qw.q, 4))
            set_buffer(self, "lb_s", cpu_kernels.pack_scales(quant.fp4_block_scale(qw.scale).reshape(n, -1)))
            d = self.global_scale if self.global_scale is not None else torch.ones(())
            if self.input_global_scale is not None:
                d = self.input_global_scale * d
            set_buffer(self, "divisor", d.float().reshape(1))
            return
        w = quant.dequantize_fp4(qw.q.to(device), qw.scale.to(device))   # without the global scale: exact ...
        self.dense = DenseLinear(w.to(torch.bfloat16), None, dtype)      # ... in bfloat16 too

    @property
    def nbytes(self) -> int:
        if self.dense is not None:
            weights = self.dense.nbytes
        else:   # packed: on the CPU kernel or the Triton one
            packed = (self.lb_codes, self.lb_s) if self.divisor is not None else (self.packed, self.scale)
            weights = sum(t.numel() * t.element_size() for t in packed)
        return weights + (self.bias.numel() * self.bias.element_size() if self.bias is not None else 0)

    def fused_spec(self) -> FusedLinear | None:
        """What forward runs on a decode batch, for a cpu_kernels DecoderStack: weight-only layers on fp4_linear."""
        if self.divisor is None or self.act:
            return None
        return FusedLinear(Kind.FP4, (self.lb_codes, self.lb_s, self.divisor), self.group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.divisor is not None:
            xk = quant.fp4_activations(x, self.act, self.input_global_scale)[0] if self.act else x
            y = cpu_kernels.fp4_linear(xk.reshape(-1, x.shape[-1]), self.lb_codes, self.lb_s, self.group,
                                       float(self.divisor))
            return self._finish(y, x.dtype).view(*x.shape[:-1], self.out_features)
        g = self.global_scale
        if self.act:   # W4A4: the input as the FP4 kernel rounds it; its global scale divides the output too
            xq, ga = quant.fp4_activations(x, self.act, self.input_global_scale)
            x, g = xq.to(x.dtype), (g if ga is None else ga * g if g is not None else ga)
        shape = x.shape
        if self.dense is None:
            from .fp4_triton import fp4_matmul

            y = fp4_matmul(x.reshape(-1, shape[-1]), self.packed, self.scale, self.group)
        else:
            y = self.dense(x.reshape(-1, shape[-1]))
        if g is not None:
            y = y.float() / g
        return self._finish(y, x.dtype).view(*shape[:-1], self.out_features)


def _probe_triton(layer: FP4Linear, dtype: torch.dtype) -> str | None:
    """None when the Triton kernel builds and runs for this layer, else why not (one line): the layer then falls
    back to the dense path."""
    if layer.in_features % 32:
        return f"{layer.in_features} input columns are not a multiple of 32"
    try:
        from .fp4_triton import fp4_matmul

        fp4_matmul(torch.zeros(1, layer.in_features, device=layer.packed.device, dtype=dtype), layer.packed,
                   layer.scale, layer.group)
    except Exception as e:  # noqa: BLE001 - no Triton, no compiler for this GPU, a build error: all mean dense
        return one_line(e)
    return None
