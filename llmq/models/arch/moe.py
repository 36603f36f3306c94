"""The mixture-of-experts families: every layer's MLP is `num_experts_per_tok` of many SwiGLU experts, chosen per
token by a linear router (base.Experts).

Qwen3-MoE (`Qwen3MoeForCausalLM`): Qwen3's attention (q/k norms, no biases), experts under `mlp.experts.<e>` with
Llama's names, the router `mlp.gate`; the chosen weights are renormalized where norm_topk_prob says. llama.cpp:
`qwen3moe`. Mixtral (`MixtralForCausalLM`): Mistral's attention, experts `block_sparse_moe.experts.<e>.w1 / w3 / w2`
(gate / up / down), always renormalized; transformers 5 names the block `mlp` in memory. llama.cpp: `llama` with
expert tensors."""

from .base import ATTN, Arch, Experts

_ATTENTION = {r: f"self_attn.{r}" for r in ATTN}  # the MLP's linears are the experts'

QWEN3_MOE = Arch("qwen3_moe", "Qwen3MoeForCausalLM", gguf_arch="qwen3moe", window="all", linears=_ATTENTION,
                 norms={"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm",
                        "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"},
                 moe=Experts(block="mlp", count_field="num_experts", width_field="moe_intermediate_size",
                             renormalize="norm_topk_prob"))
MIXTRAL = Arch("mixtral", "MixtralForCausalLM", gguf_arch="llama", gguf_permutes_qk=True, window="all",
               linears=_ATTENTION, moe=Experts(block="block_sparse_moe", module="mlp", count_field="num_local_experts",
                           width_field="intermediate_size", renormalize=True,
                           names={"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}))
