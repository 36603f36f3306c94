"""Tiny random models of every supported family for unit tests: real checkpoints and tokenizers, made in a second,
offline."""

from __future__ import annotations

from pathlib import Path

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def byte_tokenizer():
    """A byte-level BPE tokenizer with no merges: 256 byte tokens + 3 specials, every string round-trips."""
    from tokenizers import Tokenizer, decoders, models
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    for s in SPECIALS:
        vocab[s] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", unk_token=None, chat_template=CHATML)


def make_tiny_model(path: Path, seed: int = 0, **overrides) -> Path:
    """Save a random model (Llama unless model_type says another family; 2 layers, hidden 64, 4 heads / 2 KV heads
    by default) with a byte tokenizer to `path`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type = overrides.pop("model_type", "llama")
    tok = byte_tokenizer()
    cfg = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-6,
               tie_word_embeddings=False, initializer_range=0.1, bos_token_id=tok.bos_token_id,
               eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    cfg.update(overrides)
    cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])  # Qwen3 / Gemma 3 default to 128 / 256
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **cfg)).eval()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


def llmq_logits(source_dir, ids):
    """What llmq evaluated: its runtime's log-probs [batch, seq, vocab] over an artifact, one prompt per row of ids."""
    import torch

    from llmq.runtime import EngineConfig, LLMEngine

    eng = LLMEngine(source_dir, EngineConfig(max_num_seqs=2, max_model_len=64, kv_cache_memory=64 << 20))
    try:
        return torch.stack([eng.prompt_logprobs(row.tolist()) for row in ids])
    finally:
        eng.shutdown()
