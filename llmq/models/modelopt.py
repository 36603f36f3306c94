"""Reading checkpoints in NVIDIA ModelOpt's format (the NVFP4 / FP8 releases on the Hub, and `llmq build --target
trtllm`'s own output), so a downloaded one can be evaluated, served and exported again.

The quantization is `hf_quant_config.json` (`checkpoint.read_config` hands it over as a quantization_config with
quant_method "modelopt"), in either of the two shapes TensorRT-LLM's `quantization/modelopt_config.py` reads: nested
under "quantization" (quant_algo, kv_cache_quant_algo, group_size, exclude_modules; ModelOpt <= 0.43) or flat
(quant_algo, group_size, ignore, kv_cache_scheme; ModelOpt 1.0, also config.json's inline copy). Each quant_algo is
mapped onto the llmq scheme that computes the same thing, with ModelOpt's tensors (`_torch/modules/linear.py`):
- FP8 (FP8QDQLinearMethod): `weight` float8_e4m3fn [out, in], float32 scalars `weight_scale` and `input_scale`, both
  multipliers as compressed-tensors' are: llmq's FP8 per-tensor W8A8 with static activations, values unchanged.
- FP8_PER_CHANNEL_PER_TOKEN (FP8RowwiseLinearMethod): `weight` float8_e4m3fn [out, in], float32 `weight_scale` [out]
  (compressed-tensors' [out, 1] is read too), activations dynamic per token: llmq's `--method fp8`, unchanged.
- FP8_BLOCK_SCALES (FP8BlockScalesLinearMethod): `weight` float8 [out, in], float32 `weight_scale` (the DeepSeek
  recipe's `weight_scale_inv`, same values) [ceil(out/128), ceil(in/128)], activations dynamic per 1 x 128: llmq's
  block FP8.
- NVFP4 (NVFP4LinearMethod): `weight` uint8 [out, in/2] (compressed-tensors' packing), `weight_scale` float8_e4m3fn
  [out, in/16] (the same block scales), float32 `weight_scale_2` and `input_scale`, MULTIPLIERS amax / 2688, where
  llmq's global scales are DIVISORS 2688 / amax: llmq takes g = float32(1 / s). For activations that is exactly the
  scale the backend quantizes them under (its loader inverts input_scale the same way). For weights ModelOpt's
  value is e2m1 * f32(block * weight_scale_2), llmq's e2m1 * f32(block / f32(1 / weight_scale_2)): not bit-exact.
  Three float32 roundings against two: on random data about a fifth of the weights differ, each by less than 2^-22
  relative, and both stay within 3 x 2^-24 of the float64 product (tests/test_modelopt_import.py pins this).
- W8A16 / W4A16 (WeightOnlyQuantLinearMethod): `weight` int8 [out, in] (INT4: [out/2, in], two rows a byte,
  `quant.pack_int4_rows`), `weight_scale` [out]: symmetric per-channel integers, unchanged.
- W4A16_AWQ: INT4 rows as W4A16's, `weight_scale` [out, in/group_size]; a `pre_quant_scale` [in] must be ones (llmq's
  integer weights have no activation pre-scale, and folding one in would re-round them).
MIXED_PRECISION: a quant_algo (and group_size) per linear in `quantized_layers` (hf_quant_config.json, or quant_cfg.json
laid over it); the most common becomes the scheme of every linear, the others are named modules.
kv_cache_quant_algo FP8: per-layer scalar `k_scale` / `v_scale` (ModelOpt puts them on `k_proj` / `v_proj`; llmq's
export on the attention module), llmq's FP8 KV cache. Modules in exclude_modules (`*` wildcards as fnmatch) are dense.
"""

from __future__ import annotations

import fnmatch
from collections import Counter
from collections.abc import Mapping

import torch

from .. import quant
from ..errors import LlmqError
from .checkpoint import MIXED_QUANT_CONFIG
from .qconfig import QConfig, QuantArgs, fp4_activations_args, fp8_block_args
from .qweight import QuantizedWeight, get_tensor

FP8_BLOCK = (128, 128)   # TensorRT-LLM's FP8_BLOCK_SCALES block (asserted by its HF fp8 reader)
ALGOS = ("FP8", "FP8_PER_CHANNEL_PER_TOKEN", "FP8_BLOCK_SCALES", "NVFP4", "W8A16", "W4A16", "W4A16_AWQ")
MIXED = "MIXED_PRECISION"   # a quant_algo per layer, in quantized_layers


def is_modelopt(qc: Mapping) -> bool:
    """TensorRT-LLM's test: quant_method "modelopt..." or producer name "modelopt"."""
    return str(qc.get("quant_method", "")).lower().startswith("modelopt") or \
        (qc.get("producer") or {}).get("name") == "modelopt"


