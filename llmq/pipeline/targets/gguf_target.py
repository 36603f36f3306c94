"""`--target gguf`: one .gguf file that llama.cpp (and Ollama) load, carrying llmq's integers unchanged.

This module is the target: what a GGUF file cannot say, refused before anything is written (`refuse`: calibrated
KV-cache scales, one sliding window on every layer (Mistral, Qwen), RoPE scaling other than YaRN, a SwiGLU clamp
other than llama.cpp's, tensor parallelism), and the writer that puts the parts together and records them. The
parts: the block encoders (gguf_blocks.py: INT8 -> Q8_0, INT4 -> Q4_0 / Q4_1, INT5 -> Q5_0 / Q5_1, MXFP4 and NVFP4
carried over, every re-rounding counted), the tensors under llama.cpp's names and layout (gguf_tensors.py), the
hyperparameters and the tokenizer (gguf_meta.py), llama.cpp's importance matrix beside the file
(gguf_imatrix.py) and, for a vision-language model, its tower as an mmproj GGUF (gguf_mmproj.py). The build records
the file's quality as llama.cpp's CPU arithmetic gives it, modelled (gguf_compute.py).
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

import gguf

from ...errors import LlmqError
from ...models.reader import CheckpointReader
from ...models.sharding import ShardPlan
from .gguf_compute import modelled_quality
from .gguf_imatrix import write_imatrix
from .gguf_meta import add_hparams, add_tokenizer
from .gguf_mmproj import write_mmproj
from .gguf_tensors import Tensors, add_weights
from .registry import ExportTarget, TargetResult

log = logging.getLogger(__name__)


def refuse(src: CheckpointReader, engine) -> None:
    """One-line errors for what a GGUF file cannot say, before anything is written."""
    s, plan = src.spec, engine.plan
    if src.arch.gguf_refused:
        raise LlmqError(f"--target gguf: {src.arch.gguf_refused}; use --target llmq, or serve the artifact itself")
    if s.num_experts and not s.renormalize:
        raise LlmqError(f"--target gguf: llama.cpp's {src.arch.gguf_arch} renormalizes the chosen experts' weights, "
                        "which this model's config (norm_topk_prob false) does not; use --target llmq")
    if plan.tp != 1:
        raise LlmqError(f"--target gguf writes one unsharded file; llama.cpp splits layers across devices itself "
                        f"(`llama-server --split-mode`); use --tp 1, not --tp {plan.tp}")
    if src.kv_cache_dtype() is not None:
        raise LlmqError("--target gguf: llama.cpp has no calibrated KV-cache scales (its "
                        "`llama-server --cache-type-k` quantizes on the fly); build from the artifact before "
                        "`llmq quantize-kv`, or use --target llmq")
    if s.sliding_window is not None and s.sliding_window < s.max_position_embeddings:
        raise LlmqError(f"--target gguf: sliding-window attention ({s.sliding_window} of "
                        f"{s.max_position_embeddings} positions) is not in llama.cpp's {src.arch.gguf_arch} "
                        "architecture; use --target llmq")
    nope = tuple(i for i in range(s.num_layers) if (i + 1) % 4 == 0)
    if src.arch.rope_layers and s.nope_layers != nope:
        raise LlmqError(f"--target gguf: llama.cpp's {src.arch.gguf_arch} leaves the rotary embedding out of every "
                        f"fourth layer ({list(nope)}), this model out of layers {list(s.nope_layers)}; use --target "
                        "llmq")
    if s.linear_layers and s.linear_key_dim != s.linear_value_dim:
        raise LlmqError(f"--target gguf: llama.cpp's {src.arch.gguf_arch} gives a Gated DeltaNet layer one head width "
                        f"for keys and values, this model {s.linear_key_dim} and {s.linear_value_dim}; serve the "
                        "artifact with llmq (llmq serve)")
    sections = sum(src.arch.gguf_rope_sections or ())
    if sections > s.head_dim:
        raise LlmqError(f"--target gguf: llama.cpp's {src.arch.gguf_arch} needs heads of at least {sections} "
                        f"(its M-RoPE sections), this model's are {s.head_dim}; serve the artifact with llmq (llmq "
                        "serve)")
    kind = s.rope_scaling and (s.rope_scaling.get("rope_type") or s.rope_scaling.get("type"))
    if s.rope_scaling and (kind != "yarn" or {"mscale", "mscale_all_dim"} & set(s.rope_scaling)):
        shown = f"{kind!r}{' with mscale' if kind == 'yarn' else ''}"
        raise LlmqError(f"--target gguf: RoPE scaling {shown} is not written to GGUF by llmq yet (YaRN is); use "
                        "--target llmq")
    if s.swiglu is not None and s.swiglu != LLAMA_CPP_SWIGLU:
        raise LlmqError(f"--target gguf: llama.cpp's {src.arch.gguf_arch} clamps its SwiGLU with alpha "
                        f"{LLAMA_CPP_SWIGLU[0]} and limit {LLAMA_CPP_SWIGLU[1]} (fixed in its graph), this model with "
                        f"swiglu_alpha {s.swiglu[0]} and swiglu_limit {s.swiglu[1]}; use --target llmq")


# the (alpha, limit) llama.cpp's SwiGLU_OAI fixes for GPT-OSS (src/llama-graph.cpp, LLM_FFN_SWIGLU_OAI_MOE)
LLAMA_CPP_SWIGLU = (1.702, 7.0)
# llama.cpp floors / ceils YaRN's correction range (ggml_rope_yarn_corr_dims), as transformers does with truncate true
YARN_NOTE = ("llama.cpp rounds YaRN's correction range to whole dimensions (transformers' truncate true); this config "
             "says truncate false, so the few rotary frequencies at the range's edges differ from transformers'")


def _file_type(types: Counter, dense_dtype: str) -> tuple[str, int]:
    """general.file_type: the block format of the quantized linears, else the dense dtype."""
    F = gguf.LlamaFileType
    if types.get("Q4_K"):    # llama.cpp's name for a file of mostly Q4_K with other types where rows do not fit
        return "Q4_K_S", int(F.MOSTLY_Q4_K_S)
    if types.get("IQ4_XS") or types.get("IQ4_NL"):   # IQ4_NL: --grid iq4_xs's fallback, as in llama.cpp's IQ4_XS
        return "IQ4_XS", int(F.MOSTLY_IQ4_XS)
    for t in ("Q4_1", "Q4_0", "Q5_1", "Q5_0", "Q8_0"):
        if types.get(t):
            return t, int(getattr(F, f"MOSTLY_{t}"))
    if types.get("NVFP4"):
        return "NVFP4", int(F.MOSTLY_NVFP4)
    if types.get("MXFP4"):   # llama.cpp's one MXFP4 file type, named for GPT-OSS's experts
        return "MXFP4", int(F.MOSTLY_MXFP4_MOE)
    return {"bfloat16": ("BF16", int(F.MOSTLY_BF16)), "float16": ("F16", int(F.MOSTLY_F16))}.get(
        dense_dtype, ("F32", int(F.ALL_F32)))


# A W4A4 artifact (quantize --w4a4) exports its weights, exactly as the W4A16 one would: GGUF's MXFP4 / NVFP4 are
# weight formats, and llama.cpp rounds activations its own way (its CPU dot products `ggml_vec_dot_mxfp4_q8_0` /
# `_nvfp4_q8_0` take Q8_0 blocks: 8-bit, 32 a block). Nothing in a GGUF could ask for FP4 activations, so the file
# computes W4A8-like, closer to the source than what llmq evaluated; the record says so rather than refusing a usable
# file.
W4A4_NOTE = ("weights only: llama.cpp rounds activations to its own Q8_0 blocks, not to the artifact's FP4 (W4A4); "
             "its quality is the W4A16 artifact's, not the probe's")


def write_gguf(src: CheckpointReader, plan: ShardPlan, out: Path, engine) -> TargetResult:
    """Write `<source>.<type>.gguf` under `out`; the record says its file, types and what was re-rounded."""
    arch = src.arch.gguf_arch
    source_name = engine.source["name"]
    w = gguf.GGUFWriter(None, arch, use_temp_file=True)
    add_hparams(w, src, source_name)
    tokenizer = add_tokenizer(w, src)   # before the weights: a tokenizer GGUF cannot hold is refused early
    tensors = Tensors(w, src.arch)
    add_weights(tensors, src)
    ftype_name, ftype = _file_type(tensors.types, engine.dtype)
    w.add_file_type(ftype)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    fname = f"{source_name}.{ftype_name}.gguf"
    w.write_header_to_file(out / fname)
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    imatrix = write_imatrix(src, out / f"{source_name}.imatrix.gguf")
    mmproj = write_mmproj(src, out, source_name) if src.spec.vision is not None else None
    w4a4 = src.qconfig is not None and src.qconfig.weights is not None and src.qconfig.weights.fp4 is not None \
        and src.qconfig.input_activations is not None
    if w4a4:
        log.warning("--target gguf: %s", W4A4_NOTE)
    yarn_untruncated = bool(src.spec.rope_scaling) and src.spec.rope_scaling.get("truncate") is False
    if yarn_untruncated:
        log.warning("--target gguf: %s", YARN_NOTE)
    return TargetResult({"gguf": {"file": fname, "architecture": arch, "file_type": ftype_name,
                                  **({"activations": W4A4_NOTE} if w4a4 else {}),
                                  **({"rope": YARN_NOTE} if yarn_untruncated else {}),
                                  "tensor_types": dict(sorted(tensors.types.items())),
                                  "rounding": tensors.rounding.record(), "tokenizer": tokenizer,
                                  "imatrix": imatrix, **({"mmproj": mmproj} if mmproj else {})}})


TARGET = ExportTarget("gguf", write=write_gguf, read_back=None, refuse=refuse, quality=modelled_quality, no_verify=(
    "--verify runs the tensor-parallel reference check, which a single GGUF file has no use for; drop --verify "
    "(the GGUF writer packs llmq's integers as they are and records what it re-rounds)"))
