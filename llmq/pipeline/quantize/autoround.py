"""AutoRound-style rounding (Cheng et al., 2023, "Optimize Weight Rounding via Signed Gradient Descent"): every linear
of a decoder layer is rounded at once, with learned offsets, so that the quantized layer's output on the calibration
windows is as close as can be found to the float layer's.

Round-to-nearest decides each weight alone; what the next layer sees is the layer's output. Here each weight gets an
offset v in [-0.5, 0.5] added before rounding, q = clamp(round(w / s + v) + z), and each group's scale a factor m in
[0.5, 1.5] (s = s0 m, from the round-to-nearest grid s0, z of `--scales`, importance-weighted by the layer's mean
squared inputs as GPTQ's are). Rounding passes the gradient straight through. The loss is the mean squared difference
between the layer's output with every linear on its tuned grid, from the inputs the quantized layers before it produce
(the engine's sequential scheme), and the float model's own output of the layer (FLOAT_TARGETS): so a layer also
makes up what the layers before it lost, as AutoRound's reference outputs do. Each step sums the gradient over a
batch of windows and moves every v and m by lr x its sign (signed gradient descent: the step size, not the gradient's
scale, bounds how far a rounding moves), lr = 1 / iters decaying linearly to 0, as AutoRound's defaults.

The tuned scale is then rounded to its stored dtype (nearest) and the integers taken from it, so what is stored is
what is scored. The layer keeps whichever grid, round-to-nearest's or the tuned one, gives the smaller loss over all
calibration windows: the tuning never makes the calibration error worse. The last step's parameters are kept (the
learning rate has decayed to zero there), not the best batch's: batches of different windows have different losses.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.func import functional_call

from ... import quant
from ...errors import LlmqError
from ...models import qformat
from . import rtn

BITS = (4, 5, 8)   # 5: integers in [-16, 15], for GGUF's Q5_0 / Q5_1 (llmq's runtime and llama.cpp; vLLM runs 4 / 8)
CALIBRATED = True
FLOAT_TARGETS = True
BATCH = 8            # windows whose gradients one step sums (AutoRound's default batch)
SCALE_RANGE = (0.5, 1.5)


def validate(opts, spec) -> None:
    if opts.per_tensor:
        raise LlmqError("autoround tunes per-channel or per-group scales, not one per tensor; drop --per-tensor")


@dataclasses.dataclass
class TunedGrid:
    """One linear's grid under tuning: the weight in groups [out, in / g, g], the round-to-nearest scale s0 and zero
    point z ([out, in / g, 1]; z None when symmetric), the offsets v (like the weight) and scale factors m (like s0)."""

    w: torch.Tensor
    s0: torch.Tensor
    z: torch.Tensor | None
    bits: int
    group_size: int
    v: torch.Tensor
    m: torch.Tensor

    @classmethod
    def start(cls, w: torch.Tensor, bits: int, group_size: int, symmetric: bool, scale_dtype: torch.dtype,
              search: bool, importance: torch.Tensor | None) -> TunedGrid:
        wg = rtn.group_view(w.float(), group_size)
        imp = None if importance is None else rtn.group_view(importance.reshape(1, -1), group_size)
        s0, z = rtn.grid_params(wg, bits, symmetric, scale_dtype, search, imp)
        return cls(wg, s0, z, bits, group_size, torch.zeros_like(wg, requires_grad=True),
                   torch.ones_like(s0, requires_grad=True))

    def weight(self) -> torch.Tensor:
        """The weight on the tuned grid, differentiable in v and m (rounding passes the gradient straight through)."""
        qmin, qmax = quant.int_range(self.bits)
        s = self.s0 * self.m
        x = self.w / s + self.v
        q = x + (x.round() - x).detach()
        if self.z is not None:
            q = q + self.z
        return self._real(q.clamp(qmin, qmax), s)

    def _real(self, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """Integers on scales s, in groups, as the real weight [out, in]."""
        return ((q - self.z if self.z is not None else q) * s).reshape(self.w.shape[0], -1)

    def step(self, lr: float) -> None:
        with torch.no_grad():
            for p, (lo, hi) in ((self.v, (-0.5, 0.5)), (self.m, SCALE_RANGE)):
                if p.grad is not None:
                    p.sub_(p.grad.sign(), alpha=lr).clamp_(lo, hi)
                    p.grad = None

    def stored(self, scale_dtype: torch.dtype, tuned: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """(integers, scale) as they will be stored: the tuned scale rounded to nearest in `scale_dtype`, the integers
        taken from it with the offsets (tuned=False: round-to-nearest's grid)."""
        with torch.no_grad():
            s = rtn.stored_scale(self.s0 * self.m, scale_dtype) if tuned else self.s0
            q = (self.w / s + (self.v if tuned else 0)).round()
            if self.z is not None:
                q = q + self.z
            return q.clamp(*quant.int_range(self.bits)), s

    def real(self, scale_dtype: torch.dtype, tuned: bool = True) -> torch.Tensor:
        """The stored grid's real weight [out, in]."""
        return self._real(*self.stored(scale_dtype, tuned))

    def packed(self, scale_dtype: torch.dtype, tuned: bool) -> qformat.QuantizedWeight:
        q, s = self.stored(scale_dtype, tuned)
        z = self.z[..., 0] if self.z is not None else None
        return rtn.pack(q.reshape(self.w.shape[0], -1), s[..., 0], z, self.bits, self.group_size or None,
                        scale_dtype)


def _loss(layer, weights: dict[str, torch.Tensor], x: torch.Tensor, kw: dict, ref: torch.Tensor) -> torch.Tensor:
    """Mean squared difference of the layer's output with `weights` in place of its linears' and `ref`."""
    return (functional_call(layer, weights, (x,), kw, strict=False) - ref).pow(2).mean()


def tune(layer, grids: dict[str, TunedGrid], inputs: list[torch.Tensor], kwargs: list[dict],
         refs: list[torch.Tensor], iters: int, scale_dtype: torch.dtype, seed: int = 0) -> tuple[float, float]:
    """Tune `grids` (linear name -> TunedGrid) over `iters` signed-gradient steps of BATCH windows each; returns the
    loss summed over every window of round-to-nearest's grids and of the tuned ones, as stored."""
    params = [p for p in layer.parameters() if p.requires_grad]
    for p in params:
        p.requires_grad_(False)
    gen = torch.Generator().manual_seed(seed)
    order: list[int] = []
    try:
        with torch.enable_grad():
            for it in range(iters):
                lr = (1.0 / iters) * (1 - it / iters)
                batch = []
                while len(batch) < min(BATCH, len(inputs)):
                    if not order:
                        order = torch.randperm(len(inputs), generator=gen).tolist()
                    batch.append(order.pop())
                weights = {f"{n}.weight": g.weight() for n, g in grids.items()}
                torch.stack([_loss(layer, weights, inputs[i], kwargs[i], refs[i]) for i in batch]).sum().backward()
                for g in grids.values():
                    g.step(lr)
    finally:
        for p in params:
            p.requires_grad_(True)
    with torch.no_grad():
        losses = {}
        for tuned in (False, True):
            weights = {f"{n}.weight": g.real(scale_dtype, tuned) for n, g in grids.items()}
            losses[tuned] = sum(float(_loss(layer, weights, x, kw, r)) for x, kw, r in zip(inputs, kwargs, refs))
    return losses[False], losses[True]


def quantize_layer(ctx) -> dict[str, qformat.QuantizedWeight]:
    o = ctx.opts
    importance = ctx.mean_squares()
    grids = {name: TunedGrid.start(lin.weight.data, *ctx.grid(name), o.symmetric, ctx.scale_dtype, o.search,
                                   importance.get(name))
             for name, lin in ctx.linears.items()}
    nearest, tuned = tune(ctx.layer, grids, ctx.calib_inputs, ctx.sample_kwargs, ctx.float_targets, o.iters,
                          ctx.scale_dtype, o.seed)
    ctx.record.update(loss_nearest=float(f"{nearest:.4g}"), loss_tuned=float(f"{tuned:.4g}"), tuned=tuned < nearest)
    return {name: g.packed(ctx.scale_dtype, tuned < nearest) for name, g in grids.items()}
