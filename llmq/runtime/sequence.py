"""One request's state inside the engine: its tokens, how many of them already have KV in the cache, its blocks."""

from __future__ import annotations

import time
from dataclasses import dataclass
from enum import Enum, auto

import torch

from .detokenize import IncrementalText
from .sampling import PromptLogprobs, SamplingParams


@dataclass(frozen=True)
class ImageSpan:
    """An image in a prompt: its placeholder tokens' positions [start, start + length), the embeddings that replace
    them (the vision encoder's, [length, hidden]) and a digest of its pixels (prefix-cache keys include it)."""

    start: int
    length: int
    embeds: torch.Tensor
    digest: str

    @property
    def end(self) -> int:
        return self.start + self.length


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """Tokens = prompt + generated. KV exists for token_ids[:num_computed_tokens]; the rest is computed next.

    After a preemption num_computed_tokens drops to 0 and the whole sequence (prompt and output so far) is
    recomputed by chunked prefill; the generated tokens are kept, so greedy output does not change.
    """

    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 generator: torch.Generator | None = None, images: tuple[ImageSpan, ...] = ()):
        self.request_id = request_id
        self.images = images  # its prompt's images, in order
        self.token_ids = list(prompt_ids)
        self.num_prompt_tokens = len(prompt_ids)
        self.params = params
        self.generator = generator
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.state_slot = -1  # its row of every recurrent-state layer while it holds blocks (hybrid models)
        self.num_computed_tokens = 0
        self.num_hashed_blocks = 0  # leading full blocks already registered in the prefix cache
        self.last_block_key: tuple | None = None  # prefix-cache key of the last of them
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at first admission
        self.admitted = False
        self.finish_reason: str | None = None
        self.text = ""  # the output's text so far (detokenizer's), cut at a stop string
        self.detokenizer = IncrementalText(len(prompt_ids), params.skip_special_tokens)
        self.logprobs: list[dict[int, float]] = []
        self.prompt_logprobs = PromptLogprobs() if params.prompt_logprobs is not None else None
        # its grammar's matcher (constrained decoding; runtime.grammar), advanced by every sampled token
        self.matcher = params.grammar.claim() if params.grammar is not None else None
        self.num_emitted = 0  # output tokens already returned by step()
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None
        self.finished_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def next_prompt_logprob(self) -> int | None:
        """The first position whose distribution prompt_logprobs still lacks (the prompt's last, which samples,
        excluded); None when none is lacking. Positions from here must be computed, not read from the prefix cache."""
        if self.prompt_logprobs is None:
            return None
        p = len(self.prompt_logprobs.ranks)
        return p if p < self.num_prompt_tokens - 1 else None

    def chunk(self, budget: int) -> int:
        """How many of its next tokens a step computes within `budget`: all it can, except that a step never ends
        inside an image (its tokens attend to each other both ways, so they are computed together): the chunk stops
        before an image it would cut, or takes the whole image where one starts it, past the budget if need be."""
        start = self.num_computed_tokens
        end = min(self.num_tokens, start + budget)
        for im in self.images:
            if im.start < end < im.end:
                end = im.start if im.start > start else im.end
        return end - start

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED
