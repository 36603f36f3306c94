"""Every config field of the supported architectures is implemented by the runtime, inert at inference, or refused."""

from __future__ import annotations

import pytest
import torch
import transformers

from llmq.errors import LlmqError
from llmq.models import ModelSpec
from llmq.models.config_fields import IMPLEMENTED, INERT, REFUSED

CLASSES = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig, "qwen2": transformers.Qwen2Config,
           "qwen3": transformers.Qwen3Config, "gemma3_text": transformers.Gemma3TextConfig,
           "phi3": transformers.Phi3Config, "qwen3_moe": transformers.Qwen3MoeConfig,
           "mixtral": transformers.MixtralConfig, "smollm3": transformers.SmolLM3Config,
           "qwen3_5_text": transformers.Qwen3_5TextConfig, "qwen3_5_moe_text": transformers.Qwen3_5MoeTextConfig,
           "qwen3_next": transformers.Qwen3NextConfig, "gpt_oss": transformers.GptOssConfig,
           "gemma4_text": transformers.Gemma4TextConfig}
TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)


def config(model_type: str, **overrides) -> dict:
    return CLASSES[model_type](**TINY | overrides).to_dict()


def test_lists_cover_exactly_the_fields_of_the_supported_configs():
    fields = set().union(*(set(cls().to_dict()) for cls in CLASSES.values()))
    unclassified = fields - IMPLEMENTED - set(INERT) - set(REFUSED)
    assert not unclassified, f"classify these config fields in llmq/models/config_fields.py: {sorted(unclassified)}"
    assert not (IMPLEMENTED | set(INERT) | set(REFUSED)) - fields, "stale entries"
    assert not (IMPLEMENTED & set(INERT))
    assert not (IMPLEMENTED & set(REFUSED))
    assert not (set(INERT) & set(REFUSED))
    assert all(reason.isalpha() for reason in INERT.values())


@pytest.mark.parametrize("model_type,overrides,field", [
    ("llama", {"hidden_act": "gelu"}, "hidden_act"),
    ("qwen2", {"hidden_act": "relu"}, "hidden_act"),
    ("llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}, "rope_parameters"),
    ("mistral", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 8,
                                     "long_factor": [2.0] * 8, "original_max_position_embeddings": 256}},
     "rope_parameters"),
    ("llama", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     "rope_parameters"),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1}, "layer_types"),
    ("qwen2", {"layer_types": ["sliding_attention", "sliding_attention"]}, "layer_types"),  # no window to slide
    ("qwen3", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1}, "layer_types"),
    ("qwen3", {"hidden_act": "gelu"}, "hidden_act"),
    ("gemma3_text", {"hidden_activation": "silu"}, "hidden_activation"),
    ("gemma3_text", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ("gemma3_text", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ("gemma3_text", {"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                         "full_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6}}},
     "rope_parameters"),
    ("mistral", {"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
    ("llama", {"layer_types": ["sliding_attention", "sliding_attention"]}, "layer_types"),
    ("mistral", {"sliding_window": 0}, "sliding_window"),
    ("llama", {"architectures": ["LlamaForSequenceClassification"]}, "architectures"),
    ("qwen3_moe", {"mlp_only_layers": [0]}, "mlp_only_layers"),
    ("qwen3_5_text", {"layer_types": ["linear_attention", "sliding_attention"]}, "layer_types"),
    ("qwen3_5_text", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.3}},
     "rope_parameters"),  # 0.3 of a 256-wide head turns no whole number of pairs
    ("smollm3", {"no_rope_layers": [1, 0, 1]}, "no_rope_layers"),   # 3 flags for 2 layers
    ("smollm3", {"no_rope_layers": [1, 2]}, "no_rope_layers"),
    # SmolLM3's sliding layers are its NoPE layers: windows on some layers only, which this family does not run
    ("smollm3", {"use_sliding_window": True, "sliding_window": 16, "no_rope_layers": [1, 0]}, "layer_types"),
    ("qwen3_moe", {"decoder_sparse_step": 2}, "decoder_sparse_step"),
    ("qwen3_next", {"mlp_only_layers": [1]}, "mlp_only_layers"),   # a dense MLP among the MoE ones
    ("qwen3_next", {"decoder_sparse_step": 2}, "decoder_sparse_step"),
    ("mixtral", {"hidden_act": "gelu"}, "hidden_act"),
    # Phi-3 128k / 3.5: LongRoPE (short and long factors per frequency), as their config.json spells it
    ("phi3", {"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8},
              "max_position_embeddings": 1024, "original_max_position_embeddings": 256}, "rope_parameters"),
    ("phi3", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.75}},
     "rope_parameters"),
    ("phi3", {"hidden_act": "gelu_new"}, "hidden_act"),
])
def test_unimplemented_values_are_refused_naming_the_field(model_type, overrides, field):
    with pytest.raises(LlmqError, match=rf"^{model_type} config field {field}=\S.* is not supported: [^\n]+$"):
        ModelSpec.from_config(config(model_type, **overrides))


@pytest.mark.parametrize("model_type,overrides,window", [
    ("llama", {}, None),
    ("llama", {"attention_dropout": 0.1, "pretraining_tp": 2, "hidden_act": "swish", "mlp_bias": True}, None),
    ("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}, None),
    ("llama", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, None),
    ("mistral", {}, 4096),  # transformers' default window
    ("mistral", {"sliding_window": 16}, 16),
    ("mistral", {"sliding_window": None}, None),
    ("qwen2", {}, None),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 2}, None),  # no layer slides
    ("qwen2", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 0}, 16),
    ("qwen3", {}, None),
    ("gemma3_text", {}, None),  # its window is per layer (ModelSpec.local_window), not every layer's
    ("qwen3", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 0}, 16),
    ("phi3", {}, None),
    ("phi3", {"sliding_window": 16, "resid_pdrop": 0.1, "embd_pdrop": 0.1, "original_max_position_embeddings": 64},
     16),  # every layer slides; dropouts and the LongRoPE-only length change nothing at inference
])
def test_implemented_values_are_accepted_with_transformers_window(model_type, overrides, window):
    assert ModelSpec.from_config(config(model_type, **overrides)).sliding_window == window


@pytest.mark.parametrize("cls", CLASSES.values())
def test_transformers_default_configs_are_accepted(cls):
    spec = ModelSpec.from_config(cls().to_dict())
    assert spec.model_type == cls.model_type


def test_attention_and_mlp_biases_are_computed(tmp_path, make_tiny_model):
    """attention_bias and mlp_bias are in IMPLEMENTED because the runtime adds the checkpoint's biases."""
    from transformers import AutoModelForCausalLM

    from llmq.runtime import EngineConfig, LLMEngine

    d = make_tiny_model(tmp_path / "m", attention_bias=True, mlp_bias=True)
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.5)
    hf.save_pretrained(d)
    ids = list(range(40, 80))
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].log_softmax(-1)
    got = LLMEngine(d, EngineConfig(max_num_batched_tokens=16, block_size=8)).prompt_logprobs(ids)
    assert float((ref.exp() * (ref - got)).sum(-1).mean()) <= 1e-5
