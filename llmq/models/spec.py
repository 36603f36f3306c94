"""The architecture description every stage reads, derived from a Hugging Face config.json."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import LlmqError

# model_type -> architecture class. All are Llama-family decoders: RMSNorm, RoPE, SwiGLU, GQA.
SUPPORTED_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}


@dataclass(frozen=True)
class ModelSpec:
    model_type: str
    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    rope_theta: float
    rope_scaling: dict | None
    rms_norm_eps: float
    attention_bias: bool
    max_position_embeddings: int
    sliding_window: int | None

    @classmethod
    def from_config(cls, config: dict | str | Path) -> "ModelSpec":
        if not isinstance(config, dict):
            p = Path(config)
            p = p / "config.json" if p.is_dir() else p
            try:
                config = json.loads(p.read_text())
            except FileNotFoundError:
                raise LlmqError(f"{p}: no config.json (not a Hugging Face model directory)") from None
            except json.JSONDecodeError as e:
                raise LlmqError(f"{p}: config.json is not valid JSON ({e})") from None
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_ARCHITECTURES:
            arch = (config.get("architectures") or [model_type])[0]
            raise LlmqError(f"unsupported architecture {arch!r} (model_type {model_type!r}); llmq supports: "
                            + ", ".join(f"{v} ({k})" for k, v in SUPPORTED_ARCHITECTURES.items()))
        try:
            heads = int(config["num_attention_heads"])
            hidden = int(config["hidden_size"])
            rope = config.get("rope_parameters") or {}
            rope_scaling = config.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
            return cls(
                model_type=model_type,
                architecture=SUPPORTED_ARCHITECTURES[model_type],
                num_layers=int(config["num_hidden_layers"]),
                hidden_size=hidden,
                num_heads=heads,
                num_kv_heads=int(config.get("num_key_value_heads") or heads),
                head_dim=int(config.get("head_dim") or hidden // heads),
                intermediate_size=int(config["intermediate_size"]),
                vocab_size=int(config["vocab_size"]),
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                rope_theta=float(config.get("rope_theta") or rope.get("rope_theta") or 10000.0),
                rope_scaling=rope_scaling,
                rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                attention_bias=bool(config.get("attention_bias", model_type == "qwen2")),
                max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
                sliding_window=config.get("sliding_window") if config.get("use_sliding_window", True) else None,
            )
        except (KeyError, TypeError, ValueError) as e:
            raise LlmqError(f"config.json of this {model_type} model is missing or has a bad field: {e}") from None

    def kv_bytes_per_token(self, bytes_per_element: float) -> float:
        """KV-cache size of one token: 2 x layers x kv_heads x head_dim x bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * bytes_per_element

    def num_parameters(self) -> int:
        attn = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * self.hidden_size * self.intermediate_size
        emb = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (attn + mlp + 2 * self.hidden_size) + emb + self.hidden_size

    def to_dict(self) -> dict:
        return asdict(self)
