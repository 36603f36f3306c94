"""The `quantization_config` of a quantized checkpoint: compressed-tensors' config groups, written through its own
pydantic models and parsed back (llmq.models.qformat holds the tensors' side of the format and re-exports these
names). One scheme targets every `Linear`; named groups give single modules their own weight-only scheme (an INT8
lm_head or embedding, mixed precision). When the groups' compressed-tensors formats differ (INT4 pack-quantized
beside FP8 float-quantized and NVFP4 / MXFP4 pack-quantized: mixed precision across formats), each group carries its
own "format" and the top-level format is "mixed-precision", compressed-tensors' own convention (QuantizationScheme.
format, CompressionFormat.mixed_precision), which vLLM reads group by group. The Hugging Face "fp8" config of block-FP8
releases is read as the compressed-tensors scheme it is.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from .. import quant
from ..errors import LlmqError
from .arch.base import LM_HEAD
from .qweight import GGML_WEIGHTS

FORMATS = ("pack-quantized", "int-quantized", "float-quantized", "nvfp4-pack-quantized", "mxfp4-pack-quantized")
FP4_FORMATS = {"nvfp4": (quant.NVFP4_BLOCK, "nvfp4-pack-quantized"),   # format: (block size, compressed-tensors name)
               "mxfp4": (quant.MXFP4_BLOCK, "mxfp4-pack-quantized")}
FP4_NAMES = {name for _, name in FP4_FORMATS.values()}
MIXED = "mixed-precision"  # compressed-tensors' format of a config whose groups have different formats
BITS = {"int": (4, 5, 8), "float": (4, 8)}  # the widths llmq computes, by type: INT4 / INT5 / INT8, FP4 / FP8
CT_MIN, CT_MAX = (0, 20), (0, 21)  # compressed-tensors releases [CT_MIN, CT_MAX) whose format llmq writes and reads
CT_REQUIREMENT = f"compressed-tensors>={CT_MIN[0]}.{CT_MIN[1]},<{CT_MAX[0]}.{CT_MAX[1]}"


def _release(version: str) -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", str(version))
    if not m:
        raise LlmqError(f"compressed-tensors version {version!r} is not a version number")
    return int(m[1]), int(m[2])


def compressed_tensors_version() -> str:
    """The installed compressed-tensors version; an LlmqError when llmq does not write that release's format."""
    import compressed_tensors

    v = compressed_tensors.__version__
    if not CT_MIN <= _release(v) < CT_MAX:
        raise LlmqError(f"compressed-tensors {v} is installed but llmq writes the format of {CT_REQUIREMENT}; "
                        f"pip install '{CT_REQUIREMENT}'")
    return v


