"""Every tensor of a GGUF file under llama.cpp's name and in its layout, read from the family's declaration.

Names and layout live apart from the block encoders (gguf_blocks.py): they are per family, not per format. Each
family's declaration (llmq.models.arch) names its llama.cpp architecture and tensors. llama.cpp's `llama`
architecture (Llama, Mistral) applies RoPE to adjacent pairs (2i, 2i+1) of a head where Hugging Face rotates
(i, i + d/2), so the q and k rows of every head are reordered, scales and zero points with their rows (Arch.
gguf_permutes_qk); `qwen2` and `qwen3` use the Hugging Face pairing (qwen2 keeps the q/k/v biases, qwen3 adds its
per-head q/k norms as attn_q_norm / attn_k_norm), and so does `phi3`, which reads q/k/v fused as attn_qkv and gate /
up fused as ffn_up (gate rows first: its SwiGLU gates with the first half), as Phi-3 stores them. llama.cpp's `gemma3`
takes Gemma 3's four norms a layer as the (1 + w) it multiplies by, scales the embeddings by sqrt(hidden) itself,
reads which layers slide (a per-layer pattern), their window and their rotary base from keys, and fixes the query
scale from the shapes, so a query_pre_attn_scalar that differs moves into the q norm. A mixture of experts gets
llama.cpp's router (ffn_gate_inp) and one merged 3-D tensor per expert role, and a shared expert its three
matrices and its gate (ffn_gate_inp_shexp, F32 like the router); GPT-OSS's router and experts keep their biases
(F32, the experts' merged [experts, out]) and its attention sinks are attn_sinks. Dense weights keep the source dtype;
norms and biases are F32, as llama.cpp's converter writes them. An INT8 embedding table (`quantize --embedding int8`,
one scale per row) is Q8_0 like any INT8 per-channel matrix; a tied model's output is that same token_embd, as
llama.cpp reads it.
"""

from __future__ import annotations

from collections import Counter

import gguf
import numpy as np
import torch
from gguf import MODEL_TENSOR as MT

from ...errors import LlmqError
from ...models.arch import MLP, ROUTER, SHARED_GATE, expert_role
from ...models.reader import CheckpointReader, LinearWeights
from ...models.sharding import join_rows, split_rows
from .gguf_blocks import Rounding, block_type, dense_array, pack_blocks
from .gguf_linear_attention import reorder_linear_attention


