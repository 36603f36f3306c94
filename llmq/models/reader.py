"""Reading a checkpoint directory (dense, compressed-tensors or bitsandbytes) lazily, one tensor at a time.

Shared by the build stage (which slices it into rank shards) and the runtime (which loads it): tensors are opened
from the safetensors files on demand, so neither ever holds two copies of a large model. Quantized linears and
KV-cache scales are read through `qformat` and `bnbformat`, the one reader of each format.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch

from ..errors import LlmqError
from . import bnbformat, qformat
from .checkpoint import read_config, safetensors_files
from .linear_weights import LinearWeights
from .sharding import split_rows
from .spec import ModelSpec


def split_group(lw: LinearWeights, spec: ModelSpec, group: str, i: int) -> dict[str, LinearWeights]:
    """A stored fused linear of layer i (a fused `group`) as its roles' linears, cut by output rows as `spec` gives
    them (ModelSpec.group_rows); quantized ones are cut in their unpacked form, scales and zero points with their
    rows."""
    rows = spec.group_rows(group)
    n = sum(len(r) for r in rows.values())
    if n != lw.out_features:
        raise LlmqError(f"{lw.name} has {lw.out_features} rows; its config gives {n}")
    return {role: dataclasses.replace(split_rows(lw, r), name=spec.arch.linear(i, role)) for role, r in rows.items()}


def unstacked_experts(tensors: Mapping[str, torch.Tensor], spec: ModelSpec, i: int) -> dict[str, LinearWeights]:
    """Layer i's stacked experts (Experts.stacked) as each expert's gate, up and down linears with their biases, by
    role: dense, or as OpenAI's MXFP4 checkpoints store them (the GPT-OSS releases: `<stacked>_blocks` uint8 [experts,
    rows, in / 32, 16], two E2M1 codes a byte, the first in the low nibble, and `<stacked>_scales` uint8 E8M0 [experts,
    rows, in / 32], rows already [out, in]), read as MXFP4 weights, codes and scales as stored."""
    from .. import quant
    from .arch import expert_role
    from .arch.base import STACKED
    from .qweight import QuantizedWeight, get_tensor

    arch, m = spec.arch, spec.arch.moe
    out = {}
    for stacked, roles in STACKED:
        n, cols = spec.linear_shape(expert_role(0, roles[0]))
        rows = n * len(roles)
        name = f"{arch.prefix(i)}.{m.block}.{m.experts}.{stacked}"
        blocks = tensors[f"{name}_blocks"] if f"{name}_blocks" in tensors else None
        bias = get_tensor(tensors, f"{name}_bias", "dense" if blocks is None else "quantized")
        if blocks is None:
            dense = get_tensor(tensors, name, "dense")
        else:
            scales, want = get_tensor(tensors, f"{name}_scales"), (spec.num_experts, rows, cols // 32)
            if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or tuple(blocks.shape) != (*want, 16) or \
                    tuple(scales.shape) != want or cols % 32:
                dt = lambda t: str(t.dtype).removeprefix("torch.")  # noqa: E731
                raise LlmqError(f"{name}_blocks {dt(blocks)} {list(blocks.shape)} and {name}_scales {dt(scales)} "
                                f"{list(scales.shape)} do not hold MXFP4 experts of [{rows}, {cols}]; expected uint8 "
                                f"{[*want, 16]} and {list(want)}")
        for e in range(spec.num_experts):
            for j, role in enumerate(roles):   # gate and up rows interleaved
                at = torch.arange(j, rows, len(roles))
                lname = arch.linear(i, expert_role(e, role))
                if blocks is None:
                    lw = LinearWeights(lname, weight=dense[e].t().index_select(0, at).contiguous())
                else:
                    qw = QuantizedWeight(q=quant.unpack_fp4(blocks[e].index_select(0, at).reshape(len(at), cols // 2)),
                                         scale=scales[e].index_select(0, at), zero_point=None, bits=4, group_size=32,
                                         symmetric=True)
                    lw = LinearWeights(lname, qw=qw.check(lname))
                out[expert_role(e, role)] = dataclasses.replace(lw, bias=bias[e].index_select(0, at).contiguous())
    return out


class UnstackedTensors(Mapping):
    """A dense checkpoint's tensors (`tensors`, a LazyTensors) with its stacked experts (Experts.stacked) under each
    expert's linear names instead (<layer>.mlp.experts.<e>.gate_proj.weight, .bias, ...): what quantize's ExpertsBlock
    loads and writes. A layer's stacked tensors are cut once, when one of its experts is first asked for."""

    def __init__(self, tensors: Mapping, spec: ModelSpec):
        self.tensors, self.spec = tensors, spec
        stacked = {f"{spec.arch.prefix(i)}.{p}" for i in range(spec.num_layers) for p in spec.stacked_experts()}
        self._names = [n for n in tensors if n not in stacked]
        self._cut: tuple[int, dict[str, torch.Tensor]] = (-1, {})

    def _layer(self, name: str) -> dict[str, torch.Tensor]:
        i = int(name[len(self.spec.arch.layers) + 1:].split(".")[0])
        if self._cut[0] != i:
            lws = unstacked_experts(self.tensors, self.spec, i).values()
            self._cut = (i, {f"{lw.name}.{k}": t for lw in lws for k, t in (("weight", lw.weight), ("bias", lw.bias))
                             if t is not None})
        return self._cut[1]

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self.tensors:
            return self.tensors[name]
        if name.startswith(self.spec.arch.layers + ".") and name in self._layer(name):
            return self._layer(name)[name]
        raise KeyError(name)

    def __contains__(self, name: object) -> bool:
        return name in self.tensors or (isinstance(name, str) and name.startswith(self.spec.arch.layers + ".") and
                                        ".experts." in name and name in self._layer(name))

    def __iter__(self) -> Iterator[str]:   # the unstacked experts' names are not listed: their layers emit them
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


