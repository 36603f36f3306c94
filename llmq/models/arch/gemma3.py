"""Gemma 3 text models (`Gemma3ForCausalLM`, model_type gemma3_text): four RMSNorms a layer (before and after
attention, before and after the MLP), each scaling by (1 + w); per-head q/k norms; token embeddings scaled by
sqrt(hidden); GeGLU with tanh-approximated gelu; sliding-window layers (layer_types, five local to one global) with
their own rotary base; attention scaled by query_pre_attn_scalar^-1/2. The MLP is fed by pre_feedforward_layernorm,
which is therefore what AWQ and SmoothQuant fold into. llama.cpp calls it `gemma3`."""

from .base import Arch

GEMMA3 = Arch("gemma3_text", "Gemma3ForCausalLM", gguf_arch="gemma3", gguf_ffn_scale=False, window="per_layer",
              activation="gelu_tanh",
              activation_field=("hidden_activation", ("gelu_pytorch_tanh",)), norm_offset=1.0, embed_scale=True,
              rotary="transformers.models.gemma3.modeling_gemma3.Gemma3RotaryEmbedding",
              norms={"attn_norm": "input_layernorm", "attn_out_norm": "post_attention_layernorm",
                     "mlp_norm": "pre_feedforward_layernorm", "mlp_out_norm": "post_feedforward_layernorm",
                     "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"},
              rotation_refused="its norms after attention and after the MLP scale each branch's output channel by "
                               "channel before it joins the residual stream, and no rotation of the stream passes "
                               "them")
