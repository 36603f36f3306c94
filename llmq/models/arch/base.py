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
# sharding plan's: "q" (the rank's query heads), "q_proj" (the same, with each head's output gate where the family has
# one), "kv" (its KV heads), "mlp" (its MLP columns).
SPLIT = {"q_proj": ("rows", "q_proj"), "k_proj": ("rows", "kv"), "v_proj": ("rows", "kv"), "o_proj": ("cols", "q"),
         "gate_proj": ("rows", "mlp"), "up_proj": ("rows", "mlp"), "down_proj": ("cols", "mlp"),
         # a Gated DeltaNet layer's: by value heads, each with its key head ("linear_qkv": the rank's q, k and v
         # channels; "linear_v": its value heads' rows; "linear_heads": one row per value head)
         "in_proj_qkv": ("rows", "linear_qkv"), "in_proj_z": ("rows", "linear_v"),
         "in_proj_b": ("rows", "linear_heads"), "in_proj_a": ("rows", "linear_heads"), "out_proj": ("cols", "linear_v")}

# A Gated DeltaNet (linear-attention) layer's linears, by role (Qwen3.5's names): q / k / v into the short
# convolution as one, the output gate z, the per-head rates b (beta) and a (decay), the output.
LINEAR_ATTN = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")

# A mixture-of-experts layer's linears beyond attention: the router (replicated on every rank and never quantized:
# a rounded router picks other experts) and each expert's MLP, split like a dense MLP over its own width ("moe").
ROUTER = "router"
# A shared expert's (Experts.shared): its MLP, every token's, split like a dense MLP over its own width ("shared"), and
# the linear whose sigmoid scales its output per token (one output row: replicated and kept 16-bit like the router).
SHARED_GATE = "shared_expert_gate"


def expert_role(e: int, role: str) -> str:
    """The role of expert e's linear `role` (gate_proj / up_proj / down_proj): "experts.<e>.<role>"."""
    return f"experts.{e}.{role}"


def shared_role(role: str) -> str:
    """The role of the shared expert's linear `role` (gate_proj / up_proj / down_proj): "shared_expert.<role>"."""
    return f"shared_expert.{role}"


def split_of(role: str) -> tuple[str, str | None]:
    """How a role splits across ranks (SPLIT's form; ("replicated", None) for the router and the shared expert's
    gate)."""
    if role in (ROUTER, SHARED_GATE):
        return "replicated", None
    if role.startswith(("experts.", "shared_expert.")):
        return SPLIT[role.rpartition(".")[2]][0], "moe" if role.startswith("experts.") else "shared"
    return SPLIT[role]


# A stacked mixture of experts' tensors under its experts' module (Experts.stacked): each weight [experts, in,
# rows] (x @ it) with the roles whose rows it holds, interleaved (gate_up_proj: expert e's gate column r, then its up
# column r), and beside it `<weight>_bias` [experts, rows]
STACKED = (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",)))

# The embedding table and the output head: named so by every Hugging Face *ForCausalLM decoder llmq reads.
EMBEDDING = "model.embed_tokens"
LM_HEAD = "lm_head"

_LLAMA_LINEARS = {r: f"self_attn.{r}" for r in ATTN} | {r: f"mlp.{r}" for r in MLP}
_LLAMA_NORMS = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}
# llama.cpp's tensor of each role (gguf-py's MODEL_TENSOR member names).
GGUF_TENSORS = {"q_proj": "ATTN_Q", "k_proj": "ATTN_K", "v_proj": "ATTN_V", "o_proj": "ATTN_OUT",
                "gate_proj": "FFN_GATE", "up_proj": "FFN_UP", "down_proj": "FFN_DOWN", "attn_norm": "ATTN_NORM",
                "mlp_norm": "FFN_NORM", "q_norm": "ATTN_Q_NORM", "k_norm": "ATTN_K_NORM",
                "attn_out_norm": "ATTN_POST_NORM", "mlp_out_norm": "FFN_POST_NORM", "qkv_proj": "ATTN_QKV",
                "gate_up_proj": "FFN_UP"}


