"""GPTQ (Frantar et al., 2022): quantize a weight column by column, pushing each column's rounding error onto the
columns not yet quantized so that the layer's output on the calibration inputs moves as little as possible.

For a linear with inputs X the objective is ||X W^T - X Q^T||^2, whose curvature is H = 2 X^T X. With
U = chol(H^-1) (upper), quantizing column j with error e = (w_j - q_j) / U_jj is compensated by
W[:, j:] -= e U[j, j:]. Columns go in blocks (updates inside a block are immediate, the rest of the matrix gets one
batched update per block). Damping adds `damp` x mean(diag H) to the diagonal so the inverse exists; columns that
never saw a non-zero input are zeroed. Act-order processes columns by decreasing diag(H) (the inputs that matter
most go first, while there is the most freedom left to compensate). Its group scales are computed in the original
column order from the weight before any update ("static groups"), so the checkpoint needs no g_idx permutation
tensor: column c always belongs to group c // group_size, as compressed-tensors and the runtime read it.
Without act-order a group's scale is taken from the updated weights when its first column comes up, as in the paper.
With `--scales search` each group's scale minimises its rounding error weighted by diag(H) (each column's mean
squared input: the importance the output error gives it), rtn.grid_params' search.
The same sweep (`prepare`, `sweep`) rounds onto the FP4 grids (`--method nvfp4 / mxfp4 --gptq`: fp4.gptq_fp4) and
GGML's Q4_K, IQ4_XS and IQ4_NL grids (gptq_q4_k, gptq_iq4), each with its grid fixed before the sweep.

`--gptaq` (GPTAQ, Li et al. 2025: asymmetric calibration) aims at the float model instead: a linear whose float
model's inputs are X_f and whose quantized model's are X should give X Q^T = X_f W^T. Since
||X_f W^T - X Q^T||^2 = ||X_f W^T - X W'^T||^2 + ||X (W' - Q)^T||^2 for W' = W X_f^T X (X^T X)^-1, the least-squares
map from the quantized inputs to the float outputs, GPTQ's sweep on W' (same H) minimises it: W' = W + W C H^-1 with
C = 2/n (X_f - X)^T X (`asymmetric_target`, H damped as the sweep's). Every grid's parameters then come from W'.
A layer's linears then go in stages (q / k / v, o, gate / up, down; `_stages`), each measured with the stages
before it already rounded on the quantized side and still float on the float side: a linear aimed at the float
output makes up for what the linears before it in the layer lost, so measured against their float weights the next
stage would make up for it a second time, and its float targets computed through rounded weights would carry their
correction, meant for the quantized stream, into the float one.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import torch

from ... import quant
from ...errors import LlmqError
from ...models import qformat
from . import rtn

BITS = (4, 5, 8)   # 5: integers in [-16, 15], for GGUF's Q5_0 / Q5_1 (llmq's runtime and llama.cpp; vLLM runs 4 / 8)
CALIBRATED = True
BLOCK = 128


def FLOAT_TARGETS(opts) -> bool:  # noqa: N802  (the plug-in attribute, here a function of the options)
    """--gptaq aims at the float model: the engine carries its calibration states."""
    return opts.gptaq


def validate(opts, spec) -> None:
    if opts.per_tensor:
        raise LlmqError("GPTQ quantizes per channel or per group, not per tensor; drop --per-tensor")


def _damped_cholesky(h: torch.Tensor, damp: float) -> torch.Tensor:
    """chol(H + damp * mean(diag H) * I) (lower), h damped in place; the damping grows tenfold (three tries) if H is
    singular."""
    diag = h.diagonal()
    undamped = diag.clone()
    mean_diag = float(undamped.mean())
    for attempt in range(4):
        torch.add(undamped, damp * 10 ** attempt * mean_diag, out=diag)
        lower, info = torch.linalg.cholesky_ex(h)
        if int(info) == 0:
            return lower
    raise LlmqError("GPTQ: the Hessian is not positive definite even with 1000x damping; calibrate on more data")


def _upper_cholesky_of_inverse(h: torch.Tensor, damp: float) -> torch.Tensor:
    """chol(H^-1) (upper) of the damped H. `h` is scratch: damped in place, then overwritten by the inverse, so at
    most two [in, in] matrices exist at once (at 8B a down_proj Hessian is 0.8 GB, and this is the peak of GPTQ's
    memory)."""
    lower = _damped_cholesky(h, damp)
    torch.cholesky_inverse(lower, out=h)
    del lower
    return torch.linalg.cholesky(h, upper=True)


def asymmetric_target(w: torch.Tensor, h: torch.Tensor, c: torch.Tensor, damp: float) -> torch.Tensor:
    """GPTAQ's W' = W + W C H^-1 (module docstring), float32 [out, in]; h and c are read only (the damped copy of
    h is this function's)."""
    W = w.detach().float()
    lower = _damped_cholesky(h.detach().float().clone(), damp)
    return W + torch.cholesky_solve(c.float().T @ W.T, lower).T


def prepare(w: torch.Tensor, h: torch.Tensor, consume: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(W, H, importance) in float32: copies (H: unless `consume`), columns that never saw a non-zero input zeroed in
    W and given H_jj = 1, importance = the undamped diag(H)."""
    W = w.detach().float().clone()
    H = h.detach() if consume and h.dtype == torch.float32 else h.detach().float().clone()
    importance = torch.diag(H).clone()
    dead = importance == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    return W, H, importance


def sweep(W: torch.Tensor, H: torch.Tensor, damp: float, act_order: bool, block: int, round_column) -> torch.Tensor:
    """GPTQ's sweep over W [n, k] (float32; H [k, k] is scratch): `round_column(col, W1, j)` rounds column `col`
    (original order), W1[:, j] of the block being swept, and returns (q, its real value); each column's error goes
    onto the columns after it. Returns the q [n, k] in original column order."""
    k = W.shape[1]
    perm = torch.argsort(torch.diag(H), descending=True) if act_order else torch.arange(k, device=W.device)
    if act_order:
        W, H = W[:, perm], H[perm][:, perm]
    U = _upper_cholesky_of_inverse(H, damp)
    del H
    cols = perm.tolist()
    Q = torch.empty_like(W)
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        # the block transposed, so that a column, and the rows of the rank-1 updates, are contiguous; round_column
        # sees it as [n, block] (W1t.T) like the rest of W
        W1t = W[:, i1:i2].T.contiguous()
        E1t = torch.empty_like(W1t)
        U1 = U[i1:i2, i1:i2]
        inv_diag = U1.diagonal().reciprocal().tolist()
        for j in range(i2 - i1):
            q, real = round_column(cols[i1 + j], W1t.T, j)
            Q[:, i1 + j] = q
            err = torch.sub(W1t[j], real, out=E1t[j]).mul_(inv_diag[j])
            W1t[j + 1:].addr_(U1[j, j + 1:], err, alpha=-1)   # column j is done with: only the ones after it move
        W[:, i2:].addmm_(E1t.T, U[i1:i2, i2:], alpha=-1)
    return Q[:, torch.argsort(perm)] if act_order else Q


def gptq_quantize(w: torch.Tensor, h: torch.Tensor, bits: int, group_size: int, symmetric: bool,
                  scale_dtype: torch.dtype, damp: float = 0.01, act_order: bool = False,
                  consume: bool = False, search: bool = False) -> qformat.QuantizedWeight:
    """GPTQ-quantized QuantizedWeight of w [out, in] given the input Hessian h [in, in]; with `consume` h is used
    as scratch (the caller's last use of it: one [in, in] copy less); `search`: searched scales (module docstring)."""
    W, H, importance = prepare(w, h, consume)
    n, k = W.shape
    g = group_size if group_size > 0 else k
    ngroups = k // g
    scale = torch.empty(n, ngroups, device=W.device)
    zero = None if symmetric else torch.empty(n, ngroups, device=W.device)
    if act_order or g == k:  # static: every group's grid from the weight as it is now, in original column order
        s, z = rtn.grid_params(rtn.group_view(W, g), bits, symmetric, scale_dtype, search,
                               rtn.group_view(importance.view(1, k), g))
        scale[:] = s[..., 0]
        if zero is not None:
            zero[:] = z[..., 0]
    lazy_groups = not act_order and g < k

    def round_column(col, W1, j):
        gi = col // g
        if lazy_groups and col % g == 0:
            s, z = rtn.grid_params(W1[:, j:j + g], bits, symmetric, scale_dtype, search, importance[col:col + g])
            scale[:, gi] = s[:, 0]
            if zero is not None:
                zero[:, gi] = z[:, 0]
        s, z = scale[:, gi], (zero[:, gi] if zero is not None else None)
        q = quant.round_int(W1[:, j], s, z, bits)
        return q, ((q - z) * s if z is not None else q * s)

    block = g * max(1, BLOCK // g) if lazy_groups else BLOCK  # a group never straddles two blocks
    Q = sweep(W, H, damp, act_order, block, round_column)
    return rtn.pack(Q, scale, zero, bits, group_size if group_size > 0 else None, scale_dtype)


def gptq_q4_k(w: torch.Tensor, h: torch.Tensor, damp: float = 0.01, consume: bool = False, act_order: bool = False
              ) -> qformat.Q4KWeight:
    """GPTQ onto GGML's Q4_K grid: the grid (fp16 d / dmin, 6-bit sc / m per 32-weight sub-block) fixed first from the
    weight as it is (`llmq.quant.q4_k_grid`, its search weighted by diag(H): GPTQ's static groups), then the columns
    in order (`act_order`: by decreasing diag(H)), each rounded to its sub-block's grid (`llmq.quant.q4_k_codes`) and
    its error spread over the columns not yet quantized, which the fixed grid then rounds."""
    W, H, importance = prepare(w, h, consume)
    d, dmin, sc, m = quant.q4_k_grid(W, importance.clamp_min(torch.finfo(torch.float32).tiny))
    s, mn = (t.repeat_interleave(quant.Q4K_SUB, dim=1) for t in quant.q4_k_scale_min(d, dmin, sc, m))  # per column

    def round_column(col, W1, j):
        q = quant.q4_k_codes(W1[:, j], s[:, col], mn[:, col])
        return q.float(), s[:, col] * q.float() - mn[:, col]

    Q = sweep(W, H, damp, act_order, BLOCK, round_column)
    return qformat.Q4KWeight(Q.to(torch.uint8).cpu(), d.cpu(), dmin.cpu(), sc.cpu(), m.cpu())


def gptq_iq4(w: torch.Tensor, h: torch.Tensor, damp: float = 0.01, consume: bool = False, act_order: bool = False,
             grid: str = "iq4_xs") -> qformat.IQ4Weight:
    """GPTQ onto GGML's IQ4_XS or IQ4_NL grid (`grid`): the steps (IQ4_XS's fp16 d and 6-bit ls per 32-weight
    sub-block, IQ4_NL's fp16 d per 32-weight block) fixed first from the weight as it is (rtn.quantize_iq4, its
    search weighted by diag(H)), then the columns in order (`act_order`: by decreasing diag(H)), each rounded to the
    table value nearest it times its stored step (`llmq.quant.iq4_codes`) and its error spread over the columns not
    yet quantized."""
    W, H, importance = prepare(w, h, consume)
    fixed = rtn.quantize_iq4(W, grid, importance)
    step = fixed.steps().to(W.device).repeat_interleave(quant.IQ4_BLOCK, dim=1)   # per column
    values = quant.IQ4_VALUES.to(W.device)

    def round_column(col, W1, j):
        q = quant.iq4_codes(W1[:, j], step[:, col])
        return q.float(), step[:, col] * values[q.long()]

    Q = sweep(W, H, damp, act_order, BLOCK, round_column)
    return dataclasses.replace(fixed, q=Q.to(torch.uint8).cpu())


GGML_GPTQ = {"q4_k": gptq_q4_k} | {g: partial(gptq_iq4, grid=g) for g in rtn.IQ4_GRIDS}   # by grid


def quantize_layer(ctx, quantize_one=None) -> dict[str, qformat.QuantizedWeight]:
    """One linear at a time, each Hessian released once no linear needs it. `quantize_one(name, w, h, consume)`:
    the rounding (default: onto the integer grid of the options; the FP4 methods' --gptq passes fp4.gptq_fp4)."""
    o = ctx.opts
    if quantize_one is None:
        def quantize_one(name, w, h, consume):
            return gptq_quantize(w, h, *ctx.grid(name), o.symmetric, ctx.scale_dtype, damp=o.damp,
                                 act_order=o.act_order, consume=consume, search=o.search)
    if o.gptaq:
        hessians, cross = ctx.hessians(list(ctx.linears), float_inputs=True)
        stages = _stages(hessians)
    else:
        hessians, cross, stages = ctx.hessians(list(ctx.linears)), {}, [list(ctx.linears)]
    out = {}
    for k, stage in enumerate(stages):
        if k:   # measured again with the stages before it rounded
            hessians, cross = ctx.hessians(stage, float_inputs=True)
        for name in stage:
            lin = ctx.linears[name]
            h = hessians.pop(name)
            last = all(other is not h for other in hessians.values())  # q/k/v and gate/up share one Hessian
            w = asymmetric_target(lin.weight.data, h, cross.pop(name), o.damp) if o.gptaq else lin.weight.data
            grid = ctx.ggml_grid(name)
            out[name] = GGML_GPTQ[grid](w, h, o.damp, consume=last, act_order=o.act_order) if grid else \
                quantize_one(name, w, h, last)
            del h, w
            if k + 1 < len(stages):   # later stages run the layer rounded so far (its float pass: as it was)
                ctx.float_weights[name] = lin.weight.data
                lin.weight.data = out[name].dequantize(torch.float32).to(lin.weight.device)
            else:   # not needed once quantized: 0.6 GB at 8B before down_proj
                lin.weight.data = lin.weight.data.new_empty(0)
        hessians.clear()
    ctx.float_weights.clear()
    return out


def _stages(hessians: dict[str, torch.Tensor]) -> list[list[str]]:
    """The layer's linears in stages (hessians: keyed in the order the layer calls them): the first one called,
    those fed its very input (shared Hessian: q / k / v) and every linear of the same roles (the last name part: every
    expert's gate / up, then every expert's down_proj, each expert's input independent of the others'), then the
    same over the rest."""
    left, stages = dict(hessians), []
    while left:
        first = next(iter(left.values()))
        roles = {n.rsplit(".", 1)[-1] for n, h in left.items() if h is first}
        stages.append([n for n in left if n.rsplit(".", 1)[-1] in roles])
        for n in stages[-1]:
            del left[n]
    return stages
