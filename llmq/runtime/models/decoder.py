"""The decoder every supported family runs (its declaration, llmq.models.arch, says which parts a family has), over
a flat batch of tokens from many sequences (no padding), with paged attention.

Every rank of a tensor-parallel group runs this module on its own slice of the weights: attention heads and MLP
columns are split (column-parallel q/k/v, gate/up; row-parallel o_proj, down_proj followed by an all-reduce), the
vocabulary of lm_head is split across ranks and rank 0 gathers the full logits.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed import TPContext
from ..host_memory import gather_weights
from ..kv_cache import LayerKV, LayerRecurrent
from ..layers import cpu_kernels
from ..layers import stack as layer_stack
from ..layers.attention import AttentionMetadata, paged_attention, rotate_and_store, windowed
from ..layers.linear import LinearBase
from ..layers.norm import RMSNorm
from ..layers.rotary import RotaryEmbedding, apply_rotary
from .linear_attention import GatedDeltaNet


def glu(gu: torch.Tensor, activation: str, swiglu: tuple[float, float] | None = None) -> torch.Tensor:
    """act(gate) * up of fused gate_up rows [T, 2I] (SwiGLU or GeGLU; Arch.activation), or GPT-OSS's clamped SwiGLU
    under swiglu = (alpha, limit); gu is the caller's own buffer, reused."""
    if activation == "clamped_swiglu":
        alpha, limit = swiglu
        g, u = gu.chunk(2, dim=-1)
        g = g.clamp_(max=limit)
        return torch.sigmoid(g * alpha).mul_(g).mul_(u.clamp_(-limit, limit).add_(1))
    if activation == "gelu_tanh":
        g, u = gu.chunk(2, dim=-1)
        return F.gelu(g, approximate="tanh").mul_(u)
    if cpu_kernels.usable(gu) and gu.is_contiguous():
        return cpu_kernels.silu_mul(gu)
    g, u = gu.chunk(2, dim=-1)
    return F.silu(g, inplace=True).mul_(u)


