"""The quick quality probe: how far the quantized model's next-token distributions moved from the source's.

Mean KL(P_source || P_quantized) per position and top-1 agreement (argmax equal) over a held-out text sample of a few
thousand tokens: llama.cpp's `--kl-divergence` numbers, which move measurably even on models too small for task
accuracy to. The layer-by-layer engine produces both models' final hidden states from the same held-out windows (the
quantized side computing with exactly the stored weights), so no second model is ever loaded.
"""

from __future__ import annotations

import torch

from ...evals.kld import KL_EDGES, kl_counts, kl_histogram, token_kl


def _terms(p_logits: torch.Tensor, q_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position KL(P || Q) and argmax agreement, in float64."""
    if p_logits.shape != q_logits.shape:
        raise ValueError(f"logits shapes differ: {tuple(p_logits.shape)} vs {tuple(q_logits.shape)}")
    lp = torch.log_softmax(p_logits.double().reshape(-1, p_logits.shape[-1]), -1)
    lq = torch.log_softmax(q_logits.double().reshape(-1, q_logits.shape[-1]), -1)
    return token_kl(lq, lp)


def kld_top1(p_logits: torch.Tensor, q_logits: torch.Tensor) -> dict:
    """{"kld_mean", "top1", "tokens"} of next-token distributions: P (reference) vs Q (quantized), logits [..., V].
    top1 is the fraction of positions whose most likely token agrees."""
    kl, agree = _terms(p_logits, q_logits)
    return {"kld_mean": float(kl.mean()), "top1": float(agree.double().mean()), "tokens": int(kl.numel())}


def positions_per_chunk(vocab: int) -> int:
    """How many positions to score at once so that each float64 [positions, vocab] temporary stays near 32 MB (at
    Llama-3's 128k vocabulary a 512-token window would otherwise take 0.5 GB per temporary, and there are several)."""
    return max(1, (1 << 22) // vocab)


class ProbeAccumulator:
    """kld_top1 over many chunks of positions without holding all logits at once."""

    def __init__(self):
        self.kl_sum, self.agree, self.n, self.kl_max = 0.0, 0, 0, 0.0
        self.counts = [0] * (len(KL_EDGES) - 1)

    def add(self, p_logits: torch.Tensor, q_logits: torch.Tensor) -> None:
        p = p_logits.reshape(-1, p_logits.shape[-1])
        q = q_logits.reshape(-1, q_logits.shape[-1])
        step = positions_per_chunk(p.shape[-1])
        for i in range(0, max(p.shape[0], 1), step):
            kl, agree = _terms(p[i:i + step], q[i:i + step])
            self.kl_sum += float(kl.sum())
            self.kl_max = max(self.kl_max, float(kl.max()))
            self.agree += int(agree.sum())
            self.n += int(kl.numel())
            self.counts = [a + b for a, b in zip(self.counts, kl_counts(kl))]

    def result(self) -> dict:
        n = max(self.n, 1)
        return {"kld_mean": self.kl_sum / n, "kld_max": self.kl_max, "top1": self.agree / n, "tokens": self.n,
                "histogram": kl_histogram(self.counts)}
