"""`llmq build`: turn a model or quantized artifact into a tensor-parallel engine artifact (llmq or TensorRT-LLM)."""

from ...models.sharding import SUPPORTED_TP, ShardPlan, make_plan
from .stage import BuildOptions, build_engine

__all__ = ["SUPPORTED_TP", "BuildOptions", "ShardPlan", "build_engine", "make_plan"]