def fields(qc: Mapping) -> dict:
    """quant_algo, kv_cache_quant_algo, group_size, exclude_modules and quantized_layers of either shape, with a
    MIXED_PRECISION checkpoint's quant_cfg.json laid over them as TensorRT-LLM does."""
    if isinstance(qc.get("quantization"), Mapping):
        out = dict(qc["quantization"])
    else:
        kv = qc.get("kv_cache_scheme")
        fp8_kv = isinstance(kv, Mapping) and kv.get("type") == "float" and kv.get("num_bits") == 8
        out = {"quant_algo": qc.get("quant_algo"), "kv_cache_quant_algo": "FP8" if fp8_kv else None,
               "group_size": qc.get("group_size"), "exclude_modules": qc.get("ignore") or [],
               "quantized_layers": qc.get("quantized_layers") or {}}
    if out.get("quant_algo") == MIXED:
        out.update(qc.get(MIXED_QUANT_CONFIG) or {})
    return out


def scheme(algo: str, group_size: int | None) -> tuple[QuantArgs, QuantArgs | None]:
    """llmq's (weights, input activations) for a ModelOpt quant_algo; an LlmqError naming what is read."""
    if algo == "FP8":
        return QuantArgs(8, "float", strategy="tensor"), QuantArgs(8, "float", strategy="tensor")
    if algo == "FP8_PER_CHANNEL_PER_TOKEN":
        return QuantArgs(8, "float", strategy="channel"), QuantArgs(8, "float", strategy="token", dynamic=True)
    if algo == "FP8_BLOCK_SCALES" and group_size in (None, FP8_BLOCK[1]):
        return fp8_block_args(FP8_BLOCK)
    if algo == "NVFP4" and group_size in (None, quant.NVFP4_BLOCK):
        return (QuantArgs(4, "float", strategy="tensor_group", group_size=quant.NVFP4_BLOCK),
                fp4_activations_args("nvfp4"))
    if algo in ("W8A16", "W4A16"):
        return QuantArgs(8 if algo == "W8A16" else 4, strategy="channel"), None
    if algo == "W4A16_AWQ" and group_size:
        return QuantArgs(4, strategy="group", group_size=group_size), None
    raise LlmqError(f"ModelOpt quant_algo {algo!r} (group_size {group_size}) is not read by llmq; it reads "
                    f"{', '.join(ALGOS)}, each alone or per layer ({MIXED}) (FP8_BLOCK_SCALES in blocks of 128, "
                    "NVFP4 in groups of 16, W4A16_AWQ with a group_size), and FP8 KV caches")


def parse_config(qc: Mapping) -> QConfig:
    """The QConfig of a ModelOpt quantization config."""
    f = fields(qc)
    kv = f.get("kv_cache_quant_algo")
    if kv not in (None, "FP8"):
        raise LlmqError(f"ModelOpt kv_cache_quant_algo {kv!r} is not read by llmq; it reads FP8 KV caches")
    algo, modules = f.get("quant_algo"), {}
    weights, acts = scheme(algo, f.get("group_size")) if algo not in (None, MIXED) else (None, None)
    if algo == MIXED:   # the most common scheme for every linear, the others by name (llmq's own mixed layout)
        layers = {n: scheme(e.get("quant_algo"), e.get("group_size"))
                  for n, e in (f.get("quantized_layers") or {}).items()}
        if not layers:
            raise LlmqError(f"ModelOpt {MIXED} without quantized_layers (in hf_quant_config.json or "
                            f"{MIXED_QUANT_CONFIG}): which layer has which quant_algo is not said")
        weights, acts = Counter(layers.values()).most_common(1)[0][0]
        modules = {n: w for n, (w, a) in layers.items() if (w, a) != (weights, acts)}
    ignore = tuple(f"re:{fnmatch.translate(p)}" if any(c in p for c in "*?[") else p
                   for p in f.get("exclude_modules") or ())
    return QConfig(format="modelopt", weights=weights, input_activations=acts, ignore=ignore,
                   kv=QuantArgs(8, "float", strategy="tensor") if kv else None, modules=modules,
                   read=read_linear, read_kv=read_kv_scales)


def _check(ok: bool, name: str, what: str, tensors: dict[str, torch.Tensor]) -> None:
    if not ok:
        got = ", ".join(f"{k} {t.dtype} {tuple(t.shape)}" for k, t in tensors.items())
        raise LlmqError(f"{name}: ModelOpt tensors {got} do not fit; expected {what}")


def _scalar(tensors: Mapping[str, torch.Tensor], key: str) -> torch.Tensor:
    t = get_tensor(tensors, key, "ModelOpt")
    if t.numel() != 1 or not t.dtype.is_floating_point:
        raise LlmqError(f"{key}: {t.dtype} {tuple(t.shape)} is not a float32 scalar")
    return t.float().reshape(1)


def divisor(multiplier: torch.Tensor) -> torch.Tensor:
    """llmq's global-scale divisor (2688 / amax) for ModelOpt's multiplier (amax / 2688): the float32 reciprocal,
    what TensorRT-LLM's NVFP4 loader computes for input_scale."""
    return 1.0 / multiplier.float()


