"""The engine: requests in, tokens out, one scheduler iteration per step() (continuous batching).

A step is schedule -> run -> update: the scheduler picks the step's sequences (with draft tokens when speculating),
the worker runs them, the sampler (or the speculative verifier) picks their new tokens, and the scheduler appends
them and finishes requests. LLMEngine owns the tokenizer, the scheduler, the worker (rank 0's model runner, KV cache
and block manager, and for tensor parallelism the other ranks' processes), the speculator and the scorer. It is
single-threaded: the server drives it from one thread.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import LlmqError
from .config import EngineConfig
from .grammar import advance
from .sampling import NonFiniteLogits, PromptLogprobs, SamplingParams, make_generator, sample
from .scheduler import Scheduler, SchedulerOutput
from .scorer import ScoreOutput, Scorer, ScoreRequest
from .sequence import ImageSpan, Sequence
from .speculative import SpecStats, make_speculator, verify
from .worker import ModelSource, Worker


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None
    finished_time: float | None


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]] | None
    output_token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    metrics: RequestMetrics
    prompt_logprobs: PromptLogprobs | None = None  # on a request's first output, where its params asked for them


class StepFailed(RuntimeError):
    """Requests that failed in a step, finished and their blocks freed; `outputs` are the other requests'.
    `whole_batch`: the forward pass itself failed, so every request of the step is among the failed."""

    def __init__(self, outputs: list[RequestOutput], failed: dict[str, BaseException], whole_batch: bool):
        super().__init__(f"{len(failed)} request(s) failed: {next(iter(failed.values()))}")
        self.outputs, self.failed, self.whole_batch = outputs, failed, whole_batch


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    prompt_tokens_total: int
    generation_tokens_total: int
    spec: SpecStats = field(default_factory=SpecStats)  # speculative decoding's totals (all zero when it is off)


def eos_token_ids(path: Path, tokenizer) -> set[int]:
    ids = set()
    gc = path / "generation_config.json"
    if gc.is_file():
        eos = json.loads(gc.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


class LLMEngine:
    def __init__(self, model: str | Path, config: EngineConfig | None = None):
        self.config = cfg = config or EngineConfig()
        src = ModelSource.of(model)
        from ..models import load_tokenizer

        self.tokenizer = load_tokenizer(src.path)
        self.worker = w = Worker(src, cfg)
        self.path, self.spec, self.device, self.tp = w.path, w.spec, w.device, w.tp
        self.block_size, self.max_model_len, self.max_num_seqs = w.block_size, w.max_model_len, w.max_num_seqs
        self.kv_cache_dtype, self.num_blocks, self.block_manager = w.kv_cache_dtype, w.num_blocks, w.block_manager
        self.eos_token_ids = eos_token_ids(src.path, self.tokenizer)
        self.scheduler = Scheduler(self.block_manager, self.max_num_seqs, cfg.max_num_batched_tokens,
                                   self.max_model_len, self.tokenizer, self.eos_token_ids)
        self.scorer = Scorer(w, self.scheduler)
        self.requests: dict[str, Sequence] = {}
        self.speculator = make_speculator(cfg, self) if cfg.speculative else None
        self.prompt_tokens_total = 0
        self._closed = False

    @property
    def runner(self):
        """Rank 0's model runner (its model and KV cache); None after shutdown."""
        return self.worker.runner

    # -- requests -------------------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: list[int] | str, params: SamplingParams,
                    images: torch.Tensor | None = None) -> None:
        """images: a vision-language model's pixel values [n, 3, H, W] (its processor's), one per run of image
        placeholder tokens in the prompt, in order (runtime.images.ImagePrompt makes both)."""
        if request_id in self.requests:
            raise LlmqError(f"request id {request_id!r} is already in use")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise LlmqError("the prompt is empty")
        if any(not isinstance(t, int) or t < 0 or t >= self.spec.vocab_size for t in ids):
            raise LlmqError(f"prompt token ids must be integers in [0, {self.spec.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise LlmqError(f"the prompt has {len(ids)} tokens; this model's context is {self.max_model_len}")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise LlmqError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the context of "
                            f"{self.max_model_len} tokens")
        spans = self._image_spans(ids, images) if images is not None else ()
        gen = None if params.greedy else make_generator(params.seed, self.runner.device)
        seq = Sequence(request_id, ids, params, gen, spans)
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        self.prompt_tokens_total += len(ids)

    def _image_spans(self, ids: list[int], pixels: torch.Tensor) -> tuple[ImageSpan, ...]:
        """The prompt's images: each run of placeholder tokens, the encoder's embeddings for it and its pixels'
        digest; one line when the model takes no images or the runs do not match the images."""
        vision = self.runner.vision
        if vision is None:
            from ..models.vision import TEXT_ONLY

            why = TEXT_ONLY.get(self.spec.vision or "", "it is text-only")
            raise LlmqError(f"this model ({self.spec.architecture}) takes no images: {why}")
        if self.speculator is not None:
            raise LlmqError("speculative decoding does not take images yet (the draft model sees no image); serve "
                            "without --speculative")
        runs, i = [], 0
        while i < len(ids):
            if ids[i] == vision.image_token:
                j = i
                while j < len(ids) and ids[j] == vision.image_token:
                    j += 1
                runs.append((i, j - i))
                i = j
            else:
                i += 1
        if len(runs) != len(pixels) or any(n != vision.tokens_per_image for _, n in runs):
            raise LlmqError(f"{len(pixels)} image(s) but {len(runs)} run(s) of image tokens in the prompt (each of "
                            f"{vision.tokens_per_image} tokens); place images with the model's processor")
        embeds = self.runner.encode_images(pixels)
        return tuple(ImageSpan(start, n, e, hashlib.sha256(p.float().contiguous().cpu().numpy().tobytes()).hexdigest())
                     for (start, n), e, p in zip(runs, embeds, pixels))

    def abort_request(self, request_id: str) -> None:
        seq = self.requests.pop(request_id, None)
        if seq is not None and not seq.is_finished:
            self.scheduler.finish(seq, "abort")
            seq.finished_time = time.monotonic()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step ---------------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduler iteration. Raises StepFailed when requests failed (they alone, where the fault is theirs)."""
        out = self.scheduler.schedule(self.speculator)
        if not len(out):
            return []
        need = out.logits_rows()
        samplers = need.samplers
        chosen = bool(out.drafts or need.prompt_rows)  # else the runner's default rows: the samplers' last positions
        try:
            logits = self.worker.run(out.seqs, out.num_new_tokens, rows=need.wanted if chosen else None,
                                     speculating=list(out.drafts))
        except Exception as e:
            self.scheduler.take_back_drafts(out)
            raise StepFailed([], {seq.request_id: self._fail(seq, e) for seq in out.seqs}, True) from e
        bad = {}
        for seq, idx in need.prompt_rows:  # the prompt's distributions, from this same forward pass
            p0 = seq.next_prompt_logprob
            try:
                seq.prompt_logprobs.add(logits[idx], seq.token_ids[p0 + 1:p0 + 1 + len(idx)],
                                        seq.params.prompt_logprobs)
            except NonFiniteLogits as e:
                bad[seq] = e
        if chosen:
            spec_logits, logits = logits[need.spec_rows], logits[need.rows]
        self.scheduler.computed(out)
        outputs, failed = [], {seq.request_id: self._fail(seq, e) for seq, e in bad.items()}
        now = time.monotonic()
        prompt_only = [s for s in samplers if s.params.max_tokens == 0 and s not in bad]
        for seq in prompt_only:  # max_tokens 0: the prompt alone (its prompt_logprobs), nothing sampled
            self.scheduler.finish(seq, "length")
            seq.finished_time = now
            outputs.append(self._output(seq))
        if prompt_only or bad:
            keep = [i for i, s in enumerate(samplers) if s.params.max_tokens and s not in bad]
            samplers, logits = [samplers[i] for i in keep], logits[keep]
        if samplers:
            for seq, picked in zip(samplers, self._sample(logits, samplers)):
                try:
                    if isinstance(picked, Exception):
                        raise picked
                    if seq.matcher is not None and picked[0] not in self.eos_token_ids:
                        advance(seq.matcher, picked[0])
                    self.scheduler.update(seq, [picked[0]], [picked[1]], now)
                    outputs.append(self._output(seq))
                except Exception as e:
                    failed[seq.request_id] = self._fail(seq, e)
        if out.drafts:
            self._verify(spec_logits, out, now, outputs, failed)
            self.speculator.collect()
        if failed:
            raise StepFailed(outputs, failed, False)
        return outputs

    def _verify(self, logits: torch.Tensor, out: SchedulerOutput, now: float, outputs: list, failed: dict) -> None:
        """Verify the step's drafts (in batch order, as their logits rows are): each sequence keeps its accepted
        tokens and the target's next token after them; the rejected ones leave the sequence and its blocks."""
        seqs = [s for s in out.seqs if s in out.drafts]
        self.scheduler.take_back_drafts(out)
        try:
            results = verify(logits, seqs, [out.drafts[s][0] for s in seqs], [out.drafts[s][1] for s in seqs])
        except Exception as e:
            failed.update({seq.request_id: self._fail(seq, e) for seq in seqs})
            return
        for seq, v in zip(seqs, results):
            self.speculator.stats.record(len(out.drafts[seq][0]), v.accepted)
            self.worker.settle(seq.state_slot, v.accepted + 1)   # the step's last real token and the accepted drafts
            try:
                self.scheduler.update(seq, v.tokens, v.logprobs, now, verified=True)
                outputs.append(self._output(seq))
            except Exception as e:
                failed[seq.request_id] = self._fail(seq, e)

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[tuple[int, dict | None] | Exception]:
        """(token, logprobs) per sequence; when the batched sampler fails, each row alone, to find the culprit."""
        matchers = [s.matcher for s in seqs] if any(s.matcher is not None for s in seqs) else None
        try:
            return list(zip(*sample(logits, [s.params for s in seqs], [s.generator for s in seqs], matchers)))
        except Exception:
            picks = []
            for i, seq in enumerate(seqs):
                try:
                    tokens, lps = sample(logits[i:i + 1], [seq.params], [seq.generator], [seq.matcher])
                    picks.append((tokens[0], lps[0]))
                except Exception as e:
                    picks.append(e)
            return picks

    def _fail(self, seq: Sequence, error: Exception) -> Exception:
        """Finish a request that failed, freeing its blocks."""
        self.requests.pop(seq.request_id, None)
        if not seq.is_finished:
            self.scheduler.finish(seq, "error")
            seq.finished_time = time.monotonic()
        return error

    def _output(self, seq: Sequence) -> RequestOutput:
        new = seq.output_token_ids[seq.num_emitted:]
        new_lp = seq.logprobs[seq.num_emitted:] if seq.params.logprobs is not None else None
        first = seq.num_emitted == 0  # only a max_tokens 0 request's output brings no token, and it is its last
        seq.num_emitted = seq.num_output_tokens
        if seq.is_finished:
            self.requests.pop(seq.request_id, None)
        return RequestOutput(seq.request_id, new, new_lp, list(seq.output_token_ids), seq.text, seq.is_finished,
                             seq.finish_reason, seq.num_prompt_tokens, seq.num_cached_tokens,
                             RequestMetrics(seq.arrival_time, seq.first_token_time, seq.finished_time),
                             seq.prompt_logprobs if first else None)

    # -- offline helpers --------------------------------------------------------------------------------------------
    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams],
                 images: list[torch.Tensor | None] | None = None) -> list[RequestOutput]:
        """Run prompts to completion (alongside any requests already in flight); final outputs in input order,
        their new_token_ids / new_logprobs covering the whole completion, with their prompt_logprobs. images: each
        prompt's pixel values (add_request's), or None."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise LlmqError(f"{len(prompts)} prompts but {len(plist)} sampling parameter sets")
        tag = f"gen-{time.monotonic_ns()}-"
        ids = [f"{tag}{i}" for i in range(len(prompts))]
        for rid, prompt, p, im in zip(ids, prompts, plist, images or [None] * len(prompts)):
            self.add_request(rid, prompt, p, im)
        wanted = set(ids)
        final: dict[str, RequestOutput] = {}
        logprobs: dict[str, list] = {r: [] for r in ids}
        prompt: dict[str, PromptLogprobs] = {}
        while len(final) < len(ids):
            for out in self.step():
                if out.request_id not in wanted:
                    continue
                logprobs[out.request_id].extend(out.new_logprobs or [])
                if out.prompt_logprobs is not None:
                    prompt[out.request_id] = out.prompt_logprobs
                if out.finished:
                    out.new_token_ids = list(out.output_token_ids)
                    out.new_logprobs = logprobs[out.request_id] if out.new_logprobs is not None else None
                    out.prompt_logprobs = prompt.get(out.request_id)
                    final[out.request_id] = out
        return [final[r] for r in ids]

    def prompt_logprobs(self, token_ids: list[int], images: torch.Tensor | None = None) -> torch.Tensor:
        """[T, vocab] log-softmax of the next-token distribution after each position (Scorer.prompt_logprobs);
        images: a vision-language prompt's pixel values, as add_request takes them."""
        spans = self._image_spans(list(token_ids), images) if images is not None else ()
        return self.scorer.prompt_logprobs(token_ids, spans)

    def score(self, requests: list[ScoreRequest], progress: Callable[[int], None] | None = None
              ) -> list[ScoreOutput]:
        """Log-probabilities of every request's scored tokens, shared prefixes computed once (Scorer.score)."""
        return self.scorer.score(requests, progress)

    @contextmanager
    def observe_kv(self, fn: Callable[[int, torch.Tensor, torch.Tensor], None]) -> Iterator[None]:
        """Within the block, fn(layer, k, v) sees every K/V the model writes to its cache, [tokens, kv_heads,
        head_dim] in the compute dtype (K after RoPE, before any KV quantization): what calibration measures."""
        self.worker.observe_kv(fn)
        try:
            yield
        finally:
            self.worker.observe_kv(None)

    def stats(self) -> EngineStats:
        s, bm = self.scheduler, self.block_manager
        return EngineStats(len(s.running), len(s.waiting), bm.num_used_blocks, bm.num_blocks, s.prefix_cache_queries,
                           s.prefix_cache_hits, s.num_preemptions, self.prompt_tokens_total,
                           s.num_generated_tokens,
                           self.speculator.stats.copy() if self.speculator is not None else SpecStats())

    def shutdown(self) -> None:
        if getattr(self, "_closed", False):
            return
        self._closed = True
        if getattr(self, "speculator", None) is not None:
            self.speculator.close()
        if getattr(self, "worker", None) is not None:
            self.worker.shutdown()

    def __del__(self):
        try:
            self.shutdown()
        except Exception:
            pass
