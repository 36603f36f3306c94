"""The bundled continuous-batching runtime that `serve`, `eval` and `bench --offline` share."""

from .engine import EngineConfig, EngineStats, LLMEngine, RequestMetrics, RequestOutput, ScoreOutput, ScoreRequest
from .sampling import SamplingParams

__all__ = ["EngineConfig", "EngineStats", "LLMEngine", "RequestMetrics", "RequestOutput", "SamplingParams",
           "ScoreOutput", "ScoreRequest"]
