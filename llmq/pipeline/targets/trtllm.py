"""`--target trtllm`: a TensorRT-LLM checkpoint (config.json + rank<N>.safetensors), then the compile step.

Names and layouts follow TensorRT-LLM's checkpoint documentation (docs/source/architecture/checkpoint.md) and its
Llama converter (tensorrt_llm/models/llama/convert.py): per layer `attention.qkv` (q, k and v rows of this rank
stacked), `attention.dense` (o_proj), `mlp.fc` (gate_proj, the activated branch), `mlp.gate` (up_proj),
`mlp.proj` (down_proj), `input_layernorm`, `post_layernorm`; `transformer.vocab_embedding`, `transformer.ln_f`,
`lm_head` (vocab padded to a multiple of tp, always written, also for tied embeddings);
`attention.kv_cache_scaling_factor` (one float32 per layer, the larger of the K and V scales).

What its loader does with them (`PretrainedModel.from_checkpoint` -> `preprocess_weights`, then each Parameter's
value setter, which asserts the shape the layer constructor declared):
- INT4 with groups of 64 or 128 is W4A16_AWQ without pre-quant scale, the one pre-quantized layout the loader
  preprocesses itself (`preprocess_perlayer_weights`), so llmq's integers reach the GPU unchanged: `weight` int8
  [out/2, in] holding two signed 4-bit values per byte along the output axis (row 2j in the low nibble),
  `weights_scaling_factor` [out, in/group] (cast to the model dtype by the loader), and with zero points `zero`
  = -zero_point * scale in the layer's own [in/group, out] layout (not transposed by the loader).
- INT8 (per channel or grouped) is W8A16: the loader quantizes float weights itself (`weight_only_quantize_dict`:
  per output channel, scale = amax / 128, round half away from zero, clamp to [-128, 127]); its pre-quantized int8
  layout is GPU-architecture specific, so llmq writes the dequantized weights in the model dtype and `--verify`
  computes what that re-rounding does (`trtllm_requantize`) and records its KLD. Per-channel INT4 would be W4A16,
  re-rounded from llmq's 15 levels onto TensorRT-LLM's 16 (amax / 8, [-8, 7]): that moves most weights (KLD 1.1
  on SmolLM2), so it is refused with the ways out.
- Quantized layer constructors pad in/out features to a multiple of max(64, group) x tp (64 x tp for W8A16/W4A16)
  and `from_checkpoint` does not pad, so llmq writes every quantized linear at that padded shape: zero weights,
  scale 1, zero 0, each rank's padding after its real rows/columns.
- `exclude_modules` is fnmatched against module names (layer swap) and tensor names (W8A16/W4A16 quantization), and
  a non-empty list replaces the defaults, so llmq writes the defaults plus `<module>` and `<module>.*` per layer
  it keeps dense.
"""

from __future__ import annotations

import fnmatch
import json
from pathlib import Path

import torch

from ...errors import LlmqError
from ...models import qformat
from ...models.reader import CheckpointReader, LinearWeights
from ...models.sharding import RankWeights, ShardPlan, layer_slices, split_rows, vocab_slice

# The strings TensorRT-LLM accepts, read from tensorrt_llm/quantization/mode.py (class QuantAlgo(StrEnum), whose
# auto() values are the member names; QUANT_ALGO_LIST is every member but INT8; KV_CACHE_QUANT_ALGO_LIST is
# FP8, INT8, NVFP4). Listed here so that no import of tensorrt_llm is needed to validate a config.
TRTLLM_QUANT_ALGOS = frozenset({
    "W8A16", "W4A16", "W4A16_AWQ", "W4A8_AWQ", "W8A16_GPTQ", "W4A16_GPTQ", "W8A8_SQ_PER_CHANNEL",
    "W8A8_SQ_PER_TENSOR_PLUGIN", "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN", "W8A8_SQ_PER_CHANNEL_PER_TENSOR_PLUGIN",
    "W8A8_SQ_PER_TENSOR_PER_TOKEN_PLUGIN", "W4A8_QSERVE_PER_GROUP", "W4A8_QSERVE_PER_CHANNEL", "FP8",
    "FP8_PER_CHANNEL_PER_TOKEN", "FP8_BLOCK_SCALES", "MIXED_PRECISION", "NVFP4", "W4A8_NVFP4_FP8",
    "W4A8_MXFP4_FP8", "W4A8_MXFP4_MXFP8", "W4A16_MXFP4", "NO_QUANT"})
