"""The worker: one model's execution side. It owns rank 0's model runner (weights and KV cache), the other tensor-
parallel ranks' processes and the block manager of that KV cache, and runs a batch of sequences' new tokens.

The engine owns one for the target model; a draft model's proposer owns another. Neither schedules: they hand the
worker sequences in the order the runner requires (single-token entries first: scheduler.decodes_first).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import LlmqError
from ..models import ModelSpec
from ..models.engine_spec import EngineSpec
from ..models.reader import CheckpointReader
from ..models.sharding import make_plan
from .block_manager import BlockManager
from .config import DEFAULT_MAX_MODEL_LEN, EngineConfig
from .distributed import WorkerGroup, init_group, rank_device, threads_per_rank
from .kv_cache import kv_element_bytes
from .layers.linear import keeps_as_stored
from .layers.rotary import rope_tables
from .model_runner import ModelRunner, compute_dtype_for, worker_main
from .sequence import Sequence
from .step import prepare_step


def available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    import psutil

    return psutil.virtual_memory().available


@dataclass
class ModelSource:
    """What a model directory holds: a checkpoint, or a `build --target llmq` engine."""

    path: Path
    engine: EngineSpec | None  # the record of a `build --target llmq` engine
    weights_dir: Path  # the directory holding config.json (rank0/ for an engine)

    @classmethod
    def of(cls, model: str | Path) -> ModelSource:
        path = Path(model)
        if not path.is_dir():
            raise LlmqError(f"{path}: not a model directory (resolve references to an artifact path first)")
        if (path / "engine.json").is_file():
            engine = EngineSpec.read(path)
            if not engine.native:
                raise LlmqError(f"{path} is a {engine.target!r} engine; the bundled runtime loads "
                                "`llmq build --target llmq` engines (or the quantized / model artifact itself)")
            return cls(path, engine, path / "rank0")
        return cls(path, None, path)


def kv_cache_dtype_for(requested: str, ckpt: CheckpointReader, engine: EngineSpec | None) -> str:
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


def refuse_for_hybrid(spec: ModelSpec, compile: bool) -> None:
    """One line for what the runtime does not yet run with a hybrid model's Gated DeltaNet layers."""
    if compile:
        raise LlmqError(f"{spec.architecture}: --compile does not trace Gated DeltaNet layers yet; drop --compile")


