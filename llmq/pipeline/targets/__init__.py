"""`llmq build`: turn a model or quantized artifact into an engine artifact for a deploy target: llmq's own runtime
(rank shards), TensorRT-LLM (a Hugging Face checkpoint for trtllm-serve), llama.cpp (GGUF).
One module per target, each registered by one line in `registry.py`; the stage and the reference check beside them
look targets up there."""

from .stage import BuildOptions, build_engine

__all__ = ["SUPPORTED_TP", "BuildOptions", "ShardPlan", "build_engine", "make_plan"]


def __getattr__(name: str):
    """The plan needs torch: it is imported on first use, so that the CLI can read BuildOptions without torch."""
    if name in ("SUPPORTED_TP", "ShardPlan", "make_plan"):
        from ...models import sharding

        return getattr(sharding, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
