"""Linear layers: dense, and the integer weight-only schemes `llmq quantize` writes (INT8, INT4, INT5 in INT8's layer).

Weights stay in their low-bit form in memory; each class picks the fastest real kernel the device has. Every scale,
grid and cast is `llmq.quant`'s, the same arithmetic `llmq quantize` computes its quality probe with.
- 16-bit (unquantized) weights computed in float32, on x86 CPUs with AVX-512: kept as stored, on llmq's kernel
  (cpu_kernels.dense16_linear: F.linear's numbers on the float32 cast, from half the bytes); elsewhere cast to the
  compute dtype (oneDNN-prepacked on CPU).
- INT8 / INT4 weight-only with `int8_activations` (EngineConfig.int8_activations, `serve --int8-activations`) on
  x86 CPUs with AVX512-VNNI: llmq's own kernels (cpu_kernels.lowbit_linear) at every batch size, any group size that
  is a multiple of 32, with or without zero points: activations rounded to int8 per block of 32 inputs, integer
  products, float32 out (llama.cpp's Q8_0 activations; 2-4x PyTorch's kernels at batch 1). Opt-in: the quantize
  probe, eval and every export target compute with 16-bit activations, as the layers below do.
- INT8 weight-only otherwise: aten._weight_int8pack_mm (per-channel scales) for batches of up to 8 rows (decode). On
  CPU it takes bfloat16 activations and scales and returns bfloat16, so steps compute with activations and outputs
  rounded to bfloat16 (2^-8 relative); larger batches compute those numbers with the BLAS matmul on the dequantized
  weight (grouped scales, which the kernel does not take: in the compute dtype).
- INT4 / INT5 / INT8 weight-only, symmetric with bfloat16 scales, on x86 CPUs with AVX512-BF16, or AVX2 + FMA for
  INT4 / INT5 (INT8: AVX-512): llmq's kernel (cpu_kernels.lowbit_linear_bf16) on packed tiles (INT5 in 5 bits a
  weight), computing what PyTorch's kernels below compute (bfloat16 activations times the exact weights, float32
  sums, bfloat16 out; only the summation order differs), faster at batch 1 (docs/performance.md), and the same
  arithmetic at every batch size (PyTorch's INT8 one takes 8 rows and one scale a channel). INT8 in groups has no
  PyTorch kernel: without AVX-512 it takes the float path below.
- INT4 weight-only otherwise: aten._weight_int4pack_mm_for_cpu / aten._weight_int4pack_mm (CUDA) on the tinygemm
  packing (unsigned nibbles, per-group scale and zero in bfloat16): the kernels take and return bfloat16, so
  activations are rounded to bfloat16. On CPU, batches of 128+ rows (prefill) compute those numbers with the BLAS
  matmul on the weight dequantized from the packing (the kernel, a GEMV a row, is slower there on AVX2).
  The layer's kernel is what serve computes and so what the quantize probe measures (the probe runs these layers);
  shapes no kernel takes fall back to dequantize-on-the-fly, exactly.
- W8A8 and FP8 (activations quantized too): act_quant.py; FP4, block FP8, Q4_K and bitsandbytes: their own modules.
Row/column tensor-parallel splitting happens when weights are loaded; a layer only ever sees its own slice.
"""

from __future__ import annotations

import itertools
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from ... import quant
from . import cpu_kernels
from .stack import FusedLinear, Kind


