"""A quantized linear in memory, whatever layout it was read from (qformat.py's compressed-tensors, modelopt.py's
ModelOpt): `QuantizedWeight` (integers, FP8 or FP4 codes with their scales) and `GGMLWeight` (GGML's own blocks:
`Q4KWeight`, `IQ4XSWeight`, `IQ4NLWeight`); and `get_tensor` / `check_scale`, the one missing-tensor and bad-scale
errors their readers give."""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch

from .. import quant
from ..errors import LlmqError


def get_tensor(tensors: Mapping[str, torch.Tensor], key: str, layout: str = "quantized") -> torch.Tensor:
    try:
        return tensors[key]
    except KeyError:
        raise LlmqError(f"tensor {key} is missing from the {layout} checkpoint") from None


def check_scale(t: torch.Tensor, what: str, nonzero: bool = True) -> None:
    """Refuse, in one line, a NaN or infinite scale (an E8M0 exponent of 255 is NaN), or a zero one where it
    multiplies codes that need not be zero: what would otherwise surface as NaN logits."""
    bad = (t == 255) if t.dtype == torch.uint8 else ~t.float().isfinite() | ((t.float() == 0) if nonzero else False)
    if bool(bad.any()):
        at = [int(i) for i in bad.nonzero()[0]]
        value = "255 (NaN)" if t.dtype == torch.uint8 else t.float()[tuple(at)].item()
        raise LlmqError(f"{what} holds {value} at {at}: a scale must be finite{' and nonzero' if nonzero else ''}")


