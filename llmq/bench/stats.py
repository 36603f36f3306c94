"""Latency / throughput / goodput statistics over per-request records, with the definitions of DESIGN.md.

TTFT: request start to the first content chunk. TPOT (per request): (e2e - TTFT) / (output tokens - 1).
ITL: gaps between consecutive content chunks, pooled over requests. Throughputs divide by the level's wall time
(first request start to last request end), so idle time between arrivals in an open loop counts against them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

PERCENTILES = (50, 90, 95, 99)


@dataclass
class RequestRecord:
    """One request's timings, in seconds relative to the start of its load level."""

    index: int
    start: float
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    tokens_estimated: bool = False  # the server sent no usage, so the counts are ours
    ttft: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # arrival of every content-carrying chunk
    end: float | None = None
    error: str | None = None
    cancelled: bool = False  # still running when the level's time limit hit

    @property
    def ok(self) -> bool:
        return self.error is None and not self.cancelled and self.end is not None and self.ttft is not None

    @property
    def e2e(self) -> float | None:
        return None if self.end is None else self.end - self.start

    @property
    def tpot(self) -> float | None:
        n = self.completion_tokens or 0
        if not self.ok or n < 2:
            return None
        return (self.e2e - self.ttft) / (n - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "RequestRecord":
        return cls(**d)


def distribution(values: list[float]) -> dict:
    """mean, p50/p90/p95/p99 (numpy's linear interpolation), min, max and count; None entries where empty."""
    if not values:
        return {"count": 0, "mean": None, "min": None, "max": None, **{f"p{p}": None for p in PERCENTILES}}
    a = np.asarray(values, dtype=np.float64)
    out = {"count": int(a.size), "mean": float(a.mean()), "min": float(a.min()), "max": float(a.max())}
    for p, v in zip(PERCENTILES, np.percentile(a, PERCENTILES)):
        out[f"p{p}"] = float(v)
    return out


def meets_slo(r: RequestRecord, slo_ttft: float | None, slo_tpot: float | None) -> bool:
    """A request counts toward goodput when it succeeded and meets every SLO that was set (a one-token answer has
    no TPOT and meets a TPOT SLO trivially)."""
    if not r.ok:
        return False
    if slo_ttft is not None and r.ttft > slo_ttft:
        return False
    tpot = r.tpot
    return slo_tpot is None or tpot is None or tpot <= slo_tpot


def summarize(records: list[RequestRecord], slo_ttft: float | None = None, slo_tpot: float | None = None,
              cost_per_hour: float | None = None) -> dict:
    """The level's summary: latency distributions (seconds), counts, throughputs, goodput, cost per 1M tokens."""
    ok = [r for r in records if r.ok]
    failed = [r for r in records if r.error is not None]
    ends = [r.end for r in records if r.end is not None]
    duration = (max(ends) - min(r.start for r in records)) if ends else 0.0
    out_tokens = sum(r.completion_tokens or 0 for r in ok)
    in_tokens = sum(r.prompt_tokens or 0 for r in ok)
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: None)
    s = {
        "requests": len(records), "completed": len(ok), "failed": len(failed),
        "cancelled": sum(r.cancelled for r in records), "duration_s": duration,
        "prompt_tokens": in_tokens, "output_tokens": out_tokens,
        "tokens_estimated": any(r.tokens_estimated for r in ok),
        "request_throughput": per_s(len(ok)), "output_throughput": per_s(out_tokens),
        "total_token_throughput": per_s(in_tokens + out_tokens),
        "ttft": distribution([r.ttft for r in ok]),
        "tpot": distribution([t for r in ok if (t := r.tpot) is not None]),
        "itl": distribution([g for r in ok for g in r.itls]),
        "e2e": distribution([r.e2e for r in ok]),
        "errors": sorted({r.error for r in failed})[:10],
    }
    if slo_ttft is not None or slo_tpot is not None:
        good = sum(meets_slo(r, slo_ttft, slo_tpot) for r in records)
        s["good_requests"] = good
        s["goodput"] = per_s(good)
    else:
        s["good_requests"] = s["goodput"] = None
    tput = s["output_throughput"]
    s["cost_per_1m_output_tokens"] = (cost_per_hour / 3600 / tput * 1e6) if cost_per_hour is not None and tput \
        else None
    return s
