"""Qwen3.5 (dense text model, `Qwen3_5ForCausalLM`, model_type qwen3_5_text): a hybrid. `layer_types` makes three
of every four layers Gated DeltaNet layers (linear attention over a recurrent state: base.LinearAttention) and the
fourth full attention, whose q_proj also yields an output gate per head (sigmoid, before o_proj), with q / k norms and
a rotary embedding over the first quarter of each head (partial_rotary_factor; text positions are one value on
every M-RoPE axis, so the sections change nothing). Every RMSNorm scales by (1 + w), the DeltaNet's gated norm by w.
llama.cpp calls it `qwen35`.

Qwen3.5-MoE (`Qwen3_5MoeForCausalLM`, qwen3_5_moe_text): the same layers with a mixture of experts for every MLP
(the chosen experts' weights always renormalized) and a shared expert beside them, gated per token by a sigmoid.
Checkpoints store the experts one linear each, as Qwen3-MoE does. llama.cpp calls it `qwen35moe`.

Qwen3-Next (`Qwen3NextForCausalLM`, qwen3_next), the architecture Qwen3.5 grew from, computes the same layers as
Qwen3.5-MoE (the chosen experts renormalized where norm_topk_prob says) but stores a Gated DeltaNet's projections
fused and interleaved by key head: `in_proj_qkvz` (each key head's q, k, then its value heads' v and z) and
`in_proj_ba` (its value heads' b, then a). The reader cuts them into Qwen3.5's roles; quantization keeps the groups,
in_proj_ba 16-bit."""

from dataclasses import replace

from .base import ATTN, GGUF_TENSORS, Arch, Experts, LinearAttention

QWEN3_5 = Arch("qwen3_5_text", "Qwen3_5ForCausalLM", gguf_arch="qwen35", norm_offset=1.0,
               norms={"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm",
                      "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"},
               linear_attention=LinearAttention(), attn_gate=True, partial_rotary=True,
               rotary="transformers.models.qwen3_5.modeling_qwen3_5.Qwen3_5TextRotaryEmbedding",
               gguf={**GGUF_TENSORS, "mlp_norm": "ATTN_POST_NORM"},   # llama.cpp's qwen35 has no ffn_norm
               gguf_rope_sections=(11, 11, 10, 0))   # its converter's default, what the released configs say
QWEN3_5_MOE = replace(QWEN3_5, model_type="qwen3_5_moe_text", architecture="Qwen3_5MoeForCausalLM",
                      gguf_arch="qwen35moe", linears={r: f"self_attn.{r}" for r in ATTN},
                      rotary="transformers.models.qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeTextRotaryEmbedding",
                      moe=Experts(block="mlp", count_field="num_experts", width_field="moe_intermediate_size",
                                  renormalize=True, shared="shared_expert"))
QWEN3_NEXT = replace(QWEN3_5_MOE, model_type="qwen3_next", architecture="Qwen3NextForCausalLM", gguf_arch="qwen3next",
                     rotary="transformers.models.qwen3_next.modeling_qwen3_next.Qwen3NextRotaryEmbedding",
                     gguf_rope_sections=None,
                     gguf_refused="llmq does not write llama.cpp's qwen3next layout yet (grouped value heads, fused "
                                  "beta / alpha)",
                     moe=replace(QWEN3_5_MOE.moe, renormalize="norm_topk_prob"),
                     linear_attention=LinearAttention(
                         fused={"in_proj_qkvz": (("q", "in_proj_qkv"), ("k", "in_proj_qkv"), ("v", "in_proj_qkv"),
                                                 ("z", "in_proj_z")),
                                "in_proj_ba": (("b", "in_proj_b"), ("a", "in_proj_a"))},
                         kept_16bit=("in_proj_ba",), units=(("in_proj_qkvz",), ("out_proj",)),
                         feeds=(("attn_norm", ("in_proj_qkvz", "in_proj_ba")),)))
