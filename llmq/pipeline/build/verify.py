"""Reference check of an engine's rank shards, without a GPU.

It reads the shards as written (either target), runs a plain-torch Llama forward the way tensor parallelism runs
it — every rank computes its own heads and MLP columns, row-parallel partial outputs are summed (the all-reduce),
lm_head slices are concatenated (the all-gather) — and compares the logits with the unsharded source model's.
Both sides compute in float32 from the same stored values, so they agree to rounding; a wrong split (heads out
of order, a KV head given to the wrong rank, scales cut on the wrong axis) is off by orders of magnitude more.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import torch.nn.functional as F

from ...errors import LlmqError
from ...models.engine_spec import EngineSpec
from ...models.reader import ATTN, MLP, CheckpointReader, layer_prefix
from ...models.sharding import ShardPlan
from ...models.spec import ModelSpec, attends
from .weights import Lin, RankWeights

TOLERANCE = 1e-4   # max |logits - reference| / max |reference|; float32 reduction-order noise is ~1e-6


def _lin(lw, dense) -> Lin:
    return Lin(dense(lw) if dense is not None else lw.dense(torch.float32),
               lw.bias.float() if lw.bias is not None else None)


def reference_weights(src: CheckpointReader, dense=None) -> RankWeights:
    """The unsharded model as one rank: every layer whole, weights dequantized through qformat.

    `dense(linear) -> float32 weight` overrides the dequantization where a target stores values differently
    (TensorRT-LLM's W8A16 keeps the dequantized weight in the model dtype, say); it sees whole, unsplit layers.
    """
    layers, norms = [], []
    for i in range(src.spec.num_layers):
        p = layer_prefix(i)
        layers.append({n: _lin(src.linear(f"{p}.self_attn.{n}"), dense) for n in ATTN}
                      | {n: _lin(src.linear(f"{p}.mlp.{n}"), dense) for n in MLP})
        norms.append((src.tensor(f"{p}.input_layernorm.weight").float(),
                      src.tensor(f"{p}.post_attention_layernorm.weight").float()))
    return RankWeights(embed=src.tensor("model.embed_tokens.weight").float(), layers=layers, norms=norms,
                       final_norm=src.tensor("model.norm.weight").float(),
                       lm_head=_lin(src.lm_head(), dense).weight,
                       kv_scales=[src.kv_scales(i) for i in range(src.spec.num_layers)])


def llmq_rank_weights(rank_dir: Path) -> RankWeights:
    """A `--target llmq` rank directory is itself a (sliced) HF checkpoint: read it the same way as the source."""
    return reference_weights(CheckpointReader(rank_dir))


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _linear(x: torch.Tensor, lin: Lin) -> torch.Tensor:
    y = x @ lin.weight.T
    return y + lin.bias if lin.bias is not None else y


def _rope(hf_config: dict, head_dim: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin from transformers' own rotary embedding, so every rope_scaling variant matches the source model."""
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = dict(hf_config)
    model_type = cfg.pop("model_type")
    cfg.pop("quantization_config", None)
    cfg["head_dim"] = head_dim
    config = AutoConfig.for_model(model_type, **cfg)
    rot = LlamaRotaryEmbedding(config=config)
    cos, sin = rot(torch.zeros(1, dtype=torch.float32), positions)
    return cos.float(), sin.float()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.unsqueeze(2) + rotated * sin.unsqueeze(2)


def tp_forward(ranks: list[RankWeights], plan: ShardPlan, hf_config: dict, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits [batch, seq, vocab] of the model split over `ranks` exactly as tensor parallelism runs it."""
    eps = float(hf_config.get("rms_norm_eps", 1e-6))
    b, t = input_ids.shape
    d, hq, hkv = plan.head_dim, plan.heads_per_rank, plan.kv_heads_per_rank
    if plan.parallel_embedding:     # each rank looks up the ids in its vocab range; the all-reduce sums them
        rows = plan.padded_vocab_size // plan.tp
        x = sum(torch.where(((input_ids >= r * rows) & (input_ids < (r + 1) * rows))[..., None],
                            rk.embed[(input_ids - r * rows).clamp(0, rows - 1)], 0.0) for r, rk in enumerate(ranks))
    else:
        x = ranks[0].embed[input_ids]
    positions = torch.arange(t)[None].expand(b, t)
    cos, sin = _rope(hf_config, d, positions)  # [b, t, d]
    pos = torch.arange(t)
    mask = attends(pos[:, None], pos[None, :], ModelSpec.from_config(hf_config).sliding_window)
    for i in range(len(ranks[0].layers)):
        attn_sum = 0.0
        for rk in ranks:
            lay = rk.layers[i]
            h = _rms(x, rk.norms[i][0], eps)
            q = _linear(h, lay["q_proj"]).view(b, t, hq, d)
            k = _linear(h, lay["k_proj"]).view(b, t, hkv, d)
            v = _linear(h, lay["v_proj"]).view(b, t, hkv, d)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               attn_mask=mask, enable_gqa=True)
            attn_sum = attn_sum + o.transpose(1, 2).reshape(b, t, hq * d) @ lay["o_proj"].weight.T
        o_bias = ranks[0].layers[i]["o_proj"].bias
        x = x + attn_sum + (o_bias if o_bias is not None else 0.0)
        mlp_sum = 0.0
        for rk in ranks:
            lay = rk.layers[i]
            h = _rms(x, rk.norms[i][1], eps)
            mlp_sum = mlp_sum + (F.silu(_linear(h, lay["gate_proj"])) * _linear(h, lay["up_proj"])) @ lay["down_proj"].weight.T
        d_bias = ranks[0].layers[i]["down_proj"].bias
        x = x + mlp_sum + (d_bias if d_bias is not None else 0.0)
    logits = torch.cat([_rms(x, rk.final_norm, eps) @ rk.lm_head.T for rk in ranks], dim=-1)
    return logits[..., :plan.vocab_size]


def unsharded_plan(src: CheckpointReader) -> ShardPlan:
    s = src.spec
    return ShardPlan(tp=1, num_heads=s.num_heads, num_kv_heads=s.num_kv_heads, head_dim=s.head_dim,
                     padded_heads=s.num_heads, padded_kv_heads=s.num_kv_heads, intermediate_size=s.intermediate_size,
                     hidden_size=s.hidden_size, vocab_size=s.vocab_size, padded_vocab_size=s.vocab_size,
                     parallel_embedding=False)


def expected_kv_scale(scale: torch.Tensor, plan: ShardPlan, rank: int) -> torch.Tensor:
    """What rank `rank` must hold of a source KV scale: all of a per-tensor one, its KV heads' of a per-head one."""
    if scale.numel() == 1:
        return scale.float().reshape(())
    heads = plan.kv_heads(rank)
    per_head = scale.float().reshape(plan.num_kv_heads, -1)
    return torch.stack([per_head[h] if h is not None else torch.ones_like(per_head[0]) for h in heads]).reshape(-1)


def kv_scale_mismatches(ranks: list[RankWeights], src: CheckpointReader, plan: ShardPlan, target: str) -> int:
    """(layer, rank) pairs whose stored KV-cache scales are missing or differ from the source's, for KV-quantized
    engines. The llmq target keeps K and V scales (per-head ones sliced); TensorRT-LLM keeps one: their maximum."""
    bad = 0
    for i in range(src.spec.num_layers):
        want = src.kv_scales(i)
        for r, rk in enumerate(ranks):
            have = rk.kv_scales[i] if i < len(rk.kv_scales) else None
            if want is None:
                bad += have is not None and target == "llmq"
                continue
            if have is None:
                bad += 1
            elif target == "trtllm":
                top = torch.maximum(want[0].float().max(), want[1].float().max())
                bad += not (torch.equal(have[0].float().reshape(()), top) and torch.equal(have[1].float().reshape(()), top))
            else:
                bad += not all(torch.equal(h.float().reshape(-1), expected_kv_scale(w, plan, r).reshape(-1))
                               for h, w in zip(have, want))
    return bad


def max_rel_error(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a - ref).abs().max() / ref.abs().max().clamp(min=1e-30))


def verify_engine(engine_dir: Path | str, source_dir: Path | str, *, seq_len: int = 32, batch: int = 2,
                  seed: int = 0, tolerance: float = TOLERANCE) -> dict:
    """Compare the engine's TP logits with the source model's on fresh random tokens; returns the numbers.

    The split check reads the shards as stored. For a target that re-rounds what it loads (TensorRT-LLM's
    W8A16/W4A16), it also computes what the target will compute and records its KLD / top-1 agreement against
    what llmq evaluated (the artifact's own values), so the deployed quality is a measured number."""
    from ..quantize.probe import kld_top1

    engine_dir, source_dir = Path(engine_dir), Path(source_dir)
    meta = EngineSpec.read(engine_dir)
    plan = meta.plan
    src = CheckpointReader(source_dir)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, src.spec.vocab_size, (batch, seq_len), generator=gen)
    target_ranks = None
    if meta.target == "llmq":
        ranks = [llmq_rank_weights(engine_dir / d) for d in meta.ranks]
        dense = None
    elif meta.target == "trtllm":
        from .trtllm import reference_dense, trtllm_rank_weights

        ranks, cfg = trtllm_rank_weights(engine_dir / meta.outputs["trtllm_checkpoint"], plan)
        target_ranks, _ = trtllm_rank_weights(engine_dir / meta.outputs["trtllm_checkpoint"], plan, as_target_computes=True)
        dtype = getattr(torch, cfg["dtype"])
        dense = (lambda lw: reference_dense(lw, dtype))
    elif meta.target == "trtllm-hf":   # one unsharded checkpoint the backend shards itself, heads padded for tp
        from .trtllm_hf import read_modelopt_checkpoint

        ranks, dense = [read_modelopt_checkpoint(engine_dir / meta.outputs["trtllm_hf_checkpoint"])], None
        plan = dataclasses.replace(plan, tp=1, padded_vocab_size=plan.vocab_size, parallel_embedding=False)
    else:
        raise LlmqError(f"{engine_dir}: unknown engine target {meta.target!r}")
    with torch.no_grad():
        ref = tp_forward([reference_weights(src, dense)], unsharded_plan(src), src.config, ids)
        out = tp_forward(ranks, plan, src.config, ids)
        target = {}
        if meta.target == "trtllm-hf":   # what the backend computes is what was read: llmq's integers
            target = {"target_kld": kld_top1(ref, out)["kld_mean"], "target_top1": kld_top1(ref, out)["top1"]}
        if target_ranks is not None:
            evaluated = tp_forward([reference_weights(src)], unsharded_plan(src), src.config, ids)
            deployed = tp_forward(target_ranks, plan, src.config, ids)
            k = kld_top1(evaluated, deployed)
            target = {"target_kld": k["kld_mean"], "target_top1": k["top1"]}
    err = max_rel_error(out, ref)
    kv_bad = kv_scale_mismatches(ranks, src, plan, meta.target) if meta.kv_cache_dtype != "auto" else 0
    return {"target": meta.target, "tp": plan.tp, "max_rel_error": err, "tolerance": tolerance,
            "kv_scale_mismatches": kv_bad, "passed": err <= tolerance and kv_bad == 0,
            "tokens": batch * seq_len, "seed": seed, **target}
