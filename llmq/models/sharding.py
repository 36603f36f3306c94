"""The one tensor-parallel sharding plan: build's shard writers and the runtime's in-memory tensor parallelism both
apply it, so an engine built for tp ranks and a checkpoint served with --tp split exactly alike.

Column-parallel layers (q/k/v, gate, up, lm_head) keep a subset of output rows per rank; row-parallel layers
(o_proj, down) keep the matching input columns and their partial outputs are summed (all-reduce). Everything here
is index arithmetic: for each rank, which source rows/columns land in its slice, with -1 marking a zero pad.

Heads: rank r owns query heads [r*H/tp, (r+1)*H/tp). KV heads are split the same way when there are at least tp
of them, and replicated when there are fewer (tp % kv == 0): rank r then holds kv head r*kv//tp, the one its query
heads attend with. With `pad_heads`, a head count tp does not divide is padded with whole zero GQA groups (zero
q/k/v rows, zero o_proj columns): a padded head attends uniformly over zero values and adds exactly nothing.

Slicing: quantized weights are sliced in their unpacked form (`QuantizedWeight.q`, one integer per weight) and
packed again by whoever writes or loads them, so a packed axis is never cut mid-word. Scales and zero points travel
with their weights: per-channel and per-group tensors follow the output rows of a column split; group scales follow
the input columns of a row split group by group, so every rank's column range must start and end on a group
boundary or lie inside one group (whose scale that rank then keeps). Block FP8's [row block, column block] scales
follow both cuts (and any reordering, e.g. of rows within a head) wherever every block of the result draws from one
block of the source (`block_index`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field

import torch

from ..errors import LlmqError
from . import bnbformat
from .arch import split_of
from .linear_weights import LinearWeights
from .qformat import GGMLWeight
from .spec import ModelSpec

SUPPORTED_TP = (1, 2, 4, 8)


def _kv_fits(kv: int, tp: int) -> bool:
    return kv % tp == 0 or tp % kv == 0


def _heads_fit(heads: int, kv: int, tp: int) -> bool:
    return heads % tp == 0 and _kv_fits(kv, tp)


def _padded_heads(heads: int, kv: int, tp: int) -> tuple[int, int]:
    """Smallest (heads', kv') >= (heads, kv) with the same GQA group size that tp splits."""
    group = heads // kv
    kv_p = kv
    while not _heads_fit(group * kv_p, kv_p, tp):
        kv_p += 1
    return group * kv_p, kv_p


def head_rows(units: list[int | None], size: int) -> torch.Tensor:
    """Row indices of consecutive blocks of `size` (a head, say); None gives a block of -1 (zero padding)."""
    parts = [torch.arange(u * size, (u + 1) * size) if u is not None else torch.full((size,), -1) for u in units]
    return torch.cat(parts).long()


@dataclass(frozen=True)
class ShardPlan:
    tp: int
    num_heads: int            # source model
    num_kv_heads: int
    head_dim: int
    padded_heads: int         # what the engine runs (== num_heads unless pad_heads was needed)
    padded_kv_heads: int
    intermediate_size: int
    hidden_size: int
    vocab_size: int
    padded_vocab_size: int    # multiple of tp; lm_head (and a parallel embedding) rows past vocab_size are zero
    parallel_embedding: bool
    expert_size: int = 0      # a MoE layer's expert width, split like the MLP's (every rank holds every expert)
    shared_expert_size: int = 0  # its shared expert's width, split likewise
    attn_gate: bool = False   # q_proj holds each head's query and output gate (Arch.attn_gate)
    # a hybrid model's Gated DeltaNet layers (ModelSpec.linear_*): split by value heads, each rank with their key heads
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_dim: int = 0
    linear_value_dim: int = 0

    @property
    def heads_per_rank(self) -> int:
        return self.padded_heads // self.tp

    @property
    def kv_heads_per_rank(self) -> int:
        return max(self.padded_kv_heads // self.tp, 1)

    @property
    def kv_replicas(self) -> int:
        """How many ranks hold a copy of each KV head (1 unless there are fewer KV heads than ranks)."""
        return max(self.tp // self.padded_kv_heads, 1)

    @property
    def head_padding(self) -> bool:
        return self.padded_heads != self.num_heads

    def q_heads(self, rank: int) -> list[int | None]:
        """Source query head of each of this rank's heads, None for a padding head."""
        start = rank * self.heads_per_rank
        return [h if h < self.num_heads else None for h in range(start, start + self.heads_per_rank)]

    def kv_heads(self, rank: int) -> list[int | None]:
        if self.padded_kv_heads >= self.tp:
            start = rank * self.kv_heads_per_rank
            ids = range(start, start + self.kv_heads_per_rank)
        else:
            ids = [rank * self.padded_kv_heads // self.tp]
        return [k if k < self.num_kv_heads else None for k in ids]

    def q_rows(self, rank: int) -> torch.Tensor:
        """q_proj output rows of this rank; also o_proj's input columns."""
        return head_rows(self.q_heads(rank), self.head_dim)

    def q_proj_rows(self, rank: int) -> torch.Tensor:
        """q_proj output rows of this rank: q_rows, or with the family's output gate each head's query and gate."""
        return head_rows(self.q_heads(rank), self.head_dim * (2 if self.attn_gate else 1))

    def kv_rows(self, rank: int) -> torch.Tensor:
        return head_rows(self.kv_heads(rank), self.head_dim)

    def linear_heads(self, rank: int) -> torch.Tensor:
        """This rank's Gated DeltaNet value heads (its in_proj_b / in_proj_a rows, A_log and dt_bias entries)."""
        n = self.linear_value_heads // self.tp
        return torch.arange(rank * n, (rank + 1) * n)

    def linear_v_rows(self, rank: int) -> torch.Tensor:
        """in_proj_z output rows of this rank's value heads; also out_proj's input columns."""
        return head_rows(self.linear_heads(rank).tolist(), self.linear_value_dim)

    def linear_qkv_rows(self, rank: int) -> torch.Tensor:
        """in_proj_qkv output rows (and convolution channels) of this rank: the q and k channels of its key heads
        (value heads are grouped by key head, so a rank's value heads read its own key heads), then its v channels."""
        n, width = self.linear_key_heads // self.tp, self.linear_key_heads * self.linear_key_dim
        keys = head_rows(list(range(rank * n, (rank + 1) * n)), self.linear_key_dim)
        return torch.cat([keys, width + keys, 2 * width + self.linear_v_rows(rank)])

    def mlp_rows(self, rank: int) -> torch.Tensor:
        """gate/up output rows of this rank; also down_proj's input columns."""
        n = self.intermediate_size // self.tp
        return torch.arange(rank * n, (rank + 1) * n)

    def moe_rows(self, rank: int) -> torch.Tensor:
        """Every expert's gate/up output rows of this rank; also its down_proj's input columns."""
        n = self.expert_size // self.tp
        return torch.arange(rank * n, (rank + 1) * n)

    def shared_rows(self, rank: int) -> torch.Tensor:
        """The shared expert's gate/up output rows of this rank; also its down_proj's input columns."""
        n = self.shared_expert_size // self.tp
        return torch.arange(rank * n, (rank + 1) * n)

    def vocab_rows(self, rank: int) -> torch.Tensor:
        n = self.padded_vocab_size // self.tp
        idx = torch.arange(rank * n, (rank + 1) * n)
        return torch.where(idx < self.vocab_size, idx, torch.full_like(idx, -1))

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(heads_per_rank=self.heads_per_rank, kv_heads_per_rank=self.kv_heads_per_rank,
                 kv_replicas=self.kv_replicas)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ShardPlan":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})  # engines built before a field: default


class HeadSplitError(LlmqError):
    """tp does not divide the head counts and padding was not allowed; `padded` is what padding would give."""

    def __init__(self, message: str, padded: tuple[int, int]):
        super().__init__(message)
        self.padded = padded


def make_plan(spec: ModelSpec, tp: int, *, pad_heads: bool = True, parallel_embedding: bool = False) -> ShardPlan:
    """The plan for `spec` on `tp` ranks, or an LlmqError saying which tp values would work. Its messages begin "tp N"
    and name no option: build and serve spell it --tp N, deploy in GPUs per node and nodes."""
    if tp not in SUPPORTED_TP:
        raise LlmqError(f"tp {tp} is not supported: use one of {', '.join(map(str, SUPPORTED_TP))}")
    heads, kv = spec.num_heads, spec.num_kv_heads
    if heads % kv:
        raise LlmqError(f"model has {heads} attention heads and {kv} KV heads: not a whole GQA group size")
    if _heads_fit(heads, kv, tp):
        padded, kv_padded = heads, kv
    elif pad_heads:
        padded, kv_padded = _padded_heads(heads, kv, tp)
    else:
        ok = [t for t in SUPPORTED_TP if _heads_fit(heads, kv, t)]
        raise HeadSplitError(f"tp {tp} does not divide this model's {heads} attention heads / {kv} KV heads "
                             f"(tp values that do: {', '.join(map(str, ok))})", _padded_heads(heads, kv, tp))
    if spec.num_experts and spec.expert_size % tp:
        raise LlmqError(f"tp {tp} does not divide the experts' MLP width {spec.expert_size}")
    if spec.shared_expert_size % tp:
        raise LlmqError(f"tp {tp} does not divide the shared expert's MLP width {spec.shared_expert_size}")
    if not spec.num_experts and spec.intermediate_size % tp:
        raise LlmqError(f"tp {tp} does not divide the MLP width {spec.intermediate_size}")
    if spec.linear_layers and spec.linear_key_heads % tp:
        raise LlmqError(f"tp {tp} does not divide the Gated DeltaNet layers' {spec.linear_key_heads} key heads")
    padded_vocab = -(-spec.vocab_size // tp) * tp
    return ShardPlan(tp=tp, num_heads=heads, num_kv_heads=kv, head_dim=spec.head_dim, padded_heads=padded,
                     padded_kv_heads=kv_padded, intermediate_size=spec.intermediate_size,
                     hidden_size=spec.hidden_size, vocab_size=spec.vocab_size, padded_vocab_size=padded_vocab,
                     parallel_embedding=parallel_embedding, expert_size=spec.expert_size,
                     shared_expert_size=spec.shared_expert_size,
                     attn_gate=spec.arch.attn_gate, linear_key_heads=spec.linear_key_heads,
                     linear_value_heads=spec.linear_value_heads, linear_key_dim=spec.linear_key_dim,
                     linear_value_dim=spec.linear_value_dim)


def take(t: torch.Tensor, idx: torch.Tensor, dim: int, fill: float = 0) -> torch.Tensor:
    """t.index_select(dim, idx) where idx == -1 yields `fill`. Works for float8 and integer tensors too."""
    raw = t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t
    out = raw.index_select(dim, idx.clamp(min=0).to(t.device))
    pad = (idx < 0).to(t.device)
    if pad.any():
        shape = [1] * out.dim()
        shape[dim] = -1
        out = out.masked_fill(pad.view(shape), fill if raw is t else 0)
    return out.view(t.dtype) if raw is not t else out


def group_index(cols: torch.Tensor, group: int, name: str) -> torch.Tensor:
    """Map a column selection to the selection of its quantization groups (-1 for an all-padding group).

    Either the selection is whole groups, or (a rank holding less than a group, as with 64-column groups over
    32-column head slices) it lies inside one group, whose scale the rank then keeps for its partial group."""
    if 0 < cols.numel() < group and bool((cols >= 0).all()):
        first = int(cols[0])
        if (torch.equal(cols, torch.arange(first, first + cols.numel()))
                and (first + cols.numel() - 1) // group == first // group):
            return torch.tensor([first // group])
    if cols.numel() % group:
        raise LlmqError(f"{name}: a rank's {cols.numel()} input columns are not a whole number of "
                        f"{group}-column quantization groups; choose a tp (or group size) that splits on group edges")
    blocks = cols.view(-1, group)
    first = blocks[:, 0]
    expected = first[:, None] + torch.arange(group)
    real = first >= 0
    if not (torch.equal(blocks[real], expected[real]) and bool((first[real] % group == 0).all())
            and bool((blocks[~real] < 0).all())):
        raise LlmqError(f"{name}: the tensor-parallel split cuts through {group}-column quantization groups")
    return torch.where(real, first // group, torch.full_like(first, -1))


def block_index(idx: torch.Tensor, block: int, name: str) -> torch.Tensor:
    """The source block of each `block`-wide block of a selection idx (-1 = padding) of a block-FP8 weight's rows or
    columns (-1 for an all-padding block); an LlmqError where one block of the result would mix two source blocks,
    whose scales differ."""
    out = []
    for chunk in idx.split(block):
        src = (chunk[chunk >= 0] // block).unique()
        if src.numel() > 1:
            raise LlmqError(f"{name}: the cut puts parts of different {block} x {block} FP8 blocks into one block; "
                            f"choose a tp whose cuts fall on {block}-row / -column edges")
        out.append(int(src[0]) if src.numel() else -1)
    return torch.tensor(out, dtype=torch.long)


def _scale_rows(s: torch.Tensor | None, rows: torch.Tensor, fill: float) -> torch.Tensor | None:
    if s is None or s.numel() == 1:
        return s
    return take(s, rows, 0, fill)


def _scale_cols(s: torch.Tensor | None, cols: torch.Tensor, in_features: int, fill: float, name: str):
    if s is None or s.numel() == 1 or s.dim() == 1 or s.shape[-1] == 1:
        return s  # per-tensor or per-output-channel: every rank keeps it whole
    return take(s, group_index(cols, in_features // s.shape[-1], name), 1, fill)


def _check_sliceable(lw: LinearWeights) -> None:
    if isinstance(lw.qw, (bnbformat.NF4Weight, bnbformat.Int8Weight)):
        raise LlmqError(f"{lw.name}: bitsandbytes ({lw.qw.scheme}) weights are not split for tensor parallelism; "
                        "run them with tp 1, or quantize with a compressed-tensors method (rtn, gptq, awq) to shard")


def split_rows(lw: LinearWeights, rows: torch.Tensor) -> LinearWeights:
    """Column-parallel slice: keep output rows `rows` (with their bias, scales and zero points)."""
    bias = take(lw.bias, rows, 0) if lw.bias is not None else None
    if lw.qw is None:
        return LinearWeights(lw.name, weight=take(lw.weight, rows, 0), bias=bias)
    _check_sliceable(lw)
    if isinstance(lw.qw, GGMLWeight):
        return LinearWeights(lw.name, qw=lw.qw.rows(rows, lw.name), bias=bias)
    qw = lw.qw  # padded rows: q 0, zero point 0, scale 1 -> they dequantize to exactly 0
    block = getattr(qw, "block", None)
    scale = take(qw.scale, block_index(rows, block[0], lw.name), 0, 1.0) if block else \
        _scale_rows(qw.scale, rows, 1.0)
    sliced = dataclasses.replace(qw, q=take(qw.q, rows, 0), scale=scale,
                                 zero_point=_scale_rows(qw.zero_point, rows, 0))
    return LinearWeights(lw.name, qw=sliced, bias=bias)


def join_rows(parts: list[LinearWeights], name: str) -> LinearWeights:
    """Column-parallel linears as one, their output rows stacked (split_rows' inverse): a group written fused as its
    family stores it (Arch.fused). Quantized parts share their scheme and any per-tensor, input or (NVFP4) global
    scale, as the parts of one quantized matrix do."""
    bias = torch.cat([p.bias if p.bias is not None else torch.zeros(p.out_features) for p in parts]) \
        if any(p.bias is not None for p in parts) else None
    if all(p.qw is None for p in parts):
        return LinearWeights(name, weight=torch.cat([p.weight for p in parts]), bias=bias)
    for p in parts:
        _check_sliceable(p)
    qws = [p.qw for p in parts]
    if any(isinstance(q, GGMLWeight) for q in qws):
        a = qws[0]
        if not isinstance(a, GGMLWeight) or any(type(q) is not type(a) for q in qws):
            raise LlmqError(f"{name}: its parts {', '.join(p.name for p in parts)} are quantized differently and "
                            "cannot be stored as one linear")
        return LinearWeights(name, qw=type(a).cat(qws), bias=bias)

    def shared(t: torch.Tensor | None, other: torch.Tensor | None) -> bool:
        return (t is None) == (other is None) and (t is None or t.numel() > 1 or torch.equal(t, other))

    a = qws[0]
    if any(q is None or q.scheme != a.scheme or q.bits != a.bits or not (a.block or shared(q.scale, a.scale))
           or not shared(q.input_scale, a.input_scale) or not shared(q.global_scale, a.global_scale)
           or not shared(q.input_global_scale, a.input_global_scale) for q in qws):
        raise LlmqError(f"{name}: its parts {', '.join(p.name for p in parts)} are quantized differently and cannot "
                        "be stored as one linear")
    if a.block and any(q.q.shape[0] % a.block[0] for q in qws[:-1]):
        raise LlmqError(f"{name}: block FP8 parts join into one linear only when each has a whole number of "
                        f"{a.block[0]}-row blocks")

    def cat(ts: list[torch.Tensor | None]) -> torch.Tensor | None:
        return ts[0] if ts[0] is None or ts[0].numel() == 1 else torch.cat(ts)

    qw = dataclasses.replace(a, q=torch.cat([q.q for q in qws]),
                             scale=torch.cat([q.scale for q in qws]) if a.block else cat([q.scale for q in qws]),
                             zero_point=cat([q.zero_point for q in qws]))
    return LinearWeights(name, qw=qw, bias=bias)


def split_cols(lw: LinearWeights, cols: torch.Tensor) -> LinearWeights:
    """Row-parallel slice: keep input columns `cols`. The bias stays whole: it is added once after the all-reduce."""
    if lw.qw is None:
        return LinearWeights(lw.name, weight=take(lw.weight, cols, 1), bias=lw.bias)
    _check_sliceable(lw)
    qw = lw.qw
    if isinstance(qw, GGMLWeight):
        if not torch.equal(cols.cpu(), torch.arange(qw.q.shape[1])):
            raise LlmqError(f"{lw.name}: {qw.scheme} weights are not split across input columns (tensor "
                            "parallelism); use --tp 1")
        return lw
    in_features, block = qw.q.shape[1], getattr(qw, "block", None)
    sliced = dataclasses.replace(
        qw, q=take(qw.q, cols, 1),
        scale=take(qw.scale, block_index(cols, block[1], lw.name), 1, 1.0) if block else
        _scale_cols(qw.scale, cols, in_features, 1.0, lw.name),
        zero_point=_scale_cols(qw.zero_point, cols, in_features, 0, lw.name))
    return LinearWeights(lw.name, qw=sliced, bias=lw.bias)



def split_layer(full: dict[str, LinearWeights], plan: ShardPlan, rank: int) -> dict[str, LinearWeights]:
    """One rank's slice of a layer's linears (by role), each split as arch.split_of says (a router whole)."""
    index = {"q": plan.q_rows, "q_proj": plan.q_proj_rows, "kv": plan.kv_rows, "mlp": plan.mlp_rows,
             "moe": plan.moe_rows, "shared": plan.shared_rows, "linear_qkv": plan.linear_qkv_rows,
             "linear_v": plan.linear_v_rows, "linear_heads": plan.linear_heads}
    cut = {"rows": split_rows, "cols": split_cols}
    out = {}
    for role, lw in full.items():
        axis, which = split_of(role)
        out[role] = lw if axis == "replicated" else cut[axis](lw, index[which](rank))
    return out


def split_linear_tensors(tensors: dict[str, torch.Tensor], plan: ShardPlan, rank: int, arch) -> dict[str, torch.Tensor]:
    """One rank's share of a layer's other tensors (ModelSpec.linear_tensors, by path), cut as its family's
    declaration (`arch`) says: an attention layer's sink logits (Arch.sinks) follow the rank's query heads (0 for a
    padding head, whose output o_proj drops); a Gated DeltaNet layer's convolution channels and per-head decay
    parameters follow the rank's heads, the rest (the norm, per value dim) is whole."""
    if not tensors:
        return {}
    if arch.sinks in tensors:
        heads = torch.tensor([h if h is not None else -1 for h in plan.q_heads(rank)])
        return {path: take(t, heads, 0) if path == arch.sinks else t for path, t in tensors.items()}
    la = arch.linear_attention
    channels = {f"{la.module}.{t}" for t in la.channel_tensors}
    heads = {f"{la.module}.{t}" for t in la.head_tensors}
    return {path: t.index_select(0, plan.linear_qkv_rows(rank)) if path in channels else
            t.index_select(0, plan.linear_heads(rank)) if path in heads else t for path, t in tensors.items()}


def layer_slices(reader, plan: ShardPlan, i: int, ranks=None) -> list[dict[str, LinearWeights]]:
    """Rank slices of decoder layer i's linears by role, for `ranks` (all by default). `reader` is a
    CheckpointReader (or anything with its layer_linears)."""
    full = reader.layer_linears(i)
    return [split_layer(full, plan, r) for r in (range(plan.tp) if ranks is None else ranks)]


def kv_scale_slice(scale: torch.Tensor, plan, rank: int) -> torch.Tensor:
    """A per-tensor KV scale goes to every rank whole; a per-KV-head one follows the rank's KV heads."""
    if scale.numel() == 1:
        return scale
    if scale.shape[0] == plan.num_kv_heads:
        heads = torch.tensor([h if h is not None else -1 for h in plan.kv_heads(rank)])
        return take(scale, heads, 0, 1.0)
    if scale.shape[0] == plan.num_kv_heads * plan.head_dim:
        return take(scale, plan.kv_rows(rank), 0, 1.0)
    raise LlmqError(f"KV-cache scale of shape {tuple(scale.shape)} is neither per-tensor, per-KV-head nor "
                    f"per-channel ({plan.num_kv_heads} KV heads x {plan.head_dim})")


def vocab_slice(t: torch.Tensor, plan, rank: int) -> torch.Tensor:
    """Rows of an embedding-shaped tensor for this rank's vocab range, zero past the real vocab."""
    return take(t, plan.vocab_rows(rank), 0)


@dataclass
class RankWeights:
    """One rank's share of a model under Hugging Face module names: what each target's reader produces (applying
    that target's dequantization where it stores values differently) and what the runtime turns into modules."""

    layers: list[dict[str, LinearWeights]]          # by role: q_proj ... down_proj (a generator when read lazily)
    norms: list[dict[str, torch.Tensor]]            # by role: attn_norm, mlp_norm (q_norm, k_norm)
    embed: LinearWeights                            # [vocab, hidden] (INT8 rows too), this rank's rows if parallel
    final_norm: torch.Tensor
    lm_head: LinearWeights                          # this rank's vocab rows (the embedding itself where tied)
    kv_scales: list = field(default_factory=list)   # per layer: (k_scale, v_scale) as stored, or None
    # per layer: its other parameters by path (CheckpointReader.layer_tensors: a Gated DeltaNet's, sink logits)
    tensors: list = field(default_factory=list)
    # the model's other parameters beside the embedding, by name (CheckpointReader.model_tensors: Gemma 4's per-layer
    # inputs' table, projection and norm)
    model_tensors: dict = field(default_factory=dict)
