"""The layer-by-layer engine: calibrate and quantize one decoder layer at a time.

The model is built on the meta device (no memory) and each decoder layer is read from the checkpoint, in its stored
dtype, when its turn comes; only the layer being worked on is turned into float32. The hidden states entering layer
0 are captured for every calibration sample; then, for each layer in turn, the method runs its calibration passes
over that layer (hooks on its linears collect inputs, Hessians or channel statistics), returns quantized weights,
the linears are swapped for the runtime's layers for those weights (the kernels and activation quantization serve
runs), and the quantized layer is re-run to give the next layer its inputs, so each layer is calibrated on what the
quantized model before it really produces (GPTQ's sequential scheme). Each finished layer's tensors go to the
stage's writer at once and the layer is dropped, so memory holds one layer's weights and the activations, whatever
the model's size. The quality probe rides along: held-out windows flow through the float layer and through the
quantized layer side by side, and the two final hidden states meet at the norm and at the float and the quantized
lm_head (the same 16-bit one unless --lm-head / --embedding int8 rounded it). With --embedding int8 the table is
rounded first, and calibration and the probe's quantized side start from its rows.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ...errors import LlmqError
from ...models import ModelSpec, qformat
from ...models.load import pick_device
from ...runtime.loader import quantized_linear
from . import experts
from .calib import TokenWindows
from .calib_images import image_windows
from .layer_inputs import StreamLayout
from .methods import WEIGHT_ONLY, Method
from .options import QuantizeOptions
from .rtn import quantize_weight
from .schemes import SCHEMES, width_grid
from .streamed import (
    capped,
    capture_layer0,
    drop,
    head_name,
    load,
    logits,
    progress_bar,
    skeleton,
    source_tensors,
    stored_dtype,
)


class QuantLinear(nn.Module):
    """A linear that computes with a QuantizedWeight exactly as serve does: through the runtime's own layer for its
    scheme (kernels, activation quantization and all), in float32; the bias stays a parameter so the engine stores
    it with the other dense tensors."""

    def __init__(self, qw: qformat.QuantizedWeight, bias: torch.Tensor | None, device):
        super().__init__()
        self.inner = quantized_linear(qw, None, torch.float32, device)
        self.bias = nn.Parameter(bias.detach().float().to(device), requires_grad=False) if bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x)
        return y + self.bias if self.bias is not None else y


@dataclass
class LayerContext:
    """What a method's quantize_layer sees of one decoder layer (see the package docstring)."""

    index: int
    prefix: str
    layer: nn.Module
    linears: dict[str, nn.Linear]
    opts: QuantizeOptions
    spec: ModelSpec
    scale_dtype: torch.dtype
    device: torch.device
    calib_inputs: list[torch.Tensor] = field(default_factory=list)
    sample_kwargs: list[dict] = field(default_factory=list)   # the layer's keyword arguments for each sample
    widths: dict[str, int] = field(default_factory=dict)  # --target-bpw: each linear's bits (16: kept dense)
    formats: frozenset[str] = frozenset()  # --target-bpw --for: the linears in FP8 / NVFP4 / MXFP4
    float_targets: list[torch.Tensor] = field(default_factory=list)  # Method.float_targets: the float model's outputs
    float_inputs: list[torch.Tensor] = field(default_factory=list)   # ... and its states entering this layer
    float_weights: dict[str, torch.Tensor] = field(default_factory=dict)  # of linears a method rounded in place
    record: dict = field(default_factory=dict)   # what the method reports of this layer, for the manifest
    _squares: dict[str, torch.Tensor] | None = field(default=None, init=False, repr=False)

    def grid(self, name: str) -> tuple[int, int]:
        """(bits, group_size) of linear `name`: the options' grid, or 8 bits per channel where --target-bpw chose 8."""
        return width_grid(self.widths.get(name, self.opts.bits), self.opts)

    def ggml_grid(self, name: str) -> str | None:
        """The GGML grid linear `name` goes on (QuantizeOptions.ggml_grid), or None: the options' grid."""
        return self.opts.ggml_grid(self.linears[name].in_features)

    def apart(self, name: str) -> bool:
        """Whether --target-bpw took linear `name` from the method: kept at 16 bits, or put in a floating-point format
        that is rounded after the method, from the weights it leaves (it is then not in `linears`)."""
        return self.widths.get(name) == 16 or name in self.formats

    @property
    def num_tokens(self) -> int:
        return sum(x.shape[0] * x.shape[1] for x in self.calib_inputs)

    @torch.no_grad()
    def collect(self, names, fn: Callable[[str, torch.Tensor], None],
                float_fn: Callable[[str, torch.Tensor], None] | None = None) -> None:
        """One pass of the layer (as it is now) over the calibration samples; fn(name, x [tokens, in]) per linear.
        With `float_fn`, each sample first runs from the float model's state (`float_inputs`, the same positions)
        through the float layer (`float_weights` put back), float_fn(name, x) per linear, then from the quantized
        model's."""
        if not self.calib_inputs:
            raise LlmqError("this method needs calibration data but none was loaded")
        if float_fn is not None and len(self.float_inputs) != len(self.calib_inputs):
            raise LlmqError("this method needs the float model's calibration states, which the engine did not carry")
        call = [fn]
        hooks = [self.linears[n].register_forward_pre_hook(
            lambda m, args, n=n: call[0](n, args[0].reshape(-1, args[0].shape[-1]).float())) for n in names]
        try:
            with experts.every_expert(self.layer):  # a MoE layer's experts each see every token (experts.py)
                for j, (x, kw) in enumerate(zip(self.calib_inputs, self.sample_kwargs, strict=True)):
                    if float_fn is not None:
                        call[0] = float_fn
                        with experts.uncounted(self.layer), self._float_weights():
                            self.layer(self.float_inputs[j], **kw)
                        call[0] = fn
                    self.layer(x, **kw)
        finally:
            for h in hooks:
                h.remove()

    @contextmanager
    def _float_weights(self):
        """Within: the linears a method already rounded in place (`float_weights`) compute with their float weights,
        as the float model does."""
        rounded = {n: self.linears[n].weight.data for n in self.float_weights}
        for n, w in self.float_weights.items():
            self.linears[n].weight.data = w
        try:
            yield
        finally:
            for n, w in rounded.items():
                self.linears[n].weight.data = w

    def hessians(self, names, float_inputs: bool = False):
        """H = 2/n X^T X of each linear's inputs (float32, [in, in]). Linears fed the same input (q/k/v, gate/up)
        share the work and the very same tensor (at 8B one down_proj Hessian is 0.8 GB): treat them as read-only.
        With `float_inputs` also C = 2/n (X_f - X)^T X, X_f the inputs the float model gives the same linear at the
        same positions (GPTAQ's asymmetric term; `float_inputs` must be carried): returns (H, C), shared alike.
        Keyed in the order the layer calls the linears."""
        acc: dict[str, torch.Tensor] = {}
        cross: dict[str, torch.Tensor] = {}
        shared: dict[str, str] = {}  # name -> the first name that saw the same input
        last: list = [None, None]  # (input, first name fed it): holding the input keeps its address from being reused
        floats: dict[str, torch.Tensor] = {}   # this sample's float-model input of each linear
        order: dict[str, None] = {}   # the names in the order the layer first calls them

        def add(into: dict, name: str, t: torch.Tensor) -> None:
            if name in into:
                into[name] += t
            else:
                into[name] = t

        def fn(name: str, x: torch.Tensor) -> None:
            order[name] = None
            same = last[0] is not None and last[0].data_ptr() == x.data_ptr() and last[0].shape == x.shape
            if same:
                shared[name] = last[1]
                return
            last[0], last[1] = x, name
            add(acc, name, x.T @ x)
            if float_inputs:
                add(cross, name, (floats.pop(name) - x).T @ x)

        self.collect(names, fn, floats.__setitem__ if float_inputs else None)
        n = max(self.num_tokens, 1)
        for h in (*acc.values(), *cross.values()):
            h *= 2.0 / n
        hs = {name: acc[shared.get(name, name)] for name in order}
        return (hs, {name: cross[shared.get(name, name)] for name in order}) if float_inputs else hs

    def mean_squares(self) -> dict[str, torch.Tensor]:
        """{name: mean over the calibration tokens of each input column squared} of the layer's linears as they came,
        before the method changes them (one pass, kept): llama.cpp's importance matrix (what `llama-imatrix`
        collects), from llmq's calibration; AWQ weights its scale search with it."""
        if self._squares is None:
            sums: dict[str, torch.Tensor] = {}
            self.collect(list(self.linears), lambda n, x: sums.__setitem__(n, sums[n] + x.pow(2).sum(0) if n in sums
                                                                           else x.pow(2).sum(0)))
            self._squares = {n: s / max(self.num_tokens, 1) for n, s in sums.items()}
        return self._squares

    def input_absmax(self, names) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        self.collect(names, lambda n, x: out.__setitem__(n, torch.maximum(out[n], x.abs().amax(0)) if n in out
                                                        else x.abs().amax(0)))
        return out


