"""The one reader and writer of quantized checkpoints: the compressed-tensors layout that vLLM, SGLang and
transformers load.

In memory a quantized linear is a `QuantizedWeight`: one integer (or FP8 value) per weight, unpacked, with its scales.
On disk it is what compressed-tensors calls
- "pack-quantized" (weight-only INT4 / INT8): `weight_packed` int32 (values + 2^(b-1), packed densely along the input
  dimension), `weight_scale`, `weight_shape`, and for asymmetric weights `weight_zero_point` packed along the outputs;
- "int-quantized" (W8A8): `weight` int8, `weight_scale` [out, 1], `input_scale` when activations are static;
- "float-quantized" (FP8 E4M3): `weight` float8_e4m3fn, `weight_scale`, `input_scale` when activations are static;
  block FP8 (weights strategy "block", block_structure [128, 128]; activations dynamic per token per group of 128)
  has a float32 `weight_scale` [ceil(out / 128), ceil(in / 128)] (`llmq.quant`). The Hugging Face "fp8" config of
  the DeepSeek-V3 / Qwen3-FP8 releases (quant_method "fp8", weight_block_size, activation_scheme "dynamic") is read
  as that same scheme: its `weight_scale_inv` is the same multiplier under another name;
- "nvfp4-pack-quantized" (NVFP4, weight-only): `weight_packed` uint8 (two E2M1 codes a byte, the first in the low
  nibble), `weight_scale` float8_e4m3fn per 16 inputs, `weight_global_scale` float32 [1] (a divisor: `llmq.quant`);
- "mxfp4-pack-quantized" (MXFP4, weight-only): `weight_packed` as NVFP4's, `weight_scale` uint8 E8M0 exponents per
  32 inputs;
  either with FP4 activations too (W4A4, compressed-tensors' NVFP4 / MXFP4 presets): input_activations FP4 in the
  weights' groups, dynamic ("local" for NVFP4: its block scales are computed at run time under a static
  `input_global_scale` float32 [1], a divisor as weight_global_scale is; MXFP4: dynamic, nothing stored);
and `config.json` → `quantization_config` built from compressed-tensors' own pydantic models, so a config they reject
is never written, stamped with the compressed-tensors `version` that wrote it (as compressed-tensors itself does).
llmq writes and reads the format of the releases in [CT_MIN, CT_MAX) (pyproject.toml pins the same range): vLLM's
current release pins 0.17; a checkpoint stamped with a newer release is refused with one clear error rather than
misread. The output projection is dense (in `ignore`) unless `llmq quantize --lm-head int8` quantized it: then a
second config group targets `lm_head` alone with INT8 per-channel weights in the same pack-quantized layout
(transformers, compressed-tensors and vLLM resolve a module by its name before its class). A tied model is untied for
that: the embedding table stays 16-bit for the lookup, since transformers cannot load a quantized Embedding.
`llmq quantize --embedding int8` quantizes the table itself anyway, for llmq's runtime and the GGUF export: a group
targets `model.embed_tokens` with INT8 per-row weights in the same layout (compressed-tensors' own for an Embedding),
and a tied model's head is that table. transformers 5 refuses such a checkpoint (its weight initialisation needs a
dense Embedding weight); `load_hf_model` says so in one line.
Mixed precision (`--target-bpw`) uses the same mechanism: one weight-only group per other scheme, targeting its
modules by full name (e.g. `model.layers.29.mlp.down_proj`), and the 16-bit ones listed in `ignore`; across formats
(`--for`) each group carries its own format under "mixed-precision" (the config's side: qconfig.py), and each linear
is read in its group's format.
KV-cache scales are `<layer>.self_attn.k_scale` / `v_scale` ([1] per tensor, [kv_heads, 1, 1] per head, the
shapes compressed-tensors gives them) with `kv_cache_scheme` in the config;
a model whose weights stay dense but whose KV cache is calibrated has format "dense", no config groups and only a
`kv_cache_scheme` (what compressed-tensors itself writes for KV-cache-only quantization).
Every stage that reads or writes quantized weights goes through here.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .. import quant
from ..errors import LlmqError
from . import modelopt, qconfig
from .arch.base import EMBEDDING as EMBEDDING  # re-exported: the stages name the table through qformat
from .arch.base import LM_HEAD as LM_HEAD
from .qconfig import CT_MAX as CT_MAX  # the config side of the format (qconfig.py), re-exported for the stages
from .qconfig import CT_REQUIREMENT as CT_REQUIREMENT
from .qconfig import FP4_FORMATS as FP4_FORMATS
from .qconfig import FP4_NAMES, QuantArgs, fp4_activations_args
from .qconfig import QConfig as QConfig
from .qconfig import fp8_block_args as fp8_block_args
from .qconfig import quantization_config as quantization_config
from .qweight import GGML_WEIGHTS, check_scale, get_tensor
from .qweight import GGMLWeight as GGMLWeight
from .qweight import IQ4NLWeight as IQ4NLWeight
from .qweight import IQ4Weight as IQ4Weight
from .qweight import IQ4XSWeight as IQ4XSWeight
from .qweight import Q4KWeight as Q4KWeight
from .qweight import QuantizedWeight as QuantizedWeight


def parse_quantization_config(config: Mapping) -> QConfig | None:
    """The QConfig of a model config, None for an unquantized model; an LlmqError for anything we cannot read:
    ModelOpt's (modelopt.py), else compressed-tensors' and Hugging Face fp8's (qconfig.py)."""
    qc = config.get("quantization_config")
    if qc and modelopt.is_modelopt(qc):
        return modelopt.parse_config(qc)
    return qconfig.parse_quantization_config(config)


