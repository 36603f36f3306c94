"""What an architecture family is, stated once as data: every stage reads its family's `Arch`, none spells a tensor
name. The vocabulary inside llmq is the roles below (a layer's linears and norms); each family says what its
checkpoint calls them, which norm feeds which linears, how each linear splits for tensor parallelism, and what each
export calls them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# A decoder layer's linears, by role (llmq's internal names; Llama's Hugging Face names happen to match).
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
LINEARS = ATTN + MLP

# How each linear splits across tensor-parallel ranks: (kept axis, index set). "rows": column-parallel, the rank keeps
# output rows; "cols": row-parallel, the rank keeps input columns and the outputs are summed. The index sets are the
# sharding plan's: "q" (the rank's query heads), "kv" (its KV heads), "mlp" (its MLP columns).
SPLIT = {"q_proj": ("rows", "q"), "k_proj": ("rows", "kv"), "v_proj": ("rows", "kv"), "o_proj": ("cols", "q"),
         "gate_proj": ("rows", "mlp"), "up_proj": ("rows", "mlp"), "down_proj": ("cols", "mlp")}

# The embedding table and the output head: named so by every Hugging Face *ForCausalLM decoder llmq reads.
EMBEDDING = "model.embed_tokens"
LM_HEAD = "lm_head"

_LLAMA_LINEARS = {r: f"self_attn.{r}" for r in ATTN} | {r: f"mlp.{r}" for r in MLP}
_LLAMA_NORMS = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}
# llama.cpp's tensor of each role (gguf-py's MODEL_TENSOR member names).
_GGUF = {"q_proj": "ATTN_Q", "k_proj": "ATTN_K", "v_proj": "ATTN_V", "o_proj": "ATTN_OUT", "gate_proj": "FFN_GATE",
         "up_proj": "FFN_UP", "down_proj": "FFN_DOWN", "attn_norm": "ATTN_NORM", "mlp_norm": "FFN_NORM",
         "q_norm": "ATTN_Q_NORM", "k_norm": "ATTN_K_NORM", "attn_out_norm": "ATTN_POST_NORM",
         "mlp_out_norm": "FFN_POST_NORM", "qkv_proj": "ATTN_QKV", "gate_up_proj": "FFN_UP"}


@dataclass(frozen=True)
class Arch:
    model_type: str               # config.json's model_type
    architecture: str             # the Hugging Face class
    gguf_arch: str                # llama.cpp's general.architecture
    # llama.cpp's `llama` architecture rotates adjacent pairs (2i, 2i+1) where Hugging Face rotates (i, i + d/2): its
    # converter reorders the q and k rows of every head, and so does llmq's GGUF export
    gguf_permutes_qk: bool = False
    # which layers slide: "none" (none do), "all" (config.sliding_window, when set, for every layer), "layer_types"
    # (one window for every layer, where transformers' layer_types says sliding_attention), "per_layer" (the
    # layer_types' sliding layers use the window and their own rotary table, the others attend fully: Gemma 3)
    window: str = "none"
    # the MLP's activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, tanh-approximated gelu), and the config field
    # and values that say so (others are refused)
    activation: str = "silu"
    activation_field: tuple[str, tuple[str, ...]] = ("hidden_act", ("silu", "swish"))
    norm_offset: float = 0.0      # RMSNorm multiplies by (norm_offset + weight): Gemma stores w for a (1 + w) scale
    embed_scale: bool = False     # token embeddings are multiplied by sqrt(hidden_size) (Gemma)
    # transformers' rotary-embedding class when each layer type has its own table (Gemma 3); None: Llama's one table
    rotary: str | None = None
    qkv_bias: bool = False        # attention_bias's default where config.json does not say
    # the legacy TensorRT-LLM checkpoint's config keys beyond the Llama ones; None: that checkpoint is not written
    trtllm_legacy: dict | None = None
    final_norm: str = "model.norm"
    layers: str = "model.layers"
    attention: str = "self_attn"  # the attention module of a layer (KV-cache scales are stored under it)
    linears: dict[str, str] = field(default_factory=lambda: dict(_LLAMA_LINEARS))  # role -> path in a layer
    # linears the checkpoint stores fused, as Phi-3 does: group -> (path in a layer, its roles in row order). The
    # reader cuts them into their roles (the runtime, the plan and the targets work on roles); quantization runs
    # transformers' layer, so it quantizes, and the artifact stores, the group as one linear. `feeds` and `units`
    # name the group where its roles cannot be told apart. llmq's own rank directories store the roles apart under
    # `linears`' paths
    fused: dict[str, tuple[str, tuple[str, ...]]] = field(default_factory=dict)
    norms: dict[str, str] = field(default_factory=lambda: dict(_LLAMA_NORMS))  # role -> path in a layer
    gguf: dict[str, str] = field(default_factory=lambda: dict(_GGUF))
    # (producer, consumers): the producer's output is the consumers' input, so a per-channel factor can move from one
    # to the other (AWQ, SmoothQuant): a norm before the linears it feeds, or v_proj before o_proj
    feeds: tuple[tuple[str, tuple[str, ...]], ...] = (
        ("attn_norm", ("q_proj", "k_proj", "v_proj")), ("v_proj", ("o_proj",)),
        ("mlp_norm", ("gate_proj", "up_proj")), ("up_proj", ("down_proj",)))
    # linears one input feeds and engines fuse into one matmul: one quantization width each (mixed precision)
    units: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"),
                                          ("down_proj",))

    def prefix(self, i: int) -> str:
        return f"{self.layers}.{i}"

    def linear(self, i: int, role: str) -> str:
        """The module name of layer i's linear `role` (its tensors are <name>.weight, <name>.bias, ...)."""
        return f"{self.prefix(i)}.{self.linears[role]}"

    def stored_linears(self) -> dict[str, str]:
        """The linears of a layer as the checkpoint (and transformers' layer) holds them: name (a role, or a fused
        group) -> path in the layer."""
        grouped = {r for _, roles in self.fused.values() for r in roles}
        return {g: path for g, (path, _) in self.fused.items()} | \
            {r: p for r, p in self.linears.items() if r not in grouped}

    def linear_names(self, i: int) -> list[str]:
        """Layer i's linears' module names as the checkpoint stores them."""
        return [f"{self.prefix(i)}.{p}" for p in self.stored_linears().values()]

    def role_modules(self, module: str) -> list[str]:
        """The role linears a full module name holds: a stored fused group's roles' names, else the module itself
        (for what names modules when the roles are stored apart)."""
        for path, roles in self.fused.values():
            if module.endswith("." + path):
                base = module[:-len(path)]
                return [base + self.linears[r] for r in roles]
        return [module]

    def norm(self, i: int, role: str) -> str:
        """The tensor name of layer i's norm `role`."""
        return f"{self.prefix(i)}.{self.norms[role]}.weight"

    def attention_module(self, i: int) -> str:
        return f"{self.prefix(i)}.{self.attention}"

    def path(self, role: str) -> str:
        """A linear's (a role's or a fused group's) or a norm's module path inside a layer."""
        return self.linears.get(role) or (self.fused[role][0] if role in self.fused else self.norms[role])

    def feed_paths(self) -> list[tuple[str, bool, tuple[str, ...]]]:
        """`feeds` as module paths inside a layer: (producer, whether it is a norm, consumers)."""
        return [(self.path(p), p in self.norms, tuple(self.path(c) for c in cons)) for p, cons in self.feeds]

    def unit_paths(self) -> list[tuple[str, ...]]:
        return [tuple(self.path(r) for r in unit) for unit in self.units]
