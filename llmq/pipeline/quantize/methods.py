"""The registry of quantization methods (the plug-in interface is described in the package docstring)."""

from __future__ import annotations

import importlib
from types import ModuleType

from ...errors import LlmqError

WEIGHT_ONLY = ("rtn", "gptq", "awq")  # the integer weight-only methods: --scales, --embedding / --lm-head int8, mixed
METHODS = ("rtn", "gptq", "awq", "smoothquant", "fp8", "nvfp4", "mxfp4", "bnb-nf4", "bnb-int8")
PACKAGE = __name__.rsplit(".", 1)[0]


def load_method(name: str) -> ModuleType:
    """The plug-in module of a quantization method, checked for the interface above."""
    if name not in METHODS:
        raise LlmqError(f"unknown quantization method {name!r} (methods: {', '.join(METHODS)})")
    module = f"{PACKAGE}.{name.replace('-', '_')}"  # bnb-nf4 -> bnb_nf4
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise
        raise LlmqError(f"quantization method {name!r} is not available in this installation") from None
    if not all(hasattr(mod, a) for a in ("BITS", "CALIBRATED", "quantize_layer")):
        raise LlmqError(f"quantization method {name!r} does not implement BITS / CALIBRATED / quantize_layer")
    return mod
