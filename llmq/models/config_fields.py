"""Every field of the supported families' transformers configs, classified: implemented by the runtime for every
value, inert at inference, or refused (in one line naming it) for the values the runtime does not compute as
transformers' forward does. ModelSpec reads a config only through checked_hf_config, so no field is ever ignored.
"""

from __future__ import annotations

from ..errors import LlmqError
from .arch import ARCHS

# Config fields (of transformers' configs of the supported families) the runtime computes with, for every value.
IMPLEMENTED = frozenset({
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "tie_word_embeddings", "max_position_embeddings", "dtype",
    "attention_bias", "mlp_bias",  # the runtime adds whatever biases the checkpoint holds
    "use_sliding_window", "max_window_layers",  # Qwen2/3: transformers turns them into layer_types, checked below
    "_sliding_window_pattern",  # Gemma 3: likewise
    "query_pre_attn_scalar", "final_logit_softcapping",  # Gemma 3: the attention scale, a tanh cap on the logits
    # mixture of experts (Qwen3-MoE, Mixtral, Qwen3.5-MoE): how many experts (Qwen3-MoE's num_experts is transformers'
    # num_local_experts; Qwen3.5-MoE's stays num_experts), how many a token takes, their width, renormalizing
    "num_local_experts", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
    "shared_expert_intermediate_size",  # Qwen3.5-MoE's shared expert (Experts.shared)
    "no_rope_layer_interval",  # SmolLM3: transformers turns it into no_rope_layers, checked below
    # Gated DeltaNet layers (Arch.linear_attention): their key / value heads and widths, the convolution's kernel
    "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
    "linear_conv_kernel_dim",
    "swiglu_alpha", "swiglu_limit",  # GPT-OSS's clamped SwiGLU (Arch.activation "clamped_swiglu")
    # Gemma 4: the global layers' head width / KV heads, values that are the keys, KV caches shared by the last layers
    # and their wider MLP, the per-layer inputs' width and table
    "per_layer_config", "attention_k_eq_v", "num_kv_shared_layers", "use_double_wide_mlp",
    "hidden_size_per_layer_input", "vocab_size_per_layer_input",
})

# Fields that do not change the logits of an inference forward, with the reason.
INERT = {
    "transformers_version": "metadata", "_name_or_path": "metadata",
    "output_hidden_states": "outputs", "output_attentions": "outputs", "return_dict": "outputs", "use_cache": "outputs",
    "id2label": "classification", "label2id": "classification", "problem_type": "classification",
    "initializer_range": "training", "attention_dropout": "training", "pad_token_id": "training",
    "bos_token_id": "generation", "eos_token_id": "generation",
    "is_encoder_decoder": "unused", "chunk_size_feed_forward": "unused",
    "pretraining_tp": "numerics",  # slices the same matmuls in transformers 4; transformers 5 ignores it
    "output_router_logits": "outputs", "router_aux_loss_coef": "training",
    "router_jitter_noise": "training",  # Mixtral multiplies the router's input by noise in training mode only
    "resid_pdrop": "training", "embd_pdrop": "training",  # Phi-3's dropouts
    # Phi-3: the pretraining length, which transformers reads only for LongRoPE (refused under rope_parameters)
    "original_max_position_embeddings": "rope",
    "top_k_experts": "unused",  # Gemma 4's MoE block's, which enable_moe_block (refused) turns on
}

# fixed frequencies, which the runtime tabulates once ("proportional": Gemma 4's, over the whole head, the
# frequencies past partial_rotary_factor zero)
ROPE_TYPES = ("default", "linear", "yarn", "llama3", "proportional")


def window(hf_config) -> int | None:
    """The one attention window all layers use (None: full), by the family's rule (Arch.window)."""
    rule = ARCHS[hf_config.model_type].window
    if rule in ("none", "per_layer") or \
            (rule == "layer_types" and "sliding_attention" not in (hf_config.layer_types or ())):
        return None
    return hf_config.sliding_window


def local_layers(hf_config) -> tuple[int, ...]:
    """The layers that slide over their own window where the family mixes them with global ones (Arch.window
    "per_layer"), else none."""
    if ARCHS[hf_config.model_type].window != "per_layer":
        return ()
    return tuple(i for i, t in enumerate(hf_config.layer_types or ()) if t == "sliding_attention")


def _layer_types_unsupported(c) -> bool:
    types = set(getattr(c, "layer_types", None) or ())
    if ARCHS[c.model_type].linear_attention is not None:   # hybrid: linear-attention layers among full ones
        return not types <= {"linear_attention", "full_attention"}
    if ARCHS[c.model_type].window == "per_layer":
        return not types <= {"sliding_attention", "full_attention"}
    return bool(types) and types != {"sliding_attention" if window(c) is not None else "full_attention"}


