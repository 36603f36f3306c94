"""The Llama family as Hugging Face writes it: Llama 2/3, SmolLM2 (`llama`), Mistral, Qwen2. RMSNorm, RoPE, SwiGLU,
GQA, optional tied embeddings; they differ in their defaults (Qwen2's q/k/v biases), in which layers slide and in how
llama.cpp names the family."""

from .base import Arch

LLAMA = Arch("llama", "LlamaForCausalLM", gguf_arch="llama", gguf_permutes_qk=True)
MISTRAL = Arch("mistral", "MistralForCausalLM", gguf_arch="llama", gguf_permutes_qk=True, window="all")
QWEN2 = Arch("qwen2", "Qwen2ForCausalLM", gguf_arch="qwen2", window="layer_types", qkv_bias=True,
             gguf_ffn_scale=False)
