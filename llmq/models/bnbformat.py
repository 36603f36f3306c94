"""The one reader and writer of bitsandbytes checkpoints: what transformers' `BitsAndBytesConfig` + `save_pretrained`
writes, and what transformers, vLLM's bitsandbytes loader and TGI load back.

A second on-disk format beside compressed-tensors (qformat), because its tensors are bitsandbytes' own and the
engines that load them run bitsandbytes' kernels on them; llmq keeps them exactly as bitsandbytes serialized them:
- 4-bit (NF4): `weight` uint8 [(N*K+1)/2, 1] (two codes per byte over the flattened weight, first in the high
  nibble), `weight.absmax` (float32 per block, or uint8 when the absmax values are themselves quantized: "double
  quantization", with `weight.nested_absmax` / `weight.nested_quant_map` and an offset), `weight.quant_map` (the 16
  code values), and `weight.quant_state.bitsandbytes__nf4`: JSON bytes with blocksize, shape and dtype;
- 8-bit (LLM.int8): `weight` int8 [N, K], `SCB` float32 [N] (each row's absmax: w = q * SCB / 127), `weight_format`;
and `config.json` → `quantization_config` with quant_method "bitsandbytes", built by transformers' own
BitsAndBytesConfig, so a config it rejects is never written. Reading needs neither bitsandbytes nor transformers.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property

import torch

from .. import quant
from ..errors import LlmqError

EXTRA = "pip install 'llmq[bnb]'"
QUANT_METHOD = "bitsandbytes"
BLOCKSIZES = (64, 128, 256, 512, 1024, 2048, 4096)  # 4-bit blocks every bitsandbytes backend quantizes


def _import_bitsandbytes():
    """bitsandbytes, or None when it is not installed. Imported quietly: on CPUs with AVX512-BF16 it warns at import
    about an optional kernels package it would download."""
    import logging

    log = logging.getLogger("bitsandbytes")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        import bitsandbytes as bnb
    except ImportError:
        return None
    finally:
        log.setLevel(level)
    return bnb


def bitsandbytes():
    """The bitsandbytes module; an LlmqError naming the extra when it is not installed."""
    bnb = _import_bitsandbytes()
    if bnb is None:
        raise LlmqError(f"bitsandbytes is not installed; the bnb-nf4 / bnb-int8 methods need it: {EXTRA}")
    return bnb


def kernels():
    """bitsandbytes' registered ops (torch.ops.bitsandbytes) where it is installed, else None (the runtime then
    computes the same values in torch)."""
    return torch.ops.bitsandbytes if _import_bitsandbytes() is not None else None


@dataclass(frozen=True)
class BnbConfig:
    """A parsed bitsandbytes `quantization_config`: 4-bit ("nf4" / "fp4") or "int8", and the modules left dense."""

    kind: str
    skip: tuple[str, ...]
    threshold: float = 6.0
    compute_dtype: str = "float32"
    double_quant: bool = False

    def skips(self, name: str) -> bool:
        return any(name == s or name.endswith("." + s) or name.startswith(s + ".") for s in self.skip)


def quantization_config(kind: str, *, skip: tuple[str, ...] | list[str] = ("lm_head",), threshold: float = 6.0,
                        compute_dtype: str = "float32", double_quant: bool = False) -> dict:
    """The `quantization_config` dict transformers writes for these settings (kind: "nf4" or "int8")."""
    from transformers import BitsAndBytesConfig

    if kind == "int8":
        cfg = BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=threshold, llm_int8_skip_modules=list(skip))
    else:
        cfg = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=kind, bnb_4bit_use_double_quant=double_quant,
                                 bnb_4bit_compute_dtype=getattr(torch, compute_dtype), bnb_4bit_quant_storage="uint8",
                                 llm_int8_skip_modules=list(skip))
    return cfg.to_dict()


def parse_config(config: Mapping) -> BnbConfig | None:
    """The BnbConfig of a model config whose quantization_config is bitsandbytes', else None."""
    qc = config.get("quantization_config") or {}
    if qc.get("quant_method") != QUANT_METHOD:
        return None
    skip = tuple(qc.get("llm_int8_skip_modules") or ("lm_head",))
    if qc.get("load_in_8bit"):
        if qc.get("llm_int8_has_fp16_weight"):
            raise LlmqError("this bitsandbytes checkpoint keeps float16 weights (llm_int8_has_fp16_weight); llmq "
                            "reads int8 ones")
        return BnbConfig("int8", skip, threshold=float(qc.get("llm_int8_threshold", 6.0)))
    if qc.get("load_in_4bit"):
        kind = qc.get("bnb_4bit_quant_type", "fp4")
        if qc.get("bnb_4bit_quant_storage", "uint8") != "uint8" or kind not in ("nf4", "fp4"):
            raise LlmqError(f"bitsandbytes 4-bit {kind} stored as {qc.get('bnb_4bit_quant_storage')} is not "
                            "supported; llmq reads nf4 / fp4 stored as uint8")
        return BnbConfig(kind, skip, compute_dtype=str(qc.get("bnb_4bit_compute_dtype") or "float32"),
                         double_quant=bool(qc.get("bnb_4bit_use_double_quant")))
    raise LlmqError("a bitsandbytes quantization_config with neither load_in_4bit nor load_in_8bit set")


def _json_tensor(d: dict) -> torch.Tensor:
    return torch.tensor(list(json.dumps(d).encode()), dtype=torch.uint8)


