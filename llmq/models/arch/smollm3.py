"""SmolLM3 (`SmolLM3ForCausalLM`): Llama's layer, but some layers attend without the rotary embedding (NoPE):
config.json's `no_rope_layers` holds 1 for a layer that rotates and 0 for one that does not (transformers derives
it from `no_rope_layer_interval`, every fourth layer by default). llama.cpp's `smollm3` hard-codes every fourth
layer; TensorRT-LLM's PyTorch backend has no SmolLM3 model."""

from .base import Arch

SMOLLM3 = Arch("smollm3", "SmolLM3ForCausalLM", gguf_arch="smollm3", gguf_permutes_qk=True,
               rope_layers="no_rope_layers", trtllm_refused="TensorRT-LLM's PyTorch backend has no SmolLM3 model")
