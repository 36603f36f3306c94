"""Constrained decoding: a request's grammar (a JSON schema, or the Lark grammar of a tool call) held by llguidance's
matcher, whose token mask the batched sampler applies to that request's row each step.

llguidance (not xgrammar): it needs nothing beside itself (xgrammar pulls a runtime of its own and pins
transformers), builds a matcher without compiling the whole grammar against the vocabulary ahead (its masks are
computed lazily, each step's work bounded by fuel limits), fills the masks of every constrained row of a batch in one
call on its own threads without the GIL, and reports a grammar it cannot handle as one message. Building a matcher
also drops the GIL; the server builds it off the event loop with a deadline (frontend), never on the engine thread.
"""

from __future__ import annotations

import threading

import torch

from ..errors import LlmqError

_BITS = (torch.ones(32, dtype=torch.int64) << torch.arange(32)).to(torch.int32)  # bit i of a mask word


class GrammarError(LlmqError):
    """A grammar the library rejects, or one no text satisfies (one line)."""


class GrammarFailed(RuntimeError):
    """A matcher that stopped accepting mid-answer (a limit passed): that request fails, the others go on."""


def _llguidance():
    try:
        import llguidance
        import llguidance.hf  # noqa: F401  (the tokenizer bridge)
        import llguidance.torch  # noqa: F401  (the bitmask fillers)
    except ImportError:
        raise LlmqError("constrained decoding (response_format, tool_choice required) needs llguidance: "
                        "pip install 'llmq[serve]'") from None
    return llguidance


class Grammars:
    """Compiles grammars for one tokenizer and vocabulary (the model's rows, which may pass the tokenizer's)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: set[int]):
        self._hf, self.vocab_size, self._eos = tokenizer, vocab_size, sorted(eos_token_ids)
        self._tok = None
        self._lock = threading.Lock()

    def prepare(self) -> None:
        """Build the library's view of the tokenizer now (seconds on a loaded machine), not on first compile."""
        self._tokenizer()

    def _tokenizer(self):
        with self._lock:  # built once
            if self._tok is None:
                llg = _llguidance()
                try:
                    self._tok = llg.hf.from_tokenizer(self._hf, n_vocab=self.vocab_size, eos_token=self._eos)
                except Exception as e:
                    raise GrammarError(f"llguidance cannot read this model's tokenizer: {e}") from None
            return self._tok

    def json_schema(self, schema: dict, style: dict | None = None) -> Grammar:
        """The grammar of JSON text that `schema` accepts, written in `style` (llguidance's JSON options)."""
        llg = _llguidance()
        try:
            text = llg.LLMatcher.grammar_from_json_schema(schema, overrides=style)
        except ValueError as e:
            raise GrammarError(f"the schema cannot be compiled: {_line(e)}") from None
        return self.compile(text)

    def lark(self, text: str) -> Grammar:
        return self.compile(_llguidance().LLMatcher.grammar_from_lark(text))

    def compile(self, grammar: str) -> Grammar:
        """A matcher of `grammar` (llguidance's serialized form); GrammarError when the library rejects it or no
        token can begin it (a schema that only refers to itself)."""
        llg = _llguidance()
        limits = llg.LLParserLimits(verbose_errors=False)
        m = llg.LLMatcher(self._tokenizer(), grammar, log_level=0, limits=limits)
        if not m.is_error():
            m.compute_bitmask()  # the first step: a grammar that admits nothing fails here, not mid-request
        if m.is_error():
            raise GrammarError(f"the grammar library rejected it: {_line(m.get_error())}")
        return Grammar(m)


def _line(e) -> str:
    return (str(e).strip().splitlines() or ["(no message)"])[0][:300]


class Grammar:
    """A compiled grammar: the first sequence that claims it gets its matcher, later ones a fresh copy of it."""

    def __init__(self, matcher):
        self._matcher = matcher
        self._claimed = False

    def claim(self):
        if not self._claimed:
            self._claimed = True
            return self._matcher
        m = self._matcher.deep_copy()
        m.reset()
        return m


_executor = None


def _masks(matchers: list, vocab: int) -> torch.Tensor:
    """[len(matchers), ceil(vocab / 32)] int32 bitmasks of the tokens each matcher allows next, filled in one call
    on llguidance's threads."""
    global _executor
    llg = _llguidance()
    if _executor is None:
        _executor = llg.LLExecutor()
    bits = torch.empty(len(matchers), (vocab + 31) // 32, dtype=torch.int32)
    llg.torch.fill_next_token_bitmask_par(_executor, [(m, i) for i, m in enumerate(matchers)], bits)
    return bits


def constrain(logits: torch.Tensor, matchers: list) -> torch.Tensor:
    """`logits` [B, V] with each constrained row's disallowed tokens at -inf (a copy: the model's logits are inference
    tensors, and logprobs read them unmasked; rows whose matcher is None are left as they are). GrammarFailed when a
    matcher has stopped accepting."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    vocab = logits.shape[-1]
    bits = _masks([matchers[i] for i in rows], vocab)
    for i in rows:
        if matchers[i].is_error():
            raise GrammarFailed(f"the request's grammar stopped accepting: {_line(matchers[i].get_error())}")
    bits = bits.to(logits.device, non_blocking=True)
    banned = (bits.unsqueeze(-1) & _BITS.to(bits.device)).eq(0).flatten(1)[:, :vocab]
    out = logits.clone()
    if rows == list(range(len(rows))):  # the constrained rows first (a slice: no gather)
        out[:len(rows)].masked_fill_(banned, float("-inf"))
    else:
        idx = torch.tensor(rows, device=logits.device)
        out[idx] = out[idx].masked_fill_(banned, float("-inf"))
    return out


def advance(matcher, token: int) -> None:
    """Feed a sampled token to its matcher (GrammarFailed: the matcher refused it)."""
    if not matcher.consume_token(token):
        raise GrammarFailed(f"the request's grammar refused token {token}: {_line(matcher.get_error())}")