class SparseMoE(nn.Module):
    """A mixture-of-experts MLP on one rank: the router (whole on every rank, so all agree on the routing) picks
    top_k experts per token from its softmax, and only those experts run, on only their tokens, so a decode step
    reads the chosen experts' weights and no others. Each expert is a SwiGLU MLP, its width split across ranks like a
    dense MLP's; the weighted sum is this rank's partial output (the layer all-reduces it). `shared`: a shared
    expert's gate_up and down (split likewise) and its gate (whole), every token's, scaled by sigmoid(gate(x)) and
    added. `activation` / `swiglu`: the experts' (glu). `down_bias` [experts, hidden]: the experts' down biases,
    weighted as their outputs are (given to one rank only: the all-reduce sums the ranks). `bytes_read` counts the
    routed experts' weight bytes the steps so far have read (what a memory-bandwidth figure divides)."""

    def __init__(self, router: LinearBase, experts: list[tuple[LinearBase, LinearBase]], top_k: int,
                 renormalize: bool, shared: tuple[LinearBase, LinearBase, LinearBase] | None = None,
                 activation: str = "silu", swiglu: tuple[float, float] | None = None,
                 down_bias: torch.Tensor | None = None):
        super().__init__()
        self.router, self.top_k, self.renormalize = router, top_k, renormalize
        self.activation, self.swiglu, self.down_bias = activation, swiglu, down_bias
        self.gate_up = nn.ModuleList(g for g, _ in experts)
        self.down = nn.ModuleList(d for _, d in experts)
        self.shared: list[LinearBase] = list(shared or ())   # gate_up, down, gate; none without a shared expert
        for name, m in zip(("shared_gate_up", "shared_down", "shared_gate"), self.shared):
            self.add_module(name, m)
        self.expert_bytes = [g.nbytes + d.nbytes for g, d in experts]
        self.bytes_read = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._routed(x)
        if self.shared:
            gate_up, down, gate = self.shared
            out += down(glu(gate_up(x), "silu")) * torch.sigmoid(gate(x))
        return out

    def _routed(self, x: torch.Tensor) -> torch.Tensor:
        # softmax in float32 over all experts, the top_k kept (renormalized where the family does), as transformers
        probs = self.router(x).float().softmax(-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights /= weights.sum(-1, keepdim=True)
        weights = weights.to(x.dtype)
        if x.shape[0] == 1:  # one token (a batch-1 decode step): its experts in turn (in expert order, as the
            out = torch.zeros_like(x)  # grouped path and transformers sum them), no grouping or scatter
            for j in chosen[0].argsort().tolist():
                e = int(chosen[0, j])
                out.add_(self._expert(e, x) * weights[0, j])
                self.bytes_read += self.expert_bytes[e]
            return out
        out = torch.zeros_like(x)
        flat = chosen.flatten()
        order = flat.argsort(stable=True)   # token slots grouped by expert
        counts = torch.bincount(flat, minlength=len(self.down)).tolist()
        start = 0
        for e, n in enumerate(counts):
            if not n:
                continue
            slots = order[start:start + n]
            start += n
            rows = slots // self.top_k
            y = self._expert(e, x.index_select(0, rows))
            out.index_add_(0, rows, y * weights.flatten()[slots, None])
            self.bytes_read += self.expert_bytes[e]
        return out

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        y = self.down[e](glu(self.gate_up[e](x), self.activation, self.swiglu))
        return y if self.down_bias is None else y.add_(self.down_bias[e])


@dataclass
class LayerWeights:
    """One decoder layer's modules on this rank (qkv and gate_up are fused column-parallel linears; a MoE layer has
    its experts in place of gate_up / down)."""

    input_norm: RMSNorm
    qkv: LinearBase | None      # None in a Gated DeltaNet layer, whose token mixer is `mixer`
    o: LinearBase | None
    o_bias: torch.Tensor | None  # row-parallel bias: added once, after the all-reduce
    post_norm: RMSNorm
    gate_up: LinearBase | None
    down: LinearBase | None
    down_bias: torch.Tensor | None
    moe: SparseMoE | None = None
    q_norm: RMSNorm | None = None  # over each query / key head before the rotary embedding (Qwen3, Gemma 3)
    k_norm: RMSNorm | None = None
    attn_out_norm: RMSNorm | None = None  # on the attention's and the MLP's outputs before the residual add
    mlp_out_norm: RMSNorm | None = None   # (Gemma 3's four norms a layer)
    mixer: GatedDeltaNet | None = None    # a hybrid model's linear-attention layer, in place of attention
    attn_gate: bool = False  # q_proj's rows hold each head's query then its output gate (Arch.attn_gate)
    sinks: torch.Tensor | None = None  # this rank's heads' sink logits (Arch.sinks), float32
    # Gemma 4: the per-layer input's gate [size, hidden] and projection [hidden, size] weights with the norm after
    # them (Arch.per_layer_inputs), and the scalar on the layer's output (Arch.layer_scalar)
    ple: tuple[torch.Tensor, torch.Tensor, RMSNorm] | None = None
    layer_scalar: torch.Tensor | None = None


class DecoderLayer(nn.Module):
    def __init__(self, w: LayerWeights, num_heads: int, num_kv_heads: int, head_dim: int, tp: TPContext,
                 scale: float | None = None, activation: str = "silu", local: bool = False, rotates: bool = True,
                 swiglu: tuple[float, float] | None = None, v_norm: float | None = None, k_eq_v: bool = False,
                 shares_kv: bool = False):
        """scale: the attention's softmax scale (None: head_dim ** -0.5); activation, swiglu: Arch.activation and
        ModelSpec.swiglu; local: the layer attends over ModelSpec.local_window with the local rotary table; rotates:
        False for a layer that attends without the rotary embedding (ModelSpec.nope_layers). Gemma 4: v_norm, the
        epsilon of the values' RMS normalization (Arch.v_norm); k_eq_v: qkv holds q and k only and the values are the
        keys (ModelSpec.k_eq_v); shares_kv: qkv holds q only and the layer reads the KV its cache already holds, an
        earlier layer's (ModelSpec.kv_source)."""
        super().__init__()
        self.v_norm, self.k_eq_v, self.shares_kv = v_norm, k_eq_v, shares_kv
        self.ple, self.layer_scalar = w.ple, w.layer_scalar
        self.input_norm, self.post_norm = w.input_norm, w.post_norm
        self.qkv, self.o, self.gate_up, self.down = w.qkv, w.o, w.gate_up, w.down
        self.o_bias, self.down_bias = w.o_bias, w.down_bias
        self.q_norm, self.k_norm = w.q_norm, w.k_norm
        self.attn_out_norm, self.mlp_out_norm = w.attn_out_norm, w.mlp_out_norm
        self.moe, self.mixer, self.attn_gate, self.sinks = w.moe, w.mixer, w.attn_gate, w.sinks
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.scale = scale if scale is not None else head_dim ** -0.5
        self.activation, self.swiglu, self.local, self.rotates = activation, swiglu, local, rotates
        self.tp = tp

    def _reduce(self, y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = self.tp.all_reduce(y)
        return y + bias if bias is not None else y

    def _qk_normed(self, qkv: torch.Tensor) -> torch.Tensor:
        """The fused q/k/v rows with every q and k head RMS-normalized (the rotary embedding comes after)."""
        t = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(t, self.num_heads, self.head_dim)).reshape(t, self.q_size)
        k = self.k_norm(k.reshape(t, self.num_kv_heads, self.head_dim)).reshape(t, self.kv_size)
        return torch.cat([q, k, v], dim=-1)

    def _gemma4_qkv(self, qkv: torch.Tensor) -> torch.Tensor:
        """Gemma 4's q / k / v rows normalized as its attention does: q and k by their norms, v by its RMS alone, v
        being k before its norm where the layer has no v_proj (k_eq_v)."""
        t = qkv.shape[0]
        q, k = qkv[:, :self.q_size], qkv[:, self.q_size:self.q_size + self.kv_size]
        v = k if self.k_eq_v else qkv[:, self.q_size + self.kv_size:]
        v = v.reshape(t, self.num_kv_heads, self.head_dim).float()
        v = (v * torch.pow(v.pow(2).mean(-1, keepdim=True) + self.v_norm, -0.5)).to(qkv.dtype).reshape(t, -1)
        return self._qk_normed(torch.cat([q, k, v], dim=-1))

    def _shared_attention(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: LayerKV,
                          meta: AttentionMetadata) -> torch.Tensor:
        """Attention of a layer whose K / V an earlier layer stored in this cache (this step's too): its queries
        over them."""
        t = x.shape[0]
        q = self.q_norm(self.qkv(x).view(t, self.num_heads, self.head_dim))
        k, v = cache.read(meta.slot_mapping)
        a = paged_attention(apply_rotary(q, *rope), k, v, cache, meta, self.scale, self.sinks)
        return self.o(a.reshape(t, self.q_size))

    def _attention(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: LayerKV,
                   meta: AttentionMetadata) -> torch.Tensor:
        if self.shares_kv:
            return self._shared_attention(x, rope, cache, meta)
        t = x.shape[0]
        qkv = self.qkv(x)
        if self.v_norm is not None:
            qkv = self._gemma4_qkv(qkv)
        gate = None
        if self.attn_gate:  # [query, gate] per head, then k and v
            qg = qkv[:, :2 * self.q_size].view(t, self.num_heads, 2 * self.head_dim)
            gate = qg[..., self.head_dim:].reshape(t, self.q_size)
            qkv = torch.cat([qg[..., :self.head_dim].reshape(t, self.q_size), qkv[:, 2 * self.q_size:]], dim=-1)
        if self.q_norm is not None and self.v_norm is None:
            qkv = self._qk_normed(qkv)
        q, k, v = rotate_and_store(qkv, rope, cache, meta, self.num_heads, self.num_kv_heads)
        a = paged_attention(q, k, v, cache, meta, self.scale, self.sinks).reshape(t, self.q_size)
        return self.o(a if gate is None else a * torch.sigmoid(gate))

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: LayerKV | LayerRecurrent,
                meta: AttentionMetadata, ple: torch.Tensor | None = None) -> torch.Tensor:
        """ple: the layer's per-layer inputs [T, size] (Gemma 4: CausalLM.per_layer)."""
        y = self.input_norm(x)
        h = self.mixer(y, cache, meta) if self.mixer is not None else self._attention(y, rope, cache, meta)
        h = self._reduce(h, self.o_bias)
        x = x + (self.attn_out_norm(h) if self.attn_out_norm is not None else h)
        y = self.post_norm(x)
        h = self.moe(y) if self.moe is not None else self.down(glu(self.gate_up(y), self.activation, self.swiglu))
        h = self._reduce(h, self.down_bias)
        x = x.add_(self.mlp_out_norm(h) if self.mlp_out_norm is not None else h)
        if self.ple is not None:
            gate, proj, norm = self.ple
            x = x + norm(F.linear(F.gelu(F.linear(x, gate), approximate="tanh") * ple, proj))
        return x if self.layer_scalar is None else x * self.layer_scalar


