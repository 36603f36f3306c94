"""`llmq quantize`: weights to INT8 / INT4 / FP8 / FP4, one decoder layer at a time, written in compressed-tensors
format (bitsandbytes' NF4 / LLM.int8: in bitsandbytes' own serialized form, `llmq.models.bnbformat`).

Methods are plug-ins. Adding one is adding one module `llmq/pipeline/quantize/<name>.py` and its line in `METHODS`
(methods.py: its name, and the class of the options only it reads, if it has any); the stage (stage.py) and the
layer-by-layer engine (layerwise.py) do everything else: validation, calibration data, loading the model, walking the
decoder layers, the quality probe, the checkpoint, the manifest.

A method module defines:

    BITS: tuple[int, ...]          weight bit widths it supports, e.g. (4, 8); others are refused before any work
    CALIBRATED: bool | (opts) -> bool   whether it needs calibration data (False: no calibration pass at all)
    def quantize_layer(ctx: LayerContext) -> dict[str, QuantizedWeight]

and optionally `def validate(opts: QuantizeOptions, spec: ModelSpec) -> None` (raise LlmqError for options the method
cannot honour; called with the resolved options before anything is loaded) and `GROUP_SIZE` (its default, or only,
block of input columns when --group-size is not given), and `FLOAT_TARGETS = True` (or a function of the options)
for a method that aims each layer at the float model's own output of it (`ctx.float_targets`, and the states entering
the layer `ctx.float_inputs`: the float model's calibration states carried beside the quantized ones, one more forward
pass a layer).

`quantize_layer` is called once per decoder layer with a `layerwise.LayerContext`: `ctx.layer` (the float32 decoder
layer on the work device; the method may rewrite its parameters in place, e.g. fold scales into an RMSNorm, and the
engine stores the rewritten norms / biases in the model dtype), `ctx.linears` ({"self_attn.q_proj": nn.Linear, ...}),
`ctx.opts` (QuantizeOptions), `ctx.grid(name)` (the (bits, group_size) to quantize each linear to: the options', or
8 bits per channel where `--target-bpw` chose 8; linears it keeps at 16 bits are not in `ctx.linears`), `ctx.spec`
(ModelSpec), `ctx.scale_dtype` (store scales in it: `rtn.round_scale`), and
calibration passes over the layer as it is at the time of the call: `ctx.collect(names, fn)` (fn(name, x) with x the
[tokens, in_features] float32 input of each named linear, sample by sample), `ctx.hessians(names)` (with
`float_inputs=True` also GPTAQ's cross term against the float model's inputs),
`ctx.input_absmax(names)`.
It returns a `qformat.QuantizedWeight` for every linear in `ctx.linears` (the bitsandbytes methods: a
`bnbformat.NF4Weight` / `Int8Weight`, which the stage writes as a bitsandbytes checkpoint). Activation quantization
is expressed in the weight (`input_scale` for static, `dynamic=True` for per-token; FP4 W4A4: `dynamic=True`, with
NVFP4's static `input_global_scale`): the engine computes the quality
probe and the inputs it hands to the next layer through the runtime's layer for each weight (so the probe measures what
serve computes), and derives the compressed-tensors scheme from the weights (one scheme for all).
"""

from .methods import METHODS, load_method
from .options import QuantizeOptions
from .stage import quantize

__all__ = ["METHODS", "QuantizeOptions", "load_method", "quantize"]
