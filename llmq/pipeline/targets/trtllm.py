"""`--target trtllm`: a ModelOpt-style Hugging Face checkpoint for TensorRT-LLM's PyTorch backend (`trtllm-serve`, the
LLM API, the one backend left since TensorRT-LLM removed its engine backend in 2026) and the LLM-API options file that
points at it. That backend reads none of llmq's weight-only compressed-tensors schemes, so this translates; what its
loader expects of each scheme, and why the refusals below exist, is docs/build.md#tensorrt-llms-loader."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
import yaml

from ... import quant
from ...errors import LlmqError
from ...models import qformat
from ...models.checkpoint import HF_QUANT_CONFIG, MIXED_QUANT_CONFIG, ShardedWriter, copy_tokenizer, write_json
from ...models.linear_weights import LinearWeights
from ...models.reader import CheckpointReader
from ...models.sharding import ShardPlan, head_rows, join_rows, split_cols, split_rows
from .registry import ExportTarget, TargetResult
from .trtllm_loader import BACKEND_GROUPS, BLOCK, read_back

DIR = "trtllm"
OPTIONS_FILE = "llm_api_options.yaml"
MODELOPT_VERSION = "0.27.0"   # the hf_quant_config producer version whose field set this writer follows
BACKEND_FUSES = tuple(r for group in BACKEND_GROUPS for r in group)
ROW_PARALLEL = ("o_proj", "down_proj")   # cut by input columns across ranks; the others by output rows


# Why llmq's FP4 weights are not written, from `_torch/modules/linear.py`: NVFP4LinearMethod quantizes activations
# to FP4 with a calibrated `input_scale` (alpha = input_scale * weight_scale_2; none: no alpha), where llmq's
# weight-only NVFP4 has no activation scale (its one global scale per fused q/k/v and gate/up is what that loader
# asserts); `get_quant_method` has no dense MXFP4 method (W4A16_MXFP4 is MoE-only).
FP4_REFUSED = {
    "nvfp4": "NVFP4 weight-only: TensorRT-LLM's NVFP4 linear rounds activations to FP4 with a calibrated input_scale "
             "(none here; llmq invents none); re-quantize W4A4 (`llmq quantize --method nvfp4 --w4a4`), or use "
             "--target llmq, gguf or the "
             "compressed-tensors artifact (vLLM)",
    "mxfp4": "MXFP4 weight-only: TensorRT-LLM loads W4A16_MXFP4 for MoE experts only, its dense linears have no MXFP4 "
             "method (nor W4A4 MXFP4 one); use --target llmq, gguf or the compressed-tensors artifact (vLLM)",
}


def modelopt_scale(divisor: torch.Tensor, exact_inverse: bool = False) -> torch.Tensor:
    """ModelOpt's float32 multiplier (amax / 2688) for llmq's divisor g (2688 / amax), a 0-dim tensor: the float32
    reciprocal, or with `exact_inverse` the nearest float32 r whose loader-side reciprocal 1 / r is g exactly (the
    reciprocal itself when that already holds, which it does for most g)."""
    g = divisor.float().reshape(())
    r = 1.0 / g
    if exact_inverse:
        for cand in (r, torch.nextafter(r, torch.tensor(0.0)), torch.nextafter(r, torch.tensor(float("inf")))):
            if torch.equal(1.0 / cand, g):
                return cand
    return r


def modelopt_algo(qw) -> str:
    """The hf_quant_config quant_algo of one llmq quantized weight, or an LlmqError with the way out."""
    if qw.fp4:
        if qw.fp4 == "nvfp4" and qw.dynamic and qw.input_global_scale is not None:
            return "NVFP4"
        raise LlmqError(FP4_REFUSED[qw.fp4])
    if qw.block:
        if tuple(qw.block) == (BLOCK, BLOCK):
            return "FP8_BLOCK_SCALES"
        raise LlmqError(f"block FP8 in {qw.block[0]} x {qw.block[1]} blocks: TensorRT-LLM's FP8_BLOCK_SCALES takes "
                        f"{BLOCK} x {BLOCK} ones; re-quantize (`llmq quantize --method fp8 --group-size {BLOCK}`)")
    if qw.is_float:
        if qw.dynamic:   # per-token activations; a per-tensor weight scale is written once a row, the same values
            return "FP8_PER_CHANNEL_PER_TOKEN"
        if qw.input_scale is None:
            raise LlmqError("FP8 weight-only (W8A16-FP8): TensorRT-LLM's FP8 linears all round activations to FP8; "
                            "re-quantize (`llmq quantize --method fp8`), or use --target llmq or the "
                            "compressed-tensors artifact (vLLM)")
        if qw.strategy == "tensor":
            return "FP8"
        raise LlmqError("FP8 weights per channel with a static activation scale: TensorRT-LLM has no such linear "
                        "(FP8 takes per-tensor weights with it, FP8_PER_CHANNEL_PER_TOKEN per-token activations); "
                        "re-quantize (`llmq quantize --method fp8`, dynamic, or "
                        "`llmq quantize --method fp8 --per-tensor --activations static`)")
    if qw.q.dtype.is_floating_point or qw.input_scale is not None or qw.dynamic:
        raise LlmqError(f"{qw.scheme} weights are not written for TensorRT-LLM by llmq yet; "
                        "use --target llmq (or quantize to INT4 / INT8 weight-only)")
    if not qw.symmetric:
        raise LlmqError("asymmetric weights: TensorRT-LLM's PyTorch backend runs INT4 groups without zero points; "
                        "re-quantize symmetric (`llmq quantize --sym`)")
    if qw.bits not in (4, 8):
        raise LlmqError(f"INT{qw.bits} weights: TensorRT-LLM runs INT4 and INT8 only; re-quantize "
                        "(`llmq quantize --bits 4` or 8) "
                        "(5-bit is for --target gguf and llmq's runtime)")
    if qw.group_size is None:
        return "W8A16" if qw.bits == 8 else "W4A16"
    if qw.bits == 4 and qw.group_size in (64, 128):
        return "W4A16_AWQ"
    raise LlmqError(f"INT{qw.bits} in groups of {qw.group_size} has no TensorRT-LLM PyTorch-backend layout "
                    "(INT4 groups of 64 or 128, or INT8/INT4 per channel); re-quantize with one of those")


def _full_rows(plan: ShardPlan, which: str) -> torch.Tensor:
    """Rows of the padded, unsharded q (or k/v) projection: real heads first, then zero heads."""
    if which == "q":
        return torch.cat([plan.q_rows(r) for r in range(plan.tp)])
    return head_rows([k if k < plan.num_kv_heads else None for k in range(plan.padded_kv_heads)], plan.head_dim)


def algo_entry(qw) -> dict:
    """One linear's quant_algo with the fields its linear method reads: the global section of hf_quant_config.json
    when every linear has the same, else its `quantized_layers` entry (MIXED_PRECISION)."""
    algo = modelopt_algo(qw)
    extra = {"W4A16_AWQ": {"group_size": qw.group_size, "has_zero_point": False, "pre_quant_scale": True},
             "NVFP4": {"group_size": qw.group_size}, "FP8_BLOCK_SCALES": {"group_size": BLOCK}}.get(algo, {})
    return {"quant_algo": algo, **extra}


def _linear_tensors(name: str, lw: LinearWeights, dtype: torch.dtype, whole: bool) -> tuple[dict, dict | None]:
    """The HF tensors of one linear and its algo_entry (None: dense); `whole`: the backend loads it as one matrix."""
    out = {f"{name}.bias": lw.bias.to(dtype)} if lw.bias is not None else {}
    if lw.qw is None:
        return out | {f"{name}.weight": lw.weight.to(dtype)}, None
    qw, entry = lw.qw, algo_entry(lw.qw)
    algo = entry["quant_algo"]
    if algo == "NVFP4":
        return out | {f"{name}.weight": quant.pack_fp4(qw.q), f"{name}.weight_scale": qw.scale.contiguous(),
                      f"{name}.weight_scale_2": modelopt_scale(qw.global_scale),
                      f"{name}.input_scale": modelopt_scale(qw.input_global_scale, exact_inverse=True)}, entry
    if algo == "FP8_BLOCK_SCALES":   # ModelOpt's name; the loader takes the DeepSeek recipe's weight_scale_inv too
        return out | {f"{name}.weight": qw.q.contiguous(), f"{name}.weight_scale": qw.scale.float().contiguous()}, entry
    if algo == "FP8_PER_CHANNEL_PER_TOKEN":   # weight_scale [out] (FP8RowwiseLinearMethod.create_weights)
        rows = qw.scale.float().expand(qw.shape[0], 1).reshape(-1).contiguous()
        return out | {f"{name}.weight": qw.q.contiguous(), f"{name}.weight_scale": rows}, entry
    if algo == "FP8":   # float32 scalars (FP8QDQLinearMethod.load_weight_scales)
        return out | {f"{name}.weight": qw.q.contiguous(), f"{name}.weight_scale": qw.scale.float().reshape(()),
                      f"{name}.input_scale": qw.input_scale.float().reshape(())}, entry
    q = qw.q.to(torch.int8)
    if algo != "W8A16" and q.shape[0] % 2:
        raise LlmqError(f"{name}: cannot pack {q.shape[0]} output rows two per byte for TensorRT-LLM (odd count)")
    out[f"{name}.weight"] = q if algo == "W8A16" else quant.pack_int4_rows(q)
    out[f"{name}.weight_scale"] = (qw.scale.reshape(-1) if algo != "W4A16_AWQ" else qw.scale).to(dtype)
    if algo == "W4A16_AWQ" and whole:
        out[f"{name}.pre_quant_scale"] = torch.ones(q.shape[1], dtype=dtype)
    return out, entry


def check_backend_layer(prefix: str, lin: dict[str, LinearWeights], entries: dict[str, dict | None], tp: int) -> None:
    """What the backend's loader does to one layer that would change what it computes, refused: a fused group is one
    linear with one quant_algo (`apply_layerwise_quant_config` takes q_proj's / gate_proj's); FP8_BLOCK_SCALES scales
    are copied into the fused linear at row block ceil(offset / 128), so every part but the last must end on a block
    edge, and with tp > 1 each rank's rows (columns for o_proj / down_proj) must be whole blocks."""
    for group in BACKEND_GROUPS:
        got = [entries[r] for r in group if r in entries]
        if any(e != got[0] for e in got):
            algos = ", ".join(str(e and e["quant_algo"]) for e in got)
            raise LlmqError(f"{prefix}: TensorRT-LLM loads {' / '.join(group)} as one fused linear with one "
                            f"quant_algo; these are {algos} (None: 16-bit); quantize them alike")
        if got and got[0] and got[0]["quant_algo"] == "FP8_BLOCK_SCALES":
            ends = [r for r in group[:-1] if r in lin and lin[r].out_features % BLOCK]
            if ends:
                raise LlmqError(f"{prefix}.{ends[0]}: its {lin[ends[0]].out_features} rows end inside a {BLOCK}-row "
                                f"FP8 block, and TensorRT-LLM's fused loader would put the next part's block scales on "
                                "the wrong rows (FP8_BLOCK_SCALES); use --target llmq, or the compressed-tensors "
                                "artifact (vLLM)")
    for role, e in entries.items():
        if e and e["quant_algo"] == "FP8_BLOCK_SCALES" and tp > 1:
            dim = lin[role].shape[1 if role in ROW_PARALLEL else 0]
            if dim % (BLOCK * tp):
                raise LlmqError(f"{prefix}.{role}: {dim} {'columns' if role in ROW_PARALLEL else 'rows'} do not cut "
                                f"into whole {BLOCK}-wide FP8 blocks for {tp} ranks, which TensorRT-LLM's loader "
                                "assumes; build with a tp that does, or --tp 1")