@dataclass(frozen=True)
class QuantArgs:
    """How one tensor kind (weights, input activations, KV cache) is quantized; mirrors compressed-tensors'
    QuantizationArgs. strategy: tensor | channel | group | tensor_group (NVFP4's groups under a global scale) | block
    (block_structure [rows, cols]) | token | attn_head."""

    num_bits: int
    type: str = "int"              # int | float
    symmetric: bool = True
    strategy: str = "channel"
    group_size: int | None = None
    dynamic: bool | str = False    # "local": dynamic groups under a static global scale (NVFP4 activations)
    block_structure: tuple[int, int] | None = None

    def __post_init__(self):
        """Refuse, in one line naming the field, a scheme llmq cannot compute, whoever wrote the config (a
        compressed-tensors, Hugging Face fp8 or ModelOpt one): before a tensor is read by it."""
        def whole(x) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        if self.type not in BITS or not whole(self.num_bits) or self.num_bits not in BITS[self.type]:
            raise LlmqError(f"quantization scheme: num_bits {self.num_bits!r} (type {self.type}) is not a width llmq "
                            f"computes ({'; '.join(f'{t}: {list(b)}' for t, b in BITS.items())})")
        grouped = self.strategy in ("group", "tensor_group")
        if (grouped or self.group_size is not None) and not (whole(self.group_size) and (
                self.group_size > 0 or (self.group_size == -1 and not grouped))):
            raise LlmqError(f"quantization scheme: group_size {self.group_size!r} is not a positive integer (strategy "
                            f"{self.strategy}; -1, compressed-tensors' per channel, only outside group strategies)")
        if (self.strategy == "block") != (self.block_structure is not None) or self.block_structure is not None and (
                len(self.block_structure) != 2 or not all(whole(b) and b > 0 for b in self.block_structure)):
            raise LlmqError(f"quantization scheme: block_structure {self.block_structure!r} with strategy "
                            f"{self.strategy} is not two positive integers under strategy block")

    @property
    def fp4(self) -> str | None:
        """"nvfp4" / "mxfp4" for FP4 weights (told apart by their block size), else None."""
        if self.type != "float" or self.num_bits != 4:
            return None
        return next((f for f, (block, _) in FP4_FORMATS.items() if block == self.group_size), None)

    def to_ct(self):
        from compressed_tensors.quantization import QuantizationArgs

        kw: dict[str, object] = dict(num_bits=self.num_bits, type=self.type, symmetric=self.symmetric,
                                     strategy=self.strategy, dynamic=self.dynamic)
        if self.group_size is not None:
            kw["group_size"] = self.group_size
        if self.block_structure is not None:
            kw["block_structure"] = list(self.block_structure)
        if self.fp4:  # the scale dtype is what tells compressed-tensors' MX path from NVFP4's
            kw["scale_dtype"] = quant.FP8 if self.fp4 == "nvfp4" else torch.uint8
        if self.dynamic == "local":  # the global scale from the largest calibration |x| (the NVFP4 preset's observer)
            kw["observer"] = "static_minmax"
        return QuantizationArgs(**kw)

    @classmethod
    def from_dict(cls, d: Mapping) -> "QuantArgs":
        return cls(num_bits=d.get("num_bits"), type=str(d.get("type", "int")),
                   symmetric=bool(d.get("symmetric", True)),
                   strategy=str(d.get("strategy") or "tensor"), group_size=d.get("group_size"),
                   dynamic="local" if d.get("dynamic") == "local" else bool(d.get("dynamic", False)),
                   block_structure=tuple(d["block_structure"]) if d.get("block_structure") else None)


@dataclass(frozen=True)
class QConfig:
    """A parsed `quantization_config`: one scheme for every Linear except `ignore` and `modules`, plus the KV-cache
    scheme. weights is None (format "dense") when only the KV cache is quantized; modules maps a module's full name
    (`lm_head`, `model.layers.3.mlp.down_proj`) to its own weight-only scheme (a config group targeting it by name).
    format is the Linear group's compressed-tensors format (its own under a "mixed-precision" config); a named
    module's follows from its scheme (format_of)."""

    format: str
    weights: QuantArgs | None
    input_activations: QuantArgs | None
    ignore: tuple[str, ...]
    kv: QuantArgs | None
    modules: Mapping[str, QuantArgs] = field(default_factory=dict)
    scale_name: str = "weight_scale"  # the Hugging Face "fp8" checkpoints' weight_scale_inv
    ggml: Mapping[str, str] = field(default_factory=dict)  # module -> its GGML grid (qweight.GGML_WEIGHTS' names)
    # readers of another layout's tensors (ModelOpt's: `modelopt`), in place of qformat's compressed-tensors ones
    read: Callable | None = None
    read_kv: Callable | None = None

    @property
    def lm_head(self) -> QuantArgs | None:
        return self.modules.get(LM_HEAD)

    def scheme_of(self, name: str) -> tuple[QuantArgs, QuantArgs | None] | None:
        """(weights, input activations) of the linear `name`, None where it is stored dense."""
        if name in self.modules:
            return self.modules[name], None
        if self.weights is None or self.ignores(name):
            return None
        return self.weights, self.input_activations

    def format_of(self, name: str) -> str:
        """The compressed-tensors format the linear `name` is stored in."""
        return format_for(self.modules[name], None) if name in self.modules else self.format

    def ignores(self, name: str) -> bool:
        """compressed-tensors' ignore entries: a module name (matched as a suffix of the full name) or `re:<regex>`."""
        for pat in self.ignore:
            if pat.startswith("re:"):
                if re.match(pat[3:], name):
                    return True
            elif name == pat or name.endswith("." + pat):
                return True
        return False


