"""The incremental detokenizer against decoding the whole output at every step."""

from __future__ import annotations

import random

import pytest
from helpers import byte_tokenizer

from llmq.runtime.detokenize import IncrementalText


def metaspace_tokenizer():
    """A SentencePiece-style tokenizer: '▁' marks a space, and decoding drops the first token's leading one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "<s>", "</s>"] + [p + c for p in ("", "\u2581") for c in "abcé,.'"] + ["\u2581"]
    tok = Tokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tok.decoder = decoders.Metaspace(prepend_scheme="first")
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def check_steps(tok, prompt: list[int], output: list[int]) -> None:
    """After every token: the text equals decoding the whole output so far, except that an unfinished trailing
    character (U+FFFD) may be held back; at the end, exactly the whole decode."""
    ids = prompt + output
    inc = IncrementalText(len(prompt))
    for end in range(len(prompt) + 1, len(ids) + 1):
        final = end == len(ids)
        text = inc.update(tok, ids, end, final)
        full = tok.decode(ids[len(prompt):end], skip_special_tokens=True)
        if final or not full.endswith("\ufffd"):
            assert text == full, (ids[len(prompt):end], text, full)
        else:
            assert full.startswith(text)


@pytest.mark.parametrize("make", [byte_tokenizer, metaspace_tokenizer])
def test_incremental_text_equals_whole_decodes(make):
    tok = make()
    rng = random.Random(0)
    n = len(tok)
    for _ in range(200):  # random ids: split UTF-8 sequences, specials, leading spaces
        check_steps(tok, [rng.randrange(n) for _ in range(rng.randrange(3))],
                    [rng.randrange(n) for _ in range(rng.randrange(1, 30))])
    for s in ("héllo wörld, ça va? 日本語 🙂", "a b", " 'é'. c"):  # real text, tokenized as the engine's outputs are
        check_steps(tok, tok.encode("x"), tok.encode(s))


def test_default_tokenizer(default_model):
    from llmq.models import load_tokenizer

    tok = load_tokenizer(default_model.path)
    rng = random.Random(1)
    for _ in range(50):
        check_steps(tok, [rng.randrange(len(tok)) for _ in range(4)], [rng.randrange(len(tok)) for _ in range(40)])
    check_steps(tok, [], tok.encode("def f(x):\n    return x ** 2  # 平方, ü 🙂\n\n\nclass A: pass"))
