"""Reference check of an engine's rank shards, without a GPU.

Each target's reader (its `read_back`, found through the registry) turns what it wrote into per-rank weights as that
target computes with them (llmq's ranks as the runtime loads them, TensorRT-LLM's dequantized by its rules); the
runtime's own modules then run them the way tensor parallelism does — every rank a thread with its heads and MLP
columns, the all-reduce and vocabulary gather between them (runtime.model_runner.score_in_process) — and the logits
are compared with the unsharded source's, run by the same modules. A wrong split (heads out of order, a KV head on
the wrong rank, scales cut on the wrong axis) is off by orders of magnitude more than the reduction-order noise the
tolerance allows.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from ...errors import LlmqError
from ...models.engine_spec import EngineSpec
from ...models.linear_weights import LinearWeights
from ...models.reader import CheckpointReader
from ...models.sharding import RankWeights, ShardPlan, make_plan
from ...runtime.model_runner import rank_weights, score_in_process
from .registry import TARGETS, target

TOLERANCE = 1e-4   # max |logits - reference| / max |reference|; float32 reduction-order noise is ~1e-6


def reference_weights(src: CheckpointReader, dense=None) -> RankWeights:
    """The unsharded model as one rank, as the runtime loads it (quantized linears stay quantized); with
    `dense(linear) -> float32 weight`, each linear replaced by that value (the split check's exact one)."""
    rw = rank_weights(src, None, 0)
    if dense is not None:
        swap = lambda lw: LinearWeights(lw.name, weight=dense(lw), bias=lw.bias)  # noqa: E731
        rw = dataclasses.replace(rw, layers=[{n: swap(lw) for n, lw in layer.items()} for layer in rw.layers],
                                 lm_head=swap(rw.lm_head))
    return dataclasses.replace(rw, kv_scales=[src.kv_scales(i) for i in range(src.spec.num_layers)])


def exact(lw: LinearWeights) -> torch.Tensor:
    """A linear's stored value in float32: the split check compares values, not the fast kernels' bf16 rounding."""
    return lw.dense(torch.float32)


def run_plan(ranks: list[RankWeights], plan: ShardPlan, config: dict, ids: torch.Tensor,
             kv_cache_dtype: str = "auto") -> torch.Tensor:
    """Logits [batch, seq, vocab] of `ranks` split as `plan` says, through the runtime's modules (a quantized KV
    cache under the ranks' kv_scales for kv_cache_dtype int8 / fp8)."""
    starts = [r * (plan.padded_vocab_size // plan.tp) if plan.parallel_embedding and plan.tp > 1 else None
              for r in range(plan.tp)]
    return score_in_process(ranks, config, plan.heads_per_rank, plan.kv_heads_per_rank, ids, starts,
                            kv_cache_dtype=kv_cache_dtype)


def expected_kv_scale(scale: torch.Tensor, plan: ShardPlan, rank: int) -> torch.Tensor:
    """What rank `rank` must hold of a source KV scale: all of a per-tensor one, its KV heads' of a per-head one."""
    if scale.numel() == 1:
        return scale.float().reshape(())
    heads = plan.kv_heads(rank)
    per_head = scale.float().reshape(plan.num_kv_heads, -1)
    return torch.stack([per_head[h] if h is not None else torch.ones_like(per_head[0]) for h in heads]).reshape(-1)


def kv_scales_match(have, want, plan: ShardPlan, rank: int) -> bool:
    """llmq's convention: rank `rank` keeps the source's K and V scales (per-head ones sliced), and none where the
    source has none."""
    if want is None:
        return have is None
    return have is not None and all(torch.equal(h.float().reshape(-1), expected_kv_scale(w, plan, rank).reshape(-1))
                                    for h, w in zip(have, want))


def kv_scale_mismatches(ranks: list[RankWeights], src: CheckpointReader, plan: ShardPlan) -> int:
    """(layer, rank) pairs whose stored KV-cache scales are missing or differ from the source's, for KV-quantized
    engines (`kv_scales_match`)."""
    return sum(not kv_scales_match(rk.kv_scales[i] if i < len(rk.kv_scales) else None, src.kv_scales(i), plan, r)
               for i in range(src.spec.num_layers) for r, rk in enumerate(ranks))


def max_rel_error(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a - ref).abs().max() / ref.abs().max().clamp(min=1e-30))


def verify_engine(engine_dir: Path | str, source_dir: Path | str, *, seq_len: int = 32, batch: int = 2,
                  seed: int = 0, tolerance: float = TOLERANCE) -> dict:
    """Compare the engine's TP logits with the source model's on fresh random tokens; returns the numbers.

    The split check reads the shards as stored. For a target that re-rounds what it loads (`ReadBack.computes`), it
    also computes what the target will compute and records its KLD / top-1 agreement against
    what llmq evaluated (the artifact's own values, under the engine's KV-cache dtype and the scales each side
    uses), so the deployed quality is a measured number."""
    from ..quantize.probe import kld_top1

    engine_dir, source_dir = Path(engine_dir), Path(source_dir)
    meta = EngineSpec.read(engine_dir)
    src = CheckpointReader(source_dir)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, src.spec.vocab_size, (batch, seq_len), generator=gen)
    if meta.target not in TARGETS:
        raise LlmqError(f"{engine_dir}: unknown engine target {meta.target!r}")
    export = target(meta.target)
    if export.read_back is None:
        raise LlmqError(f"{engine_dir}: {export.no_verify}")
    back = export.read_back(engine_dir, meta)
    with torch.no_grad():
        ref = run_plan([reference_weights(src, exact)], make_plan(src.spec, 1), src.config, ids)
        out = run_plan(back.ranks, back.plan, src.config, ids)
        measured = {}
        if back.foreign:   # what the target computes vs what llmq evaluated (its runtime, fast kernels, KV cache)
            kv = meta.kv_cache_dtype
            evaluated = run_plan([reference_weights(src)], make_plan(src.spec, 1), src.config, ids, kv)
            k = kld_top1(evaluated, run_plan(back.computes or back.ranks, back.plan, src.config, ids, kv))
            measured = {"target_kld": k["kld_mean"], "target_top1": k["top1"]}
    err = max_rel_error(out, ref)
    kv_bad = (kv_scale_mismatches(back.ranks, src, back.plan)
              if meta.kv_cache_dtype != "auto" else 0)
    return {"target": meta.target, "tp": back.plan.tp, "max_rel_error": err, "tolerance": tolerance,
            "kv_scale_mismatches": kv_bad, "passed": err <= tolerance and kv_bad == 0,
            "tokens": batch * seq_len, "seed": seed, **measured}