def _rope_tables(rope: dict | None) -> list[dict]:
    """The rotary parameters of each layer type (Gemma 3 keys them by type; others have one)."""
    rope = rope or {}
    return list(rope.values()) if rope and all(isinstance(v, dict) for v in rope.values()) else [rope]


def _rope_unsupported(c) -> bool:
    """Refuses rotary types the runtime does not tabulate, and a partial rotary embedding where the family has none
    (Arch.partial_rotary) or it turns no whole number of pairs."""
    def partial_unsupported(factor) -> bool:
        if factor == 1.0:
            return False
        dim = (getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads) * factor
        return not ARCHS[c.model_type].partial_rotary or dim != int(dim) or int(dim) % 2 or not 0 < factor < 1
    return any(r.get("rope_type", "default") not in ROPE_TYPES or
               (r.get("rope_type") != "proportional" and partial_unsupported(r.get("partial_rotary_factor", 1.0)))
               for r in _rope_tables(c.rope_parameters))


def _window_unsupported(c) -> bool:
    w = c.sliding_window if local_layers(c) else window(c)
    return w is not None and (not isinstance(w, int) or w < 1)


def _activation_unsupported(field: str):
    """Refuses the config's activation unless it is its family's (Arch.activation_field); a field the family does
    not use is not looked at."""
    def refuse(c) -> bool:
        name, allowed = ARCHS[c.model_type].activation_field
        return name == field and getattr(c, field) not in allowed
    return refuse


def _dense_layers(field: str):
    """Refuses a MoE config whose `field` makes some layers dense (Qwen3-MoE's mlp_only_layers, decoder_sparse_step
    other than 1)."""
    def refuse(c) -> bool:
        value = getattr(c, field, None)
        return ARCHS[c.model_type].moe is not None and bool(value) and value != (1 if field.endswith("step") else [])
    return refuse


def _rope_layers_unsupported(c) -> bool:
    """Refuses a per-layer rotary list (Arch.rope_layers) that is not one 0 / 1 per layer."""
    field = ARCHS[c.model_type].rope_layers
    flags = getattr(c, field, None) if field else None
    return field is not None and (not isinstance(flags, list) or len(flags) != c.num_hidden_layers or
                                  any(f not in (0, 1) for f in flags))


# Fields the runtime implements for some values only: field -> (refuse(config), why).
REFUSED = {
    "architectures": (lambda c: any(not a.endswith("ForCausalLM") for a in c.architectures or ()),
                      "llmq runs causal language models only"),
    "hidden_act": (_activation_unsupported("hidden_act"), "this family's MLP is SwiGLU (silu)"),
    "hidden_activation": (_activation_unsupported("hidden_activation"),
                          "this family's MLP is GeGLU with the tanh-approximated gelu"),
    "rope_parameters": (_rope_unsupported, f"the runtime's rotary supports rope_type {', '.join(ROPE_TYPES)} over "
                                           "the whole head"),
    "layer_types": (_layer_types_unsupported, "this family applies one attention window to every layer"),
    "sliding_window": (_window_unsupported, "a window must be a positive number of tokens"),
    "attn_logit_softcapping": (lambda c: getattr(c, "attn_logit_softcapping", None) is not None,
                               "the runtime's attention does not cap its scores"),
    "use_bidirectional_attention": (lambda c: bool(getattr(c, "use_bidirectional_attention", False)),
                                    "llmq runs causal attention"),
    "mlp_only_layers": (_dense_layers("mlp_only_layers"), "llmq runs MoE models whose every layer is sparse"),
    "decoder_sparse_step": (_dense_layers("decoder_sparse_step"), "llmq runs MoE models whose every layer is sparse"),
    "no_rope_layers": (_rope_layers_unsupported, "it must hold one 0 (no rotary embedding) or 1 per layer"),
    "enable_moe_block": (lambda c: bool(getattr(c, "enable_moe_block", False)),
                         "llmq does not run Gemma 4's mixture-of-experts block beside the MLP yet"),
}


def checked_hf_config(config: dict):
    """transformers' config object for `config`, after refusing any field whose value the runtime would not compute
    as transformers does."""
    from transformers import AutoConfig

    model_type = config["model_type"]
    try:
        hf = AutoConfig.for_model(model_type, **{k: v for k, v in config.items()
                                                 if k not in ("model_type", "quantization_config")})
    except Exception as e:  # transformers' strict validation raises its own error types
        reason = str(e).splitlines()[-1].strip()
        raise LlmqError(f"config.json of this {model_type} model is invalid: {reason}") from None
    for name, (unsupported, why) in REFUSED.items():
        if unsupported(hf):
            value = getattr(hf, name)
            shown = sorted(set(value)) if isinstance(value, list) else value
            raise LlmqError(f"{model_type} config field {name}={shown!r} is not supported: {why}")
    return hf