def read_linear(tensors: Mapping[str, torch.Tensor], name: str, qconfig: QConfig) -> QuantizedWeight | None:
    """The QuantizedWeight of linear `name` stored in ModelOpt's layout, None where it is dense."""
    scheme_ = qconfig.scheme_of(name)
    scale_key = next((f"{name}.{k}" for k in ("weight_scale", "weight_scale_inv") if f"{name}.{k}" in tensors), None)
    if scheme_ is None:
        return None
    q = get_tensor(tensors, f"{name}.weight", "ModelOpt")
    if scale_key is None:   # stored dense, unless its codes are 8-bit ones that lost their scale
        if q.dtype.itemsize > 1:
            return None
        raise LlmqError(f"tensor {name}.weight_scale is missing from the ModelOpt checkpoint ({q.dtype} weight)")
    w, _ = scheme_
    scale = tensors[scale_key]
    seen = {"weight": q, scale_key.rsplit(".", 1)[1]: scale}
    n, k = q.shape if q.dim() == 2 else (0, 0)
    if w.fp4:
        _check(q.dtype == torch.uint8 and q.dim() == 2 and scale.dtype == quant.FP8
               and tuple(scale.shape) == (n, 2 * k // quant.NVFP4_BLOCK), name,
               "NVFP4: weight uint8 [out, in/2] and weight_scale float8_e4m3fn [out, in/16]", seen)
        return QuantizedWeight(q=quant.unpack_fp4(q), scale=scale, zero_point=None, bits=4,
                               group_size=quant.NVFP4_BLOCK, symmetric=True,
                               global_scale=divisor(_scalar(tensors, f"{name}.weight_scale_2")), dynamic=True,
                               input_global_scale=divisor(_scalar(tensors, f"{name}.input_scale")))
    if w.type == "float":
        if w.strategy == "block":
            if scale.dim() == 4:   # ModelOpt's fp8_pb_wo export adds two singleton dimensions
                scale = scale.squeeze(1).squeeze(-1)
            want = (-(-n // FP8_BLOCK[0]), -(-k // FP8_BLOCK[1]))
            _check(q.dtype == quant.FP8 and q.dim() == 2 and scale.dtype == torch.float32
                   and tuple(scale.shape) == want, name,
                   f"FP8_BLOCK_SCALES: weight float8_e4m3fn [out, in] and weight_scale float32 {list(want)}", seen)
            return QuantizedWeight(q=q, scale=scale, zero_point=None, bits=8, group_size=None, symmetric=True,
                                   dynamic=True, block=FP8_BLOCK)
        if w.strategy == "channel":
            _check(q.dtype == quant.FP8 and q.dim() == 2 and scale.dtype == torch.float32
                   and tuple(scale.shape) in ((n,), (n, 1)), name,
                   "FP8_PER_CHANNEL_PER_TOKEN: weight float8_e4m3fn [out, in] and weight_scale float32 [out]", seen)
            return QuantizedWeight(q=q, scale=scale.reshape(n, 1), zero_point=None, bits=8, group_size=None,
                                   symmetric=True, dynamic=True)
        _check(q.dtype == quant.FP8 and q.dim() == 2 and scale.numel() == 1, name,
               "FP8: weight float8_e4m3fn [out, in] and a scalar weight_scale", seen)
        if f"{name}.input_scale" not in tensors:
            raise LlmqError(f"{name}: FP8 without a static input_scale (dynamic per-tensor activations) is not "
                            "read by llmq; it computes FP8 with static per-tensor or dynamic per-token scales")
        return QuantizedWeight(q=q, scale=scale.float().reshape(1), zero_point=None, bits=8, group_size=None,
                               symmetric=True, input_scale=_scalar(tensors, f"{name}.input_scale"))
    rows = n if w.num_bits == 8 else 2 * n
    g = w.group_size if w.strategy == "group" else k
    _check(q.dtype == torch.int8 and q.dim() == 2 and k % g == 0 and tuple(scale.shape) == (
        (rows, k // g) if w.strategy == "group" else (rows,)), name,
        f"W{w.num_bits}A16: weight int8 [{'out' if w.num_bits == 8 else 'out/2'}, in] and weight_scale "
        + ("[out, in/group_size]" if w.strategy == "group" else "[out]"), seen)
    pre = tensors.get(f"{name}.pre_quant_scale")
    if pre is not None and not torch.equal(pre.float(), torch.ones_like(pre, dtype=torch.float32)):
        raise LlmqError(f"{name}: an AWQ pre_quant_scale other than ones is not read by llmq (its integer weights "
                        "take no activation pre-scale); dequantize the checkpoint or quantize the source with llmq")
    ints = q if w.num_bits == 8 else quant.unpack_int4_rows(q)
    return QuantizedWeight(q=ints, scale=scale if w.strategy == "group" else scale.reshape(-1, 1), zero_point=None,
                           bits=w.num_bits, group_size=g if w.strategy == "group" else None, symmetric=True)


def read_kv_scales(tensors: Mapping[str, torch.Tensor], prefix: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(k_scale, v_scale) [1] of attention module `prefix`: ModelOpt's on k_proj / v_proj, else on the module."""
    out = []
    for proj, s in (("k_proj", "k_scale"), ("v_proj", "v_scale")):
        key = f"{prefix}.{proj}.{s}" if f"{prefix}.{proj}.{s}" in tensors else f"{prefix}.{s}"
        out.append(_scalar(tensors, key))
    return out[0], out[1]
