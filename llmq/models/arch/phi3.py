"""Phi-3 (`Phi3ForCausalLM`): Llama's layer (RMSNorm, RoPE, SwiGLU, GQA) with q/k/v stored as one `qkv_proj` (q
rows, then k, then v) and gate/up as one `gate_up_proj` (gate rows, then up), and a window that, when
`sliding_window` is set, every layer uses. The norms feed the fused groups, so AWQ and SmoothQuant fold into them;
v -> o and up -> down are not folded, since the producer's rows are part of a fused matrix whose other rows feed
other consumers. Mixed precision treats each stored linear as a unit. llama.cpp calls it `phi3` (fused attn_qkv,
and ffn_up holding gate and up)."""

from .base import Arch

PHI3 = Arch("phi3", "Phi3ForCausalLM", gguf_arch="phi3", window="all", gguf_ffn_scale=False,
            fused={"qkv_proj": ("self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj")),
                   "gate_up_proj": ("mlp.gate_up_proj", ("gate_proj", "up_proj"))},
            feeds=(("attn_norm", ("qkv_proj",)), ("mlp_norm", ("gate_up_proj",))),
            units=(("qkv_proj",), ("o_proj",), ("gate_up_proj",), ("down_proj",)))
