"""KL divergence of next-token distributions against the baseline, on the same tokens (llama.cpp's metric).

For every position of every window, KL(P_base || P_eval) = sum_v p_base(v) (log p_base(v) - log p_eval(v)).
Reported: the mean (with its standard error), the 99th percentile, top-1 agreement (argmax equal, in points) and
both models' perplexities over the same tokens. It works even where a small model's task accuracy is at chance.

An evaluated model behind an endpoint may give only its top-k log-probabilities per position (`lm.top_k` set): then
the KL is taken over k + 1 outcomes (`topk_token_kl`) and the report says so; an in-process model can be scored the
same way (`--kld-top-k`), which is how a deployment is compared with llmq's own evaluation.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ..errors import LlmqError
from .compare import mean_stderr

WINDOW = 512
# the least mass the rest of the vocabulary keeps beyond an evaluated top-k: a server's float32 top-k of a confident
# position can sum to 1 or a hair above, which would make any baseline mass left outside it an infinite KL
REST_FLOOR = 1e-7
# the per-position KL histogram's bin edges (nats): 0, then four bins a decade from 1e-6 to 100; a KL below 1e-6 falls
# in the first bin, one above 100 in the last. Fixed, so two artifacts' histograms can be drawn on one axis.
KL_EDGES = (0.0, *(10.0 ** (e / 4) for e in range(-24, 9)))


def kl_counts(kl: torch.Tensor) -> list[int]:
    """How many of the per-position KL values fall in each bin of KL_EDGES."""
    edges = torch.tensor(KL_EDGES[1:-1], dtype=torch.float64)
    idx = torch.bucketize(kl.double().reshape(-1), edges, right=True)
    return torch.bincount(idx, minlength=len(KL_EDGES) - 1).tolist()


def kl_histogram(counts: list[int]) -> dict:
    """The manifest's record of a per-position KL histogram: the edges and the counts of each bin."""
    return {"edges": list(KL_EDGES), "counts": counts}


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


def topk_token_kl(top_eval: torch.Tensor, ids_eval: torch.Tensor, lp_base: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """token_kl from the evaluated model's top-k only ([T, k] log-probabilities, descending, and their token ids)
    against the baseline's full [T, vocab]: the KL over k + 1 outcomes, those k tokens and one bin for the rest of the
    vocabulary holding each model's remaining mass (the evaluated model's floored at REST_FLOOR). Merging outcomes
    never raises a KL divergence (log-sum inequality), so this is a lower bound on the full-vocabulary KL, equal to
    it when the rest holds no mass; top-1 agreement is exact. Also returns the evaluated rest mass per position."""
    if ids_eval.numel() and int(ids_eval.max()) >= lp_base.shape[-1]:
        raise LlmqError(f"the evaluated model names token {int(ids_eval.max())}, past the baseline's vocabulary of "
                        f"{lp_base.shape[-1]}")
    lp_e, lp_b = top_eval.double(), lp_base.double().gather(1, ids_eval)
    rest_e = (-lp_e.logsumexp(-1).clamp_max(0).expm1()).clamp_min(REST_FLOOR)
    rest_b = (-lp_b.logsumexp(-1).clamp_max(0).expm1()).clamp_min(0)
    kl, _ = token_kl(torch.cat([lp_e, rest_e.log()[:, None]], 1), torch.cat([lp_b, rest_b.log()[:, None]], 1))
    return kl, ids_eval[:, 0] == lp_base.argmax(-1), rest_e


def image_kl(lm, base, samples: list[tuple[list[int], torch.Tensor]], image_token: int) -> dict | None:
    """KL(P_base || P_eval) over the text that follows the images of vision-language prompts (token ids, pixel
    values: both models see the images): what the image conditions, scored as kl_divergence scores text. None where
    either backend cannot place images (an endpoint's completions cannot carry one)."""
    kls, agree = [], []
    for ids, pixels in samples:
        lp_e, lp_b = lm.image_logprobs(ids, pixels), base.image_logprobs(ids, pixels)
        if lp_e is None or lp_b is None:
            return None
        after = max(i for i, t in enumerate(ids) if t == image_token) + 1   # the distributions after the images
        kl, same = token_kl(lp_e[after:-1], lp_b[after:-1])
        kls += kl.tolist()
        agree += same.float().tolist()
    if not kls:
        return None
    mean, se = mean_stderr(kls)
    top1, top1_se = mean_stderr(agree)
    return {"mean": mean, "stderr": se, "p99": float(torch.tensor(kls).quantile(0.99)), "top1": 100 * top1,
            "top1_stderr": 100 * top1_se, "tokens": len(kls), "conversations": len(samples)}


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
    k = lm.top_k  # None: full distributions
    kls, agree, rest, nll_e, nll_b = [], [], [], 0.0, 0.0
    for w in windows:
        lp_b = base.logprobs_before(w).double()
        tgt = torch.tensor(w[1:])
        nll_b -= float(lp_b.gather(1, tgt[:, None]).sum())
        if k:
            top, ids = lm.top_logprobs(w)
            kl, same, left = topk_token_kl(top, ids, lp_b)
            rest += left.tolist()
        else:
            lp_e = lm.logprobs_before(w).double()
            if lp_e.shape != lp_b.shape:
                raise LlmqError(f"vocabularies differ: {lp_e.shape[-1]} vs {lp_b.shape[-1]} entries")
            kl, same = token_kl(lp_e, lp_b)
            nll_e -= float(lp_e.gather(1, tgt[:, None]).sum())
        kls += kl.tolist()
        agree += same.float().tolist()
        progress(0, 1)
    if not kls:
        raise LlmqError("kld: no tokens to compare")
    mean, se = mean_stderr(kls)
    top1, top1_se = mean_stderr(agree)
    n = len(kls)
    out = {"mean": mean, "stderr": se, "p99": float(torch.tensor(kls).quantile(0.99)), "max": max(kls),
           "histogram": kl_histogram(kl_counts(torch.tensor(kls))),
           "top1": 100 * top1, "top1_stderr": 100 * top1_se, "tokens": n,
           "ppl": None if k else math.exp(nll_e / n), "ppl_baseline": math.exp(nll_b / n), "top_k": k}
    if k:
        out.update(rest_mass=sum(rest) / n, exact=f"top1 and ppl_baseline are exact; mean, stderr, p99 and max are "
                   f"over the evaluated model's top-{k} tokens plus one bin for the rest of the vocabulary (each "
                   f"model's remaining mass; on average {sum(rest) / n:.3f} of the evaluated model's): a lower bound "
                   "on the full-vocabulary KL; the evaluated perplexity is not known")
    return out