class Sink:
    """Where the layer-by-layer run puts the checkpoint's tensors the moment they are final: `linear(name, qw)` for a
    quantized linear, `dense(name, tensor)` for every other tensor (in its stored dtype). The stage writes them to the
    artifact at once, so no finished layer stays in memory."""

    def linear(self, name: str, qw) -> None: ...

    def dense(self, name: str, tensor: torch.Tensor) -> None: ...


@dataclass
class LayerwiseResult:
    probe: dict | None
    layer_times: list[float]
    device: str
    routed: list[list[int]] | None = None  # MoE, calibrated: per layer, the calibration tokens routed to each expert
    importance: dict[str, torch.Tensor] | None = None  # weight-only, calibrated: each linear's mean squared input
    rotation: dict | None = None   # --rotate: what rotation.RotatedTensors folded in
    method_layers: list[dict] | None = None   # each layer's LayerContext.record, where the method reported any



def _kl_chunks(src: list[torch.Tensor], quant: list[torch.Tensor], norm: nn.Module, head: torch.Tensor,
               quant_head: Callable[[torch.Tensor], torch.Tensor], softcap: float | None = None) -> dict:
    """KLD / top-1 over the probe's positions, a chunk of logits at a time (probe.positions_per_chunk), of the
    logits capped as the model caps them."""
    from .probe import ProbeAccumulator, positions_per_chunk

    chunk = positions_per_chunk(head.shape[0])
    acc = ProbeAccumulator()
    for a, b in zip(src, quant):
        a, b = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
        for i in range(0, a.shape[0], chunk):
            acc.add(capped(logits(norm(a[i:i + chunk]), head), softcap),
                    capped(quant_head(norm(b[i:i + chunk])), softcap))
    return acc.result()