@dataclass(frozen=True)
class Experts:
    """A sparse MoE MLP: `top_k` of `count` expert MLPs (SwiGLU each) per token, weighted by the router's softmax
    over all experts, renormalized over the chosen ones where `renormalize` (True, or the config field saying so);
    where `shared` names one, plus a shared expert every token takes, its output scaled by sigmoid(shared_gate(x))."""

    block: str                    # the MoE module in a checkpoint's layer
    count_field: str              # config fields: number of experts, experts per token, an expert's MLP width
    width_field: str
    renormalize: bool | str       # always, or the config's boolean field
    router: str = "gate"          # the router linear, inside the block
    experts: str = "experts"      # the experts' list, inside the block
    names: dict[str, str] = field(default_factory=lambda: {r: r for r in MLP})  # role -> an expert's linear
    top_k_field: str = "num_experts_per_tok"
    module: str | None = None     # the block's attribute in transformers' layer, where it differs from `block`
    # llama.cpp's merged 3-D expert tensors (gguf-py MODEL_TENSOR members) of each role, and the router's
    gguf: dict[str, str] = field(default_factory=lambda: {"gate_proj": "FFN_GATE_EXP", "up_proj": "FFN_UP_EXP",
                                                          "down_proj": "FFN_DOWN_EXP", ROUTER: "FFN_GATE_INP"})
    # the shared expert: its SwiGLU MLP inside the block (Llama's linear names), its width's config field, its gate
    # linear inside the block
    shared: str | None = None
    shared_width_field: str = "shared_expert_intermediate_size"
    shared_gate: str = SHARED_GATE
    # llama.cpp's tensors of the shared expert's roles (gguf-py MODEL_TENSOR members)
    gguf_shared: dict[str, str] = field(default_factory=lambda: {
        "gate_proj": "FFN_GATE_SHEXP", "up_proj": "FFN_UP_SHEXP", "down_proj": "FFN_DOWN_SHEXP",
        SHARED_GATE: "FFN_GATE_INP_SHEXP"})
    # the checkpoint holds a layer's experts as the STACKED tensors under `experts` (GPT-OSS). The reader cuts them
    # into each expert's linears (with biases); llmq's own artifacts store those apart
    stacked: bool = False
    biased: bool = False          # the router and every expert's linears have biases (GPT-OSS)
    # transformers' layer unpacks its MoE block's output as (hidden states, router scores) (GPT-OSS)
    returns_scores: bool = False

    def stacked_paths(self) -> dict[str, tuple[str, ...]]:
        """Each STACKED weight's and bias's path inside a layer -> the roles whose rows it holds."""
        at = f"{self.block}.{self.experts}"
        return {f"{at}.{name}{suffix}": roles for name, roles in STACKED for suffix in ("", "_bias")}