@dataclass(frozen=True)
class NF4Weight:
    """One linear's 4-bit weight as bitsandbytes serialized it: `tensors` holds its checkpoint tensors under names
    relative to the linear ("weight", "weight.absmax", ...); the rest is derived from them."""

    tensors: dict

    @cached_property
    def state(self) -> dict:
        key = next((k for k in self.tensors if k.startswith("weight.quant_state.bitsandbytes__")), None)
        if key is None:
            raise LlmqError("a bitsandbytes 4-bit weight without its weight.quant_state.bitsandbytes__* tensor")
        return json.loads(bytes(self.tensors[key].tolist()).decode())

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.state["shape"])

    @property
    def blocksize(self) -> int:
        return int(self.state["blocksize"])

    @property
    def dtype(self) -> torch.dtype:
        """The dtype bitsandbytes dequantizes into (the weight's dtype when it was quantized)."""
        return getattr(torch, self.state["dtype"])

    @property
    def packed(self) -> torch.Tensor:
        return self.tensors["weight"]

    @property
    def code(self) -> torch.Tensor:
        return self.tensors["weight.quant_map"].float()

    @property
    def scheme(self) -> str:
        s = self.state
        return f"{s['quant_type'].upper()}-block{s['blocksize']}" + ("-dq" if "nested_blocksize" in s else "")

    def absmax(self) -> torch.Tensor:
        """Per-block absmax in float32, its double quantization undone as bitsandbytes does (dequantize the uint8
        codes blockwise, then add the offset)."""
        a = self.tensors["weight.absmax"]
        s = self.state
        if "nested_blocksize" not in s:
            return a.float()
        nested = quant.dequantize_blockwise(a, self.tensors["weight.nested_absmax"],
                                            self.tensors["weight.nested_quant_map"], int(s["nested_blocksize"]))
        return nested + torch.tensor(float(s["nested_offset"]), dtype=torch.float32)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        w = quant.dequantize_4bit(self.packed, self.absmax(), self.code, self.blocksize, self.shape, self.dtype)
        return w.to(dtype)

    @classmethod
    def cat(cls, parts: list["NF4Weight"]) -> "NF4Weight | None":
        """The weights stacked along the outputs (q/k/v, gate/up) as one serialized weight without double
        quantization, or None when blocks or nibbles would straddle two parts."""
        s0 = parts[0].state
        if any((p.state["blocksize"], p.state["quant_type"], p.state["dtype"], p.shape[1]) !=
               (s0["blocksize"], s0["quant_type"], s0["dtype"], parts[0].shape[1]) for p in parts):
            return None
        if any((p.shape[0] * p.shape[1]) % p.blocksize for p in parts) or not all(
                torch.equal(p.code, parts[0].code) for p in parts):
            return None
        shape = [sum(p.shape[0] for p in parts), parts[0].shape[1]]
        state = {k: s0[k] for k in ("quant_type", "blocksize", "dtype")} | {"shape": shape}
        return cls({"weight": torch.cat([p.packed.reshape(-1, 1) for p in parts]),
                    "weight.absmax": torch.cat([p.absmax() for p in parts]),
                    "weight.quant_map": parts[0].tensors["weight.quant_map"],
                    f"weight.quant_state.bitsandbytes__{s0['quant_type']}": _json_tensor(state)})


@dataclass(frozen=True)
class Int8Weight:
    """One linear's LLM.int8 weight: int8 rows q and their absmax SCB (w = q * SCB / 127), with the outlier threshold
    its activations are split at (from the config)."""

    q: torch.Tensor
    scb: torch.Tensor
    threshold: float

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    @property
    def scheme(self) -> str:
        return f"LLM.int8-threshold{self.threshold:g}"

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return quant.llm_int8_dequantize(self.q, self.scb, dtype)

    @classmethod
    def cat(cls, parts: list["Int8Weight"]) -> "Int8Weight":
        return cls(torch.cat([p.q for p in parts]), torch.cat([p.scb for p in parts]), parts[0].threshold)


def read_linear(tensors: Mapping[str, torch.Tensor], name: str, cfg: BnbConfig) -> NF4Weight | Int8Weight | None:
    """The weight of linear `name` in a bitsandbytes checkpoint, or None where it is stored dense."""
    w = tensors.get(f"{name}.weight")
    if cfg.skips(name) or w is None or w.dtype.is_floating_point:
        return None
    if cfg.kind == "int8":
        if w.dtype != torch.int8 or w.dim() != 2 or f"{name}.SCB" not in tensors:
            raise LlmqError(f"{name}: an LLM.int8 weight is int8 [out, in] with its SCB; found {w.dtype} "
                            f"{tuple(w.shape)}")
        return Int8Weight(w, tensors[f"{name}.SCB"].float(), cfg.threshold)
    prefix = f"{name}."
    out = NF4Weight({k[len(prefix):]: tensors[k] for k in tensors if k.startswith(prefix) and
                     k[len(prefix):].startswith("weight")})
    n, k = out.shape
    if w.dtype != torch.uint8 or w.numel() != (n * k + 1) // 2:
        raise LlmqError(f"{name}: 4-bit weight of {w.numel()} {w.dtype} does not hold a [{n}, {k}] matrix")
    return out


def write_linear(name: str, w: NF4Weight | Int8Weight) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of one linear, as bitsandbytes' Linear4bit / Linear8bitLt save them."""
    if isinstance(w, Int8Weight):
        return {f"{name}.weight": w.q.contiguous(), f"{name}.SCB": w.scb.contiguous(),
                f"{name}.weight_format": torch.tensor(0, dtype=torch.uint8)}  # 0: "row", the only layout
    return {f"{name}.{k}": v.contiguous() for k, v in w.tensors.items()}

