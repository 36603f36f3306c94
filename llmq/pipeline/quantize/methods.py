"""The registry of quantization methods and the options each one owns (the plug-in interface is described in the
package docstring).

A method's own options are declared here, beside its name, not in its module: the command line builds its flags from
them without importing torch (`llmq --help` loads none), and every method module imports torch. The stage composes
them into `QuantizeOptions` (stage.py), so each is still one flag and one recipe key; the method reads them from
`ctx.opts` and checks what needs the model in its own `validate(opts, spec)`.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from ...errors import LlmqError
from ...options import option

if TYPE_CHECKING:
    from ...models import ModelSpec
    from .layerwise import LayerContext
    from .options import QuantizeOptions

COMPUTE_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class MethodOptions:
    """A method's own options: a frozen dataclass of `option(...)` fields (composed into QuantizeOptions; this base
    has none: a method with no options of its own), and as data:
    only: (fields, message): the one-line refusal when another method is given any of these fields not at its
    default; unset: {field: value}, what a field left at None means when this method runs (`resolved()`, the value
    the manifest records); tags: {field: suffix}, added to the default artifact name where the field is set."""

    only = ((), "")
    unset = {}
    tags = {}


@dataclasses.dataclass(frozen=True)
class GPTQOptions(MethodOptions):
    act_order: bool = option(False, "GPTQ: quantize columns by decreasing Hessian diagonal.")
    damp: float = option(0.01, "GPTQ: damping, fraction of mean diag(H).", gt=0, lt=1)
    gptaq: bool = option(False, "GPTQ: aim each linear at the float model's output of it (GPTAQ's asymmetric "
                         "calibration: the weight GPTQ rounds is first moved to the least-squares map from the "
                         "quantized model's inputs to the float model's outputs), instead of at its own output on "
                         "the quantized model's inputs. The float model runs beside, and each layer's linears "
                         "are calibrated in stages (q/k/v, o, gate/up, down): more passes a layer.")

    only = (("act_order", "gptaq"), "--act-order / --gptaq are GPTQ options; use them with --method gptq (FP4: "
            "nvfp4 / mxfp4 --gptq)")
    tags = {"act_order": "-act", "gptaq": "-gptaq"}


@dataclasses.dataclass(frozen=True)
class FP4Options(GPTQOptions):
    """nvfp4 / mxfp4: round-to-nearest, or with --gptq GPTQ's error feedback onto the same grid (GPTQ's --act-order
    and --damp then apply: a subclass, so they are the same flags); weight-only, or --w4a4."""
    gptq: bool = option(False, "nvfp4 / mxfp4: round onto the FP4 grid with GPTQ's error feedback over calibration "
                        "data instead of to nearest (same format; block scales as round-to-nearest's).",
                        flag="--gptq/--no-gptq")
    w4a4: bool = option(False, "nvfp4 / mxfp4: FP4 activations too (W4A4, compressed-tensors' NVFP4 / MXFP4 "
                        "presets): block scales computed at run time, per 16 inputs (E4M3, under a static input "
                        "global scale calibrated as the weights', 2688 / max|x|) or 32 (E8M0). Default: W4A16.",
                        flag="--w4a4/--w4a16")

    only = (("gptq", "w4a4"), "--gptq / --w4a4 are the FP4 methods' options; use them with --method nvfp4 or mxfp4 "
            "(integer GPTQ: --method gptq)")
    tags = {"gptq": "-gptq", "act_order": "-act", "w4a4": "-a4"}


@dataclasses.dataclass(frozen=True)
class SmoothQuantOptions(MethodOptions):
    alpha: float | None = option(None, "SmoothQuant migration strength (default 0.5).", ge=0, le=1)

    only = (("alpha",), "--alpha is SmoothQuant's migration strength; use it with --method smoothquant")
    unset = {"alpha": 0.5}


@dataclasses.dataclass(frozen=True)
class NF4Options(MethodOptions):
    double_quant: bool = option(False, "bnb-nf4: quantize the block absmax values too (QLoRA's double "
                                "quantization: about 0.4 bits per weight less).",
                                flag="--double-quant/--no-double-quant")
    compute_dtype: str | None = option(None, "bnb-nf4: the dtype transformers computes in, recorded in the config as "
                                       "bnb_4bit_compute_dtype (default float32).", choices=COMPUTE_DTYPES)

    only = (("double_quant", "compute_dtype"), "--double-quant / --compute-dtype are bitsandbytes 4-bit options; use "
            "them with --method bnb-nf4")
    unset = {"compute_dtype": "float32"}
    tags = {"double_quant": "-dq"}


@dataclasses.dataclass(frozen=True)
class LLMInt8Options(MethodOptions):
    int8_threshold: float | None = option(None, "bnb-int8: LLM.int8's outlier threshold: activation columns with "
                                          "|x| >= it stay in floating point; 0 = none (default 6.0).", ge=0)

    only = (("int8_threshold",), "--int8-threshold is LLM.int8's outlier threshold; use it with --method bnb-int8")
    unset = {"int8_threshold": 6.0}


@dataclasses.dataclass(frozen=True)
class AutoRoundOptions(MethodOptions):
    iters: int = option(200, "autoround: signed-gradient steps per decoder layer, each over 8 calibration windows "
                        "(AutoRound's default 200; 50 is its light mode).", ge=1)

    only = (("iters",), "--iters is AutoRound's step count; use it with --method autoround")


# --method name: the options only that method reads (MethodOptions: none of its own)
METHODS: dict[str, type[MethodOptions]] = {
    "rtn": MethodOptions, "gptq": GPTQOptions, "awq": MethodOptions, "smoothquant": SmoothQuantOptions,
    "fp8": MethodOptions, "nvfp4": FP4Options, "mxfp4": FP4Options, "bnb-nf4": NF4Options,
    "bnb-int8": LLMInt8Options, "autoround": AutoRoundOptions}
METHODS_HELP = ("rtn: round-to-nearest; gptq / awq / autoround: calibrated weight-only (autoround: rounding tuned "
                "by signed gradient descent on each layer's output); smoothquant: W8A8; fp8: FP8 E4M3; "
                "nvfp4 / mxfp4: FP4, round-to-nearest or with --gptq GPTQ, weight-only or --w4a4; bnb-nf4 / bnb-int8: "
                "bitsandbytes' NF4 / LLM.int8 (needs llmq[bnb]).")  # --method's help
# the integer weight-only methods: --scales, --embedding / --lm-head int8, mixed precision
WEIGHT_ONLY = ("rtn", "gptq", "awq", "autoround")
PACKAGE = __name__.rsplit(".", 1)[0]


def method_options() -> list[type[MethodOptions]]:
    """Every method's own options class, in registry order, once."""
    return list(dict.fromkeys(METHODS.values()))


