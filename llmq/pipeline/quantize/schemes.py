"""The schemes mixed precision chooses among (`llmq quantize --target-bpw B --for ENGINE`): for each, the bytes a
[n, k] linear takes exactly as the checkpoint stores it (and as the GGUF file does), how a unit's weights are rounded
to it, and which engines load it. All are weight-only (mixed.py measures the 4- and 5-bit ones' KLD and scales
INT4's by the weight-MSE ratio for the 8-bit ones):
- int4 / int8: the options' integer grid (4 bits: --group-size, 8 bits: --int8-group-size), compressed-tensors'
  pack-quantized; the method (rtn / gptq / awq) rounds them;
- int5: 5-bit integers in groups of 32 (GGUF's Q5_0 block; Q5_1 with --asym), rounded by the method as INT4 is;
  what llmq's runtime and llama.cpp run, not vLLM / TensorRT-LLM;
- fp8: FP8 E4M3 weights with a scale per output channel in the model's dtype, 16-bit activations (float-quantized
  without input_activations: vLLM's W8A16-FP8);
- nvfp4 / mxfp4: W4A16 FP4 as `--method nvfp4` / `mxfp4` write them (round-to-nearest, amax block scales; NVFP4's
  global scale shared by a unit, as engines fuse it);
- 16bit: the stored dtype, left dense.
Which engine loads which (`ENGINES`): vLLM's compressed-tensors integration reads every one of them from named config
groups, each with its own "format" under a top-level "mixed-precision" (CompressedTensorsConfig reads a group's format
before the global one; WNA16, W8A16-FP8, W4A16-NVFP4 and W4A16-MXFP4 are its weight-only schemes). TensorRT-LLM's
PyTorch backend loads per layer what llmq's trtllm target writes weight-only: W8A16 per channel, W4A16 (AWQ-style
groups); its FP8 and NVFP4 are W8A8 / W4A4, so neither weight-only FP8 nor NVFP4 / MXFP4 W4A16 is offered for it.
GGUF holds int4 (Q4_0 / Q4_1), int5 (Q5_0 / Q5_1), int8 (Q8_0, 32-aligned groups), MXFP4 and NVFP4 (64-weight
blocks) and no FP8; NVFP4 not in the dense FFN of the llama.cpp graphs that leave out its global scale there
(Arch.gguf_ffn_scale), which the GGUF build refuses (`Scheme.loads_unit`). llmq's runtime loads all."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ... import quant
from ...errors import LlmqError
from ...models import qformat
from . import fp4, rtn
from .fp8 import quantize_weight_fp8
from .options import ENGINES

INTEGER = ("int4", "int8", "16bit")   # what --target-bpw chooses among without --for: today's widths
GRID = ("int4", "int5", "int8", "16bit")   # the schemes the quantize method rounds (or keeps dense)
INT5_GROUP = 32   # mixed precision's INT5: GGUF's Q5_0 / Q5_1 block
NVFP4_SCALE_ENTRY = 96   # GGUF: the F32 `.scale` tensor holding NVFP4's global scale, padded to 32 bytes, and its
#                          tensor-table entry (under 64 bytes)
GGUF_TYPES = {"int4": "Q4_0", "int4-asym": "Q4_1", "int5": "Q5_0", "int5-asym": "Q5_1", "int8": "Q8_0",
              "mxfp4": "MXFP4", "nvfp4": "NVFP4"}


def linear_bytes(n: int, k: int, bits: int, group_size: int, symmetric: bool, dtype_bytes: int) -> int:
    """Bytes a [n, k] integer linear takes in the checkpoint at `bits` (group_size 0: per channel; 16: dense);
    dtype_bytes: the stored dtype's, which its scales and a dense linear keep."""
    if bits == 16:
        return dtype_bytes * n * k
    groups = k // group_size if group_size else 1
    zeros = 0 if symmetric else n * groups * bits // 8
    return n * k * bits // 8 + n * groups * dtype_bytes + zeros


def width_grid(bits: int, opts) -> tuple[int, int]:
    """(bits, group_size) of an integer linear at `bits`: the options' grid at their own width, --int8-group-size at
    8, groups of INT5_GROUP at 5 (mixed precision's INT5)."""
    if bits == opts.bits:
        return bits, opts.group_size
    return bits, {8: opts.int8_group_size, 5: INT5_GROUP}.get(bits, 0)


def gguf_block(name: str) -> tuple[int, int]:
    """(weights, bytes) of a GGUF block type, from the gguf package's table (llama.cpp's)."""
    import gguf

    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]


