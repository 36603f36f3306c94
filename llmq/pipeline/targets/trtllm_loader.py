"""TensorRT-LLM's legacy checkpoint loader, as data and rules: the strings and keys it accepts, which of llmq's
schemes it runs and at what padded shape, what it quantizes itself at load and how (so that `--verify` can compute
it), and the INT4 packing it shares with its PyTorch backend.

What the loader does with a checkpoint (`PretrainedModel.from_checkpoint` -> `preprocess_weights`, then each Parameter's
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

import torch

from ...errors import LlmqError
from ...models.reader import CheckpointReader

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

ROW_PARALLEL = ("attention.dense", "mlp.proj")   # split along inputs; every other linear along outputs


def _weight_only(qw) -> bool:
    return getattr(qw, "input_scale", None) is None and not getattr(qw, "dynamic", False) and \
        not qw.q.dtype.is_floating_point


def quant_algo_for(qw) -> str:
    """The TensorRT-LLM algorithm that serves one of our quantized weights, or an LlmqError saying why none does."""
    if getattr(qw, "fp4", None):
        raise LlmqError(f"{qw.scheme} artifacts are not written as a TensorRT-LLM checkpoint by llmq yet; use --target "
                        "llmq")
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


def int4_offset(qw) -> int:
    """0 when our 4-bit integers are stored signed ([-8, 7]), 8 when stored unsigned ([0, 15])."""
    return 0 if int(qw.q.min()) >= -8 and int(qw.q.max()) <= 7 else 8


def signed_int4(qw) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Our integer weights as signed 4-bit values, and the additive zero term TensorRT-LLM wants (or None)."""
    offset = int4_offset(qw)
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


def awq_dense(q: torch.Tensor, scale: torch.Tensor, zero_t: torch.Tensor | None) -> torch.Tensor:
    """q [out, in] signed, scale [out, G], zero_t [G, out] in the layer's layout -> float32 weight."""
    group = q.shape[1] // scale.shape[1]
    w = q.float() * scale.float().repeat_interleave(group, dim=1)
    if zero_t is not None:
        w = w + zero_t.float().T.repeat_interleave(group, dim=1)
    return w


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


def refuse_int8_embedding(src: CheckpointReader, name: str) -> None:
    """TensorRT-LLM (both backends) holds the embedding in the model dtype."""
    if src.embedding_quantized():
        raise LlmqError(f"--target {name}: this artifact's embedding table is INT8 (quantize --embedding int8) "
                        "and TensorRT-LLM holds the embedding in the model dtype, where the dequantized rows would be "
                        "re-rounded; use --target llmq or gguf, or quantize without --embedding int8")
