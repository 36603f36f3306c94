"""The architecture description every stage reads, derived from a Hugging Face config.json once its fields have
passed config_fields' checks (a field the runtime would compute otherwise than transformers is refused there)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import LlmqError
from .arch import ARCHS, ATTN, ROUTER, SHARED_GATE, Arch, arch_for, expert_role
from .arch.base import LINEAR_ATTN
from .config_fields import checked_hf_config, local_layers, window

if TYPE_CHECKING:
    import torch

# model_type -> architecture class, from the declarations (llmq.models.arch).
SUPPORTED_ARCHITECTURES = {t: a.architecture for t, a in ARCHS.items()}


def _linear_attention(arch: Arch, hf) -> dict:
    """ModelSpec's fields of a hybrid model's Gated DeltaNet layers (none for other families)."""
    la = arch.linear_attention
    if la is None:
        return {}
    kh, vh = int(getattr(hf, la.key_heads)), int(getattr(hf, la.value_heads))
    if kh < 1 or vh % kh:
        raise LlmqError(f"{hf.model_type} config: {la.value_heads}={vh} is not a multiple of {la.key_heads}={kh} "
                        "(each key head serves a whole group of value heads)")
    return dict(linear_layers=tuple(i for i, t in enumerate(hf.layer_types) if t == "linear_attention"),
                linear_key_heads=int(getattr(hf, la.key_heads)), linear_value_heads=int(getattr(hf, la.value_heads)),
                linear_key_dim=int(getattr(hf, la.key_dim)), linear_value_dim=int(getattr(hf, la.value_dim)),
                linear_kernel=int(getattr(hf, la.kernel)))


def _per_layer_heads(arch: Arch, hf, local: tuple[int, ...]) -> dict:
    """ModelSpec's Gemma 4 fields (none for other families): the global layers' geometry from per_layer_config, the
    layer each shared layer reads its KV cache from (transformers' kv_sharing_modes: the last earlier layer of its
    kind), the double-wide MLPs and the per-layer inputs."""
    out: dict = {}
    n = hf.num_hidden_layers
    glob = [i for i in range(n) if i not in local]
    if arch.per_layer_heads and glob:
        layer = hf.per_layer_config[glob[0]]
        out |= dict(global_head_dim=int(layer.head_dim), global_kv_heads=int(layer.num_key_value_heads),
                    k_eq_v=bool(hf.attention_k_eq_v))
    if arch.kv_sharing and hf.num_kv_shared_layers:
        first = n - hf.num_kv_shared_layers
        types = hf.layer_types
        source = [i if i < first else max(j for j in range(first) if types[j] == types[i]) for i in range(n)]
        out |= dict(kv_source=tuple(source), wide_mlp_layers=tuple(range(first, n)) if hf.use_double_wide_mlp else ())
    ple = arch.per_layer_inputs
    if ple is not None and getattr(hf, ple.size_field):
        out |= dict(ple_dim=int(getattr(hf, ple.size_field)), ple_vocab=int(getattr(hf, ple.vocab_field)))
    return out


def attends(q_pos, kv_pos, window: int | None):
    """Whether a query at q_pos sees the key at kv_pos (broadcasting tensors): causal and, with a window, only the
    last `window` positions including its own, as transformers' masking_utils.sliding_window_overlay draws it."""
    seen = kv_pos <= q_pos
    return seen & (kv_pos > q_pos - window) if window is not None else seen


