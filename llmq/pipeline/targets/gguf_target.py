"""`--target gguf`: one .gguf file that llama.cpp (and Ollama) load, carrying llmq's integers unchanged.

GGUF's legacy block formats hold 32 consecutive weights of a row with one fp16 scale (and, for Q4_1, one fp16 min):
Q8_0 is w = d * q with q int8; Q4_0 is w = d * (n - 8) with n a nibble in [0, 15]; Q4_1 is w = d * n + m. llmq's
weights are w = (q - z) * s per group of g input columns, so a group of g = 32k columns is k blocks that share its
scale, and the mapping is
- INT8 symmetric -> Q8_0: the integers as they are, d = s;
- INT4 symmetric -> Q4_0: n = q + 8, d = s;
- INT4 asymmetric -> Q4_1: n = q + 8, d = s, m = -(8 + z) * s;
- MXFP4 -> MXFP4: the E8M0 exponent byte and the E2M1 codes (GGUF's kvalues are the same codes, doubled, with the
  exponent halved), weight j in the low nibble of byte j and j + 16 in the high one; every bit carried over;
- NVFP4 -> NVFP4 (64 weights: four E4M3 scale bytes, then 8 bytes per 16 weights, weight j in the low nibble and
  j + 8 in the high one), codes and block scales carried over; the per-tensor global scale, which GGUF's block has no
  room for, goes into the `<tensor>.scale` F32 [1] ([experts] for merged experts) that llama.cpp multiplies the
  matmul's output by: 1 / g rounded to float32 (llmq divides by g), the one re-rounding, counted in the record.
The integers are always exact. d is exact whenever s is an fp16 number: every fp16 scale, and every bf16 scale from
2^-17 to 65504 (float32 scales are re-rounded). m = -(8 + z) * s can need 12 significant bits where fp16 has 11, so
some Q4_1 mins (2% of the blocks on the tiny test model) move by half an fp16 ulp, at most 1/128 of a quantization
step. Every re-rounding is counted in the returned record.
What no block format holds is refused with the way out: groups that are not a multiple of 32 columns, INT8 with zero
points, FP8, W8A8 (llama.cpp quantizes activations its own way), calibrated KV-cache scales, one sliding window on
every layer (Mistral, Qwen) and RoPE scaling. Dense weights keep the source dtype; norms and biases are F32, as
llama.cpp's converter writes them. An INT8 embedding table (`quantize --embedding int8`, one scale per row) is Q8_0
like any INT8 per-channel matrix; a tied model's output is that same token_embd, as llama.cpp reads it.

Each family's declaration (llmq.models.arch) names its llama.cpp architecture and tensors. llama.cpp's `llama`
architecture (Llama, Mistral) applies RoPE to adjacent pairs (2i, 2i+1) of a head where Hugging Face rotates
(i, i + d/2), so the q and k rows of every head are reordered, scales and zero points with their rows (Arch.
gguf_permutes_qk); `qwen2` and `qwen3` use the Hugging Face pairing (qwen2 keeps the q/k/v biases, qwen3 adds its
per-head q/k norms as attn_q_norm / attn_k_norm), and so does `phi3`, which reads q/k/v fused as attn_qkv and gate /
up fused as ffn_up (gate rows first: its SwiGLU gates with the first half), as Phi-3 stores them. llama.cpp's `gemma3`
takes Gemma 3's four norms a layer as the (1 + w) it multiplies by, scales the embeddings by sqrt(hidden) itself,
reads which layers slide (a per-layer pattern), their window and their rotary base from keys, and fixes the query
scale from the shapes, so a query_pre_attn_scalar that differs moves into the q norm. A mixture of experts gets
llama.cpp's router (ffn_gate_inp) and one merged 3-D tensor per expert role. The tokenizer (byte-level BPE, or
Gemma's SentencePiece-style BPE with byte fallback), its special token ids and the chat template come from the
artifact's tokenizer files.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import MODEL_TENSOR as MT
from gguf import GGMLQuantizationType as GT

from ...errors import LlmqError
from ...models import importance
from ...models.arch import MLP, expert_role
from ...models.reader import CheckpointReader, LinearWeights
from ...models.sharding import ShardPlan, join_rows, split_rows
from .registry import ExportTarget, TargetResult

BLOCK = 32                                    # weights per Q8_0 / Q4_0 / Q4_1 / MXFP4 block
NVFP4_SUPER = 64                              # weights per GGUF NVFP4 block (four 16-weight scale blocks)
# tokenizer.json pre-tokenizers llama.cpp reproduces, by the name it knows them under (src/llama-vocab.cpp).
_QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_REGEX = _QWEN2_REGEX.replace(r"\p{N}|", r"\p{N}{1,3}|")
_BYTE_TOKEN = re.compile(r"<0x[0-9A-F]{2}>")   # SentencePiece's byte-fallback pieces


def refuse(src: CheckpointReader, engine) -> None:
    """One-line errors for what a GGUF file cannot say, before anything is written."""
    s, plan = src.spec, engine.plan
    if s.num_experts and not s.renormalize:
        raise LlmqError(f"--target gguf: llama.cpp's {src.arch.gguf_arch} renormalizes the chosen experts' weights, "
                        "which this model's config (norm_topk_prob false) does not; use --target llmq")
    if plan.tp != 1:
        raise LlmqError(f"--target gguf writes one unsharded file; llama.cpp splits layers across devices itself "
                        f"(--split-mode); use --tp 1, not --tp {plan.tp}")
    if src.kv_cache_dtype() is not None:
        raise LlmqError("--target gguf: llama.cpp has no calibrated KV-cache scales (its --cache-type-k quantizes "
                        "on the fly); build from the artifact before `llmq quantize-kv`, or use --target llmq")
    if s.sliding_window is not None and s.sliding_window < s.max_position_embeddings:
        raise LlmqError(f"--target gguf: sliding-window attention ({s.sliding_window} of "
                        f"{s.max_position_embeddings} positions) is not in llama.cpp's {src.arch.gguf_arch} "
                        "architecture; use --target llmq")
    if s.rope_scaling:
        raise LlmqError(f"--target gguf: RoPE scaling {s.rope_scaling.get('rope_type') or s.rope_scaling.get('type')!r}"
                        " is not written to GGUF by llmq yet; use --target llmq")


def block_type(qw, name: str):
    """The GGML block format that holds this quantized weight exactly, or an LlmqError with the way out."""
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
                        f"re-quantize with --group-size {BLOCK} (or a multiple of {BLOCK})")
    if qw.bits == 8:
        if not qw.symmetric:
            raise LlmqError(f"{name}: INT8 with zero points has no GGUF block format (Q8_0 is symmetric); "
                            "re-quantize without --asym")
        return GT.Q8_0
    if qw.bits == 4:
        return GT.Q4_0 if qw.symmetric else GT.Q4_1
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
                "q4_1_mins_rerounded_to_fp16": self.mins, "max_min_error_in_steps": self.max_min_steps,
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
        parts = [d, q.to(torch.int8).view(torch.uint8)]
    else:
        if int(q.min()) < -8 or int(q.max()) > 7:
            raise LlmqError("INT4 weights outside [-8, 7]; the artifact is damaged")
        packed = _nibbles(q + 8)
        if qtype == GT.Q4_0:
            parts = [d, packed]
        else:
            m = -(8 + _per_block(qw.zero_point, n, k)) * s
            parts = [d, _fp16_bytes(rounding.to_fp16(m, s, "min")), packed]
    return torch.cat(parts, dim=-1).reshape(n, -1).numpy()


def _dense(t: torch.Tensor, force_f32: bool = False) -> tuple[np.ndarray, GT]:
    """A dense tensor as (array, raw GGML type): F32 when asked (norms, biases), else its own dtype."""
    if force_f32 or t.dtype == torch.float32:
        return t.float().contiguous().numpy(), GT.F32
    if t.dtype == torch.float16:
        return t.contiguous().numpy(), GT.F16
    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.int16).numpy(), GT.BF16
    raise LlmqError(f"tensor of dtype {t.dtype} has no GGUF type")


def rope_rows(heads: int, head_dim: int) -> torch.Tensor:
    """Source row for each row of a llama.cpp q/k weight: per head, rows (i, i + d/2) become rows (2i, 2i + 1)."""
    half = torch.arange(head_dim // 2)
    per_head = torch.stack([half, half + head_dim // 2], dim=1).flatten()
    return (torch.arange(heads)[:, None] * head_dim + per_head).flatten()


class _Tensors:
    """Adds named tensors to the writer, counting GGML types and block-scale rounding."""

    def __init__(self, writer):
        self.writer = writer
        self.types: Counter = Counter()
        self.rounding = Rounding()

    def dense(self, name: str, t: torch.Tensor, force_f32: bool = False) -> None:
        arr, qtype = _dense(t, force_f32)
        self.writer.add_tensor(name, arr, raw_dtype=qtype)
        self.types[qtype.name] += 1

    def linear(self, name: str, lw: LinearWeights) -> None:
        if lw.qw is None:
            self.dense(f"{name}.weight", lw.weight)
        else:
            qtype = block_type(lw.qw, lw.name)
            self.writer.add_tensor(f"{name}.weight", pack_blocks(lw.qw, qtype, self.rounding), raw_dtype=qtype)
            self.types[qtype.name] += 1
            self._global_scale(name, [lw])
        if lw.bias is not None:
            self.dense(f"{name}.bias", lw.bias, force_f32=True)

    def experts(self, name: str, lws: list[LinearWeights]) -> None:
        """The experts' matrices of one role as llama.cpp's merged 3-D tensor [experts, out, in]: one GGML type for
        all of them (each expert's blocks packed as its own matrix would be)."""
        if any(lw.qw is None for lw in lws):
            if not all(lw.qw is None for lw in lws):
                raise LlmqError(f"{name}: some experts are quantized and some are not; a merged GGUF expert "
                                "tensor has one type")
            return self.dense(f"{name}.weight", torch.stack([lw.weight for lw in lws]))
        qtypes = {block_type(lw.qw, lw.name) for lw in lws}
        if len(qtypes) > 1:
            raise LlmqError(f"{name}: experts in {sorted(t.name for t in qtypes)}; a merged GGUF expert tensor has "
                            "one type")
        (qtype,) = qtypes
        self.writer.add_tensor(f"{name}.weight", np.stack([pack_blocks(lw.qw, qtype, self.rounding) for lw in lws]),
                               raw_dtype=qtype)
        self.types[qtype.name] += 1
        self._global_scale(name, lws)

    def _global_scale(self, name: str, lws: list[LinearWeights]) -> None:
        """NVFP4's global scales as llama.cpp's optional `<name>.scale` (one per matrix, [1] or [experts])."""
        if getattr(lws[0].qw, "global_scale", None) is not None:
            g = torch.cat([lw.qw.global_scale.float().reshape(1) for lw in lws])
            self.dense(f"{name}.scale", self.rounding.reciprocal(g), force_f32=True)


def gguf_name(role: str, arch, i: int) -> str:
    """llama.cpp's name of layer i's tensor `role` (without .weight / .bias), from the family's declaration (a MoE
    family's router and merged expert tensors from its Experts)."""
    table = arch.moe.gguf if arch.moe is not None and role in arch.moe.gguf else arch.gguf
    return gguf.TENSOR_NAMES[MT[table[role]]].format(bid=i)


def llama_cpp_attention_scale(spec) -> float:
    """The factor llama.cpp's `gemma3` multiplies queries by, which it derives from the shapes and reads from no key
    (src/models/gemma3.cpp): 1/sqrt(head_dim), or 1/sqrt(hidden / heads) for its 62-layer (27B) model. Every other
    architecture llmq writes scales by 1/sqrt(head_dim) too."""
    if spec.arch.gguf_arch == "gemma3" and spec.num_layers == 62:
        return (spec.hidden_size / spec.num_heads) ** -0.5
    return spec.head_dim ** -0.5


def query_norm_factor(src: CheckpointReader) -> float:
    """What the q norm's weight is multiplied by so that llama.cpp's fixed query scale gives the source's attention
    scale (query_pre_attn_scalar^-1/2): the q norm feeds only the scaled scores, so the ratio moves into it exactly
    (up to its float32 rounding). 1 where the two agree, as on every released Gemma 3."""
    s = src.spec
    factor = (s.attn_scale or s.head_dim ** -0.5) / llama_cpp_attention_scale(s)
    if factor != 1 and "q_norm" not in src.arch.norms:
        raise LlmqError(f"--target gguf: llama.cpp's {src.arch.gguf_arch} scales attention by "
                        f"{llama_cpp_attention_scale(s):.6g}, this model by {s.attn_scale:.6g}; use --target llmq")
    return factor


def _add_weights(tensors: _Tensors, src: CheckpointReader) -> None:
    """Every tensor under llama.cpp's name. A family whose RMSNorm scales by (offset + w) (Gemma) gets the norms
    stored as offset + w in float32, the weight llama.cpp's graph multiplies by, as its converter writes them."""
    names, s, arch = gguf.TENSOR_NAMES, src.spec, src.arch
    q_factor = query_norm_factor(src)
    tensors.linear(names[MT.TOKEN_EMBD], src.embedding())   # an INT8 table: Q8_0, as llama.cpp's own
    for i in range(s.num_layers):
        for role, t in src.layer_norms(i).items():
            t = t.float() + arch.norm_offset
            tensors.dense(f"{gguf_name(role, arch, i)}.weight", t * q_factor if role == "q_norm" else t, True)
        lin = src.layer_linears(i)
        if arch.gguf_permutes_qk:
            lin |= {r: split_rows(lin[r], rope_rows(heads, s.head_dim))
                    for r, heads in (("q_proj", s.num_heads), ("k_proj", s.num_kv_heads))}
        for group, (_, roles) in arch.fused.items():  # llama.cpp's phi3 reads them fused (attn_qkv, ffn_up)
            lin[group] = join_rows([lin.pop(r) for r in roles], gguf_name(group, arch, i))
        for role, lw in lin.items():
            if role.startswith("experts."):
                continue
            tensors.linear(gguf_name(role, arch, i), lw)
        if s.num_experts:  # one merged tensor per expert role, experts in order
            for role in MLP:
                tensors.experts(gguf_name(role, arch, i), [lin[expert_role(e, role)] for e in range(s.num_experts)])
    tensors.dense(f"{names[MT.OUTPUT_NORM]}.weight", src.final_norm().float() + arch.norm_offset, True)
    if src.has_lm_head() or not s.tie_word_embeddings:  # tied: llama.cpp reuses token_embd as the output
        tensors.linear(names[MT.OUTPUT], src.lm_head())


def _add_hparams(w, src: CheckpointReader, name: str) -> None:
    s = src.spec
    w.add_name(name)
    w.add_context_length(s.max_position_embeddings)
    w.add_embedding_length(s.hidden_size)
    w.add_block_count(s.num_layers)
    w.add_feed_forward_length(s.intermediate_size)  # Mixtral's is its experts' width
    if s.num_experts:
        w.add_expert_count(s.num_experts)
        w.add_expert_used_count(s.experts_per_token)
        w.add_expert_feed_forward_length(s.expert_size)  # what qwen3moe reads the experts' width from
    w.add_head_count(s.num_heads)
    w.add_head_count_kv(s.num_kv_heads)
    if s.head_dim * s.num_heads != s.hidden_size:
        w.add_key_length(s.head_dim)
        w.add_value_length(s.head_dim)
    w.add_rope_dimension_count(s.head_dim)
    w.add_rope_freq_base(s.rope_theta)
    w.add_layer_norm_rms_eps(s.rms_norm_eps)
    w.add_vocab_size(s.vocab_size)
    if s.local_layers:  # which layers slide, stated per layer (llama.cpp's default is Gemma 3's five to one)
        w.add_sliding_window(s.local_window)
        w.add_sliding_window_pattern([i in s.local_layers for i in range(s.num_layers)])
        w.add_rope_freq_base_swa(s.local_rope_theta)
    if s.final_softcap:
        w.add_final_logit_softcapping(s.final_softcap)


def pre_tokenizer_name(tok: dict) -> str | None:
    """llama.cpp's name for the tokenizer.json pre-tokenizer when it splits text the same way, else None."""
    if tok.get("normalizer"):
        return None
    pre = tok.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    shape = [(p.get("type"), p.get("use_regex"), p.get("individual_digits"),
              (p.get("pattern") or {}).get("Regex")) for p in steps]
    if shape == [("ByteLevel", True, None, None)]:
        return "gpt-2"
    if shape == [("Digits", None, True, None), ("ByteLevel", True, None, None)]:
        return "smollm"
    if len(shape) == 2 and shape[0][0] == "Split" and shape[1][:2] == ("ByteLevel", False) and \
            steps[0].get("behavior") == "Isolated" and not steps[0].get("invert"):
        return {_QWEN2_REGEX: "qwen2", _LLAMA3_REGEX: "llama-bpe"}.get(shape[0][3])
    return None


def _token_list(tok: dict, vocab_size: int) -> tuple[list[str], list[int]]:
    """Every id's token text and llama.cpp token type; ids past the tokenizer (embedding padding) are UNUSED. With
    byte fallback, the <0xNN> tokens are BYTE: llama.cpp spells unknown characters with them and decodes them."""
    TT = gguf.TokenType
    text = {i: t for t, i in tok["model"]["vocab"].items()}
    types = {i: TT.BYTE if tok["model"].get("byte_fallback") and _BYTE_TOKEN.fullmatch(t) else TT.NORMAL
             for i, t in text.items()}
    for a in tok.get("added_tokens") or []:
        text[a["id"]] = a["content"]
        types[a["id"]] = TT.CONTROL if a.get("special") else TT.USER_DEFINED
    if max(text) >= vocab_size:
        raise LlmqError(f"tokenizer has token id {max(text)} but the model's vocabulary is {vocab_size}")
    return ([text.get(i, f"[PAD{i}]") for i in range(vocab_size)],
            [int(types.get(i, TT.UNUSED)) for i in range(vocab_size)])


def tokenizer_model(tok: dict) -> str | None:
    """llama.cpp's tokenizer.ggml.model for a tokenizer.json it reproduces: "gpt2" for byte-level BPE; "llama"
    (SentencePiece) for BPE over characters with byte fallback where spaces are spelled ▁ and nothing is
    prepended (Gemma's shape: llama.cpp's add_space_prefix off); else None."""
    model, decoder, norm = tok.get("model") or {}, tok.get("decoder") or {}, tok.get("normalizer") or {}
    if model.get("type") != "BPE":
        return None
    if not model.get("byte_fallback") and decoder.get("type") == "ByteLevel":
        return "gpt2"
    pre = tok.get("pre_tokenizer")
    spaces = {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}
    if model.get("byte_fallback") and norm == spaces and \
            [d.get("type") for d in decoder.get("decoders") or ()] == ["Replace", "ByteFallback", "Fuse"] and \
            decoder["decoders"][0].get("pattern") == {"String": "▁"} and \
            (pre is None or (pre.get("type"), pre.get("pattern")) == ("Split", {"String": " "})):  # no-op: no spaces
        return "llama"                                                                           # are left
    return None


def merge_scores(tok: dict, tokens: list[str]) -> list[float]:
    """tokenizer.ggml.scores for llama.cpp's SentencePiece tokenizer, which repeatedly joins the adjacent pair whose
    joined token scores highest, where a BPE tokenizer.json joins the pair whose merge ranks first: minus the rank of
    the first merge that makes a token gives the same order. Tokens no merge makes (characters, bytes, added tokens)
    score below every merge."""
    merges = tok["model"].get("merges") or ()
    first: dict[str, int] = {}
    for r, m in enumerate(merges):
        a, b = m.split(" ", 1) if isinstance(m, str) else m
        first.setdefault(a + b, r)
    return [-float(first.get(t, len(merges))) for t in tokens]


def _adds_special(tokenizer_json: Path, bos: int | None, eos: int | None) -> tuple[bool, bool]:
    """Whether the source tokenizer puts BOS before / EOS after a text, found by encoding one."""
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(tokenizer_json)).encode("a", add_special_tokens=True).ids
    return bool(ids) and ids[0] == bos, bool(ids) and ids[-1] == eos


