"""AWQ (Lin et al., 2023): activation-aware weight quantization by per-input-channel scaling.

A few input channels carry much larger activations than the rest, and the weights that multiply them matter most.
Scaling input channel j of a linear by s_j > 1 (W' = W diag(s)) and dividing its input by s_j leaves the float
output unchanged but shrinks the relative rounding error of those weights. AWQ sets s = mean|x|^alpha (normalised
so that max * min = 1) and grid-searches alpha in [0, 1) for the smallest output error ||X Q(W diag(s))^T / s -
X W^T||^2 of the whole group of linears that share the input (alpha = 0 is plain round-to-nearest, so the search
never does worse than it on the search tokens). The division by s is folded into whatever produces the input, so
the checkpoint is a plain quantized model with no extra tensors:
- input_layernorm -> q/k/v and post_attention_layernorm -> gate/up: the RMSNorm weight is divided by s;
- v_proj -> o_proj: v_proj's output rows are divided by s (attention mixes V linearly). With grouped-query attention
  each KV channel feeds `num_heads / num_kv_heads` o_proj input channels, so s is tied across those copies;
- up_proj -> down_proj: up_proj's output rows are divided by s (silu(gate) * up is linear in up).
Row scaling of a producer that is itself quantized per output row (channel or group) does not change its own
rounding error, so the four groups are searched independently on the float layer and folded together. The search
over alpha rounds with amax scales (cheap); the final weights, with `--scales search`, get rtn.grid_params' searched
scales weighted by each column's mean squared input after folding, mean(x^2) / s^2 — the paper's second step
(a clipping search of the weight range) in its error-minimising form.
"""

from __future__ import annotations

import torch
from torch import nn

from ...errors import LlmqError
from ...models import qformat
from . import rtn

BITS = (4, 5, 8)   # 5: integers in [-16, 15], for GGUF's Q5_0 / Q5_1 (llmq's runtime and llama.cpp; vLLM runs 4 / 8)
CALIBRATED = True
GRID = 20
SEARCH_TOKENS = 1024


def validate(opts, spec) -> None:
    if opts.per_tensor:
        raise LlmqError("AWQ quantizes per channel or per group, not per tensor")