def rope_rows(heads: int, head_dim: int) -> torch.Tensor:
    """Source row for each row of a llama.cpp q/k weight: per head, rows (i, i + d/2) become rows (2i, 2i + 1)."""
    half = torch.arange(head_dim // 2)
    per_head = torch.stack([half, half + head_dim // 2], dim=1).flatten()
    return (torch.arange(heads)[:, None] * head_dim + per_head).flatten()


class Tensors:
    """Adds named tensors to the writer, counting GGML types and block-scale rounding."""

    def __init__(self, writer, arch):
        self.arch = arch
        self.writer = writer
        self.types: Counter = Counter()
        self.rounding = Rounding()

    def dense(self, name: str, t: torch.Tensor, force_f32: bool = False) -> None:
        arr, qtype = dense_array(t, force_f32)
        self.writer.add_tensor(name, arr, raw_dtype=qtype)
        self.types[qtype.name] += 1

    def linear(self, name: str, lw: LinearWeights, force_f32: bool = False) -> None:
        """A linear's weight (blocks, or dense: in the source dtype unless `force_f32`) and its bias (F32)."""
        if lw.qw is None:
            self.dense(f"{name}.weight", lw.weight, force_f32)
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
            self.dense(f"{name}.weight", torch.stack([lw.weight for lw in lws]))
            return self._biases(name, lws)
        qtypes = {block_type(lw.qw, lw.name) for lw in lws}
        if len(qtypes) > 1:
            raise LlmqError(f"{name}: experts in {sorted(t.name for t in qtypes)}; a merged GGUF expert tensor has "
                            "one type")
        (qtype,) = qtypes
        self.writer.add_tensor(f"{name}.weight", np.stack([pack_blocks(lw.qw, qtype, self.rounding) for lw in lws]),
                               raw_dtype=qtype)
        self.types[qtype.name] += 1
        self._global_scale(name, lws)
        self._biases(name, lws)

    def _biases(self, name: str, lws: list[LinearWeights]) -> None:
        """The experts' biases as one F32 tensor [experts, out] (GPT-OSS's), where they have them."""
        if lws[0].bias is not None:
            self.dense(f"{name}.bias", torch.stack([lw.bias for lw in lws]), force_f32=True)

    def _global_scale(self, name: str, lws: list[LinearWeights]) -> None:
        """NVFP4's global scales as llama.cpp's optional `<name>.scale` (one per matrix, [1] or [experts])."""
        if getattr(lws[0].qw, "global_scale", None) is not None:
            if not self.arch.gguf_ffn_scale and ".ffn_" in name and len(lws) == 1:   # Arch.gguf_ffn_scale
                raise LlmqError(f"{name}: llama.cpp's {self.arch.gguf_arch} graph does not apply NVFP4's per-tensor "
                                "scale to FFN matrices, so this file would compute them wrong; quantize to MXFP4 "
                                "(`llmq quantize --method mxfp4`) or INT4 / INT8, or use --target llmq")
            g = torch.cat([lw.qw.global_scale.float().reshape(1) for lw in lws])
            self.dense(f"{name}.scale", self.rounding.reciprocal(g), force_f32=True)


def gguf_name(role: str, arch, i: int) -> str:
    """llama.cpp's name of layer i's tensor `role` (without .weight / .bias), from the family's declaration (a MoE
    family's router, merged expert tensors and shared expert from its Experts)."""
    m = arch.moe
    if m is not None and m.shared and role.startswith("shared_expert"):   # its MLP's roles and its gate
        return gguf.TENSOR_NAMES[MT[m.gguf_shared[role.rpartition(".")[2]]]].format(bid=i)
    table = m.gguf if m is not None and role in m.gguf else \
        arch.linear_attention.gguf_linears if arch.linear_attention is not None and \
        role in arch.linear_attention.gguf_linears else arch.gguf
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


def add_weights(tensors: Tensors, src: CheckpointReader) -> None:
    """Every tensor under llama.cpp's name. A family whose RMSNorm scales by (offset + w) (Gemma) gets the norms
    stored as offset + w in float32, the weight llama.cpp's graph multiplies by, as its converter writes them."""
    names, s, arch = gguf.TENSOR_NAMES, src.spec, src.arch
    q_factor = query_norm_factor(src)
    tensors.linear(names[MT.TOKEN_EMBD], src.embedding())   # an INT8 table: Q8_0, as llama.cpp's own
    for i in range(s.num_layers):
        for role, t in src.layer_norms(i).items():
            t = t.float() + arch.norm_offset
            tensors.dense(f"{gguf_name(role, arch, i)}.weight", t * q_factor if role == "q_norm" else t, True)
        if arch.sinks and i not in s.linear_layers:   # GPT-OSS's attention sinks, F32
            tensors.dense(f"{gguf_name('sinks', arch, i)}.weight", src.layer_tensors(i)[arch.sinks], True)
        lin = src.layer_linears(i)
        if i in s.linear_layers:   # a Gated DeltaNet layer (llama.cpp's qwen35)
            for name, t in reorder_linear_attention(src, i, lin).items():
                tensors.dense(name, t, True)
        elif arch.gguf_permutes_qk:
            lin |= {r: split_rows(lin[r], rope_rows(heads, s.head_dim))
                    for r, heads in (("q_proj", s.num_heads), ("k_proj", s.num_kv_heads))}
        for group, (_, roles) in arch.fused.items():  # llama.cpp's phi3 reads them fused (attn_qkv, ffn_up)
            lin[group] = join_rows([lin.pop(r) for r in roles], gguf_name(group, arch, i))
        for role, lw in lin.items():
            if role.startswith("experts."):
                continue
            # a 16-bit router or shared expert gate F32, as llama.cpp's converter writes them
            tensors.linear(gguf_name(role, arch, i), lw, force_f32=role in (ROUTER, SHARED_GATE) and lw.qw is None)
        if s.num_experts:  # one merged tensor per expert role, experts in order
            for role in MLP:
                tensors.experts(gguf_name(role, arch, i), [lin[expert_role(e, role)] for e in range(s.num_experts)])
    tensors.dense(f"{names[MT.OUTPUT_NORM]}.weight", src.final_norm().float() + arch.norm_offset, True)
    if src.has_lm_head() or not s.tie_word_embeddings:  # tied: llama.cpp reuses token_embd as the output
        tensors.linear(names[MT.OUTPUT], src.lm_head())