def _add_tokenizer(w, src: CheckpointReader) -> dict:
    """Vocabulary (with merges for BPE, merge-order scores for SentencePiece), special ids, BOS/EOS behaviour and
    chat template; returns what was written."""
    path = src.path / "tokenizer.json"
    if not path.is_file():
        raise LlmqError(f"{src.path}: --target gguf needs tokenizer.json (a byte-level BPE or SentencePiece-style "
                        "tokenizer)")
    tok = json.loads(path.read_text(encoding="utf-8"))
    kind = tokenizer_model(tok)
    if kind is None:
        model, decoder = tok.get("model") or {}, tok.get("decoder") or {}
        raise LlmqError("--target gguf writes byte-level BPE (GPT-2 style) and Gemma-style SentencePiece BPE "
                        f"tokenizers only; this one is {model.get('type')} with a {decoder.get('type')} decoder")
    tokens, types = _token_list(tok, src.spec.vocab_size)
    special = gguf.SpecialVocab(src.path, load_merges=kind == "gpt2", n_vocab=src.spec.vocab_size)
    pre = pre_tokenizer_name(tok) if kind == "gpt2" else "default"   # SentencePiece has no pre-tokenizer
    w.add_tokenizer_model(kind)
    w.add_tokenizer_pre(pre or "default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    if kind == "llama":
        w.add_token_scores(merge_scores(tok, tokens))
        w.add_add_space_prefix(False)
    ids = special.special_token_ids
    add_bos, add_eos = _adds_special(path, ids.get("bos"), ids.get("eos"))
    special.add_special_token = {}   # decided by encoding above, not from config heuristics
    special.add_to_gguf(w, quiet=True)
    w.add_add_bos_token(add_bos)
    w.add_add_eos_token(add_eos)
    warnings = []
    if pre is None:
        warnings.append("pre-tokenizer not one llama.cpp knows: written as 'default', so llama.cpp may split "
                        "text differently from the source tokenizer (token ids given directly are unaffected)")
    if kind == "gpt2" and not special.merges:
        warnings.append("the tokenizer has no BPE merges; llama.cpp refuses a BPE vocabulary without "
                        "tokenizer.ggml.merges")
    return {"model": kind, "pre": pre or "default", "tokens": len(tokens), "merges": len(special.merges),
            "special_token_ids": dict(ids), "add_bos": add_bos, "add_eos": add_eos,
            "chat_template": special.chat_template is not None, "warnings": warnings}


def _file_type(types: Counter, dense_dtype: str) -> tuple[str, int]:
    """general.file_type: the block format of the quantized linears, else the dense dtype."""
    F = gguf.LlamaFileType
    for t in ("Q4_1", "Q4_0", "Q8_0"):
        if types.get(t):
            return t, int(getattr(F, f"MOSTLY_{t}"))
    if types.get("NVFP4"):
        return "NVFP4", int(F.MOSTLY_NVFP4)
    if types.get("MXFP4"):   # llama.cpp's one MXFP4 file type, named for GPT-OSS's experts
        return "MXFP4", int(F.MOSTLY_MXFP4_MOE)
    return {"bfloat16": ("BF16", int(F.MOSTLY_BF16)), "float16": ("F16", int(F.MOSTLY_F16))}.get(
        dense_dtype, ("F32", int(F.ALL_F32)))


def write_gguf(src: CheckpointReader, plan: ShardPlan, out: Path, engine) -> TargetResult:
    """Write `<source>.<type>.gguf` under `out`; the record says its file, types and what was re-rounded."""
    arch = src.arch.gguf_arch
    source_name = engine.source["name"]
    w = gguf.GGUFWriter(None, arch, use_temp_file=True)
    _add_hparams(w, src, source_name)
    tokenizer = _add_tokenizer(w, src)   # before the weights: a tokenizer GGUF cannot hold is refused early
    tensors = _Tensors(w)
    _add_weights(tensors, src)
    ftype_name, ftype = _file_type(tensors.types, engine.dtype)
    w.add_file_type(ftype)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    fname = f"{source_name}.{ftype_name}.gguf"
    w.write_header_to_file(out / fname)
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    imatrix = write_imatrix(src, out / f"{source_name}.imatrix.gguf")
    return TargetResult({"gguf": {"file": fname, "architecture": arch, "file_type": ftype_name,
                                  "tensor_types": dict(sorted(tensors.types.items())),
                                  "rounding": tensors.rounding.record(), "tokenizer": tokenizer,
                                  "imatrix": imatrix}})


def imatrix_entries(src: CheckpointReader, stats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """{llama.cpp tensor name: mean squared input [matrices, in]} of the linears `stats` has: one matrix per
    tensor, one per expert for a merged expert tensor; a fused group (Phi-3's attn_qkv) under its fused name."""
    arch, s = src.arch, src.spec
    out: dict[str, torch.Tensor] = {}
    fused = {r: g for g, (_, roles) in arch.fused.items() for r in roles}
    for i in range(s.num_layers):
        for role in s.roles():
            if role.startswith("experts."):
                continue
            group = fused.get(role)
            key = f"{arch.prefix(i)}.{arch.fused[group][0]}" if group else arch.linear(i, role)
            if key in stats:
                out[f"{gguf_name(group or role, arch, i)}.weight"] = stats[key].float().view(1, -1)
        for role in MLP if s.num_experts else ():
            keys = [arch.linear(i, expert_role(e, role)) for e in range(s.num_experts)]
            if all(k in stats for k in keys):
                out[f"{gguf_name(role, arch, i)}.weight"] = torch.stack([stats[k].float() for k in keys])
    return out


def write_imatrix(src: CheckpointReader, path: Path) -> dict | None:
    """llama.cpp's importance-matrix file, as `llama-imatrix` writes it (GGUF: `<tensor>.in_sum2` sums of squared
    inputs [matrices, in] and `<tensor>.counts` [matrices, 1], F32; general.type imatrix, the datasets, chunk count
    and size), from the calibration statistics `llmq quantize` kept: `llama-quantize --imatrix` then quantizes with
    llmq's calibration. None when the artifact has none (round-to-nearest, or not a quantized artifact)."""
    got = importance.read(src.path)
    if got is None:
        return None
    stats, meta = got
    entries = imatrix_entries(src, stats)
    tokens = meta["tokens"]
    w = gguf.GGUFWriter(None, src.arch.gguf_arch, use_temp_file=True)
    w.add_type("imatrix")
    w.add_array("imatrix.datasets", [f"llmq quantize calibration: {meta['source']}"])
    w.add_uint32("imatrix.chunk_count", meta["windows"])
    w.add_uint32("imatrix.chunk_size", meta["window"])
    for name, mean in sorted(entries.items()):
        w.add_tensor(f"{name}.in_sum2", (mean.double() * tokens).float().numpy())
        w.add_tensor(f"{name}.counts", np.full((mean.shape[0], 1), tokens, np.float32))
    w.write_header_to_file(path)
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {"file": path.name, "tensors": len(entries), "tokens": tokens, "windows": meta["windows"]}


TARGET = ExportTarget("gguf", write=write_gguf, read_back=None, refuse=refuse, no_verify=(
    "--verify runs the tensor-parallel reference check, which a single GGUF file has no use for; drop --verify "
    "(the GGUF writer packs llmq's integers as they are and records what it re-rounds)"))