TRTLLM_KV_CACHE_QUANT_ALGOS = frozenset({"FP8", "INT8", "NVFP4"})
# The checkpoint's config keys (checkpoint.md's config table) and the quantization section's keys (QuantConfig).
TRTLLM_CONFIG_KEYS = frozenset({"architecture", "dtype", "logits_dtype", "vocab_size", "max_position_embeddings",
                                "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                                "hidden_act", "intermediate_size", "norm_epsilon", "position_embedding_type",
                                "mapping", "quantization", "use_parallel_embedding", "embedding_sharding_dim",
                                "head_size", "rotary_base", "rotary_scaling", "attn_bias", "mlp_bias",
                                "tie_word_embeddings", "qwen_type"})
TRTLLM_QUANT_KEYS = frozenset({"quant_algo", "kv_cache_quant_algo", "group_size", "smoothquant_val", "clamp_val",
                               "use_meta_recipe", "has_zero_point", "pre_quant_scale", "exclude_modules"})
# quantize_layers' own list, used when exclude_modules is empty; a non-empty list replaces it.
TRTLLM_DEFAULT_EXCLUDES = ("*lm_head", "*router", "*vocab_embedding", "*position_embedding", "*block_embedding",
                           "*shared_expert_gate")
AWQ_GROUP_SIZES = (64, 128)          # the groupwise (fpA_intB) kernels' group sizes
REQUANTIZED = ("W8A16",)             # algorithms whose weights the loader quantizes from floats
# weight_only_quantize_dict's quant_weights: the tensor names (substrings) it quantizes, unless excluded.
REQUANTIZED_TENSORS = ("qkv.weight", "dense.weight", "fc.weight", "proj.weight", "gate.weight")

TRT_MODULES = {"o_proj": "attention.dense", "gate_proj": "mlp.fc", "up_proj": "mlp.gate", "down_proj": "mlp.proj"}
ROW_PARALLEL = ("attention.dense", "mlp.proj")   # split along inputs; every other linear along outputs
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _weight_only(qw) -> bool:
    return getattr(qw, "input_scale", None) is None and not getattr(qw, "dynamic", False) and \
        not qw.q.dtype.is_floating_point


def quant_algo_for(qw) -> str:
    """The TensorRT-LLM algorithm that serves one of our quantized weights, or an LlmqError saying why none does."""
    if qw.q.dtype.is_floating_point:
        raise LlmqError("FP8 artifacts cannot be written as a TensorRT-LLM checkpoint by llmq yet "
                        "(TensorRT-LLM needs one scale for the fused qkv); use --target llmq or --target trtllm-hf")
    if not _weight_only(qw):
        raise LlmqError("W8A8 (SmoothQuant) artifacts cannot be written as a TensorRT-LLM checkpoint by llmq yet; "
                        "use --target llmq")
    grouped = qw.group_size is not None  # kept through slicing, even where a rank holds a single group
    if qw.bits == 4 and grouped:
        if qw.group_size not in AWQ_GROUP_SIZES:
            raise LlmqError(f"INT4 groups of {qw.group_size}: TensorRT-LLM's groupwise kernels take groups of "
                            f"{' or '.join(map(str, AWQ_GROUP_SIZES))}; re-quantize with --group-size 64 or 128")
        return "W4A16_AWQ"
    if not qw.symmetric and not grouped:
        raise LlmqError("asymmetric per-channel weights have no TensorRT-LLM weight-only algorithm; use --target llmq")
    if qw.bits == 4:
        raise LlmqError("INT4 per channel: TensorRT-LLM's W4A16 loader re-quantizes it onto its own 16-level grid, "
                        "moving most of llmq's integers (KLD 1.1 on SmolLM2); use --target trtllm-hf, which keeps "
                        "them, or quantize with --group-size 64 or 128 (W4A16_AWQ keeps them too)")
    return "W8A16"


def _int4_offset(qw) -> int:
    """0 when our 4-bit integers are stored signed ([-8, 7]), 8 when stored unsigned ([0, 15])."""
    return 0 if int(qw.q.min()) >= -8 and int(qw.q.max()) <= 7 else 8