def read_linear(tensors: Mapping[str, torch.Tensor], name: str, qconfig: QConfig
                ) -> QuantizedWeight | GGMLWeight | None:
    """The QuantizedWeight (or GGMLWeight) of linear `name` (e.g. model.layers.0.mlp.up_proj), or None where it is
    stored dense; a QuantizedWeight is checked (QuantizedWeight.check) whichever layout it was read from, so that
    import refuses what a stage would fail on later."""
    qw = (qconfig.read or _read_compressed_tensors)(tensors, name, qconfig)
    return qw.check(name) if isinstance(qw, QuantizedWeight) else qw


def _packed(name: str, key: str, t: torch.Tensor, want: tuple[int, int], holds: str) -> None:
    """Refuse a packed tensor that is not int32 of the shape its unpacked form needs, before unpacking it."""
    if t.dtype != torch.int32 or tuple(t.shape) != want:
        raise LlmqError(f"{name}: {key} {str(t.dtype).removeprefix('torch.')} {list(t.shape)} does not hold {holds}; "
                        f"expected int32 {list(want)}")


def _weight_shape(name: str, t: torch.Tensor) -> torch.Size:
    shape = t.tolist() if t.dim() == 1 and t.numel() == 2 and not t.dtype.is_floating_point else None
    if shape is None or min(shape) <= 0:
        raise LlmqError(f"{name}: weight_shape {t.tolist()} is not two positive integers [out, in]")
    return torch.Size(shape)


