"""What a quantize run writes: each tensor into the artifact the moment it is final, and the checkpoint's
quantization config derived from the weights themselves (one compressed-tensors scheme for the layers' linears, named
groups for the others; or bitsandbytes' serialized form). Apart from the stage driver because it is the checkpoint
format's side of the run: it reads the weights' packings (`llmq.models.qformat`, `bnbformat`), never the model.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import TYPE_CHECKING

from ...errors import LlmqError
from ...models import bnbformat, qformat

if TYPE_CHECKING:
    from .options import QuantizeOptions


def _scheme_args(qw: qformat.QuantizedWeight) -> tuple[qformat.QuantArgs, qformat.QuantArgs | None]:
    """The compressed-tensors (weights, input_activations) arguments that describe one quantized weight."""
    if qw.block:
        return qformat.fp8_block_args(qw.block)
    kind = "float" if qw.is_float or qw.fp4 else "int"
    strategy = "group" if qw.group_size else qw.strategy  # a group as wide as the row has a [out, 1] scale too
    if qw.fp4 == "nvfp4":
        strategy = "tensor_group"  # compressed-tensors' name for groups under a global scale
    weights = qformat.QuantArgs(num_bits=qw.bits, type=kind, symmetric=qw.symmetric, strategy=strategy,
                                group_size=qw.group_size if strategy in ("group", "tensor_group") else None)
    if qw.input_scale is None and not qw.dynamic:
        return weights, None
    if qw.fp4:   # W4A4: activations in the weights' FP4 format and groups
        return weights, qformat.fp4_activations_args(qw.fp4)
    acts = qformat.QuantArgs(num_bits=8, type=kind, symmetric=True, strategy="token" if qw.dynamic else "tensor",
                             dynamic=qw.dynamic)
    return weights, acts


class CheckpointSink:
    """The layer-by-layer run's Sink (layerwise.Sink): writes each tensor into the artifact the moment it is final
    (bitsandbytes' serialized form for its methods, compressed-tensors for every other) and keeps only what the
    config and the manifest need: the schemes seen, byte and parameter counts."""

    def __init__(self, writer, opts: QuantizeOptions, dense: tuple[str, ...] = ()):
        self.writer, self.opts, self.dense_linears = writer, opts, dense
        self.args: dict[str, tuple] = {}     # compressed-tensors (weights, activations) args of each layer linear
        self.names: dict[str, str] = {}      # their scheme names
        self.example = None          # one layer weight: its type tells the checkpoint format
        self.outside: dict[str, tuple] = {}  # quantized lm_head / embedding: (weight args, scheme name, parameters)
        self.linear_bytes = self.linear_params = self.dense_params = self.bias_params = 0
        self.dense_modules: set[str] = set()
        self._linears: set[str] = set()
        self.ggml: dict[str, str] = {}       # layer linears stored as GGML's blocks (qformat.GGMLWeight): their grid

    def linear(self, name: str, qw) -> None:
        compressed = isinstance(qw, (qformat.QuantizedWeight, qformat.GGMLWeight))
        tensors = (qformat.write_linear if compressed else bnbformat.write_linear)(name, qw)
        for k, t in tensors.items():
            self.writer.add(k, t)
        if name in (qformat.LM_HEAD, qformat.EMBEDDING):
            self.outside[name] = (_scheme_args(qw)[0], qw.scheme, math.prod(qw.shape))
            return
        if isinstance(qw, qformat.GGMLWeight):
            self.ggml[name] = qw.grid
        else:
            if self.example is None:
                self.example = qw
            self.args[name] = _scheme_args(qw) if compressed else qw.scheme
        self.names[name] = qw.scheme
        self.linear_bytes += sum(t.numel() * t.element_size() for t in tensors.values())
        self.linear_params += math.prod(qw.shape)
        self._linears.add(name)

    def dense(self, name: str, tensor) -> None:
        self.writer.add(name, tensor)
        module = name.rsplit(".", 1)[0]
        self.dense_modules.add(module)
        if name.endswith(".bias") and module in self._linears:
            self.bias_params += tensor.numel()
        else:
            self.dense_params += tensor.numel()

    @property
    def base(self):
        """The scheme most layer linears have: the `Linear` group; every other is a group of named modules."""
        counts = Counter(self.args.values())
        return max(counts, key=lambda a: (counts[a], repr(a))) if counts else None

    def scheme_per_module(self) -> dict[str, str]:
        """{"Linear": the base scheme's name, module: its own scheme name for every other one}."""
        base = self.base
        if base is None:   # every quantized layer linear is on a GGML grid: --grid's names them
            out = {"Linear": qformat.GGML_WEIGHTS[self.opts.grid].scheme if self.ggml else "dense"}
        else:
            out = {"Linear": next(self.names[n] for n, a in self.args.items() if a == base)}
            out.update({n: self.names[n] for n, a in self.args.items() if a != base})
        out.update({n: self.names[n] for n in self.ggml if self.names[n] != out["Linear"]})
        out.update({n: "dense" for n in self.dense_linears})
        return out | {n: o[1] for n, o in self.outside.items()}

    def quantization_config(self) -> tuple[dict, str]:
        """(quantization_config, format name): one scheme for the layers' linears, weight-only groups of named
        modules for the others (an INT8 lm_head or embedding, mixed precision); bitsandbytes checkpoints hold one
        scheme."""
        opts, base = self.opts, self.base
        if self.ggml and base is None:   # every quantized layer linear is on a GGML grid
            return qformat.quantization_config(None, ignore=[*opts.ignored, *self.dense_linears], ggml=self.ggml,
                                               modules={n: o[0] for n, o in self.outside.items()}), \
                "compressed-tensors"
        if isinstance(self.example, qformat.QuantizedWeight):
            modules = {n: a[0] for n, a in self.args.items() if a != base}
            if any(a[1] is not None for a in self.args.values() if a != base):
                raise LlmqError(f"method {opts.method} produced {len(set(self.args.values()))} different schemes; a "
                                "checkpoint holds one for activation-quantized layers")
            modules.update({n: o[0] for n, o in self.outside.items()})
            return qformat.quantization_config(base[0], base[1], ignore=[*opts.ignored, *self.dense_linears],
                                               modules=modules, ggml=self.ggml), "compressed-tensors"
        if len(set(self.args.values())) != 1:
            raise LlmqError(f"method {opts.method} produced {len(set(self.args.values()))} different schemes; a "
                            "bitsandbytes checkpoint holds one")
        if isinstance(self.example, bnbformat.Int8Weight):
            return bnbformat.quantization_config("int8", skip=opts.ignore, threshold=opts.int8_threshold), \
                "bitsandbytes"
        return bnbformat.quantization_config("nf4", skip=opts.ignore, compute_dtype=opts.compute_dtype,
                                             double_quant=opts.double_quant), "bitsandbytes"