def tie_heads(v: torch.Tensor, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """v over o_proj's input channels (heads x head_dim) averaged over the query heads that share a KV head, so the
    result can be folded into v_proj's rows (HF's repeat_kv: KV head i serves query heads i*rep .. i*rep+rep-1)."""
    rep = num_heads // num_kv_heads
    t = v.reshape(num_kv_heads, rep, -1)
    return t.mean(1, keepdim=True).expand_as(t).reshape(-1)


def candidate_scales(x_mean: torch.Tensor, alpha: float) -> torch.Tensor:
    s = x_mean.clamp_min(1e-4).pow(alpha).clamp_min(1e-4)
    return s / (s.max() * s.min()).sqrt()


def output_error(x: torch.Tensor, weights: list[torch.Tensor], s: torch.Tensor, bits: int, group_size: int,
                 symmetric: bool, scale_dtype: torch.dtype, refs: list[torch.Tensor]) -> float:
    """Sum of squared output errors of the linears when their scaled weights are rounded to the grid."""
    err = 0.0
    for w, ref in zip(weights, refs):
        ws = rtn.group_view(w * s, group_size)
        sc, z = rtn.grid_params(ws, bits, symmetric, scale_dtype)
        wq = rtn.fake_quantize(ws, sc, z, bits).reshape(w.shape) / s
        err += float(((x @ wq.T) - ref).pow(2).sum())
    return err


def search_scales(x: torch.Tensor, x_mean: torch.Tensor, weights: list[torch.Tensor], bits: int, group_size: int,
                  symmetric: bool, scale_dtype: torch.dtype, tie=None) -> tuple[torch.Tensor, float, float]:
    """(best s, its alpha, its error) over alpha = 0, 1/GRID, ..., (GRID-1)/GRID."""
    refs = [x @ w.T for w in weights]
    best = (torch.ones_like(x_mean), 0.0, float("inf"))
    for i in range(GRID):
        alpha = i / GRID
        s = candidate_scales(tie(x_mean) if tie else x_mean, alpha)
        e = output_error(x, weights, s, bits, group_size, symmetric, scale_dtype, refs)
        if e < best[2]:
            best = (s, alpha, e)
    return best


@torch.no_grad()
def fold_scales(layer: nn.Module, producer: str, consumers: tuple[str, ...], s: torch.Tensor,
                num_heads: int, num_kv_heads: int, norm_offset: float = 0.0) -> None:
    """Multiply the consumers' input columns by s and divide the producer's output by s: the float function of the
    layer is unchanged (exactly, in real arithmetic). A norm scales by (norm_offset + w) (Arch.norm_offset), so that
    sum is what is divided."""
    for c in consumers:
        lin = layer.get_submodule(c)
        lin.weight.mul_(s.to(lin.weight.dtype)[None, :])
    prod = layer.get_submodule(producer)
    if isinstance(prod, nn.Linear):
        rows = s
        if prod.out_features != s.numel():  # GQA: one factor per KV channel
            rows = s.reshape(num_kv_heads, num_heads // num_kv_heads, -1)[:, 0].reshape(-1)
        prod.weight.div_(rows.to(prod.weight.dtype)[:, None])
        if prod.bias is not None:
            prod.bias.div_(rows.to(prod.bias.dtype))
    else:
        prod.weight.add_(norm_offset).div_(s.to(prod.weight.dtype)).sub_(norm_offset)


def quantize_layer(ctx) -> dict[str, qformat.QuantizedWeight]:
    o, spec = ctx.opts, ctx.spec
    # (producer that absorbs 1/s, consumers whose input columns absorb s): the family's feeds (Arch.feeds)
    feeds = [(p, cons) for p, _, cons in spec.arch.feed_paths(spec.num_experts, ctx.index in spec.linear_layers)]
    carriers = set(spec.kept_16bit_paths(ctx.index))  # folded into, never quantized (so not searched): routers ...
    missing = [n for _, cons in feeds for n in cons if n not in ctx.linears and not ctx.apart(n) and n not in carriers]
    if missing:
        raise LlmqError(f"AWQ scales every linear a norm or a projection feeds; layer {ctx.index} keeps "
                        f"{', '.join(missing)} dense; use --method gptq / rtn")
    heads = (spec.num_heads, spec.num_kv_heads)
    v_proj = spec.arch.path("v_proj")
    groups = [(p, cons) for p, cons in feeds if not ctx.apart(cons[0])]  # --target-bpw's 16-bit / FP units: no scales
    firsts = [cons[0] for _, cons in groups]
    sums: dict[str, torch.Tensor] = {}
    kept: dict[str, list[torch.Tensor]] = {n: [] for n in firsts}
    per_sample = max(1, SEARCH_TOKENS // max(len(ctx.calib_inputs), 1))

    def fn(name: str, x: torch.Tensor) -> None:
        sums[name] = sums[name] + x.abs().sum(0) if name in sums else x.abs().sum(0)
        idx = torch.linspace(0, x.shape[0] - 1, min(per_sample, x.shape[0]), device=x.device).round().long()
        kept[name].append(x[idx].clone())

    ctx.collect(firsts, fn)
    squares = ctx.mean_squares()  # of the layer as it came: taken before any folding below
    tokens = max(ctx.num_tokens, 1)
    importance: dict[str, torch.Tensor] = {}
    for (producer, consumers), first in zip(groups, firsts):
        x, x_mean = torch.cat(kept[first]), sums[first] / tokens
        tie = (lambda v: tie_heads(v, *heads)) if producer == v_proj else None
        weights = [ctx.linears[c].weight.data.float() for c in consumers if c not in carriers]
        s, _, _ = search_scales(x, x_mean, weights, *ctx.grid(first), o.symmetric, ctx.scale_dtype, tie)
        fold_scales(ctx.layer, producer, consumers, s, *heads, spec.arch.norm_offset)
        importance.update({c: squares[first] / s.pow(2) for c in consumers})
    return {name: rtn.quantize_weight(lin.weight.data, *ctx.grid(name), o.symmetric, ctx.scale_dtype,
                                      search=o.search, importance=importance.get(name))
            for name, lin in ctx.linears.items()}