def fp4_activations_args(fmt: str) -> QuantArgs:
    """The input_activations of compressed-tensors' W4A4 preset for FP4 format `fmt` (NVFP4 / MXFP4)."""
    block = FP4_FORMATS[fmt][0]
    return QuantArgs(num_bits=4, type="float", strategy="tensor_group" if fmt == "nvfp4" else "group",
                     group_size=block, dynamic="local" if fmt == "nvfp4" else True)


def ggml_config_key(grid: str) -> str:
    """The quantization config's list of the modules stored on GGML grid `grid` (llmq_q4_k, llmq_iq4_xs, ...)."""
    return f"llmq_{grid}"


def format_for(weights: QuantArgs, input_activations: QuantArgs | None) -> str:
    if weights.type == "float" and weights.num_bits == 4:
        if weights.fp4 is None or input_activations not in (None, fp4_activations_args(weights.fp4)):
            raise LlmqError(f"FP4 weights in groups of {weights.group_size}"
                            f"{' with these quantized activations' if input_activations else ''} have no "
                            "compressed-tensors format llmq writes (NVFP4: groups of 16, MXFP4: groups of 32, "
                            "weight-only or with activations in the weights' own FP4 format and groups)")
        from compressed_tensors.config import CompressionFormat

        fmt = FP4_FORMATS[weights.fp4][1]
        if fmt not in {f.value for f in CompressionFormat}:
            raise LlmqError(f"the installed compressed-tensors {compressed_tensors_version()} has no {fmt!r} format; "
                            f"pip install -U '{CT_REQUIREMENT}'")
        return fmt
    if weights.type == "float":
        return "float-quantized"
    return "pack-quantized" if input_activations is None else "int-quantized"