def _signed_int4(qw) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Our integer weights as signed 4-bit values, and the additive zero term TensorRT-LLM wants (or None)."""
    offset = _int4_offset(qw)
    q = qw.q.to(torch.int16) - offset
    if int(q.min()) < -8 or int(q.max()) > 7:
        raise LlmqError("INT4 weights out of the 4-bit range; the artifact is damaged")
    zp = qw.zero_point
    if zp is None and offset == 0:
        return q.to(torch.int8), None
    zp = torch.zeros_like(qw.scale, dtype=torch.float32) if zp is None else zp.float()
    return q.to(torch.int8), ((offset - zp) * qw.scale.float())


def pack_int4_rows(q: torch.Tensor) -> torch.Tensor:
    """Signed int4 [out, in] -> int8 [out/2, in]: row 2j in the low nibble, row 2j+1 in the high nibble."""
    if q.shape[0] % 2:
        raise LlmqError(f"cannot pack {q.shape[0]} output rows two per byte for TensorRT-LLM (odd count)")
    lo, hi = q[0::2].to(torch.int16) & 0xF, q[1::2].to(torch.int16) & 0xF
    return (lo | (hi << 4)).to(torch.uint8).view(torch.int8)


def unpack_int4_rows(packed: torch.Tensor) -> torch.Tensor:
    b = packed.view(torch.uint8).to(torch.int16)
    lo, hi = b & 0xF, b >> 4
    lo, hi = torch.where(lo > 7, lo - 16, lo), torch.where(hi > 7, hi - 16, hi)
    return torch.stack([lo, hi], dim=1).reshape(-1, packed.shape[1]).to(torch.int8)


def round_half_away(x: torch.Tensor) -> torch.Tensor:
    """C's round(), which TensorRT-LLM's quantizer uses (torch.round rounds halves to even)."""
    return torch.sign(x) * torch.floor(x.abs() + 0.5)


def trtllm_requantize(w: torch.Tensor, bits: int) -> torch.Tensor:
    """float32 value of a stored weight [out, in] after TensorRT-LLM's W8A16/W4A16 load-time quantization
    (symmetric_quantize_last_axis_of_batched_matrix on the transposed weight): per output channel, scale =
    amax / 2^(b-1) kept in the weight's dtype, q = round(w / scale) clamped to [-2^(b-1), 2^(b-1)-1]."""
    half = float(1 << (bits - 1))
    amax = w.float().abs().amax(dim=1, keepdim=True) / half
    q = torch.where(amax > 0, round_half_away(w.float() / amax.clamp_min(1e-30)), torch.zeros(()))
    q = q.clamp(-half, half - 1)
    return q * amax.to(w.dtype).float()


def padding_multiple(algo: str | None, group_size: int, tp: int) -> int:
    """The multiple TensorRT-LLM's quantized linear constructors pad the full in/out features to (1: no padding)."""
    if algo == "W4A16_AWQ":
        return max(64, group_size) * tp
    return 64 * tp if algo in REQUANTIZED else 1


