"""Gemma 4 text models (`Gemma4ForCausalLM`, model_type gemma4_text): Gemma 3's layer (four RMSNorms, q / k norms,
GeGLU, sliding layers beside global ones, embeddings scaled by sqrt(hidden), capped logits), with
- norms that multiply by w (not 1 + w), values RMS-normalized without a weight, and a softmax scale of 1;
- global layers of their own head width (and, with attention_k_eq_v, their own KV heads and no v_proj: the values
  are the keys before their norm), rotated by a "proportional" table over a quarter of the head;
- KV sharing: the last num_kv_shared_layers layers have no k / v projections and read the KV cache of the last
  earlier layer of their kind (with use_double_wide_mlp their MLP is twice as wide);
- per-layer inputs (base.PerLayerInputs) and a learned scalar on each layer's output.
llama.cpp calls it `gemma4`. Quantize takes it by the methods that move no factor through its norms
(quantize_methods: not AWQ / SmoothQuant, whose v_proj -> o_proj fold the values' norm breaks), one scheme for every
linear; quantize-kv calibrates the caches kept (not the sharing layers'); build refuses it in one line
(build_refused)."""

from .base import Arch, PerLayerInputs

GEMMA4 = Arch("gemma4_text", "Gemma4ForCausalLM", gguf_arch="gemma4", window="per_layer", activation="gelu_tanh",
              activation_field=("hidden_activation", ("gelu_pytorch_tanh",)), embed_scale=True,
              rotary="transformers.models.gemma4.modeling_gemma4.Gemma4TextRotaryEmbedding",
              norms={"attn_norm": "input_layernorm", "attn_out_norm": "post_attention_layernorm",
                     "mlp_norm": "pre_feedforward_layernorm", "mlp_out_norm": "post_feedforward_layernorm",
                     "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm",
                     "ple_norm": "post_per_layer_input_norm"},
              per_layer_heads=True, kv_sharing=True, v_norm=True, attention_scale=1.0, layer_scalar="layer_scalar",
              per_layer_inputs=PerLayerInputs(),
              quantize_methods=("rtn", "gptq", "fp8", "nvfp4", "mxfp4"),
              build_refused="build does not write its per-layer head widths, shared KV caches and per-layer "
                            "inputs yet",
              rotation_refused="its norms after attention and after the MLP scale each branch's output channel by "
                               "channel before it joins the residual stream, and no rotation of the stream passes "
                               "them")