@dataclass(frozen=True)
class LinearAttention:
    """The layers config.json's `layer_types` marks "linear_attention" mix tokens by the gated delta rule over a
    recurrent state (runtime.layers.delta_rule) in place of attention: q / k / v pass a depthwise causal convolution
    (its last kernel - 1 inputs kept per sequence), q and k are L2-normalized, beta = sigmoid(b), the decay
    g = -exp(A_log) softplus(a + dt_bias), and the output is RMS-normalized per value head (weight as stored), times
    silu(z), into out_proj. The layers marked "full_attention" attend over the paged KV cache."""

    module: str = "linear_attn"   # its module in a layer; its linears are LINEAR_ATTN under it
    # config fields: key / value heads and their widths, the convolution's kernel
    key_heads: str = "linear_num_key_heads"
    value_heads: str = "linear_num_value_heads"
    key_dim: str = "linear_key_head_dim"
    value_dim: str = "linear_value_head_dim"
    kernel: str = "linear_conv_kernel_dim"
    # its other parameters, kept 16-bit by every stage: the convolution, the decay's log rate and bias, the norm
    tensors: tuple[str, ...] = ("conv1d.weight", "A_log", "dt_bias", "norm.weight")
    # how tensor parallelism cuts them (the rest stay whole): by the convolution's channels (in_proj_qkv's rows), by
    # value heads
    channel_tensors: tuple[str, ...] = ("conv1d.weight",)
    head_tensors: tuple[str, ...] = ("A_log", "dt_bias")
    writers: tuple[str, ...] = ("out_proj",)   # Arch.writers' sense: the linears whose output joins the residual stream
    # linears kept 16-bit too: b and a, one row per value head, set beta (a sigmoid) and the decay (an exponential)
    # that every later token's state compounds, for a few hundredths of the layer's bytes
    kept_16bit: tuple[str, ...] = ("in_proj_b", "in_proj_a")
    # Arch.feeds of its layers: the input norm feeds q / k / v and z, and b and a, which then carry the scale
    # unquantized as a MoE router does (out_proj's input comes through the gated norm, which no factor passes)
    feeds: tuple[tuple[str, tuple[str, ...]], ...] = (
        ("attn_norm", ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")),)
    # linears the checkpoint stores fused and interleaved by key head (Qwen3-Next's in_proj_qkvz, in_proj_ba):
    # group -> the parts of one key head's rows in order, each (part, the role it belongs to). A part's rows per
    # key head: q and k one key head's (key_dim), v and z its value heads' (value heads / key heads x value_dim),
    # b and a one row per value head. A role's rows are its parts', each over every key head in turn. The reader
    # cuts them into roles; quantization and the artifact keep the group (feeds, units and kept_16bit name it)
    fused: dict[str, tuple[tuple[str, str], ...]] = field(default_factory=dict)
    # the quantized linears one input feeds (Arch.units' sense): q / k / v and the gate z, then the output
    units: tuple[tuple[str, ...], ...] = (("in_proj_qkv", "in_proj_z"), ("out_proj",))
    # llama.cpp's tensors (gguf-py MODEL_TENSOR members) of the linears, and of the others with their name's suffix
    gguf_linears: dict[str, str] = field(default_factory=lambda: {
        "in_proj_qkv": "ATTN_QKV", "in_proj_z": "ATTN_GATE", "in_proj_b": "SSM_BETA", "in_proj_a": "SSM_ALPHA",
        "out_proj": "SSM_OUT"})
    gguf_tensors: dict[str, tuple[str, str]] = field(default_factory=lambda: {
        "conv1d.weight": ("SSM_CONV1D", ".weight"), "A_log": ("SSM_A", ""), "dt_bias": ("SSM_DT", ".bias"),
        "norm.weight": ("SSM_NORM", ".weight")})


@dataclass(frozen=True)
class PerLayerInputs:
    """Gemma 4's per-layer inputs: a second embedding table holds, for every token, a small vector for each layer
    (`size` wide, all layers' side by side), added to a projection of the token's embedding (scaled by hidden^-1/2,
    RMS-normalized per layer) and scaled by 2^-1/2. After its MLP each layer mixes its vector in: the residual stream
    through `gate` (an activation, times the vector), `proj` back to the hidden width, `norm`, added to the stream."""

    table: str = "model.embed_tokens_per_layer"        # [vocab_field, layers x size], scaled by size^1/2
    projection: str = "model.per_layer_model_projection"   # [layers x size, hidden]
    projection_norm: str = "model.per_layer_projection_norm"   # [size]
    gate: str = "per_layer_input_gate"                 # in a layer: [size, hidden]
    proj: str = "per_layer_projection"                 # [hidden, size]
    norm: str = "post_per_layer_input_norm"            # [hidden]
    size_field: str = "hidden_size_per_layer_input"    # config fields: the vector's width (0: none), the table's rows
    vocab_field: str = "vocab_size_per_layer_input"


@dataclass(frozen=True)
class Arch:
    model_type: str               # config.json's model_type
    architecture: str             # the Hugging Face class
    gguf_arch: str                # llama.cpp's general.architecture
    # llama.cpp's `llama` architecture rotates adjacent pairs (2i, 2i+1) where Hugging Face rotates (i, i + d/2): its
    # converter reorders the q and k rows of every head, and so does llmq's GGUF export
    gguf_permutes_qk: bool = False
    # whether llama.cpp's graph applies a dense FFN matrix's optional `.scale` tensor (NVFP4's global scale): its
    # qwen2 / phi3 / gemma3 graphs build the FFN without it (src/models/<arch>.cpp passes NULL), so an NVFP4 FFN
    # matrix there would compute g (~1e3-1e5) times too large (llmq's Gemma 3 NVFP4 file scored NaN)
    gguf_ffn_scale: bool = True
    # the M-RoPE sections llama.cpp's graph requires (rope.dimension_sections; text positions are one value on
    # every axis, so they rotate as plain RoPE), None where it takes none
    gguf_rope_sections: tuple[int, ...] | None = None
    # which layers slide: "none" (none do), "all" (config.sliding_window, when set, for every layer), "layer_types"
    # (one window for every layer, where transformers' layer_types says sliding_attention), "per_layer" (the
    # layer_types' sliding layers use the window and their own rotary table, the others attend fully: Gemma 3)
    window: str = "none"
    # the MLP's activation: "silu" (SwiGLU), "gelu_tanh" (GeGLU, tanh-approximated gelu) or "clamped_swiglu"
    # (GPT-OSS: gate clamped above and up on both sides at swiglu_limit, gate x sigmoid(swiglu_alpha x gate) x (up
    # + 1)), and the config field and values that say so (others are refused)
    activation: str = "silu"
    activation_field: tuple[str, tuple[str, ...]] = ("hidden_act", ("silu", "swish"))
    norm_offset: float = 0.0      # RMSNorm multiplies by (norm_offset + weight): Gemma stores w for a (1 + w) scale
    embed_scale: bool = False     # token embeddings are multiplied by sqrt(hidden_size) (Gemma)
    # transformers' rotary-embedding class when each layer type has its own table (Gemma 3); None: Llama's one table
    rotary: str | None = None
    local_rotary: bool = True     # the local layers (window "per_layer") have their own rotary table (Gemma 3)
    # the path in a layer of each attention head's learned sink logit, a softmax term with no value (GPT-OSS)
    sinks: str | None = None
    qkv_bias: bool = False        # attention_bias's default where config.json does not say
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
    gguf: dict[str, str] = field(default_factory=lambda: dict(GGUF_TENSORS))
    # (producer, consumers): the producer's output is the consumers' input, so a per-channel factor can move from one
    # to the other (AWQ, SmoothQuant): a norm before the linears it feeds, or v_proj before o_proj
    feeds: tuple[tuple[str, tuple[str, ...]], ...] = (
        ("attn_norm", ("q_proj", "k_proj", "v_proj")), ("v_proj", ("o_proj",)),
        ("mlp_norm", ("gate_proj", "up_proj")), ("up_proj", ("down_proj",)))
    # the linears whose output is added to the residual stream (a rotation of the stream turns their rows: --rotate)
    writers: tuple[str, ...] = ("o_proj", "down_proj")
    # why no rotation of the residual stream can be folded into this family's weights (None: --rotate folds one)
    rotation_refused: str | None = None
    # linears one input feeds and engines fuse into one matmul: one quantization width each (mixed precision)
    units: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"),
                                          ("down_proj",))
    moe: Experts | None = None    # every layer's MLP is a mixture of experts (no dense MLP roles then)
    # the config field saying, per layer, whether it applies the rotary embedding (1) or attends without it (0:
    # NoPE, SmolLM3); None: every layer rotates
    rope_layers: str | None = None
    # why `build --target trtllm` refuses this family (None: it writes it)
    trtllm_refused: str | None = None
    gguf_refused: str | None = None   # why `build --target gguf` refuses this family (None: it writes it)
    linear_attention: LinearAttention | None = None  # hybrid: some layers are Gated DeltaNet layers
    # q_proj holds each head's query and then its output gate (2 x head_dim rows a head): the attention's output is
    # multiplied by sigmoid(gate) before o_proj (Qwen3.5, Qwen3-Next)
    attn_gate: bool = False
    partial_rotary: bool = False  # the rotary embedding may turn only the first partial_rotary_factor of a head
    # Gemma 4: the global (full-attention) layers' own head width and KV heads (the config's per_layer_config), the
    # last layers reading an earlier layer's KV cache (num_kv_shared_layers), values RMS-normalized without a weight,
    # a fixed softmax scale (1: the q / k norms stand in for it), a learned scalar on each layer's output (its path),
    # the per-layer inputs
    per_layer_heads: bool = False
    kv_sharing: bool = False
    v_norm: bool = False
    attention_scale: float | None = None
    layer_scalar: str | None = None
    per_layer_inputs: PerLayerInputs | None = None
    # the quantize methods the family takes where not all (mixed precision refused with them), and why build does
    # not write it yet (None: it does)
    quantize_methods: tuple[str, ...] | None = None
    build_refused: str | None = None

    def prefix(self, i: int) -> str:
        return f"{self.layers}.{i}"

    def linear(self, i: int, role: str) -> str:
        """The module name of layer i's linear `role` (its tensors are <name>.weight, <name>.bias, ...)."""
        return f"{self.prefix(i)}.{self.path(role)}"

    def roles(self, experts: int = 0, linear: bool = False) -> tuple[str, ...]:
        """A layer's linear roles: attention (or, `linear`, a Gated DeltaNet's) and the MLP, or attention, the router
        and each of `experts` experts'."""
        mixer = LINEAR_ATTN if linear else ATTN
        if self.moe is None:
            return mixer + MLP
        shared = tuple(shared_role(r) for r in MLP) + (SHARED_GATE,) if self.moe.shared else ()
        return mixer + (ROUTER,) + tuple(expert_role(e, r) for e in range(experts) for r in MLP) + shared

    def _expand(self, roles: tuple[str, ...], experts: int) -> list[tuple[str, ...]]:
        """A group of dense MLP roles as it is in this family: once per expert (and for the shared expert) in a MoE
        layer."""
        if self.moe is None or not set(roles) & set(MLP):
            return [roles]
        shared = [tuple(shared_role(r) for r in roles)] if self.moe.shared else []
        return [tuple(expert_role(e, r) for r in roles) for e in range(experts)] + shared

    def groups(self, linear: bool = False) -> tuple[str, ...]:
        """The fused groups a layer stores (`linear`: a Gated DeltaNet layer): the family's (Arch.fused) and its
        Gated DeltaNet layers' (LinearAttention.fused)."""
        return tuple(self.fused) + (tuple(self.linear_attention.fused) if linear else ())

    def group_roles(self, group: str) -> tuple[str, ...]:
        """The roles a stored fused group holds, in order."""
        if group in self.fused:
            return self.fused[group][1]
        return tuple(dict.fromkeys(r for _, r in self.linear_attention.fused[group]))

    def stored_linears(self, experts: int = 0, linear: bool = False) -> dict[str, str]:
        """The linears of a layer (`linear`: a Gated DeltaNet layer) as the checkpoint (and transformers' layer) holds
        them: name (a role, or a fused group) -> path in the layer. Stacked experts (Experts.stacked) are no linears
        there."""
        groups = self.groups(linear)
        grouped = {r for g in groups for r in self.group_roles(g)}
        stacked = self.moe is not None and self.moe.stacked
        return {g: self.path(g) for g in groups} | \
            {r: self.path(r) for r in self.roles(experts, linear)
             if r not in grouped and not (stacked and r.startswith("experts."))}

    def linear_names(self, i: int, experts: int = 0, linear: bool = False) -> list[str]:
        """Layer i's linears' module names as the checkpoint stores them (`linear`: it is a Gated DeltaNet layer)."""
        return [f"{self.prefix(i)}.{p}" for p in self.stored_linears(experts, linear).values()]

    def role_modules(self, module: str) -> list[str]:
        """The role linears a full module name holds: a stored fused group's roles' names, else the module itself
        (for what names modules when the roles are stored apart)."""
        for g in self.groups(self.linear_attention is not None):
            if module.endswith("." + self.path(g)):
                base = module[:-len(self.path(g))]
                return [base + self.path(r) for r in self.group_roles(g)]
        return [module]

    def norm(self, i: int, role: str) -> str:
        """The tensor name of layer i's norm `role`."""
        return f"{self.prefix(i)}.{self.norms[role]}.weight"

    def attention_module(self, i: int) -> str:
        return f"{self.prefix(i)}.{self.attention}"

    def path(self, role: str) -> str:
        """A linear's (a role's or a fused group's) or a norm's module path inside a layer."""
        m = self.moe
        if m is not None and role == ROUTER:
            return f"{m.block}.{m.router}"
        if m is not None and role.startswith("experts."):
            _, e, r = role.split(".")
            return f"{m.block}.{m.experts}.{e}.{m.names[r]}"
        if m is not None and m.shared and role == SHARED_GATE:
            return f"{m.block}.{m.shared_gate}"
        if m is not None and m.shared and role.startswith("shared_expert."):
            return f"{m.block}.{m.shared}.{role.rpartition('.')[2]}"
        if self.linear_attention is not None and (role in LINEAR_ATTN or role in self.linear_attention.fused):
            return f"{self.linear_attention.module}.{role}"
        return self.linears.get(role) or (self.fused[role][0] if role in self.fused else self.norms[role])

    def feed_roles(self, experts: int = 0, linear: bool = False) -> list[tuple[str, tuple[str, ...]]]:
        """`feeds` by role (`linear`: of a Gated DeltaNet layer, whose mixer has its own), a MoE layer's MLP norm
        feeding every expert's gate / up (and the router and a shared expert's gate, whose weights then carry the
        scale unquantized) and each expert's up feeding its down."""
        feeds = self.feeds
        if linear:
            feeds = self.linear_attention.feeds + tuple(f for f in feeds if not set(f[1]) & set(ATTN))
        out = []
        for p, cons in feeds:
            if self.moe is not None and p in MLP:
                out += [(f[0], f[1:]) for f in self._expand((p, *cons), experts)]
            elif self.moe is not None and set(cons) & set(MLP):
                gates = (ROUTER, SHARED_GATE) if self.moe.shared else (ROUTER,)
                out.append((p, tuple(r for g in self._expand(cons, experts) for r in g) + gates))
            else:
                out.append((p, cons))
        return out

    def writer_paths(self, experts: int = 0, linear: bool = False) -> list[str]:
        """`writers` as module paths inside a layer (`linear`: a Gated DeltaNet layer's, whose mixer has its own): a
        MoE layer's every expert's and the shared expert's."""
        roles = tuple(r for r in self.writers if not (linear and r in ATTN))
        roles += self.linear_attention.writers if linear else ()
        return [self.path(r) for role in roles for g in self._expand((role,), experts) for r in g]

    def feed_paths(self, experts: int = 0, linear: bool = False) -> list[tuple[str, bool, tuple[str, ...]]]:
        """`feeds` as module paths inside a layer: (producer, whether it is a norm, consumers)."""
        return [(self.path(p), p in self.norms, tuple(self.path(c) for c in cons))
                for p, cons in self.feed_roles(experts, linear)]

    def unit_roles(self, experts: int = 0) -> list[tuple[str, ...]]:
        """`units` by role; a MoE layer's MLP units once per expert (the router is no unit: it stays 16-bit); a
        hybrid family's Gated DeltaNet units too (a layer has the units of one kind or the other: callers take those
        whose linears the layer has)."""
        linear = self.linear_attention.units if self.linear_attention is not None else ()
        return [u for unit in self.units for u in self._expand(unit, experts)] + list(linear)

    def gguf_drops_scale(self, roles: tuple[str, ...]) -> bool:
        """Whether llama.cpp's graph leaves out NVFP4's global scale of a linear of these roles (gguf_ffn_scale)."""
        return not self.gguf_ffn_scale and any(self.gguf.get(r, "").startswith("FFN_") for r in roles)

    def unit_paths(self, experts: int = 0) -> list[tuple[str, ...]]:
        return [tuple(self.path(r) for r in unit) for unit in self.unit_roles(experts)]
