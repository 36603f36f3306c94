"""`llmq bench`: load tests of any OpenAI-compatible endpoint, offline engine sweeps, hardware probes, reports."""

from .offline import OfflineOptions, OfflineResult, run_offline

__all__ = ["OfflineOptions", "OfflineResult", "run_offline"]
