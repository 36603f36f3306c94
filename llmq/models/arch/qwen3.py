"""Qwen3 (dense): Qwen2's layer without q/k/v biases, with an RMSNorm over each query and key head (`q_norm`,
`k_norm`, weights [head_dim]) between the projection and the rotary embedding. llama.cpp calls it `qwen3`
(attn_q_norm / attn_k_norm)."""

from .base import Arch

QWEN3 = Arch("qwen3", "Qwen3ForCausalLM", gguf_arch="qwen3", window="layer_types",
             norms={"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm",
                    "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"})
