"""KL divergence of next-token distributions against the baseline, on the same tokens (llama.cpp's metric).

For every position of every window, KL(P_base || P_eval) = sum_v p_base(v) (log p_base(v) - log p_eval(v)).
Reported: the mean (with its standard error), the 99th percentile, top-1 agreement (argmax equal, in points) and
both models' perplexities over the same tokens. It works even where a small model's task accuracy is at chance.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ..errors import LlmqError
from .compare import mean_stderr

WINDOW = 512


def token_kl(lp_eval: torch.Tensor, lp_base: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position of [T, vocab] log-probabilities: KL(P_base || P_eval) in float64 (rounding below zero clamped)
    and whether the two argmaxes agree. Entries the baseline gives no mass (log-probability -inf) add nothing; a KL
    that is still not finite (NaN / inf logits, or mass the evaluated model rules out) is an LlmqError, never a
    number a gate could pass."""
    lp_e, lp_b = lp_eval.double(), lp_base.double()
    terms = torch.where(lp_b == float("-inf"), 0.0, lp_b.exp() * (lp_b - lp_e))
    kl = terms.sum(-1).clamp_min(0)
    if not bool(torch.isfinite(kl).all()):
        bad = int((~torch.isfinite(kl)).sum())
        raise LlmqError(f"the KL divergence is not finite at {bad} of {kl.numel()} positions: NaN or inf in the "
                        "evaluated model's or the baseline's logits")
    return kl, lp_e.argmax(-1) == lp_b.argmax(-1)


def kl_divergence(lm, base, texts: list[str], progress: Callable[[int, int], None] | None = None) -> dict:
    progress = progress or (lambda todo, done: None)
    windows = []
    for text in texts:
        ids = [lm.prefix_token_id] + lm.encode(text)
        if [base.prefix_token_id] + base.encode(text) != ids:
            raise LlmqError("kld needs the evaluated model and the baseline to share a tokenizer")
        size = min(WINDOW, lm.max_length, base.max_length)
        windows += [ids[i:i + size] for i in range(0, len(ids) - 1, size - 1) if len(ids[i:i + size]) > 1]
    progress(len(windows), 0)
    kls, agree, nll_e, nll_b = [], [], 0.0, 0.0
    for w in windows:
        lp_e = lm.full_logprobs(w).double()
        lp_b = base.full_logprobs(w).double()
        if lp_e.shape != lp_b.shape:
            raise LlmqError(f"vocabularies differ: {lp_e.shape[-1]} vs {lp_b.shape[-1]} entries")
        kl, same = token_kl(lp_e[:-1], lp_b[:-1])  # the last position predicts past the window
        kls += kl.tolist()
        agree += same.float().tolist()
        tgt = torch.tensor(w[1:])
        nll_e -= float(lp_e[:-1].gather(1, tgt[:, None]).sum())
        nll_b -= float(lp_b[:-1].gather(1, tgt[:, None]).sum())
        progress(0, 1)
    if not kls:
        raise LlmqError("kld: no tokens to compare")
    mean, se = mean_stderr(kls)
    top1, top1_se = mean_stderr(agree)
    n = len(kls)
    return {"mean": mean, "stderr": se, "p99": float(torch.tensor(kls).quantile(0.99)), "max": max(kls),
            "top1": 100 * top1, "top1_stderr": 100 * top1_se, "tokens": n,
            "ppl": math.exp(nll_e / n), "ppl_baseline": math.exp(nll_b / n)}