def _read_compressed_tensors(tensors: Mapping[str, torch.Tensor], name: str, qconfig: QConfig
                             ) -> QuantizedWeight | GGMLWeight | None:
    if name in qconfig.ggml:
        cls = GGML_WEIGHTS[qconfig.ggml[name]]
        return cls.from_blocks(get_tensor(tensors, f"{name}.weight_{cls.grid}"), name)
    scheme = qconfig.scheme_of(name)
    scale_key = f"{name}.{qconfig.scale_name}"
    if scheme is None or (f"{name}.weight_packed" not in tensors and scale_key not in tensors):
        return None
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    w, a = scheme
    scale = get_tensor(tensors, scale_key)
    if w.strategy == "block":
        return _read_fp8_block(tensors, name, w, a, scale)
    fmt = qconfig.format_of(name)
    if w.fp4 or fmt in FP4_NAMES:
        if w.fp4 is None or a not in (None, fp4_activations_args(w.fp4)):
            raise LlmqError(f"{name}: {fmt} with {w.group_size}-weight groups"
                            f"{' and these quantized activations' if a else ''} is not read by llmq (NVFP4: 16, "
                            "MXFP4: 32; weight-only, or W4A4 with activations in the weights' FP4 format and groups)")
        return _read_fp4(tensors, name, w, scale, a is not None)
    zero = None
    if fmt == "pack-quantized":   # packed densely: ceil(count x bits / 32) int32 words
        shape, bits = _weight_shape(name, get_tensor(tensors, f"{name}.weight_shape")), w.num_bits
        packed = get_tensor(tensors, f"{name}.weight_packed")
        _packed(name, "weight_packed", packed, (shape[0], -(-shape[1] * bits // 32)),
                f"weight_shape {list(shape)} at {bits} bits")
        q = unpack_from_int32(packed, bits, shape)
        if not w.symmetric:
            zp, groups = get_tensor(tensors, f"{name}.weight_zero_point"), scale.shape[-1] if scale.dim() else 1
            _packed(name, "weight_zero_point", zp, (-(-shape[0] * bits // 32), groups),
                    f"{shape[0]} x {groups} zero points at {bits} bits (packed along the outputs)")
            zero = unpack_from_int32(zp, bits, torch.Size([shape[0], groups]), packed_dim=0)
    else:
        q = get_tensor(tensors, f"{name}.weight")
        if not w.symmetric:
            zero = get_tensor(tensors, f"{name}.weight_zero_point")
    want = torch.float8_e4m3fn if w.type == "float" else torch.int8
    if q.dtype != want or q.dim() != 2:
        raise LlmqError(f"{name}: quantized weight has dtype {q.dtype} and {q.dim()} dims; expected 2-D {want}")
    k = q.shape[1]
    g = 1 if scale.numel() == 1 else scale.shape[-1]
    input_scale = tensors[f"{name}.input_scale"] if (a and not a.dynamic) else None
    if a and not a.dynamic and input_scale is None:
        raise LlmqError(f"tensor {name}.input_scale is missing: the config says activations use static scales")
    group_size = int(w.group_size) if w.strategy == "group" and w.group_size else (k // g if g > 1 else None)
    return QuantizedWeight(q=q, scale=scale, zero_point=zero, bits=w.num_bits,
                           group_size=group_size, symmetric=w.symmetric, input_scale=input_scale,
                           dynamic=bool(a and a.dynamic))


def _read_fp8_block(tensors: Mapping[str, torch.Tensor], name: str, w: QuantArgs, a: QuantArgs | None,
                    scale: torch.Tensor) -> QuantizedWeight:
    q = get_tensor(tensors, f"{name}.weight")
    block = w.block_structure
    if block is None or w.type != "float" or w.num_bits != 8 or a is None or not a.dynamic or a.type != "float" \
            or a.strategy != "group" or a.group_size != block[1]:
        raise LlmqError(f"{name}: block-quantized weights are read as block FP8 (FP8 weights with a block_structure, "
                        "FP8 activations dynamic per group as wide as a block); this scheme is not that")
    n, k = q.shape if q.dim() == 2 else (0, 0)
    want = (-(-n // block[0]), -(-k // block[1]))
    if q.dtype != quant.FP8 or q.dim() != 2 or not scale.dtype.is_floating_point or tuple(scale.shape) != want:
        raise LlmqError(f"{name}: block FP8 tensors weight {q.dtype} {tuple(q.shape)} and scale {scale.dtype} "
                        f"{tuple(scale.shape)} do not fit; expected float8_e4m3fn [out, in] and a float scale {want}")
    return QuantizedWeight(q=q, scale=scale.float(), zero_point=None, bits=8, group_size=None, symmetric=True,
                           dynamic=True, block=tuple(block))


def _read_fp4(tensors: Mapping[str, torch.Tensor], name: str, w: QuantArgs, scale: torch.Tensor,
              w4a4: bool = False) -> QuantizedWeight:
    packed = get_tensor(tensors, f"{name}.weight_packed")
    block = FP4_FORMATS[w.fp4][0]
    want = quant.FP8 if w.fp4 == "nvfp4" else torch.uint8
    n, k = packed.shape[0], 2 * packed.shape[-1]
    if packed.dtype != torch.uint8 or packed.dim() != 2 or scale.dtype != want or tuple(scale.shape) != (n, k // block):
        raise LlmqError(f"{name}: {w.fp4.upper()} tensors weight_packed {packed.dtype} {tuple(packed.shape)} and "
                        f"weight_scale {scale.dtype} {tuple(scale.shape)} do not fit; expected uint8 [out, in / 2] and "
                        f"{want} [out, in / {block}]")
    g = get_tensor(tensors, f"{name}.weight_global_scale").float().reshape(1) if w.fp4 == "nvfp4" else None
    ig = get_tensor(tensors, f"{name}.input_global_scale").float().reshape(1) if w4a4 and w.fp4 == "nvfp4" else None
    return QuantizedWeight(q=quant.unpack_fp4(packed), scale=scale, zero_point=None, bits=4, group_size=block,
                           symmetric=True, global_scale=g, dynamic=w4a4, input_global_scale=ig)


def write_linear(name: str, qw: QuantizedWeight) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of one quantized linear, in the format its scheme implies."""
    if isinstance(qw, GGMLWeight):
        return {f"{name}.weight_{qw.grid}": qw.blocks().contiguous()}
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    out = {f"{name}.weight_scale": qw.scale.contiguous()}
    if qw.fp4:
        out[f"{name}.weight_packed"] = quant.pack_fp4(qw.q).contiguous()
        if qw.global_scale is not None:
            out[f"{name}.weight_global_scale"] = qw.global_scale.float().reshape(1).contiguous()
        if qw.input_global_scale is not None:
            out[f"{name}.input_global_scale"] = qw.input_global_scale.float().reshape(1).contiguous()
        return out
    weight_only = qw.input_scale is None and not qw.dynamic
    if not qw.is_float and weight_only:
        out[f"{name}.weight_packed"] = pack_to_int32(qw.q.to(torch.int8).contiguous(), qw.bits)
        out[f"{name}.weight_shape"] = torch.tensor(list(qw.q.shape), dtype=torch.int64)
        if qw.zero_point is not None:
            out[f"{name}.weight_zero_point"] = pack_to_int32(qw.zero_point.to(torch.int8).contiguous(), qw.bits,
                                                             packed_dim=0)
    else:
        out[f"{name}.weight"] = qw.q.contiguous()
        if qw.zero_point is not None:
            out[f"{name}.weight_zero_point"] = qw.zero_point.contiguous()
    if qw.input_scale is not None:
        out[f"{name}.input_scale"] = qw.input_scale.reshape(1).contiguous()
    return out


def read_kv_scales(tensors: Mapping[str, torch.Tensor], prefix: str,
                   qconfig: QConfig | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(k_scale, v_scale) of one attention layer (`model.layers.N.self_attn`), each [1] or [kv_heads]; None when the
    checkpoint has no KV-cache scheme."""
    if qconfig is None or qconfig.kv is None:
        return None
    scales = qconfig.read_kv(tensors, prefix) if qconfig.read_kv is not None else \
        tuple(get_tensor(tensors, f"{prefix}.{n}_scale").float().flatten() for n in "kv")
    for n, s in zip("kv", scales):
        check_scale(s, f"{prefix}.{n}_scale")
    return scales


def write_kv_scales(prefix: str, k_scale: torch.Tensor, v_scale: torch.Tensor) -> dict[str, torch.Tensor]:
    """k_scale / v_scale as compressed-tensors shapes them: [1] per tensor, [kv_heads, 1, 1] per head."""
    def shaped(s: torch.Tensor) -> torch.Tensor:
        s = s.float().flatten()
        return (s if s.numel() == 1 else s.reshape(-1, 1, 1)).contiguous()

    return {f"{prefix}.k_scale": shaped(k_scale), f"{prefix}.v_scale": shaped(v_scale)}


def kv_cache_dtype(qconfig: QConfig | None) -> str | None:
    """"int8" / "fp8" when the checkpoint carries calibrated KV-cache scales, else None."""
    if qconfig is None or qconfig.kv is None:
        return None
    return "fp8" if qconfig.kv.type == "float" else "int8"
