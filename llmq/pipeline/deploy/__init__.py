"""`llmq deploy`: hand an artifact to vLLM, SGLang, TensorRT-LLM or llama.cpp, on one node or several, with the GPUs
llmq's own memory arithmetic says it needs (sizing.py), the commands each engine takes (engines.py) and, for vLLM,
the same as a KServe LLMInferenceService and a Ray Serve LLM config (manifests.py), written as a `deploy` artifact
(stage.py)."""

from .engines import ENGINES
from .sizing import GPUS
from .stage import DeployOptions, deploy, sizing_table

__all__ = ["ENGINES", "GPUS", "DeployOptions", "deploy", "sizing_table"]
