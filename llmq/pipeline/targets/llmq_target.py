"""`--target llmq`: one Hugging Face-style directory per rank, in the source's own compressed-tensors packing.

rank{r}/config.json is the source config with the engine's head counts (padded ones when --pad-heads was needed)
and an explicit head_dim; rank{r}/model.safetensors holds that rank's slices under the source's tensor names, so
the runtime's quantized layers read them exactly as they read an unsharded quantized artifact. lm_head.weight is
always written (tied embeddings are untied: its rows are split, the embedding's are not unless parallel).
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from ...models.checkpoint import save_state_dict, write_json
from ...models.reader import CheckpointReader, LinearWeights, layer_prefix
from ...models.sharding import ShardPlan, kv_scale_slice, layer_slices, split_rows, vocab_slice


def _put(state: dict, lw: LinearWeights, name: str) -> None:
    if lw.qw is None:
        state[f"{name}.weight"] = lw.weight.contiguous()
    else:
        from ...models import qformat

        state.update(qformat.write_linear(name, lw.qw))
    if lw.bias is not None:
        state[f"{name}.bias"] = lw.bias.contiguous()


def rank_config(src: CheckpointReader, plan: ShardPlan) -> dict:
    cfg = copy.deepcopy(src.config)
    cfg.update(num_attention_heads=plan.padded_heads, num_key_value_heads=plan.padded_kv_heads,
               head_dim=plan.head_dim, tie_word_embeddings=False)
    return cfg


def write_llmq(src: CheckpointReader, plan: ShardPlan, out: Path) -> list[str]:
    """Write rank0..rank{tp-1} under `out`; returns the rank directory names."""
    states: list[dict[str, torch.Tensor]] = [{} for _ in range(plan.tp)]
    for i in range(src.spec.num_layers):
        p = layer_prefix(i)
        for r, slices in enumerate(layer_slices(src, plan, i)):
            for n, lw in slices.items():
                _put(states[r], lw, f"{p}.{'self_attn' if n in ('q_proj', 'k_proj', 'v_proj', 'o_proj') else 'mlp'}.{n}")
            for norm in ("input_layernorm", "post_attention_layernorm"):
                states[r][f"{p}.{norm}.weight"] = src.tensor(f"{p}.{norm}.weight")
        scales = src.kv_scales(i)
        if scales is not None:
            from ...models import qformat

            for r in range(plan.tp):
                states[r].update(qformat.write_kv_scales(f"{p}.self_attn", kv_scale_slice(scales[0], plan, r),
                                                         kv_scale_slice(scales[1], plan, r)))
    embed = src.tensor("model.embed_tokens.weight")
    lm_head = src.lm_head()
    for r in range(plan.tp):
        states[r]["model.embed_tokens.weight"] = vocab_slice(embed, plan, r) if plan.parallel_embedding else embed
        states[r]["model.norm.weight"] = src.tensor("model.norm.weight")
        _put(states[r], split_rows(lm_head, plan.vocab_rows(r)), "lm_head")
    names = []
    for r, state in enumerate(states):
        d = out / f"rank{r}"
        d.mkdir(parents=True)
        save_state_dict(state, d)
        write_json(d / "config.json", rank_config(src, plan))
        names.append(d.name)
    return names