def quantization_config(weights: QuantArgs | None, input_activations: QuantArgs | None = None,
                        ignore: list[str] | tuple[str, ...] = (LM_HEAD,), kv: QuantArgs | None = None,
                        modules: Mapping[str, QuantArgs] | None = None, ggml: Mapping[str, str] | None = None
                        ) -> dict:
    """The `quantization_config` dict for config.json, validated by compressed-tensors' own models.
    weights=None: dense weights with a calibrated KV cache only (format "dense", no config groups).
    modules: full module name -> its own weight-only scheme (an INT8 lm_head, mixed-precision layers): one more group
    per distinct scheme, targeting its modules by name. Where the groups' formats differ, each carries its own and
    the config's is "mixed-precision".
    ggml: module -> GGML grid of the modules stored as GGML's blocks (qweight.GGMLWeight): listed under
    `llmq_<grid>` and ignored by the compressed-tensors groups (weights=None: every quantized linear is one; then
    `modules`, an INT8 embedding / lm_head, are the only groups, by name)."""
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme

    modules = dict(modules or {})
    if ggml:
        ignore = list(dict.fromkeys([*ignore, *ggml]))
        if weights:
            cfg = quantization_config(weights, input_activations, ignore, kv, modules)
        elif modules:
            by_scheme: dict[QuantArgs, list[str]] = {}
            for name, args in modules.items():
                by_scheme.setdefault(args, []).append(name)
            fmts = {format_for(args, None) for args in by_scheme}
            groups = {f"group_{i}": QuantizationScheme(targets=sorted(names), weights=args.to_ct(),
                                                        format=format_for(args, None) if len(fmts) > 1 else None)
                      for i, (args, names) in enumerate(sorted(by_scheme.items(), key=lambda kv: sorted(kv[1])))}
            cfg = {**QuantizationConfig(config_groups=groups, format=MIXED if len(fmts) > 1 else fmts.pop(),
                                        ignore=ignore, kv_cache_scheme=kv.to_ct() if kv else None,
                                        quantization_status="compressed").model_dump(mode="json", exclude_none=True),
                   "version": compressed_tensors_version()}
        else:
            cfg = {"quant_method": "compressed-tensors", "format": "dense", "config_groups": {}, "ignore": ignore,
                   "quantization_status": "compressed", "version": compressed_tensors_version()}
        for grid in sorted(set(ggml.values())):
            cfg[ggml_config_key(grid)] = sorted(n for n, g in ggml.items() if g == grid)
        return cfg
    if weights is None:
        if kv is None or input_activations is not None or modules:
            raise LlmqError("a quantization_config without a weights scheme carries a KV-cache scheme and nothing else")
        groups, fmt = {}, "dense"
    else:
        fmt = format_for(weights, input_activations)
        by_scheme: dict[QuantArgs, list[str]] = {}
        for name, args in modules.items():
            if input_activations is not None or name in ignore:
                raise LlmqError(f"{name}: a module with its own weight-only scheme sits beside weight-only linears "
                                "and is not ignored")
            by_scheme.setdefault(args, []).append(name)
        mixed = len({fmt, *(format_for(args, None) for args in by_scheme)}) > 1  # then each group says its format
        groups = {"group_0": QuantizationScheme(
            targets=["Linear"], weights=weights.to_ct(), format=fmt if mixed else None,
            input_activations=input_activations.to_ct() if input_activations else None)}
        for i, (args, names) in enumerate(sorted(by_scheme.items(), key=lambda kv: sorted(kv[1])), start=1):
            groups[f"group_{i}"] = QuantizationScheme(targets=sorted(names), weights=args.to_ct(),
                                                      format=format_for(args, None) if mixed else None)
        fmt = MIXED if mixed else fmt
    cfg = QuantizationConfig(config_groups=groups, format=fmt, ignore=list(ignore) if groups else [],
                             kv_cache_scheme=kv.to_ct() if kv else None, quantization_status="compressed")
    return {**cfg.model_dump(mode="json", exclude_none=True), "version": compressed_tensors_version()}