class Worker:
    def __init__(self, src: ModelSource, cfg: EngineConfig):
        cfg.check()  # the bounds and choices its flags declare, for code that builds one as for `llmq serve`
        self.config = cfg
        self.path = src.path
        ckpt = CheckpointReader(src.weights_dir)
        self.spec: ModelSpec = ckpt.spec
        from ..models import pick_device

        self.device = torch.device(pick_device(cfg.device))
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise LlmqError("device cuda was requested but torch sees no CUDA GPU (CPU-only build or no driver)")
        engine = src.engine
        if engine is not None:
            if cfg.tp not in (1, engine.tp):
                raise LlmqError(f"this engine was built for tp {engine.tp}: drop --tp, or build one for tp {cfg.tp} "
                                f"(`llmq build --tp {cfg.tp}`)")
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
        if self.spec.linear_layers:
            refuse_for_hybrid(self.spec, compile=cfg.compile)
        if self.spec.arch.per_layer_heads and (self.tp > 1 or cfg.compile):
            raise LlmqError(f"{self.spec.architecture}: {'--tp' if self.tp > 1 else '--compile'} does not take its "
                            "per-layer head widths and shared KV caches yet; serve it at tp 1, eagerly")
        if cfg.compile and self.tp > 1:
            raise LlmqError("--compile compiles the decode step of one rank; use it with tp 1 (tensor-parallel "
                            "ranks run eagerly)")
        self.block_size = block_size
        # an engine's max_batch_size is a build-time cap, like TensorRT-LLM's
        self.max_num_seqs = min(cfg.max_num_seqs, engine.max_batch_size) if engine else cfg.max_num_seqs
        self.kv_cache_dtype = kv_cache_dtype_for(cfg.kv_cache_dtype, ckpt, engine)
        dtype = compute_dtype_for(self.device, cfg.dtype, ckpt.config)
        # a recurrent-state slot for every sequence the scheduler runs, and one for the scorer's prompt_logprobs
        self.state_slots = self.max_num_seqs + 1 if self.spec.linear_layers else 0
        self.state_bytes = int(self.state_slots * self.spec.recurrent_state_bytes(dtype.itemsize, self.tp))
        self.num_blocks = self._num_blocks(ckpt, dtype, sliced=engine is not None)

        load_args = dict(path=str(src.path), engine=engine, tp=self.tp, device=str(self.device), dtype=cfg.dtype,
                         num_blocks=self.num_blocks, block_size=block_size, kv_cache_dtype=self.kv_cache_dtype,
                         max_positions=self.max_model_len, compile=cfg.compile,
                         int8_activations=cfg.int8_activations, state_slots=self.state_slots, spec=self.spec,
                         rope=rope_tables(ckpt.config, self.spec))
        self.ranks = None  # the other tensor-parallel ranks' processes
        self._ranks_ready = False
        self._saved_threads = None
        self._closed = False
        if self.tp > 1:
            if self.device.type == "cuda" and torch.cuda.device_count() < self.tp:
                raise LlmqError(f"tp={self.tp} needs {self.tp} GPUs; {torch.cuda.device_count()} visible")
            if self.device.type == "cpu":
                self._saved_threads = torch.get_num_threads()
                torch.set_num_threads(threads_per_rank(self.tp))
            if engine is None:
                make_plan(self.spec, self.tp)  # refuse a split that does not fit before spawning anything
            self.ranks = WorkerGroup(self.tp, load_args, self.device, worker_main)
            try:
                init_group(0, self.tp, self.ranks.port, rank_device(self.device, 0))
                self.runner = ModelRunner(**load_args, rank=0, world=self.tp)
                self.ranks.wait_ready()
                self._ranks_ready = True
            except BaseException:
                self.shutdown()
                raise
        else:
            self.runner = ModelRunner(**load_args, rank=0, world=1)
        # prefix caching reuses KV blocks, but a recurrent layer's state after a prefix is no block: hybrid models
        # compute every prompt whole
        self.block_manager = BlockManager(self.num_blocks, block_size,
                                          cfg.enable_prefix_caching and not self.spec.linear_layers, self.state_slots)
        self._settle: dict[int, int] = {}   # recurrent-state rollbacks the next step applies first (settle())

    def _num_blocks(self, ckpt: CheckpointReader, dtype: torch.dtype, sliced: bool) -> int:
        """KV-cache blocks per rank; `sliced`: ckpt is already one rank's share (an engine's rank0)."""
        cfg = self.config
        per_token = self.spec.kv_bytes_per_token(kv_element_bytes(self.kv_cache_dtype, dtype), self.tp)
        block_bytes = per_token * self.block_size
        if cfg.kv_cache_memory is not None:
            budget = int(cfg.kv_cache_memory)
        else:
            kept = functools.partial(keeps_as_stored, dtype=dtype, device=self.device)
            free = available_memory(self.device) - ckpt.runtime_bytes(dtype, kept) // (1 if sliced else self.tp) - \
                self.state_bytes
            # never more than every sequence slot filled to the context length
            budget = min(int(max(free, 0) * cfg.kv_fraction),
                         self.max_num_seqs * self.max_model_len * per_token + block_bytes)
        num_blocks = budget // block_bytes
        min_blocks = -(-self.max_model_len // self.block_size)
        if num_blocks < min_blocks:
            raise LlmqError(f"KV-cache budget of {budget / 2**20:.1f} MiB holds {num_blocks} blocks of "
                            f"{self.block_size} tokens, fewer than one {self.max_model_len}-token sequence needs "
                            f"({min_blocks}); raise the KV-cache memory or lower max_model_len")
        return int(num_blocks)

    def run(self, seqs: list[Sequence], num_new: list[int], all_logits: bool = False,
            rows: list[int] | None = None, speculating: Collection[Sequence] = ()) -> torch.Tensor:
        """Logits of one forward over num_new[i] new tokens of each seqs[i] (single-token entries first): at the
        last token of each sequence it completes, at every token (all_logits), or at the flat token positions
        `rows` of the step. `speculating`: sequences whose tokens from this step on may be rejected (a hybrid
        model's recurrent layers keep a journal of their states, until settle())."""
        step = prepare_step(seqs, num_new, self.block_size, fresh_prefill_direct=self.kv_cache_dtype == "auto",
                            all_logits=all_logits, window=self.spec.sliding_window)
        if rows is not None:
            step.logits_indices = torch.tensor(rows, dtype=torch.long)
        if self.spec.linear_layers:
            step.meta.settle, self._settle = self._settle, {}
            step.meta.journal = tuple(s.state_slot for s in speculating)
        return self.forward(step)

    def settle(self, slot: int, kept: int) -> None:
        """Keep the first `kept` tokens a speculating sequence's state slot took since run(speculating=...): a hybrid
        model's recurrent states go back to after them before the next step (nothing for other models)."""
        if self.spec.linear_layers:
            self._settle[slot] = kept

    def forward(self, step) -> torch.Tensor:
        """One prepared step on every rank; rank 0's logits."""
        if self.ranks is not None:
            self.runner.tp.broadcast(step)
        return self.runner.execute(step)

    def observe_kv(self, fn: Callable[[int, torch.Tensor, torch.Tensor], None] | None) -> None:
        if self.tp > 1:
            raise LlmqError("observe_kv needs tp=1: the other ranks write their KV heads in their own processes")
        self.runner.observe_kv(fn)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.ranks is not None:
            import torch.distributed as dist

            try:
                if self._ranks_ready:
                    self.runner.tp.broadcast(None)
            except Exception:  # workers already gone: nothing left to stop politely
                pass
            self.ranks.stop(timeout=30 if self._ranks_ready else 2)
            if dist.is_initialized():
                dist.destroy_process_group()
        if self._saved_threads is not None:
            torch.set_num_threads(self._saved_threads)
        self.runner = None  # the weights and the KV cache go now, even while a caller still holds the engine