class LazyTensors(Mapping):
    """name -> tensor over every *.safetensors file of a directory, each tensor read from disk when asked for and
    kept by nobody but the caller (see `safetensors_io`: no file is mapped into memory). A vision-language
    checkpoint's are its language model's under the text model's names (models.vision.text_name); its tower's and
    projector's are `vision` (stored name -> file), and `stored_name` maps a text name back."""

    def __init__(self, files: list[Path]):
        from .safetensors_io import TensorFile
        from .vision import text_name

        self._where: dict[str, TensorFile] = {}
        self._stored: dict[str, str] = {}   # text name -> stored name, where they differ
        self.vision: dict[str, TensorFile] = {}
        for f in files:
            h = TensorFile(f)
            for k in h.keys():
                name = text_name(k)
                if name is None:
                    self.vision[k] = h
                    continue
                self._where[name] = h
                if name != k:
                    self._stored[name] = k

    def stored_name(self, name: str) -> str:
        """The name a text-view tensor (or one to be written beside it) has in the checkpoint's own layout (a tower's
        tensor: its stored name itself, which transformers 5's layout also starts with "model.")."""
        if name in self._stored or not self._stored or name in self.vision:
            return self._stored.get(name, name)
        # a new tensor (a quantized linear's scales): under its module's stored prefix
        from .vision import LANGUAGE_PREFIXES

        stored_prefix = {text: p for p, text in LANGUAGE_PREFIXES if any(v.startswith(p) for v in
                                                                          self._stored.values())}
        for text, p in stored_prefix.items():
            if name.startswith(text):
                return p + name[len(text):]
        return name

    def vision_tensor(self, name: str) -> torch.Tensor:
        return self.vision[name].get(name)

    def __getitem__(self, name: str) -> torch.Tensor:
        try:
            return self._where[name].get(self._stored.get(name, name))
        except KeyError:
            raise KeyError(name) from None

    def __contains__(self, name: object) -> bool:  # Mapping's default would read the tensor
        return name in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def info(self, name: str) -> tuple[torch.dtype, list[int]]:
        """(dtype, shape) of a tensor, from the file's header: nothing is read."""
        dtype, shape, _ = self._where[name].entries[self._stored.get(name, name)]
        return dtype, shape

    def vision_info(self) -> dict[str, tuple[torch.dtype, list[int]]]:
        """(dtype, shape) of every tower / projector tensor, by stored name."""
        return {n: tuple(h.entries[n][:2]) for n, h in self.vision.items()}


