"""The gated delta rule of linear-attention layers (Gated DeltaNet: Qwen3.5, Qwen3-Next), in float32.

Per value head, the state S [Dk, Dv] is decayed by exp(g_t) and corrected towards v_t along k_t at rate beta_t:
    S <- exp(g_t) S;  u_t = beta_t (v_t - S^T k_t);  S <- S + k_t u_t^T;  o_t = S^T q_t.
Decode steps apply it once per sequence (`step`). A prefill chunk applies it in blocks of C tokens (`chunked`): with
G_i the block's cumulative log decay, the corrections u of a block solve one unit lower-triangular system
    u_i + beta_i sum_{j<i} e^{G_i - G_j} (k_i . k_j) u_j = beta_i (v_i - e^{G_i} S0^T k_i),
after which the outputs and the block's final state are matrix products. Both give the recurrence's values up to
float32 summation order.
"""

from __future__ import annotations

import torch


def step(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
         beta: torch.Tensor) -> torch.Tensor:
    """One token of each of B sequences: state [B, H, Dk, Dv] (updated in place), q / k [B, H, Dk], v [B, H, Dv],
    g / beta [B, H] -> o [B, H, Dv]."""
    state.mul_(g.exp()[..., None, None])
    u = (v - torch.einsum("bhkv,bhk->bhv", state, k)) * beta[..., None]
    state.add_(k[..., :, None] * u[..., None, :])
    return torch.einsum("bhkv,bhk->bhv", state, q)


def chunked(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
            beta: torch.Tensor, block: int = 64) -> torch.Tensor:
    """T tokens of one sequence: state [H, Dk, Dv] (updated in place), q / k [T, H, Dk], v [T, H, Dv], g / beta
    [T, H] -> o [T, H, Dv]."""
    q, k, v = (x.transpose(0, 1) for x in (q, k, v))          # [H, T, D]
    g, beta = g.transpose(0, 1), beta.transpose(0, 1)            # [H, T]
    out = torch.empty_like(v)
    s = state
    for lo in range(0, q.shape[1], block):
        hi = min(lo + block, q.shape[1])
        qb, kb, vb, bb = q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], beta[:, lo:hi]
        G = g[:, lo:hi].cumsum(-1)                               # [H, C]
        n = hi - lo
        below = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        # e^{G_i - G_j} for j <= i; the exponent is masked before exp (above the diagonal it is positive)
        decay = (G[:, :, None] - G[:, None, :]).masked_fill(~below, float("-inf")).exp()   # [H, C, C]
        kk = kb @ kb.transpose(1, 2) * decay
        system = torch.eye(n, dtype=q.dtype, device=q.device) + (kk * bb[..., None]).tril(-1)
        eg = G.exp()[..., None]                                  # [H, C, 1]
        rhs = bb[..., None] * (vb - eg * (kb @ s))
        u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        out[:, lo:hi] = eg * (qb @ s) + (qb @ kb.transpose(1, 2) * decay) @ u
        tail = (G[:, -1:] - G).exp()[..., None]                  # e^{G_C - G_j}: [H, C, 1]
        s = G[:, -1].exp()[:, None, None] * s + (kb * tail).transpose(1, 2) @ u
    state.copy_(s)
    return out.transpose(0, 1)
