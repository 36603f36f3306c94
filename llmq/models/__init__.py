"""Model references, checkpoints and the architecture description every stage reads."""

from .default import DEFAULT, cache_dir, default_gguf
from .load import load_hf_model, load_tokenizer, pick_device
from .resolve import resolve_model, source_artifact
from .spec import SUPPORTED_ARCHITECTURES, ModelSpec

__all__ = ["DEFAULT", "SUPPORTED_ARCHITECTURES", "ModelSpec", "cache_dir", "default_gguf", "load_hf_model",
           "load_tokenizer", "pick_device", "resolve_model", "source_artifact"]