class LinearBase(nn.Module):
    bias: torch.Tensor | None

    def _finish(self, y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        y = y.to(dtype)
        return y + self.bias if self.bias is not None else y

    @property
    def nbytes(self) -> int:
        """Bytes of weights a forward reads (for MBU)."""
        return sum(t.numel() * t.element_size() for t in self.buffers())


def set_buffer(module: nn.Module, name: str, t: torch.Tensor | None) -> None:
    """A layer's tensor as a contiguous non-persistent buffer (moves with the module; the checkpoint is llmq's, not
    the module's state dict); every layer class of this package stores its tensors so."""
    module.register_buffer(name, t.contiguous() if t is not None else None, persistent=False)


def _kernel_input(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Activations as the packed kernels take them: in their dtype and contiguous. The CUDA int4 kernel refuses
    strided rows (the CPU one accepts them), and the MLP's down projection gets the gate half of gate_up in place."""
    return x.to(dtype).contiguous()


def aligned(t: torch.Tensor) -> torch.Tensor:
    """t, copied to the allocator's 64-byte alignment when it is not aligned: the int8 CPU kernel crashes the process
    (a segfault, not an error) for 4+ rows on a weight that is not 32-byte aligned, as safetensors can hand one out."""
    t = t.contiguous()
    return t if t.data_ptr() % 64 == 0 else t.clone()


class DenseLinear(LinearBase):
    """A float weight. On CPUs with AVX-512, a bfloat16 / float16 weight computed in float32 stays as stored and runs
    on cpu_kernels.dense16_linear (exact widening, float32 products: F.linear's numbers on the float32 cast, reading
    half the bytes; 2x+ at batch 1). Otherwise, on CPU, the float32 (or natively supported bfloat16) weight is
    prepacked once for oneDNN (what inductor does when freezing a model): about 2x faster than the BLAS call for the
    wide lm_head and ~20% for decode-sized batches."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        dtype = dtype or weight.dtype
        self.out_features, self.in_features = weight.shape
        set_buffer(self, "bias", bias.to(dtype) if bias is not None else None)
        self.dense16 = keeps_16bit(weight, dtype)
        weight = weight if self.dense16 else weight.to(dtype)
        self.packed = None if self.dense16 else _mkldnn_pack(weight)
        self.handle = _register_packed(self.packed) if self.packed is not None else None
        self.dtype_bytes = weight.element_size()
        set_buffer(self, "weight", None if self.packed is not None else weight)

    @property
    def nbytes(self) -> int:
        n = self.out_features * self.in_features * self.dtype_bytes
        return n + (self.bias.numel() * self.bias.element_size() if self.bias is not None else 0)

    def fused_spec(self) -> FusedLinear | None:
        """What forward runs on a decode batch, for a cpu_kernels DecoderStack (None: no kernel it has)."""
        return FusedLinear(Kind.DENSE16, (self.weight,)) if self.dense16 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.dense16:
            y = cpu_kernels.dense16_linear(x2, self.weight) if cpu_kernels.usable(x2) else \
                F.linear(x2, self.weight.to(x.dtype))  # in a compiled graph: the same numbers, inductor's kernels
            return self._finish(y, x.dtype).view(*shape[:-1], self.out_features)
        if self.packed is not None:
            if torch.compiler.is_compiling():  # the compiled decode step cannot trace an opaque oneDNN tensor
                y = _packed_linear(x2, self.handle, self.out_features, self.bias)
            else:
                y = torch.ops.mkldnn._linear_pointwise(x2, self.packed, self.bias, "none", [], "")
            return y.view(*shape[:-1], self.out_features)
        return F.linear(x, self.weight, self.bias)


def keeps_16bit(weight: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether a DenseLinear computing in `dtype` keeps this weight as stored (a 16-bit weight, float32 arithmetic, on
    cpu_kernels.dense16_linear); the model keeps a tied embedding table as stored then too."""
    return keeps_as_stored(weight.dtype, tuple(weight.shape), dtype, weight.device)


def keeps_as_stored(stored: torch.dtype, shape: tuple[int, ...], dtype: torch.dtype, device) -> bool:
    """Whether the runtime holds a weight not loaded yet as its checkpoint stores it (what the KV-cache budget
    subtracts): keeps_16bit for a 16-bit one; FP4 codes (uint8, `shape` the unpacked [N, K]) stay packed on
    cpu_kernels.fp4_linear (every FP4 block size, 16 or 32, takes it where 16 does)."""
    if stored == torch.uint8:
        return torch.device(device).type == "cpu" and cpu_kernels.fp4_fits(shape[0], shape[1], 16)
    return dtype == torch.float32 and cpu_kernels.dense16_fits(stored, shape, device)


_PACKED: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()  # handle -> packed weight
_HANDLES = itertools.count()


def _register_packed(packed: torch.Tensor) -> int:
    handle = next(_HANDLES)
    _PACKED[handle] = packed
    return handle


@torch.library.custom_op("llmq::packed_linear", mutates_args=())
def _packed_linear(x: torch.Tensor, handle: int, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    """A prepacked DenseLinear inside a compiled graph: the packed weight is named by a handle (a graph constant),
    since torch.compile cannot take an opaque oneDNN tensor as an input."""
    return torch.ops.mkldnn._linear_pointwise(x, _PACKED[handle], bias, "none", [], "")


@_packed_linear.register_fake
def _(x, handle, out_features, bias):
    return x.new_empty(x.shape[0], out_features)


def _mkldnn_pack(weight: torch.Tensor):
    """oneDNN-prepacked copy of a float32 CPU weight (or a bfloat16 one where the CPU computes bfloat16 natively,
    AVX512-BF16 / AMX: `--dtype bfloat16` then reads half the bytes), or None where there is no such path."""
    native_bf16 = weight.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if weight.device.type != "cpu" or not (weight.dtype == torch.float32 or native_bf16) or \
            not torch.backends.mkldnn.is_available():
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())
        x = torch.randn(3, weight.shape[1], dtype=weight.dtype)
        rows = torch.linspace(0, weight.shape[0] - 1, min(weight.shape[0], 512)).long()  # a float32 copy of these
        w = weight[rows].float()                                                          # only: 2 GB less at 8B
        got = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "").float()[:, rows]
        tol = 1e-3 if weight.dtype == torch.float32 else 2e-2
        if torch.allclose(got, F.linear(x.float(), w), rtol=tol, atol=tol * float(w.abs().max()) * w.shape[1] ** 0.5):
            return packed
    except (RuntimeError, AttributeError):
        pass
    return None


def grouped(scale: torch.Tensor, n: int) -> torch.Tensor:
    """Scales / zero points as [N, G] (G groups along the input dimension; 1 = per channel)."""
    scale = scale.float()
    if scale.numel() == 1:
        return scale.reshape(1, 1).expand(n, 1)
    return scale.reshape(n, -1)


class Int8WeightOnlyLinear(LinearBase):
    """8-bit weights, and 5-bit ones (GGUF's Q5_0 / Q5_1) held as int8 unless llmq's INT5 kernel packs them."""

    max_kernel_rows = 8  # above this PyTorch's kernel (a GEMV per row) loses to dequantize + BLAS

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bias: torch.Tensor | None,
                 compute_dtype: torch.dtype, int8_activations: bool = False, bits: int = 8):
        super().__init__()
        n, k = q.shape
        self.out_features, self.in_features = n, k
        set_buffer(self, "q", aligned(q.to(torch.int8)))
        set_buffer(self, "scale", grouped(scale, n))
        set_buffer(self, "zero", grouped(zero, n) if zero is not None and bool((zero != 0).any()) else None)
        set_buffer(self, "bias", bias.to(compute_dtype) if bias is not None else None)
        self.compute_dtype = compute_dtype
        # llmq's kernels: with int8 activations wherever they fit; with 16-bit ones for symmetric weights with
        # bfloat16 scales (PyTorch's kernel's numbers where it would serve: one scale a channel), INT5 in 5 bits
        int5 = bits == 5 and not int8_activations
        self.lowbit = None if not int8_activations and self.zero is not None else \
            (int5 and _lowbit(self, q, self.scale, None, 5, False)) or \
            _lowbit(self, q, self.scale, self.zero, 8, int8_activations)
        if self.lowbit:
            for name in ("q", "scale", "zero"):
                self._buffers.pop(name)
        # the packed kernel wants one scale per output channel and no zero point
        self.kernel = not self.lowbit and self.scale.shape[1] == 1 and self.zero is None and \
            hasattr(torch.ops.aten, "_weight_int8pack_mm")
        if self.kernel:
            self._kdtype = torch.bfloat16 if q.device.type == "cpu" else compute_dtype
            set_buffer(self, "kscale", self.scale[:, 0].to(self._kdtype))
            self.kernel = kernel_runs(lambda: self._kernel(torch.zeros(1, k, device=q.device, dtype=compute_dtype)))

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(_kernel_input(x, self._kdtype), self.q, self.kscale)

    def fused_spec(self) -> FusedLinear | None:
        """What forward runs on a decode batch, for a cpu_kernels DecoderStack (None: no kernel it has)."""
        if self.lowbit:
            return _lowbit_spec(self)
        if self.kernel and self.q.device.type == "cpu":
            return FusedLinear(Kind.INT8PACK, (self.q, self.kscale), 0, self.max_kernel_rows)
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        rows = x2.shape[0]
        if self.lowbit:
            y = _lowbit_mm(self, x2)
        elif self.kernel and rows <= self.max_kernel_rows:
            y = self._kernel(x2)
        elif self.kernel:   # the kernel's numbers (its rounded x and scales, exact products, rounded out) on the BLAS
            w = self.q.float() * self.kscale.float()[:, None]
            y = F.linear(_kernel_input(x2, self._kdtype).float(), w).to(self._kdtype)
        else:
            y = F.linear(x2, quant.dequantize(self.q, self.scale, self.zero, x.dtype))
        return self._finish(y, x.dtype).view(*shape[:-1], self.out_features)