@dataclass(frozen=True)
class QuantizedWeight:
    """One linear's weight as integers q (signed, [-2^(b-1), 2^(b-1)-1]; or float8_e4m3fn for FP8) of shape
    [out, in] and scale / zero_point of shape [1] (tensor), [out, 1] (channel) or [out, in/g] (group).
    Real weight = (q - zero_point) * scale. input_scale: static activation scale [1]; dynamic: per-token scales.
    FP4 (NVFP4 / MXFP4): q holds uint8 E2M1 codes, one per weight; scale the E4M3 (NVFP4) or E8M0 (MXFP4, uint8)
    block scales [out, in/g]; global_scale NVFP4's float32 [1] divisor (real weight: `llmq.quant.dequantize_fp4`).
    Block FP8: block = (rows, cols) of a weight block, scale float32 [ceil(out / rows), ceil(in / cols)], activations
    dynamic per token per group of `cols` inputs.
    FP4 with dynamic=True is W4A4: activations in the weight's FP4 format, block scales computed at run time, under
    NVFP4's static input_global_scale (float32 [1], a divisor) (`llmq.quant.fp4_activations`)."""

    q: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor | None
    bits: int
    group_size: int | None
    symmetric: bool
    input_scale: torch.Tensor | None = None
    dynamic: bool = False
    global_scale: torch.Tensor | None = None
    block: tuple[int, int] | None = None
    input_global_scale: torch.Tensor | None = None

    @property
    def is_float(self) -> bool:
        return self.q.dtype == torch.float8_e4m3fn

    @property
    def fp4(self) -> str | None:
        """"nvfp4" (E4M3 block scales) / "mxfp4" (E8M0 ones) for FP4 codes, else None."""
        if self.q.dtype != torch.uint8:
            return None
        return "mxfp4" if self.scale.dtype == torch.uint8 else "nvfp4"

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    @property
    def strategy(self) -> str:
        if self.block:
            return "block"
        if self.scale.numel() == 1:
            return "tensor"
        return "channel" if self.scale.shape[-1] == 1 else "group"

    @property
    def activation_bits(self) -> int | None:
        if self.fp4:
            return 4 if self.dynamic else None
        return 8 if (self.input_scale is not None or self.dynamic) else None

    @property
    def scheme(self) -> str:
        if self.fp4:
            return self.fp4.upper() + ("" if self.dynamic else "A16")   # compressed-tensors' preset names
        kind = "FP8" if self.is_float else f"W{self.bits}A{self.activation_bits or 16}"
        detail = f"group{self.group_size}" if self.strategy == "group" else (
            f"block{self.block[0]}x{self.block[1]}" if self.block else self.strategy)
        sym = "" if self.is_float else ("-sym" if self.symmetric else "-asym")
        act = "" if self.activation_bits is None else ("-dynamic" if self.dynamic else "-static")
        return f"{kind}-{detail}{sym}{act}"

    def check(self, name: str) -> QuantizedWeight:
        """This weight, refused in one line naming linear `name` where its codes, scales, groups and zero points do
        not fit each other or a scale is not finite and nonzero (an FP4 block of zeros has a zero block scale):
        whatever layout it came from, a damaged or hostile checkpoint stops here rather than as a traceback or NaN
        logits later. A weight narrower than one group (a rank's slice) keeps that group's scale."""
        if self.q.dim() != 2 or self.q.dtype not in (torch.int8, torch.float8_e4m3fn, torch.uint8):
            raise LlmqError(f"{name}: quantized weight {self.q.dtype} {list(self.q.shape)} is not int8, FP8 or FP4 "
                            "codes [out, in]")
        n, k = self.q.shape
        g = self.group_size
        if g and k % g and k > g:
            raise LlmqError(f"{name}: group_size {g} does not divide the weight's {k} inputs")
        shape = tuple(self.scale.shape)
        if self.block or g:
            fits = shape == ((-(-n // self.block[0]), -(-k // self.block[1])) if self.block else (n, -(-k // g)))
        else:
            fits = self.scale.numel() == 1 or shape == (n, 1)
        if not fits:
            raise LlmqError(f"{name}: weight scale of shape {list(self.scale.shape)} does not fit a [{n}, {k}] weight"
                            + (f" in groups of {g}" if g else f" in {self.block[0]} x {self.block[1]} blocks"
                               if self.block else " (expected one scale, or one per output row)"))
        if self.zero_point is not None and self.zero_point.numel() != self.scale.numel():
            raise LlmqError(f"{name}: weight zero point of shape {list(self.zero_point.shape)} does not match its "
                            f"scale's {list(self.scale.shape)}")
        check_scale(self.scale, f"{name}: weight scale", nonzero=not self.fp4)
        for what, s in (("global scale", self.global_scale), ("input scale", self.input_scale),
                        ("input global scale", self.input_global_scale)):
            if s is not None:
                check_scale(s, f"{name}: {what}")
        return self

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.fp4:
            return quant.dequantize_fp4(self.q, self.scale, self.global_scale, dtype)
        if self.block:
            return quant.dequantize_fp8_blocks(self.q, self.scale, self.block, dtype)
        return quant.dequantize(self.q, self.scale, self.zero_point, dtype)


@dataclass(frozen=True)
class GGMLWeight(ABC):
    """One linear's weight on one of GGML's block grids (`llmq quantize --grid q4_k / iq4_xs`, and IQ4_NL where
    --grid iq4_xs falls back), which compressed-tensors cannot hold (a Q4_K min is any multiple of dmin, not an
    integer zero point; the IQ4 values are a non-uniform table), so the checkpoint carries GGML's own blocks:
    `<name>.weight_<grid>` uint8 [out, in / block_weights * block_bytes], the modules listed under `llmq_<grid>` in
    the quantization config (and in `ignore`, so that a compressed-tensors loader skips them rather than misreads
    them), read by llmq's runtime and written to GGUF as the same type byte for byte. A subclass is a frozen dataclass
    adding its scales' fields after the codes q, in its unpacking's order: every field is a tensor, rows first."""

    grid: ClassVar[str]           # llmq's name for it (--grid's), the checkpoint tensor's suffix and the config key's
    scheme: ClassVar[str]         # GGML's type name
    block_weights: ClassVar[int]  # weights per GGML block (a super-block of sub-blocks, or one block)
    block_bytes: ClassVar[int]    # bytes per GGML block
    q: torch.Tensor               # the codes, uint8 [out, in] in [0, 15]

    bits = 4
    fp4 = None
    block = None
    input_scale = None
    global_scale = None
    input_global_scale = None
    dynamic = False
    is_float = False

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def _tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))

    @abstractmethod
    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor: ...

    @abstractmethod
    def blocks(self) -> torch.Tensor:
        """GGML's block bytes, uint8 [out, in / block_weights * block_bytes]."""

    @staticmethod
    @abstractmethod
    def _unpack(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """blocks()' inverse: the fields' tensors."""

    @classmethod
    def from_blocks(cls, blocks: torch.Tensor, name: str = "") -> GGMLWeight:
        if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] % cls.block_bytes:
            raise LlmqError(f"{name}: weight_{cls.grid} {blocks.dtype} {tuple(blocks.shape)} is not GGML {cls.scheme} "
                            f"blocks (uint8 [out, in / {cls.block_weights} * {cls.block_bytes}])")
        return cls(*cls._unpack(blocks))

    def rows(self, rows: torch.Tensor, name: str = "") -> GGMLWeight:
        """The output rows `rows` (a selection or permutation; padding rows have no GGML form)."""
        if int(rows.min()) < 0 or int(rows.max()) >= self.q.shape[0]:
            raise LlmqError(f"{name}: {self.scheme} weights are not padded for tensor parallelism; use --tp 1")
        return type(self)(*(t.index_select(0, rows) for t in self._tensors()))

    @classmethod
    def cat(cls, parts: list[GGMLWeight]) -> GGMLWeight:
        return cls(*(torch.cat(ts) for ts in zip(*(p._tensors() for p in parts))))


@dataclass(frozen=True)
class Q4KWeight(GGMLWeight):
    """GGML's Q4_K (`llmq.quant`'s Q4_K): codes q uint8 [out, in] in [0, 15], per 256-weight super-block d and dmin
    (float16 [out, in / 256]), per 32-weight sub-block the 6-bit sc and m (uint8 [out, in / 32]); real weight =
    d * sc * q - dmin * m (`llmq.quant.dequantize_q4_k`); blocks `llmq.quant.pack_q4_k`'s."""

    d: torch.Tensor
    dmin: torch.Tensor
    sc: torch.Tensor
    m: torch.Tensor

    grid = "q4_k"
    scheme = "Q4_K"
    block_weights = quant.Q4K_SUPER
    block_bytes = quant.Q4K_BYTES

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return quant.dequantize_q4_k(self.q, self.d, self.dmin, self.sc, self.m, dtype)

    def blocks(self) -> torch.Tensor:
        return quant.pack_q4_k(self.q, self.d, self.dmin, self.sc, self.m).reshape(self.q.shape[0], -1)

    _unpack = staticmethod(quant.unpack_q4_k)


@dataclass(frozen=True)
class IQ4Weight(GGMLWeight):
    """GGML's 4-bit table grids: codes q uint8 [out, in] in [0, 15] indexing quant.IQ4_VALUES, times a step per 32
    weights that a subclass stores its own way (`steps`); real weight = step * IQ4_VALUES[q]
    (`llmq.quant.dequantize_iq4`). The runtime computes with the codes and the steps alone (kquant.IQ4Linear)."""

    @abstractmethod
    def steps(self) -> torch.Tensor:
        """The float32 step of every 32 weights, [out, in / 32] (exact)."""

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return quant.dequantize_iq4(self.q, self.steps(), dtype)


@dataclass(frozen=True)
class IQ4XSWeight(IQ4Weight):
    """GGML's IQ4_XS (`llmq.quant`'s IQ4_XS): per 256-weight super-block d (float16 [out, in / 256]), per 32-weight
    sub-block the 6-bit ls (uint8 [out, in / 32]); step = d * (ls - 32); blocks `llmq.quant.pack_iq4_xs`'s."""

    d: torch.Tensor
    ls: torch.Tensor

    grid = "iq4_xs"
    scheme = "IQ4_XS"
    block_weights = quant.IQ4XS_SUPER
    block_bytes = quant.IQ4XS_BYTES

    def steps(self) -> torch.Tensor:
        return quant.iq4_xs_steps(self.d, self.ls)

    def blocks(self) -> torch.Tensor:
        return quant.pack_iq4_xs(self.q, self.d, self.ls).reshape(self.q.shape[0], -1)

    _unpack = staticmethod(quant.unpack_iq4_xs)


@dataclass(frozen=True)
class IQ4NLWeight(IQ4Weight):
    """GGML's IQ4_NL (`llmq.quant`'s IQ4_NL), --grid iq4_xs's where 256 does not divide the input width, as in
    llama.cpp: per 32-weight block the step d itself (float16 [out, in / 32]); blocks `llmq.quant.pack_iq4_nl`'s."""

    d: torch.Tensor

    grid = "iq4_nl"
    scheme = "IQ4_NL"
    block_weights = quant.IQ4_BLOCK
    block_bytes = quant.IQ4NL_BYTES

    def steps(self) -> torch.Tensor:
        return self.d.float()

    def blocks(self) -> torch.Tensor:
        return quant.pack_iq4_nl(self.q, self.d).reshape(self.q.shape[0], -1)

    _unpack = staticmethod(quant.unpack_iq4_nl)


# by llmq's grid name: --grid's, and iq4_nl (--grid iq4_xs's fallback)
GGML_WEIGHTS: dict[str, type[GGMLWeight]] = {c.grid: c for c in (Q4KWeight, IQ4XSWeight, IQ4NLWeight)}