@dataclass(frozen=True)
class Scheme:
    """One candidate: its name, bits per weight before scales, and the engines that load it."""

    name: str
    bits: int
    engines: frozenset[str]

    @property
    def integer(self) -> bool:
        """Rounded by the quantize method on an integer grid (int4 / int5 / int8), or left dense (16bit)."""
        return self.name in GRID

    def checkpoint_bytes(self, n: int, k: int, opts, dtype_bytes: int = 2) -> int:
        """Bytes of a [n, k] linear in the checkpoint: values, scales, zero points, global scale (scales and dense
        weights in the stored dtype, of dtype_bytes)."""
        if self.name == "16bit":
            return dtype_bytes * n * k
        if self.name == "fp8":
            return n * k + n * dtype_bytes
        if self.name == "nvfp4":
            return n * k // 2 + n * k // quant.NVFP4_BLOCK + 4
        if self.name == "mxfp4":
            return n * k // 2 + n * k // quant.MXFP4_BLOCK
        return linear_bytes(n, k, *width_grid(self.bits, opts), opts.symmetric, dtype_bytes)

    def gguf_bytes(self, n: int, k: int, opts) -> int:
        """Bytes of a [n, k] linear in the GGUF file `llmq build --target gguf` writes."""
        if self.name == "16bit":
            return 2 * n * k
        asym = self.name in ("int4", "int5") and not opts.symmetric   # zero points: Q4_1 / Q5_1
        weights, size = gguf_block(GGUF_TYPES[f"{self.name}-asym" if asym else self.name])
        return n * (k // weights) * size + (NVFP4_SCALE_ENTRY if self.name == "nvfp4" else 0)

    def loads(self, engine: str, shapes: list[tuple[int, int]], opts) -> bool:
        """Whether `engine` loads this scheme for linears of these shapes under these options."""
        if engine not in self.engines:
            return False
        if engine == "gguf":
            if self.name == "nvfp4":
                return all(k % gguf_block("NVFP4")[0] == 0 for _, k in shapes)
            if self.name == "int8":
                return opts.symmetric   # Q8_0 has no zero point
        if engine == "trtllm" and self.name == "int8":
            return opts.int8_group_size == 0   # W8A16: a scale per output channel
        return True

    def loads_unit(self, engine: str, arch, roles: tuple[str, ...]) -> bool:
        """Whether `engine`, which loads this scheme, loads it for the unit of these roles: not NVFP4 where llama.cpp's
        graph drops the global scale (Arch.gguf_ffn_scale; the GGUF build would refuse the artifact)."""
        return not (engine == "gguf" and self.name == "nvfp4" and arch.gguf_drops_scale(roles))

    def quantize_unit(self, weights: list[torch.Tensor], opts, scale_dtype: torch.dtype
                      ) -> list[qformat.QuantizedWeight]:
        """Round-to-nearest of a unit's weights (q/k/v or gate/up share NVFP4's global scale); the integer grids as
        the rtn method rounds them (--scales), for the sensitivity pass."""
        if self.name == "fp8":   # weight-only: quantize_weight_fp8 without an input scale makes activations dynamic
            return [dataclasses.replace(quantize_weight_fp8(w, "channel", scale_dtype=scale_dtype), dynamic=False)
                    for w in weights]
        if self.name in qformat.FP4_FORMATS:
            g = quant.nvfp4_global_scale(torch.stack([w.abs().amax() for w in weights]).max()) \
                if self.name == "nvfp4" else None
            return [fp4.quantize_weight(w, self.name, g) for w in weights]
        if self.name == "16bit":
            raise LlmqError("16bit weights are kept, not rounded")
        return [rtn.quantize_weight(w, *width_grid(self.bits, opts), opts.symmetric, scale_dtype, search=opts.search)
                for w in weights]


_ALL = frozenset(ENGINES)
SCHEMES = {s.name: s for s in (
    Scheme("int4", 4, _ALL),
    Scheme("int5", 5, frozenset({"llmq", "gguf"})),
    Scheme("nvfp4", 4, frozenset({"llmq", "vllm", "gguf"})),
    Scheme("mxfp4", 4, frozenset({"llmq", "vllm", "gguf"})),
    Scheme("int8", 8, _ALL),
    Scheme("fp8", 8, frozenset({"llmq", "vllm"})),
    Scheme("16bit", 16, _ALL),
)}


def candidates(engine: str | None, shapes: list[tuple[int, int]], opts) -> list[Scheme]:
    """The schemes --target-bpw chooses among: the integer widths without --for, else every scheme `engine` loads
    for linears of these shapes; cheapest first."""
    if engine is None:
        return [SCHEMES[n] for n in INTEGER]
    out = [s for s in SCHEMES.values() if s.loads(engine, shapes, opts)]
    return sorted(out, key=lambda s: sum(s.checkpoint_bytes(n, k, opts) for n, k in shapes))