@dataclass(frozen=True)
class ModelSpec:
    model_type: str
    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    rope_theta: float
    rope_scaling: dict | None
    rms_norm_eps: float
    attention_bias: bool
    max_position_embeddings: int
    sliding_window: int | None      # the window every layer uses (None: full attention)
    local_window: int | None = None  # Arch.window "per_layer": the window of the layers in local_layers
    local_layers: tuple[int, ...] = ()
    local_rope_theta: float | None = None  # the rotary base of the layers in local_layers (their own table; None:
    # the global one, Arch.local_rotary)
    attn_scale: float | None = None  # softmax scale of the attention scores; None: head_dim ** -0.5
    final_softcap: float | None = None  # logits = c * tanh(logits / c)
    num_experts: int = 0             # mixture of experts (Arch.moe): experts per layer (0: a dense MLP)
    experts_per_token: int = 0
    expert_size: int = 0             # an expert's MLP width
    renormalize: bool = False        # the chosen experts' weights are scaled to sum to 1
    shared_expert_size: int = 0      # the shared expert's MLP width (Experts.shared; 0: none)
    swiglu: tuple[float, float] | None = None  # (alpha, limit) of a clamped SwiGLU (Arch.activation)
    nope_layers: tuple[int, ...] = ()  # layers that attend without the rotary embedding (Arch.rope_layers)
    rotary_dim: int | None = None    # a partial rotary embedding turns the first rotary_dim of each head (None: all)
    # hybrid models (Arch.linear_attention): the Gated DeltaNet layers (the others attend), their key / value heads
    # and widths, their convolution's kernel
    linear_layers: tuple[int, ...] = ()
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_dim: int = 0
    linear_value_dim: int = 0
    linear_kernel: int = 0
    # a vision-language checkpoint's model_type (models.vision): its tower and projector sit beside this language
    # model, which is what the fields above describe
    vision: str | None = None
    # Gemma 4 (Arch.per_layer_heads, kv_sharing, per_layer_inputs): the global layers' head width and KV heads (None:
    # the others'), whether their values are their keys (no v_proj), the layer whose KV cache each layer reads (its
    # own, or an earlier one's: () when every layer has its own), the layers whose MLP is twice intermediate_size,
    # the per-layer inputs' width and table rows (0: none)
    global_head_dim: int | None = None
    global_kv_heads: int | None = None
    k_eq_v: bool = False
    kv_source: tuple[int, ...] = ()
    wide_mlp_layers: tuple[int, ...] = ()
    ple_dim: int = 0
    ple_vocab: int = 0

    @classmethod
    def from_config(cls, config: dict | str | Path) -> "ModelSpec":
        if not isinstance(config, dict):
            p = Path(config)
            p = p / "config.json" if p.is_dir() else p
            try:
                config = json.loads(p.read_text())
            except FileNotFoundError:
                raise LlmqError(f"{p}: no config.json (not a Hugging Face model directory)") from None
            except json.JSONDecodeError as e:
                raise LlmqError(f"{p}: config.json is not valid JSON ({e})") from None
        from .vision import is_multimodal, language_config

        vision = config.get("model_type") if is_multimodal(config) else None
        config = language_config(config)
        model_type = config.get("model_type")
        arch = arch_for(model_type, (config.get("architectures") or [model_type])[0])
        hf = checked_hf_config(config)
        try:
            heads = int(config["num_attention_heads"])
            hidden = int(config["hidden_size"])
            rope = config.get("rope_parameters") or {}
            rope = rope.get("full_attention", rope)  # per layer type (Gemma 3): the global layers' table
            rope_scaling = config.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default"
                                                          else None)
            local = local_layers(hf)
            qpas = config.get("query_pre_attn_scalar")
            m = arch.moe
            moe = {} if m is None else dict(
                num_experts=int(getattr(hf, m.count_field)), experts_per_token=int(getattr(hf, m.top_k_field)),
                expert_size=int(getattr(hf, m.width_field)),
                shared_expert_size=int(getattr(hf, m.shared_width_field)) if m.shared else 0,
                renormalize=m.renormalize if isinstance(m.renormalize, bool) else bool(getattr(hf, m.renormalize)))
            return cls(
                model_type=model_type,
                architecture=arch.architecture,
                num_layers=int(config["num_hidden_layers"]),
                hidden_size=hidden,
                num_heads=heads,
                num_kv_heads=int(config.get("num_key_value_heads") or heads),
                head_dim=int(config.get("head_dim") or hidden // heads),
                # a MoE whose every MLP is experts may have no dense width (Qwen3.5-MoE)
                intermediate_size=int(config["intermediate_size"] if m is None else config.get("intermediate_size", 0)),
                vocab_size=int(config["vocab_size"]),
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                rope_theta=float(config.get("rope_theta") or rope.get("rope_theta") or 10000.0),
                rope_scaling=rope_scaling,
                rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                attention_bias=bool(config.get("attention_bias", arch.qkv_bias)),
                max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
                sliding_window=window(hf),
                local_window=hf.sliding_window if local else None,
                local_layers=local,
                local_rope_theta=float(hf.rope_parameters["sliding_attention"]["rope_theta"])
                if local and arch.local_rotary else None,
                attn_scale=arch.attention_scale if arch.attention_scale is not None else
                float(qpas) ** -0.5 if qpas else None,
                final_softcap=config.get("final_logit_softcapping"),
                nope_layers=tuple(i for i, f in enumerate(getattr(hf, arch.rope_layers)) if not f)
                if arch.rope_layers else (),
                rotary_dim=int(int(config.get("head_dim") or hidden // heads) * rope["partial_rotary_factor"])
                if rope.get("partial_rotary_factor", 1.0) != 1.0 and rope.get("rope_type") != "proportional"
                else None,   # a proportional table covers the whole head (zero frequencies past the factor)
                **_linear_attention(arch, hf),
                **moe,
                swiglu=(float(hf.swiglu_alpha), float(hf.swiglu_limit)) if arch.activation == "clamped_swiglu"
                else None,
                vision=vision,
                **_per_layer_heads(arch, hf, local),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise LlmqError(f"config.json of this {model_type} model is missing or has a bad field: {e}") from None

    @property
    def arch(self) -> Arch:
        """The family's declaration: tensor names, fused groups, splits, export names."""
        return ARCHS[self.model_type]

    def roles(self, i: int | None = None) -> tuple[str, ...]:
        """A decoder layer's linear roles (Arch.roles with this model's experts): layer i's, or an attention
        layer's. A layer reading another's KV cache has no k / v projections, a global layer whose values are its keys
        no v_proj (Gemma 4)."""
        roles = self.arch.roles(self.num_experts, i in self.linear_layers)
        if i is not None and self.shares_kv(i):
            return tuple(r for r in roles if r not in ("k_proj", "v_proj"))
        if i is not None and self.k_eq_v and i not in self.local_layers:
            return tuple(r for r in roles if r != "v_proj")
        return roles

    def shares_kv(self, i: int) -> bool:
        """Whether layer i reads an earlier layer's KV cache (kv_source) instead of keeping its own."""
        return bool(self.kv_source) and self.kv_source[i] != i

    def head_dim_of(self, i: int) -> int:
        """Layer i's head width: a global layer's own where the family has one (global_head_dim)."""
        return self.global_head_dim if self.global_head_dim and i not in self.local_layers else self.head_dim

    def kv_heads_of(self, i: int) -> int:
        """Layer i's KV heads: a global layer's own where the family has them (global_kv_heads)."""
        return self.global_kv_heads if self.global_kv_heads and i not in self.local_layers else self.num_kv_heads

    def units(self, i: int) -> list[int]:
        """Layer i's units, as indices into Arch.unit_roles(num_experts): a hybrid model's layers have their kind's
        (attention or Gated DeltaNet) beside the MLP's."""
        have = set(self.roles(i)) | set(self.arch.groups(i in self.linear_layers))
        return [u for u, unit in enumerate(self.arch.unit_roles(self.num_experts)) if set(unit) <= have]

    def stored_linears(self, i: int) -> dict[str, str]:
        """Layer i's linears as stored (Arch.stored_linears, less the roles the layer lacks: roles): name -> path in
        the layer."""
        linear = i in self.linear_layers
        absent = set(self.arch.roles(self.num_experts, linear)) - set(self.roles(i))
        return {n: p for n, p in self.arch.stored_linears(self.num_experts, linear).items() if n not in absent}

    def norm_roles(self, i: int) -> tuple[str, ...]:
        """Layer i's norms: a Gated DeltaNet layer has none of its family's attention module's (q_norm, k_norm)."""
        inside = f"{self.arch.attention}."
        return tuple(r for r, path in self.arch.norms.items()
                     if (i not in self.linear_layers or not path.startswith(inside)) and
                     not (r == "k_norm" and self.shares_kv(i)) and not (r == "ple_norm" and not self.ple_dim))

    def linear_tensors(self, i: int) -> dict[str, tuple[int, ...]]:
        """Layer i's parameters besides linears and norms (a Gated DeltaNet layer's, Arch.linear_attention; an
        attention layer's sink logits, Arch.sinks): path in the layer -> shape."""
        la, arch = self.arch.linear_attention, self.arch
        if la is None or i not in self.linear_layers:
            ple, h = arch.per_layer_inputs, self.hidden_size
            return ({arch.sinks: (self.num_heads,)} if arch.sinks else {}) | \
                ({arch.layer_scalar: (1,)} if arch.layer_scalar else {}) | \
                ({f"{ple.gate}.weight": (self.ple_dim, h), f"{ple.proj}.weight": (h, self.ple_dim)}
                 if self.ple_dim and ple is not None else {})
        hv = self.linear_value_heads
        shapes = ((self.linear_conv_dim, 1, self.linear_kernel), (hv,), (hv,), (self.linear_value_dim,))
        return {f"{la.module}.{t}": shape for t, shape in zip(la.tensors, shapes)}

    def stacked_experts(self) -> dict[str, tuple[int, ...]]:
        """A layer's stacked expert tensors (Experts.stacked) by path in the layer, with their shapes (a weight
        [experts, in, rows], a bias [experts, rows]); {} for a family that stores one linear per expert."""
        m = self.arch.moe
        if m is None or not m.stacked:
            return {}
        out = {}
        for path, roles in m.stacked_paths().items():
            n, k = self.linear_shape(expert_role(0, roles[0]))
            rows = n * len(roles)
            out[path] = (self.num_experts, rows) if path.endswith("_bias") else (self.num_experts, k, rows)
        return out

    def kept_16bit(self) -> list[str]:
        """The decoder linears every method keeps 16-bit, never calibrated, priced as dense tensors: MoE routers (a
        rounded router picks other experts) and shared experts' gates (one output row, a sigmoid), and the Gated
        DeltaNet layers' rate projections (LinearAttention .kept_16bit)."""
        return [f"{self.arch.prefix(i)}.{p}" for i in range(self.num_layers) for p in self.kept_16bit_paths(i)]

    def kept_16bit_paths(self, i: int) -> list[str]:
        """kept_16bit's linears of layer i, as paths inside the layer (what AWQ and SmoothQuant fold scales into
        without quantizing them)."""
        roles = ((ROUTER, SHARED_GATE) if self.shared_expert_size else (ROUTER,)) if self.num_experts else ()
        if i in self.linear_layers:
            roles += self.arch.linear_attention.kept_16bit
        ple = self.arch.per_layer_inputs   # Gemma 4's per-layer input gate and projection
        return [self.arch.path(r) for r in roles] + ([ple.gate, ple.proj] if ple is not None and self.ple_dim else [])

    def model_modules(self) -> dict[str, tuple[int, ...]]:
        """The model's modules outside its layers beside the embedding, head and final norm, with their weight's
        shape: Gemma 4's per-layer inputs' table, projection and norm (Arch.per_layer_inputs; none for other
        families)."""
        ple = self.arch.per_layer_inputs
        if ple is None or not self.ple_dim:
            return {}
        width = self.num_layers * self.ple_dim
        return {ple.table: (self.ple_vocab, width), ple.projection: (width, self.hidden_size),
                ple.projection_norm: (self.ple_dim,)}

    @property
    def linear_conv_dim(self) -> int:
        """Channels of a Gated DeltaNet layer's convolution: its q, k and v."""
        return 2 * self.linear_key_heads * self.linear_key_dim + self.linear_value_heads * self.linear_value_dim

    def recurrent_state_bytes(self, bytes_per_element: float, tp: int = 1) -> float:
        """One sequence's Gated DeltaNet states on one of `tp` ranks, every such layer: the convolution's last
        kernel - 1 inputs in the compute dtype and the float32 delta-rule state. Fixed per sequence, not per token."""
        conv = self.linear_conv_dim * (self.linear_kernel - 1) * bytes_per_element
        state = self.linear_value_heads * self.linear_key_dim * self.linear_value_dim * 4
        return len(self.linear_layers) * (conv + state) / tp

    def linear_shape(self, role: str, i: int | None = None) -> tuple[int, int]:
        """[out, in] of a decoder layer's linear `role` (q_proj ... down_proj, router, experts.<e>.<role>,
        shared_expert.<role>, shared_expert_gate), or of a stored fused group (Arch.fused: its roles' rows stacked);
        of layer i's where layers differ (Gemma 4's global heads and double-wide MLPs)."""
        if role in self.arch.groups(self.arch.linear_attention is not None):
            shapes = [self.linear_shape(r, i) for r in self.arch.group_roles(role)]
            return sum(n for n, _ in shapes), shapes[0][1]
        d = self.head_dim if i is None else self.head_dim_of(i)
        h, q, kv, ff = self.hidden_size, self.num_heads * d, (self.num_kv_heads if i is None else
                                                              self.kv_heads_of(i)) * d, self.intermediate_size
        if i is not None and i in self.wide_mlp_layers:
            ff *= 2
        if role == ROUTER:
            return self.num_experts, h
        if role == SHARED_GATE:
            return 1, h
        if role.startswith(("experts.", "shared_expert.")):
            ff = self.expert_size if role.startswith("experts.") else self.shared_expert_size
            role = role.rpartition(".")[2]
        vd, hv = self.linear_value_heads * self.linear_value_dim, self.linear_value_heads
        return {"in_proj_qkv": (self.linear_conv_dim, h), "in_proj_z": (vd, h), "in_proj_b": (hv, h),
                "in_proj_a": (hv, h), "out_proj": (h, vd),
                "q_proj": (q * (2 if self.arch.attn_gate else 1), h), "k_proj": (kv, h), "v_proj": (kv, h),
                "o_proj": (h, q), "gate_proj": (ff, h), "up_proj": (ff, h), "down_proj": (h, ff)}[role]

    def group_rows(self, group: str) -> dict[str, torch.Tensor]:
        """The stored rows of each role of a fused group, in the role's own row order: a family's (Arch.fused) one
        role after another, a Gated DeltaNet's (LinearAttention.fused) interleaved by key head."""
        import torch

        if group in self.arch.fused:   # one role after another
            out, start = {}, 0
            for r in self.arch.group_roles(group):
                n = self.linear_shape(r)[0]
                out[r], start = torch.arange(start, start + n), start + n
            return out
        parts = self.arch.linear_attention.fused[group]
        per_value = self.linear_value_heads // self.linear_key_heads
        width = {"q": self.linear_key_dim, "k": self.linear_key_dim, "v": per_value * self.linear_value_dim,
                 "z": per_value * self.linear_value_dim, "b": per_value, "a": per_value}
        block = sum(width[p] for p, _ in parts)   # one key head's rows
        rows: dict[str, list[torch.Tensor]] = {}
        start = 0
        for p, role in parts:   # a part over every key head in turn
            part = torch.arange(start, start + width[p])
            rows.setdefault(role, []).extend(h * block + part for h in range(self.linear_key_heads))
            start += width[p]
        return {role: torch.cat(r) for role, r in rows.items()}

    def norm_shape(self, role: str, i: int | None = None) -> tuple[int]:
        """The weight shape of a decoder layer's norm `role` (layer i's where head widths differ): per head for q / k
        norms, else the residual width."""
        d = self.head_dim if i is None else self.head_dim_of(i)
        return (d if role in ("q_norm", "k_norm") else self.hidden_size,)

    def kv_layers(self) -> list[int]:
        """The layers that keep a KV cache: attention layers (not a hybrid's Gated DeltaNet ones) that read no other
        layer's (kv_source)."""
        return [i for i in range(self.num_layers) if i not in self.linear_layers and not self.shares_kv(i)]

    def kv_bytes_per_token(self, bytes_per_element: float, tp: int = 1) -> float:
        """KV-cache size of one token on one of `tp` ranks: K and V of every layer keeping a cache, KV heads x
        head_dim x bytes per element each (a rank holds its share of the KV heads, at least one). The one place this
        is computed: the worker sizes its cache with it, serve and the benchmarks report with it."""
        return sum(2 * max(self.kv_heads_of(i) // tp, 1) * self.head_dim_of(i) for i in self.kv_layers()) * \
            bytes_per_element

    def num_parameters(self, active: bool = False) -> int:
        """All parameters, or (`active`) those one token computes with: its experts only in a MoE model."""
        mlp = 3 * self.hidden_size * self.intermediate_size
        if self.num_experts:
            mlp = self.hidden_size * (self.num_experts + 3 * self.expert_size *
                                      (self.experts_per_token if active else self.num_experts))
            mlp += self.hidden_size * (3 * self.shared_expert_size + 1) if self.shared_expert_size else 0

        def mixer(i: int) -> int:  # attention, or a Gated DeltaNet with its other parameters, and the layer's norms
            roles = [r for r in self.roles(i) if r in ATTN or r in LINEAR_ATTN]
            return sum(math.prod(self.linear_shape(r, i)) for r in roles) + \
                sum(math.prod(t) for t in self.linear_tensors(i).values()) + \
                sum(self.norm_shape(r, i)[0] for r in self.norm_roles(i))

        emb = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        layers = sum(mixer(i) + mlp * (2 if i in self.wide_mlp_layers else 1) for i in range(self.num_layers))
        return layers + emb + self.hidden_size + sum(math.prod(s) for s in self.model_modules().values())

    def to_dict(self) -> dict:
        return asdict(self)


def check_tensors(spec: ModelSpec, tensors: dict[str, tuple], where: str) -> None:
    """Refuse, in one line naming the tensor, a dense checkpoint whose tensors are not exactly what `spec` declares:
    a missing or extra tensor, a shape the config does not give, or a non-float dtype. `tensors`: name -> (dtype,
    shape), from the files' headers (nothing is read)."""
    from .arch.base import EMBEDDING, LM_HEAD

    arch, h = spec.arch, spec.hidden_size
    want: dict[str, tuple[int, ...]] = {f"{EMBEDDING}.weight": (spec.vocab_size, h), f"{arch.final_norm}.weight": (h,)}
    optional: dict[str, tuple[int, ...]] = {}
    (optional if spec.tie_word_embeddings else want)[f"{LM_HEAD}.weight"] = (spec.vocab_size, h)
    want |= {f"{name}.weight": shape for name, shape in spec.model_modules().items()}
    for i in range(spec.num_layers):
        for name, path in spec.stored_linears(i).items():
            shape = spec.linear_shape(name, i)
            want[f"{arch.prefix(i)}.{path}.weight"] = shape
            optional[f"{arch.prefix(i)}.{path}.bias"] = shape[:1]
        for role in spec.norm_roles(i):
            want[arch.norm(i, role)] = spec.norm_shape(role, i)
        want |= {f"{arch.prefix(i)}.{path}": shape for path, shape in spec.linear_tensors(i).items()}
        want |= {f"{arch.prefix(i)}.{path}": shape for path, shape in spec.stacked_experts().items()}
    for name in want.keys() - tensors.keys():
        raise LlmqError(f"{where}: tensor {name} is missing ({spec.architecture}, {spec.num_layers} layers)")
    for name, (dtype, shape) in tensors.items():
        if name.endswith(".rotary_emb.inv_freq"):  # a buffer older checkpoints saved; transformers recomputes it
            continue
        expected = want.get(name, optional.get(name))
        if expected is None:
            raise LlmqError(f"{where}: unexpected tensor {name}: not part of a {spec.architecture} as its config.json "
                            "describes it")
        if tuple(shape) != tuple(expected):
            raise LlmqError(f"{where}: tensor {name} has shape {list(shape)}, but config.json gives "
                            f"{list(expected)}")
        if not dtype.is_floating_point:
            raise LlmqError(f"{where}: tensor {name} is {str(dtype).removeprefix('torch.')}; an unquantized "
                            "checkpoint stores floating-point weights (quantize it with llmq instead)")