def quant_configs(entries: dict[str, dict], kv_algo: str | None, dense: list[str]) -> tuple[dict, dict | None]:
    """hf_quant_config.json, and quant_cfg.json where the linears' entries differ (quant_algo MIXED_PRECISION, the
    per-layer file `_torch/model_config.py` reads over the former; `quantized_layers` in both, as ModelOpt writes)."""
    kinds = {json.dumps(e, sort_keys=True) for e in entries.values()}
    q = {"kv_cache_quant_algo": kv_algo, "exclude_modules": sorted(dense)}
    producer = {"name": "modelopt", "version": MODELOPT_VERSION}
    if len(kinds) <= 1:
        return {"producer": producer, "quantization": json.loads(kinds.pop()) | q if kinds else
                {"quant_algo": None} | q}, None
    layers = dict(sorted(entries.items()))
    mixed = {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": kv_algo, "quantized_layers": layers}
    return {"producer": producer, "quantization": {"quant_algo": "MIXED_PRECISION", **q, "quantized_layers": layers}}, \
        mixed


def refuse(src: CheckpointReader, engine) -> None:
    """What this backend cannot load, refused before anything is written."""
    if src.arch.trtllm_refused:
        raise LlmqError(f"--target trtllm: {src.arch.trtllm_refused}; use --target llmq, or the artifact itself "
                        "(compressed-tensors) for vLLM / SGLang")
    q = src.qconfig
    fp4 = sorted({a.fp4 for a in (q.weights, *q.modules.values()) if a is not None and a.fp4}) if q else []
    w4a4 = fp4 == ["nvfp4"] and not q.modules and q.input_activations == qformat.fp4_activations_args("nvfp4")
    if fp4 and not w4a4:   # any unit in FP4 but NVFP4 W4A4, a mixed artifact's too
        raise LlmqError(FP4_REFUSED[fp4[0]])
    if src.embedding_quantized():
        raise LlmqError("--target trtllm: this artifact's embedding table is INT8 (`llmq quantize --embedding int8`) "
                        "and TensorRT-LLM holds the embedding in the model dtype, where the dequantized rows would be "
                        "re-rounded; use --target llmq or gguf, or quantize with a 16-bit one "
                        "(`llmq quantize --embedding keep`)")
    if engine.kv_cache_dtype == "int8":
        raise LlmqError("an INT8 KV cache is not loaded by TensorRT-LLM's PyTorch backend (it ignores "
                        "kv_cache_config.dtype int8); calibrate FP8 with `llmq quantize-kv --kv fp8`")
    if src.spec.num_experts and (src.bnb is not None or (src.qconfig is not None and src.qconfig.weights)):
        raise LlmqError("quantized experts: TensorRT-LLM's fused MoE loads FP8 / NVFP4 / W4A8 experts, none of which "
                        "llmq writes yet; build the unquantized MoE for trtllm, or use --target llmq, gguf or the "
                        "compressed-tensors artifact (vLLM)")
    if src.arch.fused and engine.tp > 1:
        raise LlmqError(f"--target trtllm: TensorRT-LLM's PyTorch backend loads {src.spec.architecture}'s fused "
                        f"{', '.join(src.arch.fused)} whole and would cut them across q / k / v and gate / up with "
                        "tp > 1; build with --tp 1 (the backend shards it itself), or use --target llmq")


def _max_num_tokens(engine) -> int:
    return max(engine.max_seq_len, min(engine.max_batch_size * engine.max_seq_len, 8192))


def write_llm_api_options(ckpt: Path, engine, attention_window: int | None = None) -> dict:
    """Options for `trtllm-serve CKPT --extra_llm_api_options FILE` / `LLM(CKPT, **options)`, written beside the
    checkpoint: the parallel sizes and the KV-cache dtype are run-time settings there, as is a sliding-window model's
    window (`kv_cache_config.max_attention_window`)."""
    kv = {"dtype": engine.kv_cache_dtype} | ({"max_attention_window": [attention_window]} if attention_window else {})
    options = {"tensor_parallel_size": engine.tp, "pipeline_parallel_size": engine.pp,
               "max_batch_size": engine.max_batch_size, "max_seq_len": engine.max_seq_len,
               "max_num_tokens": _max_num_tokens(engine), "kv_cache_config": kv}
    (ckpt / OPTIONS_FILE).write_text(yaml.safe_dump(options, sort_keys=True))
    rel = f"{ckpt.name}/{OPTIONS_FILE}"
    return {"status": "pytorch-options", "options": rel,
            "serve_command": f"trtllm-serve {ckpt.name} --extra_llm_api_options {rel}"}


def write_trtllm(src: CheckpointReader, plan: ShardPlan, engine_dir: Path, engine) -> TargetResult:
    """Write the padded Hugging Face checkpoint, hf_quant_config.json and the LLM-API options under `DIR`."""
    out = engine_dir / DIR
    dtype = getattr(torch, engine.dtype)
    kv = engine.kv_cache_dtype
    arch = src.arch
    q_rows, kv_rows = _full_rows(plan, "q"), _full_rows(plan, "kv")
    entries, dense = {}, []
    rounding = {"alpha_max_rel_error": 0.0, "input_scales_not_exactly_inverted": 0}   # NVFP4 W4A4 only
    out.mkdir(parents=True)
    with ShardedWriter(out) as state:  # each tensor written as it is made: one layer in memory at most
        for i in range(src.spec.num_layers):
            lin = src.layer_linears(i)
            lin |= {"q_proj": split_rows(lin["q_proj"], q_rows), "k_proj": split_rows(lin["k_proj"], kv_rows),
                    "v_proj": split_rows(lin["v_proj"], kv_rows), "o_proj": split_cols(lin["o_proj"], q_rows)}
            for group, (path, roles) in arch.fused.items():  # as the family stores it
                lin[group] = join_rows([lin.pop(r) for r in roles], f"{arch.prefix(i)}.{path}")
            stored = {k: f"{arch.prefix(i)}.{p}" for k, p in arch.stored_linears(src.spec.num_experts).items()}
            made = {k: _linear_tensors(name, lin[k], dtype, k not in BACKEND_FUSES) for k, name in stored.items()}
            check_backend_layer(arch.prefix(i), lin, {key: entry for key, (_, entry) in made.items()}, engine.tp)
            for key, name in stored.items():
                (tensors, entry), lw = made.pop(key), lin[key]
                for k, t in tensors.items():
                    state.add(k, t)
                if entry is None:
                    dense.append(name)
                else:
                    entries[name] = entry
                if entry and entry["quant_algo"] == "NVFP4":   # what the backend's scalars make of llmq's globals
                    ins, ws2 = tensors[f"{name}.input_scale"], tensors[f"{name}.weight_scale_2"]
                    alpha = (ins * ws2).double()
                    want = 1 / (lw.qw.input_global_scale.double() * lw.qw.global_scale.double()).reshape(())
                    rounding["alpha_max_rel_error"] = max(rounding["alpha_max_rel_error"],
                                                          float((alpha - want).abs() / want))
                    rounding["input_scales_not_exactly_inverted"] += int(
                        not torch.equal(1.0 / ins, lw.qw.input_global_scale.float().reshape(())))
            del lin, lw, tensors   # before the next layer is read: one layer in memory
            for role, t in src.layer_norms(i).items():
                state.add(arch.norm(i, role), t.to(dtype))
            scales = src.kv_scales(i)
            if scales is not None and kv == "fp8":
                if any(s.numel() != 1 for s in scales):
                    raise LlmqError("per-head FP8 KV scales: TensorRT-LLM's PyTorch backend takes one k_scale / "
                                    "v_scale per layer; re-run `llmq quantize-kv --kv fp8` with per-tensor scales")
                for k, s in zip(("k_scale", "v_scale"), scales):
                    state.add(f"{arch.attention_module(i)}.{k}", s.float().reshape(()))
        state.add(f"{qformat.EMBEDDING}.weight", src.tensor(f"{qformat.EMBEDDING}.weight").to(dtype))
        state.add(f"{arch.final_norm}.weight", src.final_norm().to(dtype))
        head = src.lm_head()
        if head.qw is not None:
            head = LinearWeights(qformat.LM_HEAD, weight=head.dense(torch.float32))
        state.add(f"{qformat.LM_HEAD}.weight", head.weight.to(dtype))   # untied: the backend gets its own lm_head
        del head
        state.close()
    qcfg, mixed = quant_configs(entries, "FP8" if kv == "fp8" else None, [*dense, qformat.LM_HEAD]) \
        if (entries or kv == "fp8") else (None, None)
    cfg = copy.deepcopy(src.config)
    cfg.pop("quantization_config", None)   # it describes llmq's compressed-tensors tensors, which this has not
    cfg.update(num_attention_heads=plan.padded_heads, num_key_value_heads=plan.padded_kv_heads,
               head_dim=plan.head_dim, tie_word_embeddings=False, torch_dtype=engine.dtype)
    write_json(out / "config.json", cfg)
    if qcfg is not None:
        write_json(out / HF_QUANT_CONFIG, qcfg)
    if mixed is not None:
        write_json(out / MIXED_QUANT_CONFIG, mixed)
    copy_tokenizer(src.path, out)
    window = src.spec.sliding_window if (src.spec.sliding_window or engine.max_seq_len) < engine.max_seq_len else None
    extra = {"nvfp4_rounding": rounding} if any(e["quant_algo"] == "NVFP4" for e in entries.values()) else {}
    return TargetResult({"hf_checkpoint": DIR, "hf_quant_config": qcfg, **extra,
                         "compile": write_llm_api_options(out, engine, attention_window=window)})


TARGET = ExportTarget("trtllm", write=write_trtllm, read_back=read_back, refuse=refuse)
