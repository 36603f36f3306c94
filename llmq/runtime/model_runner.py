"""Executes steps: loads this rank's model and KV cache and runs the forward of each step (step.py turns a scheduled
batch into its tensors)."""

from __future__ import annotations

import dataclasses
import functools
import threading
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from ..errors import LlmqError
from ..models import ModelSpec
from ..models.arch import ROUTER, SHARED_GATE, expert_role, shared_role
from ..models.arch.base import LINEAR_ATTN
from ..models.engine_spec import EngineSpec
from ..models.linear_weights import LinearWeights
from ..models.reader import CheckpointReader
from ..models.sharding import (
    RankWeights,
    ShardPlan,
    kv_scale_slice,
    layer_slices,
    make_plan,
    split_linear_tensors,
    split_rows,
)
from ..models.vision import runs_images
from .compiled import compile_decode
from .distributed import LocalGroup, LocalTPContext, TPContext, init_group, rank_device, threads_per_rank
from .host_memory import release_free_heap
from .kv_cache import LayerKV, allocate_layer_caches
from .layers.linear import keeps_16bit
from .layers.norm import RMSNorm
from .layers.rotary import RopeTable, RopeTables, RotaryEmbedding, rope_tables
from .loader import build_linear
from .models.decoder import CausalLM, DecoderLayer, LayerWeights, PerLayerInputs, SparseMoE
from .models.linear_attention import GatedDeltaNet
from .models.vision import load_vision
from .step import StepInput, prepare_step


def compute_dtype_for(device: torch.device, requested: str | torch.dtype | None, config: dict) -> torch.dtype:
    """float32 on CPU (bf16 matmuls are ~20x slower there); the checkpoint's 16-bit dtype on GPUs."""
    if requested is not None:
        d = getattr(torch, requested) if isinstance(requested, str) else requested
        if not isinstance(d, torch.dtype) or not d.is_floating_point:
            raise LlmqError(f"dtype {requested!r} is not a floating-point torch dtype")
        return d
    if device.type == "cpu":
        return torch.float32
    name = str(config.get("dtype") or config.get("torch_dtype") or "bfloat16")
    return torch.float16 if name == "float16" else torch.bfloat16