def local_shape(module: str, out_local: int, in_local: int, tp: int, multiple: int) -> tuple[int, int]:
    """[out, in] of one rank's tensor as the layer constructor declares it: full features padded to `multiple`,
    the split one divided by tp (outputs for column-parallel layers, inputs for row-parallel ones)."""
    up = lambda n: -(-n // multiple) * multiple  # noqa: E731
    if module.endswith(ROW_PARALLEL):
        return up(out_local), up(in_local * tp) // tp
    return up(out_local * tp) // tp, up(in_local)


def _pad(t: torch.Tensor, shape: tuple[int, ...], fill: float = 0) -> torch.Tensor:
    """t grown at the end of each dimension to `shape`, new entries `fill`."""
    if tuple(t.shape) == tuple(shape):
        return t
    out = torch.full(shape, fill, dtype=t.dtype)
    out[tuple(slice(0, n) for n in t.shape)] = t
    return out


def _awq_tensors(qw, dtype: torch.dtype, shape: tuple[int, int]) -> dict[str, torch.Tensor]:
    q, zero = _signed_int4(qw)
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
    q, zero = _signed_int4(lw.qw)
    return _awq_dense(q, lw.qw.scale.to(dtype), None if zero is None else zero.to(dtype).T)


def _awq_dense(q: torch.Tensor, scale: torch.Tensor, zero_t: torch.Tensor | None) -> torch.Tensor:
    """q [out, in] signed, scale [out, G], zero_t [G, out] in the layer's layout -> float32 weight."""
    group = q.shape[1] // scale.shape[1]
    w = q.float() * scale.float().repeat_interleave(group, dim=1)
    if zero_t is not None:
        w = w + zero_t.float().T.repeat_interleave(group, dim=1)
    return w


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
                    has_zero = has_zero or qw.zero_point is not None or bool(_int4_offset(qw))
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


def exclude_patterns(dense_modules: list[str]) -> list[str]:
    """exclude_modules for a quantized checkpoint: TensorRT-LLM's defaults (a non-empty list replaces them) plus
    each dense decoder linear as a module name and as its tensors' prefix (both kinds of name are fnmatched)."""
    return [*TRTLLM_DEFAULT_EXCLUDES, *(p for m in sorted(dense_modules) for p in (m, f"{m}.*"))]


def excluded(name: str, patterns: list[str] | None) -> bool:
    """Whether TensorRT-LLM leaves module or tensor `name` unquantized under exclude_modules `patterns`."""
    return any(fnmatch.fnmatchcase(name, p) for p in (patterns or TRTLLM_DEFAULT_EXCLUDES))


def requantized_at_load(tensor: str, patterns: list[str] | None) -> bool:
    """Whether TensorRT-LLM's W8A16 loader quantizes this float tensor (weight_only_quantize_dict's rule)."""
    return any(n in tensor for n in REQUANTIZED_TENSORS) and not excluded(tensor, patterns)


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


def validate_config(cfg: dict) -> None:
    """Refuse a config TensorRT-LLM would reject: unknown keys or algorithm strings outside its QuantAlgo enum."""
    if unknown := set(cfg) - TRTLLM_CONFIG_KEYS:
        raise LlmqError(f"TensorRT-LLM config has unknown keys: {sorted(unknown)}")
    q = cfg["quantization"]
    if unknown := set(q) - TRTLLM_QUANT_KEYS:
        raise LlmqError(f"TensorRT-LLM quantization section has unknown keys: {sorted(unknown)}")
    if q["quant_algo"] is not None and (q["quant_algo"] not in TRTLLM_QUANT_ALGOS or q["quant_algo"] == "INT8"):
        raise LlmqError(f"quant_algo {q['quant_algo']!r} is not one TensorRT-LLM accepts")
    if q["kv_cache_quant_algo"] is not None and q["kv_cache_quant_algo"] not in TRTLLM_KV_CACHE_QUANT_ALGOS:
        raise LlmqError(f"kv_cache_quant_algo {q['kv_cache_quant_algo']!r} is not one TensorRT-LLM accepts")
    if q["exclude_modules"] and (missing := set(TRTLLM_DEFAULT_EXCLUDES) - set(q["exclude_modules"])):
        raise LlmqError(f"exclude_modules replaces TensorRT-LLM's default exclusions and lacks {sorted(missing)}: "
                        "its loader would quantize those modules (a vocab embedding then needs scales nobody wrote)")
    m = cfg["mapping"]
    if m["world_size"] != m["tp_size"] * m["pp_size"]:
        raise LlmqError("TensorRT-LLM mapping: world_size must equal tp_size * pp_size")


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


def write_trtllm(src: CheckpointReader, plan: ShardPlan, out: Path, engine) -> dict:
    """Write the checkpoint under `out`, run the compile step; returns the engine record's ranks, quantization and
    outputs for this target (`engine` is the EngineSpec being written)."""
    from .compile import compile_trtllm

    if src.arch.trtllm_legacy is None:
        raise LlmqError(f"--target trtllm writes the legacy TensorRT-LLM checkpoint for Llama, Mistral and Qwen2 only, "
                        f"not {src.spec.architecture}; use --target trtllm-hf (TensorRT-LLM's PyTorch backend)")
    if src.spec.sliding_window is not None and src.spec.sliding_window < engine.max_seq_len:
        raise LlmqError(f"this model attends over a sliding window of {src.spec.sliding_window} tokens, which a "
                        "TensorRT-LLM checkpoint cannot carry (it is a run-time setting there); "
                        "use --target trtllm-hf, whose LLM-API options set max_attention_window")
    dtype_name = engine.dtype
    dtype = _DTYPES.get(dtype_name)
    if dtype is None:
        raise LlmqError(f"model dtype {dtype_name!r} has no TensorRT-LLM equivalent")
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
    return {"ranks": [f"trtllm/rank{r}.safetensors" for r in range(plan.tp)], "trtllm_checkpoint": "trtllm",
            "quantization": cfg["quantization"], "requantized_by_target": algo in REQUANTIZED,
            "compile": compile_trtllm(out, engine)}


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
            return LinearWeights(prefix, weight=_awq_dense(qint, scale.to(getattr(torch, cfg["dtype"])), zero),
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
