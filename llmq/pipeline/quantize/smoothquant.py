"""W8A8 INT8 with SmoothQuant (Xiao et al., 2023): int8 per-channel weights, int8 per-token activations.

Activations of LLMs have a few input channels with outliers 10-100x larger than the rest, which per-token int8
quantization cannot represent without crushing every other channel. SmoothQuant moves that difficulty into the
weights with an exact rewrite: for input channel j, s_j = max|X_j|^alpha / max|W_j|^(1 - alpha), X' = X / s and
W' = W * s, so X' W'^T = X W^T. The division of X is folded into whatever produced X:
- the RMSNorm weight before q/k/v (input_layernorm) and before gate/up (post_attention_layernorm);
- v_proj's output rows before o_proj (attention mixes V rows linearly, per KV head; with GQA one factor per
  (KV head, channel) is shared by the query heads of its group);
- up_proj's output rows before down_proj (silu(gate) * up is linear in up).
Then every linear is quantized to int8 per output channel (symmetric, scale = max|W_i| / 127), and activations are
quantized per token at run time (dynamic) or with a static per-tensor scale from calibration (max|X'| / 127).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

from ... import quant
from ...errors import LlmqError
from ...models import qformat
from . import rtn

BITS = (8,)
CALIBRATED = True


def smoothing_factors(act_absmax: torch.Tensor, weights: list[torch.Tensor], alpha: float) -> torch.Tensor:
    """s [K] for consumers `weights` ([N_i, K] each) of an input whose channel absmax is `act_absmax` [K].
    Channels never seen active (or with all-zero weights) keep s = 1: dividing by a tiny s would blow them up."""
    if not 0 <= alpha <= 1:
        raise LlmqError(f"SmoothQuant alpha must be in [0, 1], got {alpha}")
    a = act_absmax.double()
    w = torch.cat([x.double() for x in weights]).abs().amax(0)
    s = a.pow(alpha) / w.pow(1 - alpha)
    ok = (a > 0) & (w > 0) & torch.isfinite(s)
    return torch.where(ok, s, torch.ones_like(s))


def smooth_layer(weights: Mapping[str, torch.Tensor], act_absmax: Mapping[str, torch.Tensor], alpha: float,
                 num_heads: int, num_kv_heads: int, head_dim: int, mappings: list[tuple[str, bool, tuple[str, ...]]],
                 v_proj: str, norm_offset: float = 0.0) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Smooth one decoder layer. `weights`: its tensors under their names relative to the layer
    (input_layernorm.weight, self_attn.q_proj.weight, ... optional biases); `act_absmax`: per-input-channel absmax of
    each linear's input (keys "self_attn.q_proj" ... "mlp.down_proj"), measured on the unsmoothed layer;
    `mappings`: (producer, whether it is a norm, consumers), the family's Arch.feed_paths(); `v_proj`: its path,
    whose factors are shared per GQA group; `norm_offset`: a norm scales by (norm_offset + w) (Arch.norm_offset).
    Returns the smoothed tensors (same keys and dtypes; computed in float64, exact in real arithmetic) and each
    linear's input factors s (its smoothed input is X / s)."""
    out = {k: v.double().clone() for k, v in weights.items()}
    factors = {}
    for producer, is_norm, consumers in mappings:
        x = act_absmax[consumers[0]].double()
        ws = [out[f"{c}.weight"] for c in consumers]
        if producer == v_proj:
            # per (KV head, channel): max over the group's query heads of the o_proj input stats and weights
            group = num_heads // num_kv_heads
            x = x.view(num_kv_heads, group, head_dim).amax(1).reshape(-1)
            w = ws[0].abs().view(-1, num_kv_heads, group, head_dim).amax(2).reshape(ws[0].shape[0], -1)
            s_v = smoothing_factors(x, [w], alpha)
            s = s_v.view(num_kv_heads, 1, head_dim).expand(num_kv_heads, group, head_dim).reshape(-1)
            div = s_v
        else:
            s = smoothing_factors(x, ws, alpha)
            div = s
        if is_norm:
            out[f"{producer}.weight"] = (out[f"{producer}.weight"] + norm_offset) / div - norm_offset
        else:
            out[f"{producer}.weight"] /= div[:, None]
            if f"{producer}.bias" in out:
                out[f"{producer}.bias"] /= div
        for c in consumers:
            out[f"{c}.weight"] *= s[None, :]
            factors[c] = s.float()
    return {k: v.to(weights[k].dtype) for k, v in out.items()}, factors