@dataclasses.dataclass(frozen=True)
class Method:
    """A method's plug-in module as read by `load_method` (the package docstring names each part)."""

    name: str
    bits: tuple[int, ...]
    calibrated: bool | Callable[[QuantizeOptions], bool]
    quantize_layer: Callable[[LayerContext], dict]
    validate: Callable[[QuantizeOptions, ModelSpec], None] | None = None
    group_size: int | None = None      # its default, or only, block of input columns
    partial_groups: bool = False       # a --group-size need not divide the input widths (block FP8)
    # it aims each layer at the float model's output of it (LayerContext.float_targets / float_inputs)
    float_targets: bool | Callable[[QuantizeOptions], bool] = False

    def needs_calibration(self, opts: QuantizeOptions) -> bool:
        """CALIBRATED, for these options (e.g. FP8 only for static activation scales)."""
        return _for_options(self.calibrated, opts)

    def aims_at_float(self, opts: QuantizeOptions) -> bool:
        """FLOAT_TARGETS, for these options (GPTQ's --gptaq)."""
        return _for_options(self.float_targets, opts)


def _for_options(flag: bool | Callable[[QuantizeOptions], bool], opts: QuantizeOptions) -> bool:
    """A plug-in attribute that is a bool, or a function of the options."""
    return bool(flag(opts) if callable(flag) else flag)


def load_method(name: str) -> Method:
    """The plug-in of a quantization method, checked for the interface above."""
    if name not in METHODS:
        raise LlmqError(f"unknown quantization method {name!r} (methods: {', '.join(METHODS)})")
    module = f"{PACKAGE}.{name.replace('-', '_')}"  # bnb-nf4 -> bnb_nf4
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise
        raise LlmqError(f"quantization method {name!r} is not available in this installation") from None
    missing = [a for a in ("BITS", "CALIBRATED", "quantize_layer") if a not in vars(mod)]
    if missing:
        raise LlmqError(f"quantization method {name!r} does not implement {' / '.join(missing)}")
    return Method(name, mod.BITS, mod.CALIBRATED, mod.quantize_layer, vars(mod).get("validate"),
                  vars(mod).get("GROUP_SIZE"), vars(mod).get("PARTIAL_GROUPS", False),
                  vars(mod).get("FLOAT_TARGETS", False))