class CheckpointReader:
    """A checkpoint directory of a supported family: config, spec, its declaration (`arch`: what its tensors are
    called) and its tensors, dense or quantized."""

    def __init__(self, path: Path | str, spec: ModelSpec | None = None):
        """spec: this config.json's, where the caller has it (a tensor-parallel rank gets rank 0's: deriving it
        imports transformers' config classes, most of a fresh process's start)."""
        from .vision import language_config

        self.path = Path(path)
        self.stored_config = read_config(self.path)
        self.config = language_config(self.stored_config)   # a vision-language checkpoint's language model's
        self.spec = spec or ModelSpec.from_config(self.stored_config)
        self.arch = self.spec.arch
        files = safetensors_files(self.path)
        if not files:
            raise LlmqError(f"{self.path}: no *.safetensors weights found")
        self.tensors = LazyTensors(files)
        self.bnb = bnbformat.parse_config(self.config)
        self.qconfig = None if self.bnb else qformat.parse_quantization_config(self.config)

    @property
    def quantized(self) -> bool:
        return self.qconfig is not None or self.bnb is not None

    def tensor(self, name: str) -> torch.Tensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise LlmqError(f"{self.path}: tensor {name} is missing from the checkpoint") from None

    def linear_tensors(self, name: str) -> tuple[torch.Tensor | None, qformat.QuantizedWeight | None,
                                                 torch.Tensor | None]:
        """(dense weight, quantized weight, bias) of one linear: exactly one of the first two is set."""
        bias = self.tensors.get(f"{name}.bias")
        if self.bnb is not None:
            qw = bnbformat.read_linear(self.tensors, name, self.bnb)
        else:
            qw = qformat.read_linear(self.tensors, name, self.qconfig) if self.qconfig is not None else None
        return (None if qw is not None else self.tensor(f"{name}.weight")), qw, bias

    def linear(self, name: str) -> LinearWeights:
        weight, qw, bias = self.linear_tensors(name)
        return LinearWeights(name, weight=weight, qw=qw, bias=bias)

    def layer_linears(self, i: int) -> dict[str, LinearWeights]:
        """Layer i's linears by role (q_proj ... down_proj; router and experts.<e>.<role> in a MoE layer); a group
        stored fused (Arch.fused) is cut into its roles, a group stored apart (llmq's rank directories) is read by
        role."""
        parts: dict[str, LinearWeights] = {}
        biases = [p for p in self.spec.stacked_experts() if p.endswith("_bias")]   # the weights: dense or MXFP4
        if biases and f"{self.arch.prefix(i)}.{biases[0]}" in self.tensors:
            parts |= unstacked_experts(self.tensors, self.spec, i)
        for group in self.arch.groups(i in self.spec.linear_layers):
            name = self.arch.linear(i, group)
            if f"{name}.weight" in self.tensors or f"{name}.weight_packed" in self.tensors:
                parts |= split_group(self.linear(name), self.spec, group, i)
        return {r: parts[r] if r in parts else self.linear(self.arch.linear(i, r)) for r in self.spec.roles(i)}

    def layer_norms(self, i: int) -> dict[str, torch.Tensor]:
        """Layer i's norm weights by role (attn_norm, mlp_norm, and q_norm / k_norm where the family has them)."""
        return {r: self.tensor(self.arch.norm(i, r)) for r in self.spec.norm_roles(i)}

    def layer_tensors(self, i: int) -> dict[str, torch.Tensor]:
        """Layer i's other parameters (a Gated DeltaNet layer's convolution, decay and norm: ModelSpec.linear_tensors)
        by their path in the layer."""
        return {p: self.tensor(f"{self.arch.prefix(i)}.{p}") for p in self.spec.linear_tensors(i)}

    def model_tensors(self) -> dict[str, torch.Tensor]:
        """The weights of ModelSpec.model_modules, by module name."""
        return {n: self.tensor(f"{n}.weight") for n in self.spec.model_modules()}

    def final_norm(self) -> torch.Tensor:
        return self.tensor(f"{self.arch.final_norm}.weight")

    def embedding(self) -> LinearWeights:
        """The token embedding table [vocab, hidden]: as stored, or INT8 per row (`quantize --embedding int8`)."""
        if self.embedding_quantized():
            return self.linear(qformat.EMBEDDING)
        return LinearWeights(qformat.EMBEDDING, weight=self.tensor(f"{qformat.EMBEDDING}.weight"))

    def embedding_quantized(self) -> bool:
        """Whether the table is stored quantized (known from the config and the tensor names, nothing is read)."""
        return self.qconfig is not None and qformat.EMBEDDING in self.qconfig.modules

    def lm_head(self, embed: LinearWeights | None = None) -> LinearWeights:
        """lm_head, or the embedding where the model ties them (`embed`: the table already read, shared rather than
        read again)."""
        if self.has_lm_head():
            return self.linear(qformat.LM_HEAD)
        if self.spec.tie_word_embeddings:
            return dataclasses.replace(embed or self.embedding(), name=qformat.LM_HEAD)
        raise LlmqError(f"{self.path}: no lm_head weights and tie_word_embeddings is false")

    def runtime_bytes(self, compute_dtype: torch.dtype,
                      kept: Callable[[torch.dtype, tuple[int, ...]], bool] | None = None) -> int:
        """About what the runtime's weights take once loaded: floating-point tensors in the compute dtype (a bf16
        checkpoint served in float32 doubles) unless `kept(dtype, shape)` says the runtime keeps them as stored
        (runtime.layers.linear.keeps_as_stored; FP4 codes too), packed integers and quantization scales as stored.
        Known before loading, so the KV-cache budget can be sized from what is left."""
        total = 0
        for name in self.tensors:
            dtype, shape = self.tensors.info(name)
            numel = math.prod(shape)
            stacked = name.endswith("_blocks")   # OpenAI's MXFP4 experts [experts, rows, in / 32, 16]
            fp4 = dtype == torch.uint8 and (stacked or name.endswith((".weight_packed", ".weight")) and
                                            self._fp4(name.rsplit(".", 1)[0]))   # CT's / ModelOpt's
            if fp4:
                # an FP4 layer holds its codes packed where a kernel takes them, else its E2M1 x block-scale values
                # as a bfloat16 weight (runtime.layers.fp4)
                full = (shape[-3], 32 * shape[-2]) if stacked else (shape[0], 2 * shape[1])
                if kept is not None and kept(torch.uint8, full):
                    total += numel
                else:
                    kept16 = kept is not None and kept(torch.bfloat16, full)
                    total += 2 * numel * (2 if kept16 else max(compute_dtype.itemsize, 2))
                continue
            wide = dtype.is_floating_point and dtype.itemsize > 1 and not name.endswith(("_scale", "_zero_point")) \
                and not (kept is not None and kept(dtype, tuple(shape)))
            total += numel * (max(compute_dtype.itemsize, dtype.itemsize) if wide else dtype.itemsize)
        # a vision-language model's tower and projector, computed with in the compute dtype (models.vision)
        total += sum(math.prod(shape) * max(compute_dtype.itemsize, dtype.itemsize)
                     for dtype, shape in self.tensors.vision_info().values())
        if self.embedding_quantized():
            scales = math.prod(self.tensors.info(f"{qformat.EMBEDDING}.weight_scale")[1])
            total += scales * 2  # the table's row scales are held in float32 for the lookup
            if not self.has_lm_head():  # the tied head packs its own copy of the table (codes, 16-bit scales)
                total += math.prod(self.tensors.info(f"{qformat.EMBEDDING}.weight_packed")[1]) * 4 + scales * 2
        return total

    def _fp4(self, module: str) -> bool:
        scheme = self.qconfig.scheme_of(module) if self.qconfig is not None else None
        return scheme is not None and scheme[0].fp4 is not None

    def has_lm_head(self) -> bool:
        return any(k.startswith(f"{qformat.LM_HEAD}.") for k in self.tensors)

    def kv_scales(self, i: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(k_scale, v_scale) of layer i when the checkpoint carries calibrated KV-cache scales (never of a hybrid
        model's Gated DeltaNet layer: it keeps no KV cache)."""
        if i in self.spec.linear_layers:
            return None
        return qformat.read_kv_scales(self.tensors, self.arch.attention_module(i), self.qconfig)

    def kv_cache_dtype(self) -> str | None:
        """'int8' / 'fp8' when the checkpoint carries a KV-cache scheme, else None."""
        return qformat.kv_cache_dtype(self.qconfig)
