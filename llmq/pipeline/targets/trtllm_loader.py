"""What TensorRT-LLM's PyTorch backend makes of the checkpoint `--target trtllm` writes (the loader's rules, from
`_torch/modules/linear.py`, are in docs/build.md#tensorrt-llms-loader): the values it holds, read independently for
`--verify`'s split check, and what it computes, for `--verify`'s score against what llmq evaluated."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from ... import quant
from ...models import qformat
from ...models.checkpoint import HF_QUANT_CONFIG, MIXED_QUANT_CONFIG
from ...models.linear_weights import LinearWeights
from ...models.reader import CheckpointReader, split_group
from ...models.sharding import RankWeights
from ...models.spec import ModelSpec
from .registry import ReadBack

# the linears the backend fuses from separate tensors, one fused linear (one quant_algo) a group; every other one it
# loads whole, reading AWQ's pre_quant_scale
BACKEND_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
BLOCK = 128   # FP8_BLOCK_SCALES: 128 x 128 weight blocks (FP8BlockScalesLinearMethod), activations per 1 x 128


def read_modelopt_checkpoint(path: Path):
    """The checkpoint as TensorRT-LLM's PyTorch backend computes with it, one rank of float32 weights (q * scale
    per channel, group or 128 x 128 block, pre_quant_scale folded into the input columns), for the reference check;
    MIXED_PRECISION: each linear's quant_algo from quant_cfg.json's quantized_layers (else hf_quant_config.json's)."""
    from ...models.checkpoint import safetensors_files
    from ...models.reader import LazyTensors

    st = LazyTensors(safetensors_files(path))
    qfile, mfile = path / HF_QUANT_CONFIG, path / MIXED_QUANT_CONFIG
    q = json.loads(qfile.read_text())["quantization"] if qfile.is_file() else {}
    per_layer = (json.loads(mfile.read_text()) if mfile.is_file() else q).get("quantized_layers") or {}
    cfg = json.loads((path / "config.json").read_text())

    def lin(name: str) -> LinearWeights:
        w = st[f"{name}.weight"]
        bias = st[f"{name}.bias"].float() if f"{name}.bias" in st else None
        algo = per_layer.get(name, {}).get("quant_algo") \
            if q.get("quant_algo") == "MIXED_PRECISION" else q.get("quant_algo")
        if algo is None or w.dtype in (torch.float32, torch.float16, torch.bfloat16):
            return LinearWeights(name, weight=w.float(), bias=bias)
        scale = st[f"{name}.weight_scale"]
        if algo == "NVFP4":   # E2M1 x E4M3 block scale x weight_scale_2 (a multiplier)
            deq = quant.dequantize_fp4(quant.unpack_fp4(w), scale)
            return LinearWeights(name, weight=deq * st[f"{name}.weight_scale_2"].float(), bias=bias)
        if algo == "FP8_BLOCK_SCALES":   # weight block [i, j] times scale[i, j]; edge blocks partial
            rows = scale.float().repeat_interleave(BLOCK, 0)[:w.shape[0]]
            return LinearWeights(name, weight=w.float() * rows.repeat_interleave(BLOCK, 1)[:, :w.shape[1]], bias=bias)
        scale = scale.float()
        if algo in ("FP8", "FP8_PER_CHANNEL_PER_TOKEN"):   # a scalar, or one a row
            return LinearWeights(name, weight=w.float() * scale.reshape(-1, 1), bias=bias)
        ints = (w if algo == "W8A16" else quant.unpack_int4_rows(w)).float()
        if algo == "W4A16_AWQ":
            w = ints * scale.repeat_interleave(ints.shape[1] // scale.shape[1], dim=1)
            if f"{name}.pre_quant_scale" in st:
                w = w * st[f"{name}.pre_quant_scale"].float()[None, :]
            return LinearWeights(name, weight=w, bias=bias)
        return LinearWeights(name, weight=ints * scale[:, None], bias=bias)

    spec = ModelSpec.from_config(cfg)
    arch = spec.arch
    layers, norms, kv = [], [], []
    for i in range(cfg["num_hidden_layers"]):
        attn = arch.attention_module(i)
        layer = {}
        for key, stored in arch.stored_linears(spec.num_experts).items():
            lw = lin(f"{arch.prefix(i)}.{stored}")
            layer |= split_group(lw, spec, key, i) if key in arch.fused else {key: lw}
        layers.append(layer)
        norms.append({role: st[arch.norm(i, role)].float() for role in arch.norms})
        kv.append((st[f"{attn}.k_scale"], st[f"{attn}.v_scale"]) if f"{attn}.k_scale" in st else None)
    embed = LinearWeights(qformat.EMBEDDING, weight=st[f"{qformat.EMBEDDING}.weight"].float())
    return RankWeights(embed=embed, layers=layers, norms=norms, final_norm=st[f"{arch.final_norm}.weight"].float(),
                       lm_head=lin(qformat.LM_HEAD), kv_scales=kv)


def fp8_fused_rescale(layer: dict[str, LinearWeights], dtype: torch.dtype, skip: set[str]) -> dict:
    """The FP8 (per-tensor) parts of each fused q/k/v and gate/up as the backend's one linear holds them
    (FP8QDQLinearMethod.rescale_fused_weights): each part's codes times its scale, divided by the parts' largest
    scale, in the model dtype, rounded to FP8 again; the largest input scale for all. `skip`: roles the family
    stores fused, which the backend loads whole (one scale already)."""
    out = {}
    for group in BACKEND_GROUPS:
        parts = {r: layer[r] for r in group if r in layer and r not in skip and layer[r].qw is not None
                 and layer[r].qw.is_float and layer[r].qw.input_scale is not None}
        if len(parts) < 2:
            continue
        smax = torch.stack([lw.qw.scale.float().reshape(()) for lw in parts.values()]).max()
        imax = torch.stack([lw.qw.input_scale.float().reshape(()) for lw in parts.values()]).max()
        for r, lw in parts.items():
            q = lw.qw.q.to(dtype).mul_(lw.qw.scale.float().reshape(())).div_(smax).to(quant.FP8)
            out[r] = dataclasses.replace(lw, qw=dataclasses.replace(lw.qw, q=q, scale=smax.reshape(1),
                                                                    input_scale=imax.reshape(1)))
    return out


def backend_computes(ckpt: Path, dtype: torch.dtype) -> RankWeights:
    """What the backend computes with the checkpoint: llmq's ModelOpt import of it (the same quantized linears, their
    activation rounding included), then what its loader changes: FP8 per-tensor q/k/v and gate/up re-rounded as one
    linear (`fp8_fused_rescale`), and an FP8 KV cache at scale 1.0, since it reads no k_scale / v_scale from the
    attention module (see the module docstring)."""
    from ...runtime.model_runner import rank_weights

    src = CheckpointReader(ckpt)
    rw = rank_weights(src, None, 0)
    stored_fused = {r for _, roles in src.arch.fused.values() for r in roles}
    layers = [layer | fp8_fused_rescale(layer, dtype, stored_fused) for layer in rw.layers]
    unit = (torch.ones(()), torch.ones(()))
    kv = [None if src.kv_scales(i) is None else unit for i in range(src.spec.num_layers)]
    return dataclasses.replace(rw, layers=layers, kv_scales=kv)


def read_back(engine_dir: Path, engine) -> ReadBack:
    """One unsharded checkpoint that the backend shards itself, heads padded for tp: checked as one rank, and
    scored as the backend computes with it (`backend_computes`)."""
    plan = dataclasses.replace(engine.plan, tp=1, padded_vocab_size=engine.plan.vocab_size, parallel_embedding=False)
    ckpt = engine_dir / engine.outputs["hf_checkpoint"]
    return ReadBack(ranks=[read_modelopt_checkpoint(ckpt)], plan=plan,
                    computes=[backend_computes(ckpt, getattr(torch, engine.dtype))])
