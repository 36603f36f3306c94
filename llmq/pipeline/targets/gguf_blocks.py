"""GGUF's block encoders: one quantized weight as llama.cpp's bytes, a dense tensor as its raw GGML type.

The arithmetic of the GGUF translation, apart from names and metadata: which integers and scales go where and what
is re-rounded. It reads nothing of the model, so each format is checked bit for bit on its own.

GGUF's legacy block formats hold 32 consecutive weights of a row with one fp16 scale (and, for Q4_1 / Q5_1, one fp16
min): Q8_0 is w = d * q with q int8; Q4_0 is w = d * (n - 8) with n a nibble in [0, 15]; Q4_1 is w = d * n + m; Q5_0
/ Q5_1 are Q4_0 / Q4_1 with a fifth bit (n in [0, 31], w = d * (n - 16) / d * n + m), the low nibbles laid out as
Q4's and the 32 fifth bits in a little-endian uint32 `qh` (bit j for weight j) after d (and m). llmq's
weights are w = (q - z) * s per group of g input columns, so a group of g = 32k columns is k blocks that share its
scale, and the mapping is
- INT8 symmetric -> Q8_0: the integers as they are, d = s;
- INT4 symmetric -> Q4_0: n = q + 8, d = s;
- INT4 asymmetric -> Q4_1: n = q + 8, d = s, m = -(8 + z) * s;
- INT5 symmetric / asymmetric -> Q5_0 / Q5_1: n = q + 16, d = s (m = -(16 + z) * s);
- MXFP4 -> MXFP4: the E8M0 exponent byte and the E2M1 codes (GGUF's kvalues are the same codes, doubled, with the
  exponent halved), weight j in the low nibble of byte j and j + 16 in the high one; every bit carried over;
- Q4_K / IQ4_XS / IQ4_NL (`llmq quantize --grid q4_k / iq4_xs`, llmq.models.qformat.GGMLWeight) -> the same type:
  llmq's codes and block scales are GGML's, packed by `llmq.quant.pack_q4_k` / `pack_iq4_xs` / `pack_iq4_nl` (the
  same bytes the checkpoint holds); nothing is re-rounded;
- NVFP4 -> NVFP4 (64 weights: four E4M3 scale bytes, then 8 bytes per 16 weights, weight j in the low nibble and
  j + 8 in the high one), codes and block scales carried over; the per-tensor global scale, which GGUF's block has no
  room for, goes into the `<tensor>.scale` F32 [1] ([experts] for merged experts) that llama.cpp multiplies the
  matmul's output by: 1 / g rounded to float32 (llmq divides by g), the one re-rounding, counted in the record.
The integers are always exact. d is exact whenever s is an fp16 number: every fp16 scale, and every bf16 scale from
2^-17 to 65504 (float32 scales are re-rounded). m = -(2^(b-1) + z) * s can need 12 significant bits where fp16 has
11, so some Q4_1 / Q5_1 mins (2% of the blocks on the tiny test model) move by half an fp16 ulp, at most 1/128 of a
quantization step. Every re-rounding is counted in the returned record.
What no block format holds (`block_type`) is refused with the way out.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as GT

from ...errors import LlmqError
from ...models.qweight import GGMLWeight

BLOCK = 32                                    # weights per Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 / MXFP4 block
NVFP4_SUPER = 64                              # weights per GGUF NVFP4 block (four 16-weight scale blocks)


def block_type(qw, name: str):
    """The GGML block format that holds this quantized weight exactly, or an LlmqError with the way out."""
    if isinstance(qw, GGMLWeight):   # GGML's own blocks: its scheme is the GGML type's name
        return GT[qw.scheme]
    if qw.fp4 == "mxfp4":
        return GT.MXFP4
    if qw.fp4:
        if qw.q.shape[1] % NVFP4_SUPER:
            raise LlmqError(f"{name}: {qw.q.shape[1]} input columns do not fill GGUF's {NVFP4_SUPER}-weight NVFP4 "
                            "blocks; use --target llmq")
        return GT.NVFP4
    if qw.is_float:
        raise LlmqError(f"{name}: FP8 weights have no GGUF block format; quantize to INT8/INT4 or build the "
                        "dense model and use llama-quantize")
    if qw.input_scale is not None or qw.dynamic:
        raise LlmqError(f"{name}: W8A8 (quantized activations) has no GGUF equivalent; llama.cpp quantizes "
                        "activations itself; re-quantize weight-only (`llmq quantize --bits 8`)")
    k = qw.q.shape[1]
    group = qw.group_size or k  # per channel / per tensor: one scale for the whole row
    if k % BLOCK or group % BLOCK:
        raise LlmqError(f"{name}: groups of {group} of {k} input columns do not fill GGUF's {BLOCK}-weight blocks; "
                        f"re-quantize with groups of {BLOCK} (`llmq quantize --group-size {BLOCK}`, or a multiple)")
    if qw.bits == 8:
        if not qw.symmetric:
            raise LlmqError(f"{name}: INT8 with zero points has no GGUF block format (Q8_0 is symmetric); "
                            "re-quantize symmetric (`llmq quantize --sym`)")
        return GT.Q8_0
    if qw.bits == 4:
        return GT.Q4_0 if qw.symmetric else GT.Q4_1
    if qw.bits == 5:
        return GT.Q5_0 if qw.symmetric else GT.Q5_1
    raise LlmqError(f"{name}: {qw.bits}-bit weights have no GGUF block format")


def _per_block(t: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """A scale or zero point ([1], [n, 1] or [n, groups]) as one float32 value per 32-column block: [n, k/32]."""
    t = t.float().reshape(1, 1) if t.numel() == 1 else t.float().reshape(n, -1)
    return t.expand(n, t.shape[1]).repeat_interleave(k // BLOCK // t.shape[1], dim=1)


class Rounding:
    """What writing fp16 block scales / mins changed, counted over every block of the file."""

    def __init__(self):
        self.blocks = 0
        self.scales = 0
        self.max_scale_rel = 0.0
        self.mins = 0
        self.max_min_steps = 0.0
        self.global_scales = 0
        self.max_global_rel = 0.0

    def reciprocal(self, g: torch.Tensor) -> torch.Tensor:
        """NVFP4's global divisor g as the float32 multiplier 1 / g that llama.cpp's `.scale` tensor is."""
        r = (1 / g.double()).float()
        self.global_scales += g.numel()
        self.max_global_rel = max(self.max_global_rel, float((r.double() * g.double() - 1).abs().max()))
        return r

    def to_fp16(self, v: torch.Tensor, step: torch.Tensor, kind: str) -> torch.Tensor:
        """v rounded to fp16 (refused where it overflows); counts the values that changed."""
        h = v.to(torch.float16)
        if not torch.isfinite(h).all():
            raise LlmqError(f"a block {kind} of {float(v.abs().max()):.3g} overflows GGUF's fp16 block {kind}s")
        changed = h.float() != v
        if kind == "scale":
            self.blocks += v.numel()
            self.scales += int(changed.sum())
            rel = ((h.float() - v).abs() / v.abs().clamp_min(torch.finfo(torch.float32).tiny)).max()
            self.max_scale_rel = max(self.max_scale_rel, float(rel))
        else:
            self.mins += int(changed.sum())
            err = ((h.float() - v).abs() / step.clamp_min(torch.finfo(torch.float32).tiny)).max()
            self.max_min_steps = max(self.max_min_steps, float(err))
        return h

    def record(self) -> dict:
        return {"integers": "exact", "blocks": self.blocks,
                "scales_rerounded_to_fp16": self.scales, "max_scale_rel_error": self.max_scale_rel,
                "mins_rerounded_to_fp16": self.mins, "max_min_error_in_steps": self.max_min_steps,
                "nvfp4_global_scales_as_float32_reciprocals": self.global_scales,
                "max_global_scale_rel_error": self.max_global_rel}


def _fp16_bytes(h: torch.Tensor) -> torch.Tensor:
    """fp16 [n, nb] -> its little-endian bytes [n, nb, 2]."""
    return h.contiguous().view(torch.uint8).reshape(*h.shape, 2)


def _nibbles(n: torch.Tensor) -> torch.Tensor:
    """[n, nb, 32] values in [0, 15] -> [n, nb, 16] bytes: weight j in the low nibble of byte j, j + 16 in the high."""
    return (n[..., :16] | (n[..., 16:] << 4)).to(torch.uint8)


def pack_blocks(qw, qtype, rounding: Rounding) -> np.ndarray:
    """The GGUF bytes [out, in/32 * block bytes] of one quantized weight, its integers carried over unchanged."""
    n, k = qw.q.shape
    if isinstance(qw, GGMLWeight):
        return qw.blocks().numpy()
    if qtype == GT.MXFP4:   # llmq's E8M0 exponent and E2M1 codes are GGUF's, byte for byte
        e = qw.scale.reshape(n, k // BLOCK, 1)
        return torch.cat([e, _nibbles(qw.q.reshape(n, k // BLOCK, BLOCK))], dim=-1).reshape(n, -1).numpy()
    if qtype == GT.NVFP4:   # E4M3 scale bytes are GGUF's UE4M3 for these (non-negative) scales
        c = qw.q.reshape(n, k // NVFP4_SUPER, 4, 16)
        nib = (c[..., :8] | (c[..., 8:] << 4)).reshape(n, k // NVFP4_SUPER, 32)
        d = qw.scale.view(torch.uint8).reshape(n, k // NVFP4_SUPER, 4)
        return torch.cat([d, nib], dim=-1).reshape(n, -1).numpy()
    q = qw.q.to(torch.int16).reshape(n, k // BLOCK, BLOCK)
    s = _per_block(qw.scale, n, k)
    d = _fp16_bytes(rounding.to_fp16(s, s, "scale"))
    if qtype == GT.Q8_0:
        return torch.cat([d, q.to(torch.int8).view(torch.uint8)], dim=-1).reshape(n, -1).numpy()
    half = 1 << (qw.bits - 1)
    if int(q.min()) < -half or int(q.max()) >= half:
        raise LlmqError(f"INT{qw.bits} weights outside [{-half}, {half - 1}]; the artifact is damaged")
    u = q + half
    parts = [d]
    if not qw.symmetric:
        m = -(half + _per_block(qw.zero_point, n, k)) * s
        parts.append(_fp16_bytes(rounding.to_fp16(m, s, "min")))
    if qw.bits == 5:   # the fifth bits: bit j of a little-endian uint32 for weight j
        high = ((u >> 4).to(torch.int64) << torch.arange(BLOCK)).sum(-1, keepdim=True)
        parts.append(((high >> torch.arange(0, 32, 8)) & 0xFF).to(torch.uint8))
    parts.append(_nibbles(u & 15))
    return torch.cat(parts, dim=-1).reshape(n, -1).numpy()


def dense_array(t: torch.Tensor, force_f32: bool = False) -> tuple[np.ndarray, GT]:
    """A dense tensor as (array, raw GGML type): F32 when asked (norms, biases), else its own dtype."""
    if force_f32 or t.dtype == torch.float32:
        return t.float().contiguous().numpy(), GT.F32
    if t.dtype == torch.float16:
        return t.contiguous().numpy(), GT.F16
    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.int16).numpy(), GT.BF16
    raise LlmqError(f"tensor of dtype {t.dtype} has no GGUF type")