def load_model(ckpt: CheckpointReader, tp: int, rank: int, engine: EngineSpec | None, dtype: torch.dtype,
               device: torch.device, max_positions: int, int8_activations: bool = False,
               rope: RopeTables | None = None) -> tuple[CausalLM, int, int]:
    """This rank's model, its number of local query heads and local KV heads.

    engine is the record of a `build --target llmq` engine (ckpt is then its rank directory, already sliced);
    None means ckpt is a whole checkpoint, sliced here for tp > 1 by the same sharding plan the build stage uses.
    rope: rope_tables(ckpt.config, ckpt.spec), where rank 0 computed them.
    """
    spec = ckpt.spec
    if engine is not None:
        built = engine.plan
        heads, kv_heads = built.heads_per_rank, built.kv_heads_per_rank
        embed_start = rank * (built.padded_vocab_size // tp) if built.parallel_embedding and tp > 1 else None
        plan = None
    else:
        plan = make_plan(spec, tp) if tp > 1 else None
        heads = plan.heads_per_rank if plan else spec.num_heads
        kv_heads = plan.kv_heads_per_rank if plan else spec.num_kv_heads
        embed_start = None
    rw = rank_weights(ckpt, plan, rank, lazy=True)
    model = assemble(rw, ckpt.config, heads, kv_heads, TPContext(rank, tp, tp > 1), dtype, device, max_positions,
                     embed_start, int8_activations, spec=spec, rope=rope)
    return model, heads, kv_heads


def rank_weights(ckpt: CheckpointReader, plan: ShardPlan | None, rank: int, lazy: bool = False) -> RankWeights:
    """A checkpoint's weights for one rank (all of them without a plan), quantized ones left quantized. `lazy`: the
    layers and their norms are read only as a consumer iterates them, once (load_model: one layer's checkpoint
    tensors in memory beside the runtime's modules, not the whole checkpoint)."""
    def layer(i: int) -> dict:
        return layer_slices(ckpt, plan, i, ranks=[rank])[0] if plan is not None else ckpt.layer_linears(i)

    n = ckpt.spec.num_layers
    layers = (layer(i) for i in range(n)) if lazy else [layer(i) for i in range(n)]
    norms = (ckpt.layer_norms(i) for i in range(n)) if lazy else [ckpt.layer_norms(i) for i in range(n)]
    embed = ckpt.embedding()
    head = ckpt.lm_head(embed)  # tied: the same table, so assemble() keeps a 16-bit one sharing its memory
    if plan is not None:
        head = split_rows(head, plan.vocab_rows(rank))
    tensors = [ckpt.layer_tensors(i) for i in range(n)]   # a layer's few small others (a DeltaNet's; sinks)
    if plan is not None:
        tensors = [split_linear_tensors(t, plan, rank, ckpt.arch) for t in tensors]
    return RankWeights(layers=layers, norms=norms, embed=embed, final_norm=ckpt.final_norm(), lm_head=head,
                       tensors=tensors, model_tensors=ckpt.model_tensors())


def assemble(rw: RankWeights, config: dict, heads: int, kv_heads: int, tpc: TPContext, dtype: torch.dtype,
             device: torch.device, max_positions: int, embed_start: int | None = None, int8_activations: bool = False,
             linear_module: Callable[[list[LinearWeights]], torch.nn.Module] | None = None,
             spec: ModelSpec | None = None, rope: RopeTables | None = None) -> CausalLM:
    """The runtime model of one rank from its weights: quantized linears become the runtime's quantized layers,
    q/k/v and gate/up are fused, row-parallel biases are added after the all-reduce. int8_activations:
    EngineConfig.int8_activations. linear_module: builds every linear (q/k/v or gate/up parts together) instead,
    for modelling another engine's arithmetic around the runtime's attention, norms and rotary. spec and rope:
    config's ModelSpec and rope_tables where the caller has them (both else derived here, through transformers)."""
    spec = spec or ModelSpec.from_config(config)
    rope = rope or rope_tables(config, spec)
    arch = spec.arch

    def norm(w: torch.Tensor | None) -> RMSNorm | None:
        if w is None:
            return None
        if arch.norm_offset:  # (offset + w) once, in float32 as transformers adds it, then the compute dtype
            w = w.float() + arch.norm_offset
        return RMSNorm(w.to(device=device, dtype=dtype), spec.rms_norm_eps)

    def linear(parts: list[LinearWeights]):
        return linear_module(parts) if linear_module else build_linear(parts, dtype, device, int8_activations)

    def row_bias(lw: LinearWeights):
        b = lw.bias.to(device=device, dtype=dtype) if lw.bias is not None else None
        return b, dataclasses.replace(lw, bias=None)

    def rotary_table(table: RopeTable) -> RotaryEmbedding:
        inv_freq, attn_scaling = table
        return RotaryEmbedding(inv_freq, max_positions, attn_scaling, device=device, dtype=dtype)

    rotary = rotary_table(rope[0])
    local = (rotary_table(rope[1]), spec.local_window) if rope[1] is not None else None
    layers = []
    def mlp(lin: dict[str, LinearWeights]) -> dict:
        """A layer's MLP modules: gate_up / down (row-parallel bias apart), or its experts."""
        if not spec.num_experts:
            down_bias, down = row_bias(lin["down_proj"])
            return dict(gate_up=linear([lin["gate_proj"], lin["up_proj"]]), down=linear([down]), down_bias=down_bias)
        downs = [row_bias(lin[expert_role(e, "down_proj")]) for e in range(spec.num_experts)]
        experts = [(linear([lin[expert_role(e, "gate_proj")], lin[expert_role(e, "up_proj")]]), linear([down]))
                   for e, (_, down) in enumerate(downs)]
        shared = (linear([lin[shared_role("gate_proj")], lin[shared_role("up_proj")]]),
                  linear([lin[shared_role("down_proj")]]), linear([lin[SHARED_GATE]])) \
            if spec.shared_expert_size else None
        down_bias = torch.stack([b for b, _ in downs]) if downs[0][0] is not None and tpc.rank == 0 else None
        return dict(gate_up=None, down=None, down_bias=None,
                    moe=SparseMoE(linear([lin[ROUTER]]), experts, spec.experts_per_token, spec.renormalize, shared,
                                  arch.activation, spec.swiglu, down_bias))

    def mixer(i: int, lin: dict[str, LinearWeights]) -> dict:
        """A layer's token mixer: attention (q/k/v fused, o's row-parallel bias apart), or a Gated DeltaNet."""
        if i not in spec.linear_layers:
            o_bias, o = row_bias(lin["o_proj"])
            sinks = rw.tensors[i][arch.sinks].to(device=device, dtype=torch.float32) if arch.sinks else None
            qkv = [lin[r] for r in ("q_proj", "k_proj", "v_proj") if r in lin]   # Gemma 4's: q (and k) alone too
            return dict(qkv=linear(qkv), o=linear([o]), o_bias=o_bias, attn_gate=arch.attn_gate, sinks=sinks)
        conv, a_log, dt_bias, gated_norm = (rw.tensors[i][f"{la.module}.{n}"].to(device) for n in la.tensors)
        net = GatedDeltaNet(linear([lin[r] for r in LINEAR_ATTN[:4]]), linear([lin["out_proj"]]), conv.to(dtype),
                            a_log, dt_bias, gated_norm.to(dtype), spec.rms_norm_eps, spec.linear_key_heads // tpc.world,
                            spec.linear_value_heads // tpc.world, spec.linear_key_dim, spec.linear_value_dim)
        return dict(qkv=None, o=None, o_bias=None, mixer=net)

    def gemma4(i: int, norms: dict[str, torch.Tensor]) -> dict:
        """Layer i's per-layer input modules and output scalar (Arch.per_layer_inputs, layer_scalar)."""
        out, ple = {}, arch.per_layer_inputs
        if arch.layer_scalar:
            out["layer_scalar"] = rw.tensors[i][arch.layer_scalar].to(device=device, dtype=dtype)
        if ple is not None and spec.ple_dim:
            t = rw.tensors[i]
            out["ple"] = (t[f"{ple.gate}.weight"].to(device=device, dtype=dtype),
                          t[f"{ple.proj}.weight"].to(device=device, dtype=dtype), norm(norms["ple_norm"]))
        return out

    la = arch.linear_attention
    for i, (lin, norms) in enumerate(zip(rw.layers, rw.norms)):
        w = LayerWeights(
            input_norm=norm(norms["attn_norm"]), **mixer(i, lin), post_norm=norm(norms["mlp_norm"]), **mlp(lin),
            q_norm=norm(norms.get("q_norm")), k_norm=norm(norms.get("k_norm")),
            attn_out_norm=norm(norms.get("attn_out_norm")), mlp_out_norm=norm(norms.get("mlp_out_norm")),
            **gemma4(i, norms))
        layer_kv = spec.kv_heads_of(i) if spec.global_kv_heads else kv_heads   # per layer at tp 1 only (worker)
        layers.append(DecoderLayer(w, heads, layer_kv, spec.head_dim_of(i), tpc, spec.attn_scale, arch.activation,
                                   i in spec.local_layers, i not in spec.nope_layers, spec.swiglu,
                                   spec.rms_norm_eps if arch.v_norm else None,
                                   spec.k_eq_v and i not in spec.local_layers, spec.shares_kv(i)))
        release_free_heap()
    per_layer = None
    if spec.ple_dim:
        ple = arch.per_layer_inputs
        t = rw.model_tensors
        per_layer = PerLayerInputs(t[ple.table].to(device), t[ple.projection].to(device=device, dtype=dtype),
                                   norm(t[ple.projection_norm]), spec.ple_dim)
    head, table, scale = rw.lm_head, rw.embed.weight, None
    if rw.embed.qw is not None:  # INT8 rows and their scales, looked up as stored (a tied head is built from them)
        qw = rw.embed.qw  # a scale per row, or per group of columns
        table, scale = qw.q.to(device), qw.scale.float().reshape(qw.q.shape[0], -1).to(device)
    elif head.weight is table:  # tied: one table shared with the head's weight, as stored where the head computes
        table = table.to(device)  # from that (keeps_16bit), else in the compute dtype
        table = table if keeps_16bit(table, dtype) else table.to(dtype)
        head = LinearWeights("lm_head", weight=table)
    else:  # looked up a few rows at a time: stays as stored (half the memory of a float32 copy at 16 bits)
        table = table.to(device=device)
    model = CausalLM(table, layers, norm(rw.final_norm), linear([head]), rotary, spec.vocab_size, tpc, embed_start,
                     scale, local, spec.hidden_size ** 0.5 if arch.embed_scale else None, spec.final_softcap,
                     per_layer)
    release_free_heap()
    return model.eval()


def score_in_process(ranks: list[RankWeights], config: dict, heads: int, kv_heads: int, ids: torch.Tensor,
                     embed_starts: list[int | None] | None = None, dtype: torch.dtype = torch.float32,
                     block_size: int = 16,
                     linear_module: Callable[[list[LinearWeights]], torch.nn.Module] | None = None,
                     kv_cache_dtype: str = "auto") -> torch.Tensor:
    """Logits [batch, seq, vocab] of a model split over `ranks`, every rank a thread of this process running the
    runtime's own modules and collectives (LocalTPContext): for checking shards as serve computes them, without
    spawning processes. Each row of `ids` is one sequence, all prefilled in one step. linear_module: as assemble's.
    kv_cache_dtype int8 / fp8: a quantized cache under each rank's kv_scales, attention reading it back as serve's
    does."""
    from .sampling import SamplingParams
    from .sequence import Sequence

    spec, world = ModelSpec.from_config(config), len(ranks)
    b, t = ids.shape
    nblk = -(-t // block_size)
    group, device = LocalGroup(world), torch.device("cpu")
    models = [assemble(rw, config, heads, kv_heads, LocalTPContext(r, world, world > 1, group), dtype, device, t,
                       (embed_starts or [None] * world)[r], linear_module=linear_module) for r, rw in enumerate(ranks)]
    seqs = []
    for i, row in enumerate(ids.tolist()):
        seq = Sequence(f"check-{i}", row, SamplingParams(max_tokens=1))
        seq.block_table = list(range(i * nblk, (i + 1) * nblk))
        seq.state_slot = i
        seqs.append(seq)
    step = prepare_step(seqs, [t] * b, block_size, fresh_prefill_direct=kv_cache_dtype == "auto", all_logits=True,
                        window=spec.sliding_window)
    results: list = [None] * world

    def run(r: int) -> None:
        try:
            scales = None if kv_cache_dtype == "auto" else [tuple(torch.as_tensor(x).float().flatten() for x in kv)
                                                            for i, kv in enumerate(ranks[r].kv_scales)
                                                            if i not in spec.linear_layers]   # attention layers
            caches = allocate_layer_caches(spec, b * nblk, block_size, kv_heads, kv_cache_dtype, dtype, device,
                                           scales, b, world)
            with torch.inference_mode():
                results[r] = models[r](step.input_ids, step.positions, caches, step.meta, step.logits_indices)
        except BaseException as e:   # free the others from the barrier they would wait at forever
            results[r] = e
            group.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,), name=f"llmq-check-rank{r}") for r in range(world)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    failed = [x for x in results if isinstance(x, BaseException) and not isinstance(x, threading.BrokenBarrierError)]
    if failed:
        raise failed[0]
    return results[0].view(b, t, -1)


def load_kv_scales(ckpt: CheckpointReader, plan: ShardPlan | None, rank: int):
    """The (k_scale, v_scale) of every layer keeping a KV cache (ModelSpec.kv_layers: not a hybrid's Gated DeltaNet
    layers, nor Gemma 4's sharing ones) for this rank (its KV heads' share of per-head scales), in order, or None."""
    scales = []
    for i in ckpt.spec.kv_layers():
        s = ckpt.kv_scales(i)
        if s is None:
            return None
        k, v = (torch.as_tensor(x).float().flatten() for x in s)
        if plan is not None:
            k, v = kv_scale_slice(k, plan, rank), kv_scale_slice(v, plan, rank)
        scales.append((k, v))
    return scales


class ModelRunner:
    """One rank's model and KV cache."""

    def __init__(self, path: str, engine: EngineSpec | None, tp: int, rank: int, world: int, device: str, dtype,
                 num_blocks: int, block_size: int, kv_cache_dtype: str, max_positions: int, compile: bool = False,
                 int8_activations: bool = False, state_slots: int = 0, spec: ModelSpec | None = None,
                 rope: RopeTables | None = None):
        """spec, rope: rank 0's ModelSpec and rope_tables (every rank's config.json is rank 0's: llmq_target), so
        that no other rank imports transformers."""
        assert world == tp
        self.device = torch.device(device)
        self.rank_dir = Path(path) / f"rank{rank}" if engine is not None else Path(path)
        ckpt = CheckpointReader(self.rank_dir, spec)
        self.dtype = compute_dtype_for(self.device, dtype, ckpt.config)
        self.model, self.num_heads, self.num_kv_heads = load_model(ckpt, tp, rank, engine, self.dtype, self.device,
                                                                   max_positions, int8_activations, rope)
        self.tp = self.model.tp
        self.spec: ModelSpec = ckpt.spec
        self.block_size = block_size
        plan = make_plan(ckpt.spec, tp) if (engine is None and tp > 1) else None
        scales = load_kv_scales(ckpt, plan, rank) if kv_cache_dtype != "auto" else None
        self.caches = allocate_layer_caches(ckpt.spec, num_blocks, block_size, self.num_kv_heads, kv_cache_dtype,
                                            self.dtype, self.device, scales, state_slots, tp)
        self.kv_cache_dtype = kv_cache_dtype
        self.decode = compile_decode(self.model, self.device) if compile else None
        # a vision-language model's tower and projector, on rank 0 (whose image embeddings every rank's step gets)
        self.vision = load_vision(ckpt.tensors, ckpt.stored_config, self.dtype, self.device) \
            if runs_images(ckpt.spec.vision) and rank == 0 else None

    def observe_kv(self, fn: Callable[[int, torch.Tensor, torch.Tensor], None] | None) -> None:
        """Have every layer's KV cache call fn(layer, k, v) with the K/V it is given to store (None: stop)."""
        for i, cache in enumerate(self.caches):
            if isinstance(cache, LayerKV) and not self.spec.shares_kv(i):   # a shared cache: its own layer's
                cache.observer = None if fn is None else functools.partial(fn, i)

    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """The processor's pixel values [n, 3, H, W] -> image embeddings [n, tokens per image, hidden]."""
        with torch.inference_mode():
            return self.vision(pixels.to(self.device))

    def execute(self, step: StepInput) -> torch.Tensor | None:
        step = step.to(self.device)
        args = (step.input_ids, step.positions, self.caches, step.meta, step.logits_indices)
        if self.decode is not None and not step.meta.prefills:
            return self.decode(*args)
        with torch.inference_mode():
            return self.model(*args, images=step.images)


def worker_main(rank: int, world: int, port: int, load_args: dict, conn) -> None:
    """Entry point of a spawned rank: load, report readiness (or the error) to rank 0, then serve steps."""
    import signal

    import torch.distributed as dist

    # Ctrl-C in a terminal reaches the whole process group; the ranks must outlive it while a server drains.
    # Rank 0 ends them (a None broadcast, else terminate()), and a dead rank 0 breaks their collective anyway.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    device = rank_device(torch.device(load_args["device"]), rank)
    if device.type == "cpu":
        torch.set_num_threads(threads_per_rank(world))
    try:
        init_group(rank, world, port, device)
        runner = ModelRunner(**{**load_args, "device": str(device)}, rank=rank, world=world)
        conn.send(("ok", None))
    except BaseException as e:  # report anything to rank 0 instead of leaving it waiting on a collective
        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}"))
        return
    finally:
        conn.close()
    try:
        while True:
            step = runner.tp.broadcast(None)
            if step is None:
                break
            runner.execute(step)
    finally:
        dist.destroy_process_group()
