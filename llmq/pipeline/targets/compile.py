"""The TensorRT-LLM compile step after the checkpoint is written: one of three outcomes, recorded in the manifest.

- "engine": tensorrt_llm with its TensorRT engine builder and a CUDA GPU: one engine per rank under trtllm/engine/.
- "pytorch-options" (`--target trtllm-hf`): the options file trtllm-serve / the LLM API take, beside the Hugging
  Face checkpoint TensorRT-LLM's PyTorch backend loads (its engine builder was removed on its main branch in 2026).
- "checkpoint-only": no tensorrt_llm, no GPU for the builder, or a tensorrt_llm without the builder (then
  --target trtllm-hf is the way): the checkpoint alone, and one line saying why.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from ...errors import LlmqError

OPTIONS_FILE = "llm_api_options.yaml"


def _max_num_tokens(engine) -> int:
    return max(engine.max_seq_len, min(engine.max_batch_size * engine.max_seq_len, 8192))


def write_llm_api_options(ckpt: Path, engine, attention_window: int | None = None) -> dict:
    """Options for `trtllm-serve CKPT --extra_llm_api_options FILE` / `LLM(CKPT, **options)`, written beside the
    Hugging Face checkpoint that TensorRT-LLM's PyTorch backend loads (`--target trtllm-hf`). A sliding-window model
    gets its window as `kv_cache_config.max_attention_window` (TensorRT-LLM sets windows at run time)."""
    kv = {"dtype": engine.kv_cache_dtype} | ({"max_attention_window": [attention_window]} if attention_window else {})
    options = {"tensor_parallel_size": engine.tp, "pipeline_parallel_size": engine.pp,
               "max_batch_size": engine.max_batch_size, "max_seq_len": engine.max_seq_len,
               "max_num_tokens": _max_num_tokens(engine), "kv_cache_config": kv}
    (ckpt / OPTIONS_FILE).write_text(yaml.safe_dump(options, sort_keys=True))
    rel = f"{ckpt.name}/{OPTIONS_FILE}"
    return {"status": "pytorch-options", "options": rel,
            "serve_command": f"trtllm-serve {ckpt.name} --extra_llm_api_options {rel}"}


def build_engines(ckpt: Path, engine) -> dict:
    """Compile one TensorRT engine per rank with tensorrt_llm's builder (needs the GPU the engine will run on)."""
    from tensorrt_llm import BuildConfig, build
    from tensorrt_llm.models import MODEL_MAP

    cfg = json.loads((ckpt / "config.json").read_text())
    model_cls = MODEL_MAP.get(cfg["architecture"])
    if model_cls is None:
        raise LlmqError(f"this tensorrt_llm has no model class for {cfg['architecture']}")
    out = ckpt / "engine"
    build_config = BuildConfig(max_batch_size=engine.max_batch_size, max_seq_len=engine.max_seq_len,
                               max_num_tokens=_max_num_tokens(engine))
    for rank in range(engine.tp):
        model = model_cls.from_checkpoint(str(ckpt), rank=rank)
        build(model, build_config).save(str(out))
    return {"status": "engine", "engine_dir": "trtllm/engine"}


def compile_trtllm(ckpt: Path, engine) -> dict:
    try:
        import tensorrt_llm  # noqa: F401
    except ImportError:
        return {"status": "checkpoint-only",
                "reason": "tensorrt_llm is not installed: install it (pip install 'llmq[trtllm]') on a machine "
                          "with an NVIDIA GPU to compile engines from this checkpoint"}
    try:
        from tensorrt_llm import BuildConfig, build  # noqa: F401  (absent where only the PyTorch backend remains)
    except ImportError:
        return {"status": "checkpoint-only",
                "reason": "this tensorrt_llm has only its PyTorch backend, which loads Hugging Face checkpoints, "
                          "not this one: build with --target trtllm-hf"}
    import torch

    if not torch.cuda.is_available():
        return {"status": "checkpoint-only",
                "reason": "tensorrt_llm is installed but no CUDA GPU is visible: engines are compiled for the GPU "
                          "they run on; run `trtllm-build --checkpoint_dir trtllm` there"}
    return build_engines(ckpt, engine)