def _round_formats(linears: dict[str, nn.Linear], chosen: dict[str, str], spec: ModelSpec, opts,
                   dtype: torch.dtype) -> dict[str, qformat.QuantizedWeight]:
    """The linears mixed precision put in a floating-point format, rounded a unit at a time (a unit shares NVFP4's
    global scale)."""
    out = {}
    for unit in spec.arch.unit_paths(spec.num_experts):
        names = [n for n in unit if n in linears]
        if names:
            scheme = SCHEMES[chosen[names[0]]]
            out |= dict(zip(names, scheme.quantize_unit([linears[n].weight.data for n in names], opts, dtype)))
    return out


@torch.no_grad()
def run_layerwise(model_dir: Path, method: Method, opts: QuantizeOptions, spec: ModelSpec, calib: TokenWindows | None,
                  probe: TokenWindows | None, sink: Sink, progress: bool = True,
                  widths: dict[str, int] | None = None, formats: dict[str, str] | None = None) -> LayerwiseResult:
    """Quantize every decoder layer's linears of the model in `model_dir` with `method` (a plug-in), handing
    each finished tensor to `sink`. widths: full linear name -> bits where --target-bpw chose them (16: dense);
    formats: full linear name -> the floating-point scheme (fp8 / nvfp4 / mxfp4, schemes.py) it chose instead, rounded
    to nearest a unit at a time here rather than by the method.
    At most one decoder layer's weights are in memory at any time."""
    from transformers.utils import logging as hf_logging

    device = torch.device(pick_device(opts.device))
    hf_logging.disable_progress_bar()
    arch = spec.arch
    source = source_tensors(model_dir, spec, opts.rotate, opts.seed)
    model_dtype = stored_dtype(model_dir)
    model = skeleton(model_dir, arch, model_dtype, device)
    embed = load(model.get_submodule(qformat.EMBEDDING), qformat.EMBEDDING, source, device)
    layers = model.get_submodule(arch.layers)
    widths, formats = widths or {}, formats or {}
    ignore = qformat.QConfig(format="pack-quantized", weights=None, input_activations=None, kv=None,
                             ignore=(*opts.ignore, *spec.kept_16bit(), *(n for n, b in widths.items() if b == 16)))

    emitted: set[str] = set()
    for name in spec.model_modules():   # Gemma 4's per-layer inputs, computed by the model before its layers
        load(model.get_submodule(name), name, source, device)
    layout = StreamLayout.of(spec)
    probe_src, probe_kw = capture_layer0(model, arch, probe.samples, device, layout) if probe is not None \
        else ([], [[]] * len(model.get_submodule(arch.layers)))
    floats = method.aims_at_float(opts)
    calib_f = None   # the float model's own calibration states, for a method that aims at them (Method.float_targets)
    if calib is not None and floats and opts.embedding == "int8":   # from the 16-bit table
        calib_f = capture_layer0(model, arch, calib.samples, device, layout,
                                 image_windows(model_dir, model, list(calib.images), device))[0]
    quant_embed = None
    if opts.embedding == "int8":  # from here on the model looks tokens up in the INT8 table, as serve will
        quant_embed = quantize_weight(embed.weight, 8, opts.int8_group_size, True, model_dtype, search=opts.search)
        sink.linear(qformat.EMBEDDING, quant_embed)
        emitted.add(qformat.EMBEDDING + ".weight")
        embed.weight.data = quant_embed.dequantize(torch.float32).to(device)
    images = image_windows(model_dir, model, list(calib.images), device) if calib is not None else []
    calib_x, calib_kw = capture_layer0(model, arch, calib.samples, device, layout, images) if calib is not None \
        else ([], [])
    if calib_f is None and floats:
        calib_f = list(calib_x)   # the same states until the first quantized layer
    probe_q = (capture_layer0(model, arch, probe.samples, device, layout)[0]
               if quant_embed is not None and probe is not None else [x.clone() for x in probe_src])
    for name in (qformat.EMBEDDING, *spec.model_modules()):
        drop(model, name)  # read again from the checkpoint when it is written

    times: list[float] = []
    routed: list[list[int]] = []
    importance: dict[str, torch.Tensor] = {}
    records: list[dict] = []
    with progress_bar(progress) as bar:
        task = bar.add_task(f"{opts.method} w{opts.bits}", total=len(layers))
        for i in range(len(layers)):
            t0 = time.perf_counter()
            prefix = arch.prefix(i)
            bar.update(task, description=f"{opts.method} w{opts.bits} layer {i + 1}/{len(layers)}")
            layer = load(layers[i], prefix, source, device).to(dtype=torch.float32)
            if layout is not None:
                layout.adapt(layer, i)
            probe_src = [layer(x, **kw) for x, kw in zip(probe_src, probe_kw[i])]
            linears = {n: m for n, m in layer.named_modules()
                       if isinstance(m, nn.Linear) and not ignore.ignores(f"{prefix}.{n}")}
            own_formats = {n: formats[f"{prefix}.{n}"] for n in linears if f"{prefix}.{n}" in formats}
            in_format = {n: linears.pop(n) for n in own_formats}
            own = {n[len(prefix) + 1:]: b for n, b in widths.items() if n.startswith(prefix + ".")}
            float_in = calib_f or []
            if calib_f:   # before the method changes the layer: the float layer on the float model's states
                calib_f = [layer(x, **kw) for x, kw in zip(calib_f, calib_kw[i])]
            ctx = LayerContext(i, prefix, layer, linears, opts, spec, model_dtype, device, calib_x,
                               calib_kw[i] if calib_kw else [], own, frozenset(own_formats), calib_f or [], float_in)
            if calib_x and opts.method in WEIGHT_ONLY:
                importance.update({f"{prefix}.{n}": s.cpu() for n, s in ctx.mean_squares().items()})
            qws = method.quantize_layer(ctx)
            records.append(ctx.record)
            routed += [b.routed for b in experts.blocks(layer) if sum(b.routed)]
            if set(qws) != set(linears):
                raise LlmqError(f"method {opts.method} returned weights for {sorted(qws)} in layer {i}, "
                                f"expected {sorted(linears)}")
            qws |= _round_formats(in_format, own_formats, spec, opts, model_dtype)
            linears |= in_format
            for name, qw in qws.items():
                lin = linears[name]
                if tuple(qw.shape) != (lin.out_features, lin.in_features):  # (a method may have freed lin.weight)
                    raise LlmqError(f"{prefix}.{name}: quantized shape {tuple(qw.shape)} != "
                                    f"{(lin.out_features, lin.in_features)}")
                parent, _, attr = name.rpartition(".")
                setattr(layer.get_submodule(parent) if parent else layer, attr, QuantLinear(qw, lin.bias, device))
                sink.linear(f"{prefix}.{name}", qw)
                emitted.add(f"{prefix}.{name}.weight")
            for name, p in layer.named_parameters():  # norms, biases, ignored linears: as stored, computed as stored
                stored_p = p.data.to(model_dtype)
                p.data = stored_p.float()
                sink.dense(f"{prefix}.{name}", stored_p.cpu())
                emitted.add(f"{prefix}.{name}")
            probe_q = [layer(x, **kw) for x, kw in zip(probe_q, probe_kw[i])]
            if calib_x and i + 1 < len(layers):
                calib_x = [layer(x, **kw) for x, kw in zip(calib_x, calib_kw[i])]
            layers[i] = nn.Module()  # drop the finished layer
            times.append(round(time.perf_counter() - t0, 3))
            bar.advance(task)

    head = head_name(source)
    tied = head != f"{qformat.LM_HEAD}.weight"
    quant_head = QuantLinear(quant_embed, None, device) if quant_embed is not None and tied else None
    if opts.lm_head == "int8" and quant_head is None:
        qw = quantize_weight(source[head].to(device=device, dtype=torch.float32), 8, opts.int8_group_size, True,
                             model_dtype, search=opts.search)
        sink.linear(qformat.LM_HEAD, qw)
        emitted.add(qformat.LM_HEAD + ".weight")
        quant_head = QuantLinear(qw, None, device)
    for k in source:  # embedding, final norm, a 16-bit lm_head: as stored, one at a time
        if k not in emitted:
            sink.dense(k, source[k])
    result_probe = None
    if probe is not None:
        table = source[head].to(device)  # as stored: float32 a slice at a time (streamed.logits)
        norm = load(model.get_submodule(arch.final_norm), arch.final_norm, source, device).to(dtype=torch.float32)
        if layout is not None:
            probe_src, probe_q = [layout.narrow(x) for x in probe_src], [layout.narrow(x) for x in probe_q]
        result_probe = _kl_chunks(probe_src, probe_q, norm, table, quant_head or (lambda h: logits(h, table)),
                                  spec.final_softcap)
        result_probe["source"] = probe.source
    return LayerwiseResult(result_probe, times, str(device), routed or None, importance or None,
                           source.manifest() if opts.rotate != "none" else None,
                           records if any(records) else None)