def parse_quantization_config(config: Mapping) -> QConfig | None:
    """The QConfig of a compressed-tensors or Hugging Face fp8 model config, None for an unquantized model; an
    LlmqError for anything we cannot read (qformat.parse_quantization_config, every stage's entry, reads ModelOpt's
    first)."""
    qc = config.get("quantization_config")
    if not qc:
        return None
    if qc.get("quant_method") == "fp8":
        return _hf_fp8_config(qc)
    if qc.get("quant_method") == "mxfp4":
        return _openai_mxfp4_config()
    if qc.get("quant_method") != "compressed-tensors":
        raise LlmqError(f"quantization method {qc.get('quant_method')!r} is not supported; llmq reads "
                        "compressed-tensors checkpoints (as written by `llmq quantize` or llm-compressor), Hugging "
                        "Face block fp8, ModelOpt and OpenAI's MXFP4 ones")
    if qc.get("version") and _release(qc["version"]) >= CT_MAX:
        raise LlmqError(f"this checkpoint was written by compressed-tensors {qc['version']}, a newer format than llmq "
                        f"reads ({CT_REQUIREMENT})")
    fmt = qc.get("format")
    groups = [g for g in (qc.get("config_groups") or {}).values() if isinstance(g, Mapping) and g.get("weights")]
    kv = qc.get("kv_cache_scheme")
    ggml = {name: grid for grid in GGML_WEIGHTS for name in qc.get(ggml_config_key(grid)) or ()}
    if fmt == "dense" and not groups and (kv or ggml):  # KV-cache-only quantization, or every linear on a GGML grid
        return QConfig(format=fmt, weights=None, input_activations=None, ignore=tuple(qc.get("ignore") or ()),
                       kv=QuantArgs.from_dict(kv) if kv else None, ggml=ggml)
    if fmt not in (*FORMATS, MIXED):
        raise LlmqError(f"compressed-tensors format {fmt!r} is not supported; llmq reads {', '.join(FORMATS)} and "
                        f"{MIXED} of them")
    linear = [g for g in groups if list(g.get("targets") or ()) == ["Linear"]]
    named = [g for g in groups if g not in linear]
    if ggml and not linear and named and all(not g.get("input_activations") for g in named):
        # every layer linear on a GGML grid, an INT8 embedding / lm_head named beside them
        return QConfig(format="dense", weights=None, input_activations=None, ignore=tuple(qc.get("ignore") or ()),
                       kv=QuantArgs.from_dict(kv) if kv else None,
                       modules={t: QuantArgs.from_dict(g["weights"]) for g in named for t in g["targets"]}, ggml=ggml)
    if len(linear) != 1 or any(g.get("input_activations") or any(
            not isinstance(t, str) or t.startswith("re:") or t == "Linear" for t in g.get("targets") or ())
            for g in named):
        raise LlmqError("only compressed-tensors checkpoints with one scheme for every Linear layer (and optionally "
                        "weight-only ones for modules named in full) are supported")
    modules = {t: QuantArgs.from_dict(g["weights"]) for g in named for t in g["targets"]}
    acts = linear[0].get("input_activations")
    weights, acts = QuantArgs.from_dict(linear[0]["weights"]), QuantArgs.from_dict(acts) if acts else None
    if fmt == MIXED:
        fmt = linear[0].get("format") or format_for(weights, acts)
    for g in named:   # a named group's format is its scheme's (the config's, unless it is mixed-precision)
        want = format_for(QuantArgs.from_dict(g["weights"]), None)
        if g.get("format", want if qc.get("format") == MIXED else fmt) != want:
            raise LlmqError(f"compressed-tensors group for {', '.join(g['targets'][:3])} is stored as "
                            f"{g.get('format', fmt)!r}, which llmq does not read for its scheme (it writes {want!r})")
    return QConfig(format=fmt, weights=weights, input_activations=acts,
                   ignore=tuple(qc.get("ignore") or ()), kv=QuantArgs.from_dict(kv) if kv else None,
                   modules=modules, ggml=ggml)


def _hf_fp8_config(qc: Mapping) -> QConfig:
    """The Hugging Face "fp8" config of block-FP8 releases as the compressed-tensors scheme it is."""
    block = qc.get("weight_block_size")
    if qc.get("activation_scheme", "dynamic") != "dynamic" or not block or len(block) != 2:
        raise LlmqError("Hugging Face fp8 checkpoints are read when block-quantized (weight_block_size [rows, cols]) "
                        f"with dynamic activations; this one has weight_block_size {block} and activation_scheme "
                        f"{qc.get('activation_scheme')!r}")
    weights, acts = fp8_block_args(tuple(block))
    return QConfig(format="float-quantized", weights=weights, input_activations=acts,
                   ignore=tuple(qc.get("modules_to_not_convert") or (LM_HEAD,)), kv=None,
                   scale_name="weight_scale_inv")


def _openai_mxfp4_config() -> QConfig:
    """OpenAI's MXFP4 config (quant_method "mxfp4", transformers' Mxfp4Config: the GPT-OSS releases): MXFP4 is the
    stacked experts' only (read with them: reader.unstacked_experts); every linear read by its own name is dense,
    whatever modules_to_not_convert lists."""
    return QConfig(format=FP4_FORMATS["mxfp4"][1], weights=QuantArgs(num_bits=4, type="float", strategy="group",
                                                                     group_size=quant.MXFP4_BLOCK),
                   input_activations=None, ignore=(r"re:^(?!.*\.experts\.)",), kv=None, read=lambda *_: None)


def fp8_block_args(block: tuple[int, int]) -> tuple[QuantArgs, QuantArgs]:
    """compressed-tensors' FP8_BLOCK scheme for `block`: (weights, input activations)."""
    return (QuantArgs(num_bits=8, type="float", strategy="block", block_structure=tuple(block)),
            QuantArgs(num_bits=8, type="float", strategy="group", group_size=block[1], dynamic=True))