@dataclass
class PerLayerInputs:
    """Gemma 4's per-layer inputs (models.arch.base.PerLayerInputs): the table as stored [vocab, layers x size], the
    projection of the embeddings [layers x size, hidden] and the norm over each layer's part."""

    table: torch.Tensor
    projection: torch.Tensor
    norm: RMSNorm
    size: int

    def __call__(self, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Every layer's inputs [T, layers, size] of the tokens `ids` and their (scaled) embeddings x, in x's
        dtype (the compute dtype, as the token embeddings are scaled): the table's rows times size^1/2, plus the
        normalized projection of x times hidden^-1/2, times 2^-1/2."""
        rows = F.embedding(ids, self.table).to(x.dtype) * torch.tensor(self.size ** 0.5, dtype=x.dtype)
        proj = F.linear(x, self.projection) * x.shape[-1] ** -0.5
        proj = self.norm(proj.view(x.shape[0], -1, self.size))
        return (proj + rows.view_as(proj)) * 2 ** -0.5


class CausalLM(nn.Module):
    def __init__(self, embed: torch.Tensor, layers: list[DecoderLayer], norm: RMSNorm, lm_head: LinearBase,
                 rotary: RotaryEmbedding, vocab_size: int, tp: TPContext, embed_vocab_start: int | None,
                 embed_scale: torch.Tensor | None = None, local: tuple[RotaryEmbedding, int] | None = None,
                 embed_mult: float | None = None, final_softcap: float | None = None,
                 per_layer: PerLayerInputs | None = None):
        """local: the rotary table and window of the layers marked local (ModelSpec.local_layers); embed_mult: the
        factor on every embedding row (Arch.embed_scale); final_softcap: ModelSpec.final_softcap; per_layer:
        Gemma 4's per-layer inputs."""
        super().__init__()
        self.per_layer = per_layer
        self.register_buffer("embed", embed, persistent=False)
        self.register_buffer("embed_scale", embed_scale, persistent=False)  # [vocab, 1] for an INT8 table
        self.layers = nn.ModuleList(layers)
        self.norm, self.lm_head, self.rotary = norm, lm_head, rotary
        self.rotary_local, self.local_window = local if local is not None else (None, None)
        self.embed_mult, self.final_softcap = embed_mult, final_softcap
        self.vocab_size = vocab_size
        self.tp = tp
        self.embed_vocab_start = embed_vocab_start  # None: whole embedding table on every rank
        if embed.device.type == "cpu":
            gather_weights(self)  # before the stacks below capture the weights
        # runs of consecutive layers as (first, end, their DecoderStack or None, the most decodes it takes)
        fused = [layer_stack.fused_layer_args(layer) for layer in layers]  # a StackLayer, or None
        # (a run's layers share one rotary table: NoPE layers run apart)
        self.runs = []
        for (stacked, _), group in itertools.groupby(range(len(layers)),
                                                     key=lambda i: (fused[i] is not None, layers[i].rotates)):
            idx = list(group)
            run = [f for f in (fused[i] for i in idx) if f is not None] if stacked else []
            self.runs.append((idx[0], idx[-1] + 1, layer_stack.decoder_stack(run) if run else None,
                              min(f.max_rows for f in run) if run else 0))
        self.has_stacks = any(stack is not None for _, _, stack, _ in self.runs)

    def _stacks_serve(self, caches: list[LayerKV], meta: AttentionMetadata) -> bool:
        """Whether this step runs the DecoderStacks: decodes only, 16/32-bit caches nobody observes, eagerly (a compiled
        step traces the layers' operations)."""
        if not self.has_stacks or meta.prefills or meta.settle or meta.journal:
            return False
        kv = [c for c in caches if isinstance(c, LayerKV)]  # a hybrid model's recurrent layers keep no KV
        # a speculating slot's journal records its inputs (GatedDeltaNet._record): such steps run op by op
        if any(c.journals for c in caches if isinstance(c, LayerRecurrent)):
            return False
        return cpu_kernels.usable(meta.slot_mapping) and all(c.kv_dtype == "auto" and c.observer is None for c in kv)

    def _layers(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], caches: list[LayerKV],
                meta: AttentionMetadata, positions: torch.Tensor, ple: torch.Tensor | None = None) -> torch.Tensor:
        steps = {}  # (local, rotates) -> the rotary table and metadata of such layers, made on first use

        def step(layer: DecoderLayer) -> tuple[tuple[torch.Tensor, torch.Tensor], AttentionMetadata]:
            key = (layer.local, layer.rotates)
            if key not in steps:
                r, m = (self.rotary_local.table(positions), windowed(meta, self.local_window)) if layer.local \
                    else (rope, meta)
                # a NoPE layer rotates by the identity (cos 1, sin 0): exactly its q and k, on the same kernels
                steps[key] = (r if layer.rotates else (torch.ones_like(r[0]), torch.zeros_like(r[1]))), m
            return steps[key]

        stacks = self._stacks_serve(caches, meta)
        first = next((layer for layer in self.layers if layer.mixer is None), self.layers[0])   # attention's heads
        for lo, hi, stack, rows in self.runs:
            if stacks and stack is not None and meta.num_decode <= rows:
                x = layer_stack.run_stack(stack, x, step(self.layers[lo])[0], caches[lo:hi], meta, first.num_heads,
                                          first.num_kv_heads, first.scale)
            else:
                for i in range(lo, hi):
                    layer_rope, layer_meta = step(self.layers[i])
                    x = self.layers[i](x, layer_rope, caches[i], layer_meta, None if ple is None else ple[:, i])
        return x

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The table's rows of `ids` in the compute dtype (the norm's): a 16-bit table as stored, whose values the cast
        reproduces exactly; an INT8 one times its row's scales (one, or one per group of columns) in float32, then
        cast (as quantize's probe computes)."""
        rows = F.embedding(ids, self.embed)
        if self.embed_scale is not None:
            s = F.embedding(ids, self.embed_scale)  # [..., groups]
            rows = (rows.float().unflatten(-1, (s.shape[-1], -1)) * s.unsqueeze(-1)).flatten(-2)
        return rows.to(self.norm.weight.dtype)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.embed_vocab_start is None:
            return self._rows(ids)
        local = ids - self.embed_vocab_start
        inside = (local >= 0) & (local < self.embed.shape[0])
        h = self._rows(local.clamp(0, self.embed.shape[0] - 1)) * inside.unsqueeze(-1)
        return self.tp.all_reduce(h)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, caches: list[LayerKV],
                meta: AttentionMetadata, logits_indices: torch.Tensor,
                images: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor | None:
        """Logits [len(logits_indices), vocab] in float32 on rank 0 (None on the other ranks). Callers choose the
        autograd mode: inference_mode eagerly, no_grad around the compiled decode step. images: (flat rows, image
        embeddings) that replace those rows' (scaled) token embeddings."""
        x = self._embed(input_ids)
        if self.embed_mult is not None:  # in the rows' dtype, as transformers scales them
            x = x * torch.tensor(self.embed_mult, dtype=x.dtype)
        if images is not None:
            x[images[0]] = images[1].to(x.dtype)
        ple = self.per_layer(input_ids, x) if self.per_layer is not None else None
        rope = self.rotary.table(positions)
        x = self._layers(x, rope, caches, meta, positions, ple)
        h = self.norm(x.index_select(0, logits_indices))
        logits = self.tp.gather_vocab(self.lm_head(h).float())
        if logits is None:
            return None
        logits = logits[:, :self.vocab_size]
        c = self.final_softcap
        return logits if c is None else torch.tanh(logits / c) * c

    def weight_bytes(self) -> int:
        """Bytes of weights every decode step reads on this rank (the embedding table only by lookup). A mixture of
        experts' experts are read as routed, so they are not in it: expert_bytes_read() counts what the steps read."""
        def linears(module: nn.Module) -> Iterator[LinearBase]:
            for child in module.children():
                if isinstance(child, LinearBase):  # not descended: a ConcatLinear's nbytes already holds its parts'
                    yield child
                elif isinstance(child, SparseMoE):
                    yield child.router
                    yield from child.shared
                else:
                    yield from linears(child)

        norms = sum(m.weight.numel() * m.weight.element_size() for m in self.modules() if isinstance(m, RMSNorm))
        per_layer = [t for layer in self.layers if layer.ple is not None for t in layer.ple[:2]] + \
            ([self.per_layer.projection] if self.per_layer is not None else [])
        return sum(m.nbytes for m in linears(self)) + norms + sum(t.numel() * t.element_size() for t in per_layer)

    def expert_bytes_read(self) -> int:
        """Expert weight bytes the steps so far have read on this rank (SparseMoE.bytes_read; 0 without experts)."""
        return sum(m.bytes_read for m in self.modules() if isinstance(m, SparseMoE))
