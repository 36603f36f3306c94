"""The engine: requests in, tokens out, one scheduler iteration per step() (continuous batching).

LLMEngine owns the tokenizer, the scheduler and block manager, rank 0's model runner and, for tensor parallelism,
the worker processes of the other ranks. It is single-threaded: the server drives it from one thread.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import LlmqError
from ..models import ModelSpec
from .block_manager import BlockManager
from .distributed import WorkerGroup, init_group, rank_device, threads_per_rank
from .kv_cache import KV_DTYPES, kv_element_bytes
from .layers.linear import keeps_16bit_as
from ..models.engine_spec import EngineSpec
from ..models.reader import CheckpointReader
from ..models.sharding import make_plan
from ..options import SPECULATIVE_MAX_BATCH
from .model_runner import ModelRunner, compute_dtype_for, prepare_step, worker_main
from .sampling import SamplingParams, make_generator, sample
from .scheduler import Scheduler
from .sequence import Sequence
from .speculative import SpecStats, make_speculator, verify

DEFAULT_MAX_MODEL_LEN = 4096
DEFAULT_KV_CACHE_FRACTION = 0.25


@dataclass
class EngineConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512  # per-step token budget (chunked prefill)
    max_model_len: int | None = None  # None: the model's (or engine's) max positions, capped at 4096
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes for the KV cache (per rank); None: kv_cache_fraction of free memory
    kv_cache_fraction: float = DEFAULT_KV_CACHE_FRACTION
    kv_cache_dtype: str = "auto"  # "auto" (compute dtype, or the checkpoint's calibrated scheme) | "int8" | "fp8"
    enable_prefix_caching: bool = True
    tp: int = 1
    device: str | None = None
    dtype: str | None = None  # compute dtype; None: float32 on CPU, the checkpoint's 16-bit dtype on GPU
    compile: bool = False  # torch.compile the decode-only steps (runtime/compiled.py); tp 1 only
    # INT4 / INT8 weight-only products with activations rounded to int8 per block of 32 inputs (llama.cpp's Q8_0
    # arithmetic) on CPUs with AVX512-VNNI: ~2x faster decode, not what the quantize probe and the exports compute
    int8_activations: bool = False
    speculative: str | None = None  # "ngram" (prompt lookup) or a draft model's directory (same tokenizer); None: off
    num_speculative_tokens: int = 4  # draft tokens per speculating sequence and step
    speculative_max_batch: int | None = SPECULATIVE_MAX_BATCH  # no drafts while more sequences run (None: any)


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


class StepFailed(RuntimeError):
    """Requests that failed in a step, finished and their blocks freed; `outputs` are the other requests'.
    `whole_batch`: the forward pass itself failed, so every request of the step is among the failed."""

    def __init__(self, outputs: list[RequestOutput], failed: dict[str, BaseException], whole_batch: bool):
        super().__init__(f"{len(failed)} request(s) failed: {next(iter(failed.values()))}")
        self.outputs, self.failed, self.whole_batch = outputs, failed, whole_batch


@dataclass
class ScoreRequest:
    """Score token_ids[start:], each token given every token before it (1 <= start < len(token_ids))."""

    token_ids: list[int]
    start: int


@dataclass
class ScoreOutput:
    logprobs: list[float] = field(default_factory=list)  # log p(token_ids[i] | token_ids[:i]) for i >= start
    greedy: list[bool] = field(default_factory=list)  # whether token_ids[i] was the most likely next token
    num_cached_tokens: int = 0  # leading tokens whose KV came from the prefix cache


@dataclass
class _Scoring:
    """A score request in flight: its sequence and the prefix-cache keys of all its full blocks."""

    index: int
    request: ScoreRequest
    seq: Sequence
    keys: list[tuple]
    out: ScoreOutput


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


def available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    import psutil

    return psutil.virtual_memory().available


@dataclass
class _Source:
    path: Path
    engine: EngineSpec | None  # the record of a `build --target llmq` engine
    weights_dir: Path  # the directory holding config.json (rank0/ for an engine)


def _source(model: str | Path) -> _Source:
    path = Path(model)
    if not path.is_dir():
        raise LlmqError(f"{path}: not a model directory (resolve references to an artifact path first)")
    if (path / "engine.json").is_file():
        engine = EngineSpec.read(path)
        if engine.target != "llmq":
            raise LlmqError(f"{path} is a {engine.target!r} engine; the bundled runtime loads "
                            "`llmq build --target llmq` engines (or the quantized / model artifact itself)")
        return _Source(path, engine, path / "rank0")
    return _Source(path, None, path)


class LLMEngine:
    def __init__(self, model: str | Path, config: EngineConfig | None = None):
        self.config = cfg = config or EngineConfig()
        src = _source(model)
        self.path = src.path
        ckpt = CheckpointReader(src.weights_dir)
        self.spec: ModelSpec = ckpt.spec
        from ..models import load_tokenizer, pick_device

        self.tokenizer = load_tokenizer(src.path)
        self.device = torch.device(pick_device(cfg.device))
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise LlmqError("device cuda was requested but torch sees no CUDA GPU (CPU-only build or no driver)")
        engine = src.engine
        if engine is not None:
            if cfg.tp not in (1, engine.tp):
                raise LlmqError(f"this engine was built for tp={engine.tp}; rebuild it with --tp {cfg.tp}")
            self.tp = engine.tp
            block_size = engine.block_size
            limit = engine.max_seq_len
        else:
            self.tp = cfg.tp
            block_size = cfg.block_size
            limit = min(self.spec.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
        if cfg.max_model_len is not None and cfg.max_model_len > max(limit, 1) and engine is not None:
            raise LlmqError(f"max_model_len {cfg.max_model_len} exceeds the engine's max_seq_len {limit}")
        self.max_model_len = cfg.max_model_len or limit
        if self.max_model_len > self.spec.max_position_embeddings:
            raise LlmqError(f"max_model_len {self.max_model_len} exceeds the model's "
                            f"{self.spec.max_position_embeddings} positions")
        if cfg.compile and self.tp > 1:
            raise LlmqError("--compile compiles the decode step of one rank; use it with tp 1 (tensor-parallel "
                            "ranks run eagerly)")
        if cfg.max_num_seqs < 1 or cfg.max_num_batched_tokens < 1 or block_size < 1:
            raise LlmqError("max_num_seqs, max_num_batched_tokens and block_size must be positive")
        self.block_size = block_size
        # an engine's max_batch_size is a build-time cap, like TensorRT-LLM's
        self.max_num_seqs = min(cfg.max_num_seqs, engine.max_batch_size) if engine \
            else cfg.max_num_seqs
        self.kv_cache_dtype = self._kv_dtype(cfg.kv_cache_dtype, ckpt, engine)
        dtype = compute_dtype_for(self.device, cfg.dtype, ckpt.config)
        self.num_blocks = self._num_blocks(ckpt, dtype, sliced=engine is not None)
        self.eos_token_ids = self._eos_ids(src.path)

        load_args = dict(path=str(src.path), engine=engine, tp=self.tp, device=str(self.device), dtype=cfg.dtype,
                         num_blocks=self.num_blocks, block_size=block_size, kv_cache_dtype=self.kv_cache_dtype,
                         max_positions=self.max_model_len, compile=cfg.compile,
                         int8_activations=cfg.int8_activations)
        self.workers = None
        self._workers_ready = False
        self._saved_threads = None
        if self.tp > 1:
            if self.device.type == "cuda" and torch.cuda.device_count() < self.tp:
                raise LlmqError(f"tp={self.tp} needs {self.tp} GPUs; {torch.cuda.device_count()} visible")
            if self.device.type == "cpu":
                self._saved_threads = torch.get_num_threads()
                torch.set_num_threads(threads_per_rank(self.tp))
            if engine is None:
                make_plan(self.spec, self.tp)  # refuse a split that does not fit before spawning anything
            self.workers = WorkerGroup(self.tp, load_args, self.device, worker_main)
            try:
                init_group(0, self.tp, self.workers.port, rank_device(self.device, 0))
                self.runner = ModelRunner(**load_args, rank=0, world=self.tp)
                self.workers.wait_ready()
                self._workers_ready = True
            except BaseException:
                self.shutdown()
                raise
        else:
            self.runner = ModelRunner(**load_args, rank=0, world=1)
        self.block_manager = BlockManager(self.num_blocks, block_size, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, self.max_num_seqs, cfg.max_num_batched_tokens)
        self.requests: dict[str, Sequence] = {}
        self.speculator = make_speculator(cfg, self) if cfg.speculative else None
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self._closed = False

    # -- setup helpers ---------------------------------------------------------------------------------------------
    @staticmethod
    def _kv_dtype(requested: str, ckpt: CheckpointReader, engine: EngineSpec | None) -> str:
        if requested not in KV_DTYPES:
            raise LlmqError(f"kv_cache_dtype must be one of {', '.join(KV_DTYPES)}; got {requested!r}")
        have = (engine.kv_cache_dtype if engine else None) or ckpt.kv_cache_dtype() or "auto"
        if requested == "auto":
            return have
        if have == "auto" and requested == "int8":
            raise LlmqError("an int8 KV cache needs calibrated k_scale/v_scale and this checkpoint has none; "
                            "run `llmq quantize-kv REF --kv int8` first")
        if have == "auto":  # fp8 without calibration: scale 1.0 (e4m3 covers +-448)
            return requested
        if have != requested:
            raise LlmqError(f"this checkpoint's KV-cache scales are calibrated for {have}, not {requested}")
        return requested

    def _num_blocks(self, ckpt: CheckpointReader, dtype: torch.dtype, sliced: bool) -> int:
        """KV-cache blocks per rank; `sliced`: ckpt is already one rank's share (an engine's rank0)."""
        cfg = self.config
        heads_per_rank = max(self.spec.num_kv_heads // self.tp, 1)
        per_token = 2 * self.spec.num_layers * heads_per_rank * self.spec.head_dim * kv_element_bytes(
            self.kv_cache_dtype, dtype)
        block_bytes = per_token * self.block_size
        if cfg.kv_cache_memory is not None:
            budget = int(cfg.kv_cache_memory)
        else:
            if not 0 < cfg.kv_cache_fraction <= 1:
                raise LlmqError(f"kv_cache_fraction must be in (0, 1], got {cfg.kv_cache_fraction}")
            kept = functools.partial(keeps_16bit_as, dtype=dtype, device=self.device)
            free = available_memory(self.device) - ckpt.runtime_bytes(dtype, kept) // (1 if sliced else self.tp)
            # never more than every sequence slot filled to the context length
            budget = min(int(max(free, 0) * cfg.kv_cache_fraction),
                         self.max_num_seqs * self.max_model_len * per_token + block_bytes)
        num_blocks = budget // block_bytes
        min_blocks = -(-self.max_model_len // self.block_size)
        if num_blocks < min_blocks:
            raise LlmqError(f"KV-cache budget of {budget / 2**20:.1f} MiB holds {num_blocks} blocks of "
                            f"{self.block_size} tokens, fewer than one {self.max_model_len}-token sequence needs "
                            f"({min_blocks}); raise the KV-cache memory or lower max_model_len")
        return int(num_blocks)

    def _eos_ids(self, path: Path) -> set[int]:
        ids = set()
        gc = path / "generation_config.json"
        if gc.is_file():
            eos = json.loads(gc.read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    # -- requests -------------------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: list[int] | str, params: SamplingParams) -> None:
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
        gen = None if params.greedy else make_generator(params.seed, self.runner.device)
        seq = Sequence(request_id, ids, params, gen)
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        self.prompt_tokens_total += len(ids)

    def abort_request(self, request_id: str) -> None:
        seq = self.requests.pop(request_id, None)
        if seq is not None and not seq.is_finished:
            self.scheduler.finish(seq, "abort")
            seq.finished_time = time.monotonic()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step ---------------------------------------------------------------------------------------------------
    def _forward(self, step) -> torch.Tensor:
        if self.workers is not None:
            self.runner.tp.broadcast(step)
        return self.runner.execute(step)

    def step(self) -> list[RequestOutput]:
        """One scheduler iteration. Raises StepFailed when requests failed (they alone, where the fault is theirs)."""
        batch = self.scheduler.schedule()
        if not len(batch):
            return []
        drafts = {}
        if self.speculator is not None:
            drafts = self.speculator.draft(batch.seqs, batch.num_new_tokens, len(self.scheduler.running),
                                           self.scheduler.max_num_batched_tokens, self.block_manager,
                                           self.max_model_len)
            if drafts:  # verifications are chunks now: keep single-token entries first
                items = sorted(zip(batch.seqs, batch.num_new_tokens), key=lambda c: c[1] != 1)
                batch.seqs, batch.num_new_tokens = [c[0] for c in items], [c[1] for c in items]
        # the positions whose logits the step needs: a sampler's last, a verification's every one
        samplers, rows, spec_rows, wanted, q0 = [], [], [], [], 0
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            if seq in drafts:
                spec_rows.extend(range(len(wanted), len(wanted) + n))
                wanted.extend(range(q0, q0 + n))
            elif seq.num_computed_tokens + n == seq.num_tokens:
                samplers.append(seq)
                rows.append(len(wanted))
                wanted.append(q0 + n - 1)
            q0 += n
        try:
            step = prepare_step(batch.seqs, batch.num_new_tokens, self.block_size,
                                fresh_prefill_direct=self.kv_cache_dtype == "auto", window=self.spec.sliding_window)
            if drafts:
                step.logits_indices = torch.tensor(wanted, dtype=torch.long)
            logits = self._forward(step)
        except Exception as e:
            for seq, (draft, _) in drafts.items():
                del seq.token_ids[-len(draft):]
            raise StepFailed([], {seq.request_id: self._fail(seq, e) for seq in batch.seqs}, True) from e
        if drafts:
            spec_logits, logits = logits[spec_rows], logits[rows]
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            if seq not in drafts:
                seq.num_computed_tokens += n
                self.block_manager.commit(seq)
        outputs, failed = [], {}
        now = time.monotonic()
        if samplers:
            for seq, picked in zip(samplers, self._sample(logits, samplers)):
                try:
                    if isinstance(picked, Exception):
                        raise picked
                    self._append(seq, *picked, now)
                    outputs.append(self._output(seq))
                except Exception as e:
                    failed[seq.request_id] = self._fail(seq, e)
        if drafts:
            self._accept(spec_logits, {s: drafts[s] for s in batch.seqs if s in drafts}, now, outputs, failed)
            self.speculator.collect()
        if failed:
            raise StepFailed(outputs, failed, False)
        return outputs

    def _accept(self, logits: torch.Tensor, drafts: dict, now: float, outputs: list, failed: dict) -> None:
        """Verify the step's drafts (in batch order, as their logits rows are): keep each sequence's accepted tokens
        (their KV is computed), emit the target's next token after them, and drop the rejected ones from the sequence
        and its blocks."""
        seqs = list(drafts)
        base = {seq: seq.num_tokens - len(drafts[seq][0]) for seq in seqs}
        for seq in seqs:
            del seq.token_ids[base[seq]:]
        try:
            results = verify(logits, seqs, [drafts[s][0] for s in seqs], [drafts[s][1] for s in seqs])
        except Exception as e:
            failed.update({seq.request_id: self._fail(seq, e) for seq in seqs})
            return
        for seq, v in zip(seqs, results):
            self.speculator.stats.record(len(drafts[seq][0]), v.accepted)
            try:
                for token, lp in zip(v.tokens, v.logprobs):
                    self._append(seq, token, lp, now)
                    if seq.is_finished:
                        break
                else:
                    seq.num_computed_tokens = base[seq] + v.accepted
                    self.block_manager.commit(seq)
                    self.block_manager.trim(seq, seq.num_tokens)
                outputs.append(self._output(seq))
            except Exception as e:
                failed[seq.request_id] = self._fail(seq, e)

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[tuple[int, dict | None] | Exception]:
        """(token, logprobs) per sequence; when the batched sampler fails, each row alone, to find the culprit."""
        try:
            return list(zip(*sample(logits, [s.params for s in seqs], [s.generator for s in seqs])))
        except Exception:
            picks = []
            for i, seq in enumerate(seqs):
                try:
                    tokens, lps = sample(logits[i:i + 1], [seq.params], [seq.generator])
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

    def _append(self, seq: Sequence, token: int, logprob: dict | None, now: float) -> None:
        seq.token_ids.append(token)
        self.generation_tokens_total += 1
        if seq.first_token_time is None:
            seq.first_token_time = now
        if logprob is not None:
            seq.logprobs.append(logprob)
        p = seq.params
        reason = None
        end = seq.num_tokens
        if (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
            reason = "stop"
            end -= 1  # the stop token is not text
        length = seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len
        before = len(seq.text)
        seq.text = seq.detokenizer.update(self.tokenizer, seq.token_ids, end, reason is not None or length)
        if p.stop and len(seq.text) > before:  # a stop string ending in the new text
            since = max(0, before - max(map(len, p.stop)) + 1)
            cut = min((i for i in (seq.text.find(s, since) for s in p.stop) if i >= 0), default=-1)
            if cut >= 0:
                seq.text = seq.text[:cut]
                reason = "stop"
        if reason is None and length:
            reason = "length"
        if reason is not None:
            self.scheduler.finish(seq, reason)
            seq.finished_time = now

    def _output(self, seq: Sequence) -> RequestOutput:
        new = seq.output_token_ids[seq.num_emitted:]
        new_lp = seq.logprobs[seq.num_emitted:] if seq.params.logprobs is not None else None
        seq.num_emitted = seq.num_output_tokens
        if seq.is_finished:
            self.requests.pop(seq.request_id, None)
        return RequestOutput(seq.request_id, new, new_lp, list(seq.output_token_ids), seq.text, seq.is_finished,
                             seq.finish_reason, seq.num_prompt_tokens, seq.num_cached_tokens,
                             RequestMetrics(seq.arrival_time, seq.first_token_time, seq.finished_time))

    # -- offline helpers --------------------------------------------------------------------------------------------
    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams]
                 ) -> list[RequestOutput]:
        """Run prompts to completion (alongside any requests already in flight); final outputs in input order,
        their new_token_ids / new_logprobs covering the whole completion."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise LlmqError(f"{len(prompts)} prompts but {len(plist)} sampling parameter sets")
        tag = f"gen-{time.monotonic_ns()}-"
        ids = [f"{tag}{i}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, plist):
            self.add_request(rid, prompt, p)
        wanted = set(ids)
        final: dict[str, RequestOutput] = {}
        logprobs: dict[str, list] = {r: [] for r in ids}
        while len(final) < len(ids):
            for out in self.step():
                if out.request_id not in wanted:
                    continue
                logprobs[out.request_id].extend(out.new_logprobs or [])
                if out.finished:
                    out.new_token_ids = list(out.output_token_ids)
                    out.new_logprobs = logprobs[out.request_id] if out.new_logprobs is not None else None
                    final[out.request_id] = out
        return [final[r] for r in ids]

    def prompt_logprobs(self, token_ids: list[int]) -> torch.Tensor:
        """[T, vocab] log-softmax of the next-token distribution after each position, through the paged path.

        Runs in chunks of the step budget on blocks of its own, which are released afterwards and never cached.
        """
        ids = list(token_ids)
        if not ids or len(ids) > self.max_model_len:
            raise LlmqError(f"prompt_logprobs needs 1..{self.max_model_len} tokens, got {len(ids)}")
        seq = Sequence("prompt-logprobs", ids, SamplingParams(max_tokens=1, temperature=0))
        if not self.block_manager.allocate(seq, len(ids)):
            raise LlmqError(f"not enough free KV blocks for a {len(ids)}-token sequence right now")
        out = []
        try:
            budget = self.config.max_num_batched_tokens
            while seq.num_computed_tokens < len(ids):
                n = min(budget, len(ids) - seq.num_computed_tokens)
                step = prepare_step([seq], [n], self.block_size, fresh_prefill_direct=self.kv_cache_dtype == "auto",
                                    all_logits=True, window=self.spec.sliding_window)
                out.append(self._forward(step).log_softmax(-1))
                seq.num_computed_tokens += n
        finally:
            self.block_manager.release(seq)
        return torch.cat(out).cpu()

    def score(self, requests: list[ScoreRequest], progress: Callable[[int], None] | None = None
              ) -> list[ScoreOutput]:
        """Log-probabilities of every request's scored tokens, several sequences per step (chunked to the budget).

        Requests that share a prefix (one few-shot prompt, one question with several answers) compute it once
        through the prefix cache: a request is admitted only when no request in flight is still computing blocks
        it could reuse. Sorting by tokens makes such requests neighbours. progress(n) counts finished requests.
        For whole next-token distributions, see prompt_logprobs.
        """
        if self.has_unfinished():
            raise LlmqError("the engine is serving requests; scoring needs it to itself")
        for r in requests:
            if not 1 <= r.start < len(r.token_ids) or len(r.token_ids) > self.max_model_len:
                raise LlmqError(f"cannot score {len(r.token_ids)} tokens from {r.start} (context {self.max_model_len})")
        pending = sorted(range(len(requests)), key=lambda i: requests[i].token_ids)
        results: list[ScoreOutput | None] = [None] * len(requests)
        active: list[_Scoring] = []
        try:
            while pending or active:
                pending = self._admit_scoring(requests, pending, active)
                if not active:
                    raise LlmqError("the KV cache cannot hold one scoring request; give it more memory")
                done = self._score_step(active)
                for a in done:
                    self.block_manager.release(a.seq)
                    active.remove(a)
                    results[a.index] = a.out
                if done and progress is not None:
                    progress(len(done))
        finally:
            for a in active:
                self.block_manager.release(a.seq)
        return results  # type: ignore[return-value]

    def _admit_scoring(self, requests: list[ScoreRequest], pending: list[int], active: list[_Scoring]) -> list[int]:
        """Move pending requests (from a lookahead window) into `active` while slots and blocks last, except those
        whose shareable blocks another active request is still computing; returns the still pending."""
        bm, bs = self.block_manager, self.block_size
        computing = {k for a in active for k in a.keys[a.seq.num_computed_tokens // bs:]}
        kept = []
        for pos, i in enumerate(pending):
            if pos >= 4 * self.max_num_seqs or len(active) >= self.max_num_seqs:
                return kept + pending[pos:]
            r = requests[i]
            seq = Sequence(f"score-{i}", r.token_ids[:r.start], SamplingParams(max_tokens=1, temperature=0))
            matched = bm.match_prefix(seq) // bs
            shareable = bm.block_keys(r.token_ids, (r.start - 1) // bs, matched, seq.last_block_key)
            if any(k in computing for k in shareable) or not bm.allocate(seq, len(r.token_ids)):
                bm.release(seq)  # wait for the request computing these blocks (or for free blocks)
                kept.append(i)
                continue
            seq.token_ids = list(r.token_ids)
            a = _Scoring(i, r, seq, list(bm.block_keys(r.token_ids, len(r.token_ids) // bs)),
                         ScoreOutput(num_cached_tokens=matched * bs))
            active.append(a)
            computing.update(a.keys[matched:])
        return kept

    def _score_step(self, active: list[_Scoring]) -> list[_Scoring]:
        """One step over the requests in flight (within the token budget); returns those it finished."""
        chunks, left = [], self.config.max_num_batched_tokens
        for a in active:
            if left == 0:
                break
            n = min(len(a.request.token_ids) - a.seq.num_computed_tokens, left)
            chunks.append((a, n))
            left -= n
        chunks.sort(key=lambda c: c[1] != 1)  # single-token chunks first, as prepare_step requires
        step = prepare_step([a.seq for a, _ in chunks], [n for _, n in chunks], self.block_size,
                            fresh_prefill_direct=self.kv_cache_dtype == "auto", all_logits=True,
                            window=self.spec.sliding_window)
        rows, targets, owners, q0 = [], [], [], 0
        for a, n in chunks:
            st, toks = a.seq.num_computed_tokens, a.request.token_ids
            for p in range(max(st, a.request.start - 1), min(st + n, len(toks) - 1)):
                rows.append(q0 + p - st)
                targets.append(toks[p + 1])
                owners.append(a)
            q0 += n
        step.logits_indices = torch.tensor(rows or [0], dtype=torch.long)  # a step scoring nothing runs for its KV
        logits = self._forward(step)
        if rows:
            lsm = logits.float().log_softmax(-1)
            tgt = torch.tensor(targets, device=lsm.device)
            for a, lp, hit in zip(owners, lsm.gather(1, tgt[:, None])[:, 0].tolist(),
                                  (lsm.argmax(-1) == tgt).tolist()):
                a.out.logprobs.append(lp)
                a.out.greedy.append(hit)
        done = []
        for a, n in chunks:
            a.seq.num_computed_tokens += n
            self.block_manager.commit(a.seq)
            if a.seq.num_computed_tokens == len(a.request.token_ids):
                done.append(a)
        return done

    @contextmanager
    def observe_kv(self, fn: Callable[[int, torch.Tensor, torch.Tensor], None]) -> Iterator[None]:
        """Within the block, fn(layer, k, v) sees every K/V the model writes to its cache, [tokens, kv_heads,
        head_dim] in the compute dtype (K after RoPE, before any KV quantization): what calibration measures."""
        if self.tp > 1:
            raise LlmqError("observe_kv needs tp=1: the other ranks write their KV heads in their own processes")
        self.runner.observe_kv(fn)
        try:
            yield
        finally:
            self.runner.observe_kv(None)

    def stats(self) -> EngineStats:
        s, bm = self.scheduler, self.block_manager
        return EngineStats(len(s.running), len(s.waiting), bm.num_used_blocks, bm.num_blocks, s.prefix_cache_queries,
                           s.prefix_cache_hits, s.num_preemptions, self.prompt_tokens_total,
                           self.generation_tokens_total,
                           self.speculator.stats.copy() if self.speculator is not None else SpecStats())

    def shutdown(self) -> None:
        if getattr(self, "_closed", False):
            return
        self._closed = True
        if getattr(self, "speculator", None) is not None:
            self.speculator.close()
        if self.workers is not None:
            import torch.distributed as dist

            try:
                if self._workers_ready:
                    self.runner.tp.broadcast(None)
            except Exception:  # workers already gone: nothing left to stop politely
                pass
            self.workers.stop(timeout=30 if self._workers_ready else 2)
            if dist.is_initialized():
                dist.destroy_process_group()
        if self._saved_threads is not None:
            torch.set_num_threads(self._saved_threads)
        self.runner = None  # the weights and the KV cache go now, even while a caller still holds the engine

    def __del__(self):
        try:
            self.shutdown()
        except Exception:
            pass
