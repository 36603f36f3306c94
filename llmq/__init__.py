"""llmq: quantize, shard, evaluate, serve and benchmark Hugging Face causal LMs, one versioned artifact per stage."""

__version__ = "0.1.0"
