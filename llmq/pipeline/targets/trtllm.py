"""`--target trtllm`: a TensorRT-LLM checkpoint (config.json + rank<N>.safetensors), then the compile step.

Names and layouts follow TensorRT-LLM's checkpoint documentation (docs/source/architecture/checkpoint.md) and its
Llama converter (tensorrt_llm/models/llama/convert.py): per layer `attention.qkv` (q, k and v rows of this rank
stacked), `attention.dense` (o_proj), `mlp.fc` (gate_proj, the activated branch), `mlp.gate` (up_proj),
`mlp.proj` (down_proj), `input_layernorm`, `post_layernorm`; `transformer.vocab_embedding`, `transformer.ln_f`,
`lm_head` (vocab padded to a multiple of tp, always written, also for tied embeddings);
`attention.kv_cache_scaling_factor` (one float32 per layer, the larger of the K and V scales).

What its loader accepts and does with them is `trtllm_loader.py`; this module writes and reads back.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ...errors import LlmqError
from ...models import qformat
from ...models.linear_weights import LinearWeights
from ...models.reader import CheckpointReader
from ...models.sharding import RankWeights, ShardPlan, layer_slices, split_rows, vocab_slice
from .registry import ExportTarget, ReadBack, TargetResult
from .trtllm_loader import (
    REQUANTIZED,
    TRTLLM_DEFAULT_EXCLUDES,
    awq_dense,
    exclude_patterns,
    excluded,
    int4_offset,
    local_shape,
    pack_int4_rows,
    padding_multiple,
    quant_algo_for,
    refuse_int8_embedding,
    requantized_at_load,
    signed_int4,
    trtllm_requantize,
    unpack_int4_rows,
    validate_config,
)

TRT_MODULES = {"o_proj": "attention.dense", "gate_proj": "mlp.fc", "up_proj": "mlp.gate", "down_proj": "mlp.proj"}
DIR = "trtllm"   # the checkpoint's directory in the engine artifact
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _pad(t: torch.Tensor, shape: tuple[int, ...], fill: float = 0) -> torch.Tensor:
    """t grown at the end of each dimension to `shape`, new entries `fill`."""
    if tuple(t.shape) == tuple(shape):
        return t
    out = torch.full(shape, fill, dtype=t.dtype)
    out[tuple(slice(0, n) for n in t.shape)] = t
    return out


def _awq_tensors(qw, dtype: torch.dtype, shape: tuple[int, int]) -> dict[str, torch.Tensor]:
    q, zero = signed_int4(qw)
    gshape = (shape[0], shape[1] // qw.group_size)   # a rank's partial group is padded to a whole one
    out = {"weight": pack_int4_rows(_pad(q, shape)), "weights_scaling_factor": _pad(qw.scale, gshape, 1).contiguous()}
    if zero is not None:   # a model-dtype parameter the loader takes as is, in the layer's [in/g, out] layout
        out["zero"] = _pad(zero, gshape).T.to(dtype).contiguous()
    return out


def reference_dense(lw: LinearWeights, dtype: torch.dtype) -> torch.Tensor:
    """float32 value of a source linear as this checkpoint stores it, for the unsharded side of the split check."""
    if lw.qw is None:
        return lw.weight.to(dtype).float()
    if quant_algo_for(lw.qw) != "W4A16_AWQ":
        return lw.dense(torch.float32).to(dtype).float()
    q, zero = signed_int4(lw.qw)
    return awq_dense(q, lw.qw.scale.to(dtype), None if zero is None else zero.to(dtype).T)


def _stack_rows(parts: list[LinearWeights]) -> LinearWeights:
    """q, k and v slices of one rank stacked into the fused qkv linear (rows, scales, zero points, bias)."""
    import dataclasses

    bias = None
    if any(p.bias is not None for p in parts):
        bias = torch.cat([p.bias if p.bias is not None else torch.zeros(p.shape[0]) for p in parts])
    if parts[0].qw is None:
        return LinearWeights("qkv", weight=torch.cat([p.weight for p in parts]), bias=bias)
    qws = [p.qw for p in parts]
    def cat(xs):
        return None if xs[0] is None else torch.cat(xs)
    fused = dataclasses.replace(qws[0], q=cat([q.q for q in qws]), scale=cat([q.scale for q in qws]),
                                zero_point=cat([q.zero_point for q in qws]))
    return LinearWeights("qkv", qw=fused, bias=bias)


def _schemes(src: CheckpointReader) -> tuple[str | None, dict]:
    """The model's TensorRT-LLM quant_algo and its quantization fields.

    TensorRT-LLM takes one algorithm per checkpoint. Grouped INT4 layers decide it (W4A16_AWQ) when present; other
    quantized layers are then stored dequantized and excluded. Without grouped INT4 every quantized layer is stored
    dequantized and TensorRT-LLM quantizes it per channel (W8A16).
    """
    if not src.quantized:
        return None, {}
    algos, groups, has_zero = set(), set(), False  # what the INT4 layers say, not the layers: one at a time
    for i in range(src.spec.num_layers):
        for name in src.arch.linear_names(i):
            qw = src.linear(name).qw
            if qw is not None:
                algos.add(algo := quant_algo_for(qw))
                if algo == "W4A16_AWQ":
                    groups.add(qw.group_size)
                    has_zero = has_zero or qw.zero_point is not None or bool(int4_offset(qw))
    if not algos:
        return None, {}
    if groups:
        if len(groups) > 1:
            raise LlmqError(f"INT4 layers use different group sizes {sorted(groups)}; "
                            "a TensorRT-LLM checkpoint has one")
        return "W4A16_AWQ", {"group_size": int(groups.pop()), "has_zero_point": has_zero}
    return "W8A16", {}


def _kv_cache_scaling_factor(scales: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """TensorRT-LLM keeps one KV scale per layer for K and V and all heads: the largest of ours (1.0 if none)."""
    if scales is None:
        return torch.ones(1)
    return torch.maximum(scales[0].float().max(), scales[1].float().max()).reshape(1)


def trtllm_config(src: CheckpointReader, plan: ShardPlan, algo: str | None, qfields: dict, kv_algo: str | None,
                  exclude: list[str] | None, dtype: str) -> dict:
    s = src.spec
    cfg = {
        "architecture": s.architecture, "dtype": dtype, "logits_dtype": "float32", "vocab_size": s.vocab_size,
        "max_position_embeddings": s.max_position_embeddings, "hidden_size": s.hidden_size,
        "num_hidden_layers": s.num_layers, "num_attention_heads": plan.padded_heads,
        "num_key_value_heads": plan.padded_kv_heads, "head_size": s.head_dim, "hidden_act": "silu",
        "intermediate_size": s.intermediate_size, "norm_epsilon": s.rms_norm_eps,
        "position_embedding_type": "rope_gpt_neox", "rotary_base": s.rope_theta, "rotary_scaling": s.rope_scaling,
        "mapping": {"world_size": plan.tp, "tp_size": plan.tp, "pp_size": 1},
        "quantization": {"quant_algo": algo, "kv_cache_quant_algo": kv_algo,
                         "group_size": qfields.get("group_size", 128),
                         "has_zero_point": qfields.get("has_zero_point", False), "pre_quant_scale": False,
                         "exclude_modules": exclude},
        "use_parallel_embedding": plan.parallel_embedding, "embedding_sharding_dim": 0,
        "attn_bias": s.attention_bias, "mlp_bias": bool(src.config.get("mlp_bias", False)),
        "tie_word_embeddings": False,
    }
    return cfg | src.arch.trtllm_legacy


class _RankWriter:
    """Writes each rank's tensors into its rank{r}.safetensors as they come (one tensor in memory at a time);
    knows which linears TensorRT-LLM will quantize and at what shape."""

    def __init__(self, algo: str | None, qfields: dict, plan: ShardPlan, dtype: torch.dtype, out: Path):
        from ...models.safetensors_io import SafetensorsWriter

        self.algo, self.plan, self.dtype = algo, plan, dtype
        self.multiple = padding_multiple(algo, qfields.get("group_size", 64), plan.tp)
        self.files = [SafetensorsWriter(out / f"rank{r}.safetensors") for r in range(plan.tp)]
        self.dense: set[str] = set()

    def put(self, r: int, name: str, tensor: torch.Tensor) -> None:
        self.files[r].add(name, tensor)

    def close(self, ok: bool) -> None:
        for f in self.files:
            f.close() if ok else f.abort()

    def _quantized_here(self, lw: LinearWeights) -> bool:
        """Whether TensorRT-LLM will run this linear quantized (else it is excluded and stays dense)."""
        if self.algo is None or lw.qw is None:
            return False
        return self.algo in REQUANTIZED or quant_algo_for(lw.qw) == self.algo

    def linear(self, r: int, module: str, lw: LinearWeights) -> None:
        by_default = excluded(module, TRTLLM_DEFAULT_EXCLUDES)   # lm_head: always dense in TensorRT-LLM
        quantized = self._quantized_here(lw) and not by_default
        if self.algo is not None and not quantized and not by_default:
            self.dense.add(module)
        out_l, in_l = lw.shape
        shape = local_shape(module, out_l, in_l, self.plan.tp, self.multiple) if quantized else (out_l, in_l)
        if quantized and self.algo == "W4A16_AWQ":
            t = _awq_tensors(lw.qw, self.dtype, shape)
        else:
            w = lw.weight.to(self.dtype) if lw.qw is None else lw.dense(torch.float32).to(self.dtype)
            t = {"weight": _pad(w, shape).contiguous()}  # a 16-bit weight without a float32 round trip (1 GB at 8B)
        if lw.bias is not None:
            t["bias"] = _pad(lw.bias.to(self.dtype), (shape[0],)).contiguous()
        for k, v in t.items():
            self.put(r, f"{module}.{k}", v)


def refuse(src: CheckpointReader, engine) -> None:
    """What the legacy checkpoint cannot carry, refused before anything is written."""
    refuse_int8_embedding(src, "trtllm")
    if src.arch.trtllm_legacy is None:
        raise LlmqError(f"--target trtllm writes the legacy TensorRT-LLM checkpoint for Llama, Mistral and Qwen2 only, "
                        f"not {src.spec.architecture}; use --target trtllm-hf (TensorRT-LLM's PyTorch backend)")
    if src.spec.sliding_window is not None and src.spec.sliding_window < engine.max_seq_len:
        raise LlmqError(f"this model attends over a sliding window of {src.spec.sliding_window} tokens, which a "
                        "TensorRT-LLM checkpoint cannot carry (it is a run-time setting there); "
                        "use --target trtllm-hf, whose LLM-API options set max_attention_window")
    if engine.dtype not in _DTYPES:
        raise LlmqError(f"model dtype {engine.dtype!r} has no TensorRT-LLM equivalent")


def write_trtllm(src: CheckpointReader, plan: ShardPlan, engine_dir: Path, engine) -> TargetResult:
    """Write the checkpoint under `DIR`, run the compile step; the record names the rank files, the checkpoint's
    quantization section and the compile result (`engine` is the EngineSpec being written)."""
    from .compile import compile_trtllm

    out = engine_dir / DIR
    dtype_name = engine.dtype
    dtype = _DTYPES[dtype_name]
    algo, qfields = _schemes(src)
    kv = engine.kv_cache_dtype
    kv_algo = {"int8": "INT8", "fp8": "FP8"}.get(kv)
    out.mkdir(parents=True)
    w = _RankWriter(algo, qfields, plan, dtype, out)
    try:
        for i in range(src.spec.num_layers):
            tp_ = f"transformer.layers.{i}"
            norms = src.layer_norms(i)
            kv_s = _kv_cache_scaling_factor(src.kv_scales(i)) if kv_algo is not None else None
            for r, sl in enumerate(layer_slices(src, plan, i)):
                w.linear(r, f"{tp_}.attention.qkv", _stack_rows([sl["q_proj"], sl["k_proj"], sl["v_proj"]]))
                for n, trt in TRT_MODULES.items():
                    w.linear(r, f"{tp_}.{trt}", sl[n])
                w.put(r, f"{tp_}.input_layernorm.weight", norms["attn_norm"].to(dtype))
                w.put(r, f"{tp_}.post_layernorm.weight", norms["mlp_norm"].to(dtype))
                if kv_s is not None:
                    w.put(r, f"{tp_}.attention.kv_cache_scaling_factor", kv_s)
            del norms  # before the next layer's tensors are read
        embed = src.tensor(f"{qformat.EMBEDDING}.weight").to(dtype)
        for r in range(plan.tp):
            w.put(r, "transformer.vocab_embedding.weight", vocab_slice(embed, plan, r) if plan.parallel_embedding
                  else embed)
            w.put(r, "transformer.ln_f.weight", src.final_norm().to(dtype))
        del embed
        lm_head = src.lm_head()
        for r in range(plan.tp):
            w.linear(r, "lm_head", split_rows(lm_head, plan.vocab_rows(r)))
        del lm_head
        exclude = exclude_patterns(sorted(w.dense)) if algo is not None else None
        cfg = trtllm_config(src, plan, algo, qfields, kv_algo, exclude, dtype_name)
        validate_config(cfg)
    except BaseException:
        w.close(ok=False)
        raise
    w.close(ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return TargetResult({"trtllm_checkpoint": DIR, "requantized_by_target": algo in REQUANTIZED,
                         "compile": compile_trtllm(out, engine)},
                        ranks=[f"{DIR}/rank{r}.safetensors" for r in range(plan.tp)], quantization=cfg["quantization"])


def _unpad(t: torch.Tensor, shape: tuple[int, ...], fill: float, name: str) -> torch.Tensor:
    """The real part of a padded tensor; the padding must be `fill` (a padded row or column that contributes)."""
    real = t[tuple(slice(0, n) for n in shape)]
    rest = t.clone()
    rest[tuple(slice(0, n) for n in shape)] = fill
    if not bool((rest == fill).all()):
        raise LlmqError(f"{name}: the padding TensorRT-LLM's layer shape needs is not {fill:g} everywhere")
    return real


def trtllm_rank_weights(ckpt: Path, plan: ShardPlan, *, as_target_computes: bool = False):
    """Read rank<N>.safetensors back into float32 per-rank weights for the reference check: as stored, or (with
    as_target_computes) after the quantization TensorRT-LLM applies at load (W8A16 re-rounding)."""
    from safetensors.torch import load_file


    cfg = json.loads((ckpt / "config.json").read_text())
    validate_config(cfg)
    q = cfg["quantization"]
    algo, patterns = q["quant_algo"], q["exclude_modules"]
    d, hq, hkv = plan.head_dim, plan.heads_per_rank, plan.kv_heads_per_rank
    bits = 8 if algo == "W8A16" else None

    def lin(state: dict, prefix: str, shape: tuple[int, int]) -> LinearWeights:
        w = state[f"{prefix}.weight"]
        bias = state.get(f"{prefix}.bias")
        bias = _unpad(bias, shape[:1], 0, f"{prefix}.bias").float() if bias is not None else None
        if w.dtype == torch.int8 and algo == "W4A16_AWQ":
            g = cfg["quantization"]["group_size"]
            qint = _unpad(unpack_int4_rows(w), shape, 0, f"{prefix}.weight")
            gshape = (shape[0], -(-shape[1] // g))
            scale = _unpad(state[f"{prefix}.weights_scaling_factor"], gshape, 1, f"{prefix}.weights_scaling_factor")
            zero = state.get(f"{prefix}.zero")
            zero = _unpad(zero.T, gshape, 0, f"{prefix}.zero").T if zero is not None else None
            return LinearWeights(prefix, weight=awq_dense(qint, scale.to(getattr(torch, cfg["dtype"])), zero),
                                 bias=bias)
        w = _unpad(w, shape, 0, f"{prefix}.weight")
        if as_target_computes and bits and requantized_at_load(f"{prefix}.weight", patterns):
            return LinearWeights(prefix, weight=trtllm_requantize(w, bits), bias=bias)
        return LinearWeights(prefix, weight=w.float(), bias=bias)

    h, inter = plan.hidden_size, plan.intermediate_size // plan.tp
    shapes = {"attention.qkv": ((hq + 2 * hkv) * d, h), "attention.dense": (h, hq * d),
              "mlp.fc": (inter, h), "mlp.gate": (inter, h), "mlp.proj": (h, inter)}
    ranks = []
    for r in range(plan.tp):
        st = load_file(str(ckpt / f"rank{r}.safetensors"))
        layers, norms = [], []
        for i in range(cfg["num_hidden_layers"]):
            p = f"transformer.layers.{i}"
            qkv = lin(st, f"{p}.attention.qkv", shapes["attention.qkv"])
            sizes = [hq * d, hkv * d, hkv * d]
            ws = qkv.weight.split(sizes)
            bs = qkv.bias.split(sizes) if qkv.bias is not None else (None,) * 3
            layer = {n: LinearWeights(n, weight=w, bias=b) for n, w, b in zip(("q_proj", "k_proj", "v_proj"), ws, bs)}
            layer |= {n: lin(st, f"{p}.{trt}", shapes[trt]) for n, trt in TRT_MODULES.items()}
            layers.append(layer)
            norms.append({"attn_norm": st[f"{p}.input_layernorm.weight"].float(),
                          "mlp_norm": st[f"{p}.post_layernorm.weight"].float()})
        kv = [st.get(f"transformer.layers.{i}.attention.kv_cache_scaling_factor") for i in range(len(layers))]
        head = st["lm_head.weight"]
        embed = LinearWeights(qformat.EMBEDDING, weight=st["transformer.vocab_embedding.weight"].float())
        ranks.append(RankWeights(embed=embed, layers=layers, norms=norms,
                                 final_norm=st["transformer.ln_f.weight"].float(),
                                 lm_head=lin(st, "lm_head", tuple(head.shape)),
                                 kv_scales=[None if s is None else (s, s) for s in kv]))
    return ranks, cfg


def kv_scale_is_the_largest(have, want, plan: ShardPlan, rank: int) -> bool:
    """One scale for K and V: both must be the larger of the source's (anything where it has none)."""
    if want is None:
        return True
    top = torch.maximum(want[0].float().max(), want[1].float().max())
    return have is not None and torch.equal(have[0].float().reshape(()), top) and \
        torch.equal(have[1].float().reshape(()), top)


def read_back(engine_dir: Path, engine) -> ReadBack:
    """The ranks as stored and as TensorRT-LLM computes with them (W8A16 re-rounded at load)."""
    ckpt = engine_dir / engine.outputs["trtllm_checkpoint"]
    ranks, cfg = trtllm_rank_weights(ckpt, engine.plan)
    computes, _ = trtllm_rank_weights(ckpt, engine.plan, as_target_computes=True)
    dtype = getattr(torch, cfg["dtype"])
    return ReadBack(ranks=ranks, plan=engine.plan, computes=computes, dense=lambda lw: reference_dense(lw, dtype),
                    kv_matches=kv_scale_is_the_largest)


TARGET = ExportTarget("trtllm", write=write_trtllm, read_back=read_back, refuse=refuse)