class Int4WeightOnlyLinear(LinearBase):
    """4-bit weights with per-group scales (and zero points). Stored packed for the tinygemm kernels when they
    accept the shape (N % 16 == 0 on CPU, K a multiple of the group size); otherwise as int8 values."""

    max_kernel_rows = 32  # rows a kernel call takes
    blas_rows = 128       # on CPU, from here on the dequantized weight on the BLAS (bench_format_speed's prefill)

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bias: torch.Tensor | None,
                 compute_dtype: torch.dtype, int8_activations: bool = False):
        super().__init__()
        n, k = q.shape
        self.out_features, self.in_features = n, k
        scale = grouped(scale, n)
        zero = grouped(zero, n) if zero is not None else None
        self.group_size = k // scale.shape[1]
        self.compute_dtype = compute_dtype
        set_buffer(self, "bias", bias.to(compute_dtype) if bias is not None else None)
        self.lowbit = _lowbit(self, q, scale, zero, 4, int8_activations)
        self.packed = None if self.lowbit else _pack_int4(q, scale, zero, self.group_size)
        self.unpacks = 0  # the packing's channel block where _dequantized_t reads it (CPU; checked when packed), or 0
        if self.packed is not None:
            set_buffer(self, "w_packed", self.packed[0])
            set_buffer(self, "scales_zeros", self.packed[1])
            unpacks, self._kdtype = self.packed[2], self.packed[1].dtype
            self.packed = kernel_runs(lambda: self._kernel(torch.zeros(1, k, device=q.device, dtype=compute_dtype)))
            self.unpacks = unpacks if self.packed else 0
        if not self.packed and not self.lowbit:
            set_buffer(self, "q", q.to(torch.int8))
            set_buffer(self, "scale", scale)
            set_buffer(self, "zero", zero)
            for name in ("w_packed", "scales_zeros"):
                self._buffers.pop(name, None)

    def fused_spec(self) -> FusedLinear | None:
        """What forward runs on a decode batch, for a cpu_kernels DecoderStack (None: no kernel it has)."""
        if self.lowbit:
            return _lowbit_spec(self)
        if self.packed and self.w_packed.device.type == "cpu":
            return FusedLinear(Kind.INT4PACK, (self.w_packed, self.scales_zeros), self.group_size,
                               self.max_kernel_rows)
        return None

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        x = _kernel_input(x, self._kdtype)
        if x.device.type == "cpu":
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.w_packed, self.group_size, self.scales_zeros)
        return torch.ops.aten._weight_int4pack_mm(x, self.w_packed, self.group_size, self.scales_zeros)

    def _dequantized_t(self) -> torch.Tensor:
        """The weight transposed, [K, N] in float32, as the CPU kernel computes it ((u - 8) * s + z, exact) from its
        packing (_unpacked_cpu_int4)."""
        n, k, g = self.out_features, self.in_features, self.group_size
        w = _unpacked_cpu_int4(self.w_packed, n, k, self.unpacks).transpose(0, 1).reshape(k // g, g, n).float()
        sz = self.scales_zeros.float()
        return w.sub_(8).mul_(sz[:, None, :, 0]).add_(sz[:, None, :, 1]).view(k, n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.lowbit:
            y = _lowbit_mm(self, x2)
        elif self.packed and x2.shape[0] <= self.max_kernel_rows:
            y = self._kernel(x2)
        elif self.unpacks and x2.shape[0] >= self.blas_rows:  # the kernel's numbers: its rounded x, exact weights
            y = (_kernel_input(x2, self._kdtype).float() @ self._dequantized_t()).to(self._kdtype)
        elif self.packed:
            y = torch.cat([self._kernel(c) for c in x2.split(self.max_kernel_rows)])
        else:
            y = F.linear(x2, quant.dequantize(self.q, self.scale, self.zero, x.dtype))
        return self._finish(y, x.dtype).view(*shape[:-1], self.out_features)


def _lowbit(layer: LinearBase, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int,
            int8_activations: bool) -> tuple[int, int, bool] | None:
    """(bits, group size, int8_activations) after giving `layer` llmq's packed weight (buffers lb_codes / lb_s /
    lb_sz) where the CPU has the kernels and the shape fits (cpu_kernels): lowbit_linear for int8 activations,
    lowbit_linear_bf16 for 16-bit ones (symmetric, with bfloat16 scales, as llmq's artifacts store them: exactly
    PyTorch's kernels' numbers); None, nothing changed, otherwise."""
    n, k = q.shape
    group = k // scale.shape[1]
    if not cpu_kernels.usable(q) or not cpu_kernels.lowbit_fits(n, k, group, bits, int8_activations):
        return None
    codes, s, sz = cpu_kernels.pack(q, scale, zero, bits)
    if not int8_activations and (sz.numel() or s.dtype != torch.bfloat16):
        return None  # PyTorch's kernel rounds scales and a zero-point term to bfloat16: it keeps these layers
    for name, t in zip(("lb_codes", "lb_s", "lb_sz"), (codes, s, sz)):
        set_buffer(layer, name, t)
    return bits, group, int8_activations


def _lowbit_spec(layer: LinearBase) -> FusedLinear:
    """fused_spec of a layer on llmq's low-bit kernels: any number of rows."""
    bits, group, a8 = layer.lowbit
    if not a8:
        kind = {4: Kind.LOWBIT4_BF16, 5: Kind.LOWBIT5_BF16, 8: Kind.LOWBIT8_BF16}[bits]
        return FusedLinear(kind, (layer.lb_codes, layer.lb_s), group)
    return FusedLinear(Kind.LOWBIT4 if bits == 4 else Kind.LOWBIT8, (layer.lb_codes, layer.lb_s, layer.lb_sz), group)


def _lowbit_mm(layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
    bits, group, a8 = layer.lowbit
    if not a8:
        return cpu_kernels.lowbit_linear_bf16(x, layer.lb_codes, layer.lb_s, bits, group)
    return cpu_kernels.lowbit_linear(x, layer.lb_codes, layer.lb_s, layer.lb_sz, bits, group)


def _unpacked_cpu_int4(packed: torch.Tensor, n: int, k: int, block: int) -> torch.Tensor:
    """The CPU int4 kernel's packing ([N, K/2] bytes) read back as [N / block, K, block] nibbles: blocks of `block`
    output channels (PyTorch's CPU build packs 64 where it runs AVX-512, 32 on AVX2), each K rows of block / 2
    bytes, channel j's nibble low and j + block / 2's high."""
    b = packed.view(n // block, k, block // 2)
    return torch.cat([b & 15, b >> 4], dim=2)


def _pack_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group: int):
    """(packed weight, scales_and_zeros [K/g, N, 2], the channel block with which _unpacked_cpu_int4 reads it back
    or 0) for the tinygemm kernels, or None when they cannot take it.

    tinygemm computes (u - 8) * s + z from unsigned nibbles u; with u = q + offset that equals (q - zero) * s when
    z = (8 - offset - zero) * s.
    """
    n, k = q.shape
    cpu = q.device.type == "cpu"
    if cpu and not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        return None
    tiles = None if cpu else cuda_inner_k_tiles(k)
    if k % group or group not in (32, 64, 128, 256) or (cpu and n % 16) or (not cpu and (n % 8 or tiles is None)):
        return None
    offset = 8 if int(q.min()) < 0 else 0
    u = (q.to(torch.int32) + offset)
    if int(u.min()) < 0 or int(u.max()) > 15:
        return None
    z = (8 - offset - (zero if zero is not None else 0.0)) * scale
    kdtype = torch.bfloat16
    sz = torch.stack([scale.t(), z.t() if torch.is_tensor(z) else torch.zeros_like(scale.t())], dim=-1)
    sz = sz.to(kdtype).contiguous()
    try:
        if cpu:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(u.contiguous(), 1)
        else:
            nib = (u[:, ::2] << 4 | u[:, 1::2]).to(torch.uint8)
            packed = torch.ops.aten._convert_weight_to_int4pack(nib.contiguous(), tiles)
    except RuntimeError:
        return None
    # PyTorch documents no layout for its CPU packing: the unpacking is used only where it reads back u exactly
    block = next((b for b in (64, 32) if cpu and n % b == 0 and torch.equal(
        _unpacked_cpu_int4(packed, n, k, b).permute(0, 2, 1).reshape(n, k), u.to(torch.uint8))), 0)
    return packed, sz, block


def cuda_inner_k_tiles(k: int) -> int | None:
    """The CUDA tinygemm packing's k-tiles per load (2, 4 or 8 tiles of 16 columns): the largest whose 16 x tiles
    divides K, so the 8B-class K (4096, 14336) get 8 and SmolLM2's 576 gets 4; None when K % 32."""
    return next((t for t in (8, 4, 2) if k % (16 * t) == 0), None)


def kernel_runs(fn) -> bool:
    """Whether a kernel runs here for this shape (some builds / GPUs lack one); never raises."""
    try:
        fn()
        return True
    except (RuntimeError, NotImplementedError):
        return False


def one_line(e: BaseException) -> str:
    """An exception as one line (a layer's fallback_reason: why it runs its exact fallback, not its kernel)."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"[:300]
