"""GPT-OSS (`GptOssForCausalLM`, model_type gpt_oss): Llama's pre-norm layer with biases on all four attention
linears, a learned sink logit per attention head (a softmax term that takes probability and adds no value), sliding
layers (layer_types: every other one by default) beside full ones under one rotary table (YaRN in the released
models), and a mixture of experts for every MLP: a router with a bias whose top-k logits are softmaxed (the full
softmax renormalized over the chosen ones: the same weights), experts with biases and a clamped SwiGLU
(Arch.activation "clamped_swiglu"), stored stacked (Experts.stacked). llama.cpp calls it `gpt-oss` (its graph
`openai-moe`), with the sinks as attn_sinks and the norm before the MLP as post_attention_norm."""

from .base import ATTN, GGUF_TENSORS, Arch, Experts

GPT_OSS = Arch("gpt_oss", "GptOssForCausalLM", gguf_arch="gpt-oss", window="per_layer", local_rotary=False,
               activation="clamped_swiglu", qkv_bias=True, sinks="self_attn.sinks",
               rotary="transformers.models.gpt_oss.modeling_gpt_oss.GptOssRotaryEmbedding",
               linears={r: f"self_attn.{r}" for r in ATTN},
               moe=Experts(block="mlp", router="router", count_field="num_local_experts",
                           width_field="intermediate_size", renormalize=True, stacked=True, biased=True,
                           returns_scores=True),
               gguf={**GGUF_TENSORS, "mlp_norm": "ATTN_POST_NORM", "sinks": "ATTN_SINKS"},
               trtllm_refused="llmq does not write TensorRT-LLM's GPT-OSS checkpoint yet")