def quantize_weight_int8(w: torch.Tensor, input_absmax: torch.Tensor | None = None,
                         scale_dtype: torch.dtype = torch.float32, per_tensor: bool = False
                         ) -> qformat.QuantizedWeight:
    """int8 per output channel (or per tensor), symmetric (scale = max|W| / 127, round to nearest). With
    `input_absmax` activations get a static per-tensor scale max|X| / 127, else they are quantized per token."""
    qw = rtn.quantize_weight(w, 8, 0, True, scale_dtype, per_tensor=per_tensor)
    if input_absmax is None:
        return dataclasses.replace(qw, dynamic=True)
    input_scale = quant.absmax_scale(input_absmax.max().reshape(1), fp8=False)
    return dataclasses.replace(qw, input_scale=input_scale.cpu())


def validate(opts, spec) -> None:
    check_per_channel(opts, "smoothquant")  # alpha's range is checked with the options (QuantizeOptions.check)


def check_per_channel(opts, method: str) -> None:
    """W8A8 and FP8 weights are symmetric, per output channel or per tensor."""
    if opts.group_size and opts.group_size > 0:
        raise LlmqError(f"--method {method} quantizes weights per output channel (or --per-tensor); "
                        "drop --group-size")
    if not opts.symmetric:
        raise LlmqError(f"--method {method} quantizes weights symmetrically; drop --asym")


def quantize_layer(ctx) -> dict[str, qformat.QuantizedWeight]:
    """Measure each linear's input absmax, smooth the layer in place (norms, v_proj / up_proj rows, consumers'
    columns), then quantize every linear to int8 with per-token or static per-tensor activation scales.
    A mapping that touches a linear kept dense (--ignore) is skipped, so ignored layers stay as they were."""
    layer, spec, opts = ctx.layer, ctx.spec, ctx.opts
    absmax = ctx.input_absmax(list(ctx.linears))
    carriers = set(spec.kept_16bit_paths(ctx.index))  # a MoE router (...) takes the factors, unquantized
    mappings = [m for m in spec.arch.feed_paths(spec.num_experts, ctx.index in spec.linear_layers)
                if all(c in ctx.linears or c in carriers for c in m[2]) and (m[1] or m[0] in ctx.linears)]
    params = {f"{n}.{p}": getattr(lin, p) for n, lin in ctx.linears.items() for p in ("weight", "bias")
              if getattr(lin, p, None) is not None}
    params |= {f"{n}.weight": layer.get_submodule(n).weight for n, is_norm, _ in mappings if is_norm}
    params |= {f"{c}.weight": layer.get_submodule(c).weight for *_, cons in mappings for c in cons if c in carriers}
    new, factors = smooth_layer({k: p.data for k, p in params.items()}, absmax, opts.alpha, spec.num_heads,
                                spec.num_kv_heads, spec.head_dim, mappings, spec.arch.path("v_proj"),
                                spec.arch.norm_offset)
    with torch.no_grad():
        for k, p in params.items():
            p.copy_(new[k])
    static = opts.activations == "static"
    out = {}
    for n, lin in ctx.linears.items():
        x = absmax[n].to(lin.weight.device) / factors[n].to(lin.weight.device) if n in factors else absmax[n]
        out[n] = quantize_weight_int8(lin.weight.data, x if static else None, ctx.scale_dtype, opts.per_tensor)
    return out
