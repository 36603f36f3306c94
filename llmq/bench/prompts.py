"""The prompts a load test sends: synthetic text of exact token counts for the served tokenizer, or a JSONL file.

Synthetic prompts are random words from the tokenizer's own vocabulary, decoded and re-encoded until the text
encodes to exactly the wanted number of tokens (including any special tokens the tokenizer adds, as servers
encode prompts that way), so the server's reported prompt_tokens equal the requested length.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import LlmqError
from ..jsonl import read_jsonl

_WORD = re.compile(r"^ ?[A-Za-z]{1,12}$")
_FALLBACK_WORDS = ("the time of year when people go out and look at the sky above them for a while and then "
                   "come back home to tell each other what they saw").split()


@dataclass
class Prompt:
    text: str
    output_len: int
    input_len: int | None = None  # the intended token count, when known exactly


def _word_pool(tok) -> np.ndarray:
    """Token ids that decode to a plain ASCII word: sequences of them re-encode (almost always) to themselves."""
    special = set(tok.all_special_ids)
    pool = [i for i in range(len(tok)) if i not in special and _WORD.match(tok.decode([i]) or "")]
    if len(pool) < 10:
        raise LlmqError("the tokenizer has too few plain-word tokens to build synthetic prompts; use --dataset")
    return np.asarray(pool)


def exact_length_text(tok, n: int, rng: np.random.Generator, pool: np.ndarray | None = None) -> str:
    """Text that `tok.encode(text)` (special tokens included) turns into exactly n tokens."""
    overhead = len(tok.encode("a")) - len(tok.encode("a", add_special_tokens=False))
    want = n - overhead
    if want < 1:
        raise LlmqError(f"input length {n} is shorter than the tokenizer's {overhead} special tokens + 1")
    pool = _word_pool(tok) if pool is None else pool
    ids = list(rng.choice(pool, want))
    for _ in range(20):
        text = tok.decode(ids)
        if text.startswith(" "):
            text = text[1:]
        enc = tok.encode(text, add_special_tokens=False)
        if len(enc) == want:
            return text
        ids = enc[:want] if len(enc) > want else enc + list(rng.choice(pool, want - len(enc)))
    raise LlmqError(f"could not build a prompt of exactly {n} tokens with this tokenizer; use --dataset")


def input_lengths(num: int, mean: int, std: float = 0.0, low: int | None = None, high: int | None = None,
                  seed: int = 0) -> list[int]:
    """num lengths: fixed (`mean`), normal(mean, std) clipped to >= 1, or uniform over [low, high]."""
    rng = np.random.default_rng(seed)
    if low is not None or high is not None:
        if low is None or high is None or not 1 <= low <= high:
            raise LlmqError(f"an input-length range needs 1 <= LOW <= HIGH, got {low}:{high}")
        return [int(x) for x in rng.integers(low, high + 1, num)]
    if mean < 1:
        raise LlmqError(f"--input-len must be >= 1, got {mean}")
    if std > 0:
        return [max(1, int(round(x))) for x in rng.normal(mean, std, num)]
    return [mean] * num


def synthetic(tok, lengths: list[int], output_len: int, seed: int = 0) -> list[Prompt]:
    """Prompts of exact token counts; without a tokenizer, approximate ones (about one token per word)."""
    rng = np.random.default_rng(seed + 1)
    if tok is None:
        words = np.asarray(_FALLBACK_WORDS)
        return [Prompt(" ".join(rng.choice(words, n)), output_len) for n in lengths]
    pool = _word_pool(tok)
    return [Prompt(exact_length_text(tok, n, rng, pool), output_len, n) for n in lengths]


def from_jsonl(path: str | Path, num: int | None, default_output_len: int) -> list[Prompt]:
    """Prompts from a JSONL file of {"prompt": str, "output_len": int (optional)}, cycled up to num."""
    p = Path(path)
    if not p.is_file():
        raise LlmqError(f"{p}: no such prompt file")
    prompts = []
    for n, row in read_jsonl(p):
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"]:
            raise LlmqError(f"{p}:{n}: each line needs a non-empty string field \"prompt\"")
        out = row.get("output_len", default_output_len)
        if not isinstance(out, int) or out < 1:
            raise LlmqError(f"{p}:{n}: output_len must be a positive integer")
        prompts.append(Prompt(row["prompt"], out))
    if not prompts:
        raise LlmqError(f"{p}: no prompts")
    num = num or len(prompts)
    return [prompts[i % len(prompts)] for i in range(num)]
