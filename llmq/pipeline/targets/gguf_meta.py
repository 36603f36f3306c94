"""A GGUF file's key-value metadata: the model's hyperparameters under llama.cpp's keys, and the tokenizer.

The tokenizer (byte-level BPE, or Gemma's SentencePiece-style BPE with byte fallback), its special token ids and the
chat template come from the artifact's tokenizer files; llama.cpp must split text as the source tokenizer does, so
what it cannot reproduce is refused or written with a warning in the record. Apart from the tensors because it
reads only the config and tokenizer.json, never a weight.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import gguf

from ...errors import LlmqError
from ...models.reader import CheckpointReader

# tokenizer.json pre-tokenizers llama.cpp reproduces, by the name it knows them under (src/llama-vocab.cpp).
_QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_REGEX = _QWEN2_REGEX.replace(r"\p{N}|", r"\p{N}{1,3}|")
_BYTE_TOKEN = re.compile(r"<0x[0-9A-F]{2}>")   # SentencePiece's byte-fallback pieces


def add_hparams(w, src: CheckpointReader, name: str) -> None:
    s = src.spec
    w.add_name(name)
    w.add_context_length(s.max_position_embeddings)
    w.add_embedding_length(s.hidden_size)
    w.add_block_count(s.num_layers)
    if s.intermediate_size:   # Mixtral's is its experts' width; Qwen3.5-MoE has none
        w.add_feed_forward_length(s.intermediate_size)
    if s.num_experts:
        w.add_expert_count(s.num_experts)
        w.add_expert_used_count(s.experts_per_token)
        w.add_expert_feed_forward_length(s.expert_size)  # what qwen3moe reads the experts' width from
    if s.shared_expert_size:
        w.add_expert_shared_feed_forward_length(s.shared_expert_size)
    w.add_head_count(s.num_heads)
    w.add_head_count_kv(s.num_kv_heads)
    if s.head_dim * s.num_heads != s.hidden_size:
        w.add_key_length(s.head_dim)
        w.add_value_length(s.head_dim)
    w.add_rope_dimension_count(s.rotary_dim or s.head_dim)
    if src.arch.gguf_rope_sections:
        w.add_rope_dimension_sections(list(src.arch.gguf_rope_sections))
    w.add_rope_freq_base(s.rope_theta)
    if s.rope_scaling:   # YaRN (what refuse lets through), under the keys llama.cpp's converter writes
        r = s.rope_scaling
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(r["factor"])
        w.add_rope_scaling_orig_ctx_len(r["original_max_position_embeddings"])
        for key, add in (("beta_fast", w.add_rope_scaling_yarn_beta_fast),
                         ("beta_slow", w.add_rope_scaling_yarn_beta_slow),
                         ("extrapolation_factor", w.add_rope_scaling_yarn_ext_factor),
                         ("attention_factor", w.add_rope_scaling_yarn_attn_factor)):
            if r.get(key) is not None:
                add(r[key])
    if s.linear_layers:   # a hybrid's Gated DeltaNet layers, as llama.cpp's qwen35 reads them (its ssm keys)
        w.add_ssm_conv_kernel(s.linear_kernel)
        w.add_ssm_state_size(s.linear_key_dim)
        w.add_ssm_group_count(s.linear_key_heads)
        w.add_ssm_time_step_rank(s.linear_value_heads)
        w.add_ssm_inner_size(s.linear_value_dim * s.linear_value_heads)
        # which layers are recurrent (gguf-py 0.19 has no writer method for llama.cpp's key)
        w.add_array(f"{w.arch}.attention.recurrent_layers", [i in s.linear_layers for i in range(s.num_layers)])
    w.add_layer_norm_rms_eps(s.rms_norm_eps)
    w.add_vocab_size(s.vocab_size)
    if s.local_layers:  # which layers slide, stated per layer (llama.cpp's default is Gemma 3's five to one)
        w.add_sliding_window(s.local_window)
        w.add_sliding_window_pattern([i in s.local_layers for i in range(s.num_layers)])
        if s.local_rope_theta is not None:   # their own base (Gemma 3); else llama.cpp takes the global one
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


def add_tokenizer(w, src: CheckpointReader) -> dict:
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
