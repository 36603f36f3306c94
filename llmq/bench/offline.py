"""Offline sweep: the bundled runtime in-process, one batch size at a time, to trace the roofline curve.

For each batch size B, B requests (distinct random prompts, so nothing is shared through the prefix cache) are
prefilled, then every decode step (B tokens) is timed. Per step:
  MBU = (weight bytes + KV bytes read) / step time / peak read bandwidth
  MFU = 2 x parameters x B / step time / peak matmul FLOP/s (of the compute dtype)
where the KV bytes are the cached context of all B sequences at that step. Small batches are bandwidth bound
(MBU high, MFU low); MFU climbs with B until compute saturates.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from ..artifacts import Artifact, Store
from ..errors import LlmqError
from ..options import SpeculativeOptions, option


@dataclass
class OfflineResult:
    batch_size: int
    decode_steps: int
    step_ms: float  # mean decode step = per-token latency of every sequence in the batch
    step_ms_p50: float
    tokens_per_s: float  # output tokens/s across the batch
    prefill_s: float  # all B prompts, until every sequence had its first token
    weight_bytes: int
    kv_bytes: float  # mean KV bytes read per decode step
    mbu: float | None  # None: the achieved rate exceeded the measured peak (a cache-resident working set)
    mfu: float | None

    def to_dict(self) -> dict:
        return asdict(self)


def _compute_params(spec) -> int:
    """Parameters a token multiplies through: an untied input embedding is a lookup, not a matmul; a mixture of
    experts' chosen experts only."""
    return spec.num_parameters(active=True) - (0 if spec.tie_word_embeddings else spec.vocab_size * spec.hidden_size)


@dataclass(frozen=True)
class OfflineOptions(SpeculativeOptions):
    """What `llmq bench offline` (or a recipe's bench stage) asks for."""

    batch_sizes: list[int] = option([1, 2, 4, 8, 16], "Batch sizes to sweep.", ge=1, min_items=1)
    input_len: int = option(128, "Prompt tokens.", ge=1)
    output_len: int = option(128, "Output tokens per sequence (at least 2: decode steps to time).", ge=2)
    name: str | None = option(None, "Name of the bench-report artifact (default: bench-<source name>).")
    time_limit: float = option(300.0, "Seconds per batch size (hard stop).", gt=0)
    device: str | None = option(None, "Device (default: cuda when available).")
    dtype: str | None = option(None, "Compute dtype (default: the runtime's choice).",
                               choices=("float32", "bfloat16", "float16"))
    seed: int = option(0, "Seeds the random prompts.")
    refresh: bool = option(False, "Measure the machine's peaks again instead of using the cached figures.")
    compile: bool = option(False, "torch.compile the decode step (compiled before timing; tp 1).")
    int8_activations: bool = option(False, "INT4 / INT8 weight-only products with int8 activations (llama.cpp's Q8_0 "
                                    "arithmetic; AVX512-VNNI CPUs): faster, not what quantize's probe measured.")


def run_offline(source: Artifact, opts: OfflineOptions, store: Store, command: str | None = None,
                progress: Callable[[OfflineResult], None] | None = None) -> Artifact:
    """Sweep `source` (a model, quantized or llmq engine artifact) and save a bench-report artifact."""
    from . import report as R
    from .hw import hardware

    if source.kind not in ("model", "quantized", "engine"):
        raise LlmqError(f"{source.ref} is a {source.kind} artifact; the offline bench takes a model, quantized or "
                        "engine artifact")
    opts.check()
    hw = hardware(opts.device, refresh=opts.refresh)
    results, settings = sweep(source.path, opts.batch_sizes, opts.input_len, opts.output_len, hw, opts.time_limit,
                              opts.device, opts.dtype, opts.seed, progress, opts.engine_fields(store),
                              compile=opts.compile, int8_activations=opts.int8_activations)
    settings["engine"] = source.ref
    report = {"schema": R.SCHEMA, "mode": "offline", "settings": settings, "offline": [r.to_dict() for r in results]}
    return R.save(store, report, opts.name, [source.id], command)


def sweep(path: str | Path, batch_sizes: list[int], input_len: int, output_len: int, hw: dict | None,
          time_limit: float = 300.0, device: str | None = None, dtype: str | None = None, seed: int = 0,
          progress: Callable[[OfflineResult], None] | None = None, speculative: dict | None = None,
          compile: bool = False, int8_activations: bool = False
          ) -> tuple[list[OfflineResult], dict]:
    """Results per batch size, plus the engine settings they were measured with. `speculative`: EngineConfig's
    speculative fields (a speculating step emits several tokens per sequence, so rates count tokens, not steps).
    hw: the machine's peaks (bench.hw.hardware), or None to time only (MBU / MFU left None)."""
    import numpy as np
    import torch

    from ..runtime import EngineConfig, LLMEngine, SamplingParams
    from ..runtime.kv_cache import kv_element_bytes
    from .hw import hardware, peak_flops

    if not batch_sizes or min(batch_sizes) < 1:
        raise LlmqError("--batch-sizes needs positive integers, e.g. 1,2,4,8")
    if input_len < 1 or output_len < 2:
        raise LlmqError("offline bench needs --input-len >= 1 and --output-len >= 2 (decode steps to time)")
    max_b = max(batch_sizes)
    cfg = EngineConfig(max_num_seqs=max_b, max_num_batched_tokens=max(512, input_len), enable_prefix_caching=False,
                       max_model_len=input_len + output_len + 1, device=device, dtype=dtype, compile=compile,
                       int8_activations=int8_activations,
                       **(speculative or {}))
    engine = LLMEngine(path, cfg)
    try:
        spec = engine.spec
        kv_per_token = spec.kv_bytes_per_token(kv_element_bytes(engine.kv_cache_dtype, engine.runner.dtype))
        model = engine.runner.model
        weight_bytes = model.weight_bytes()   # read every step; a MoE's routed experts are counted as read below
        flops_per_token = 2 * _compute_params(spec)
        peak_bw, peak_fl = (hw["read_bandwidth"], peak_flops(hw, engine.runner.dtype)) if hw else (None, None)
        rng = np.random.default_rng(seed)
        special = set(engine.tokenizer.all_special_ids)
        vocab = [i for i in range(min(spec.vocab_size, len(engine.tokenizer))) if i not in special]
        params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
        warm = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
        # warm up on a prompt as long as the timed ones, so the first timed prefill pays no one-off costs; compiled,
        # also on the batch sizes whose graphs the sweep will hit (batch 1 and more)
        for n in sorted({1, min(2, max_b)}) if compile else [1]:
            engine.generate([list(map(int, rng.choice(vocab, input_len))) for _ in range(n)], warm)
        results, rates = [], []  # rates: (bytes read / s, FLOP / s) achieved at each batch size
        for b in batch_sizes:
            ids = [f"b{b}-{i}" for i in range(b)]
            for rid in ids:
                engine.add_request(rid, [int(t) for t in rng.choice(vocab, input_len)], params)
            seqs = [engine.requests[r] for r in ids]
            t0 = time.perf_counter()
            deadline = t0 + time_limit
            while any(s.first_token_time is None for s in seqs):
                engine.step()
            prefill = time.perf_counter() - t0
            times, kv, made, experts = [], [], 0, 0
            # only steps in which all B sequences decode (a sequence prefilled a step early finishes a step early)
            while not any(s.is_finished for s in seqs) and time.perf_counter() < deadline:
                context = sum(s.num_tokens for s in seqs)  # the KV each new token attends to
                read0 = model.expert_bytes_read()
                t = time.perf_counter()
                made += sum(len(o.new_token_ids) for o in engine.step())
                if engine.device.type == "cuda":
                    torch.cuda.synchronize(engine.device)
                times.append(time.perf_counter() - t)
                experts += model.expert_bytes_read() - read0
                kv.append(context * kv_per_token)
            for rid in ids:
                engine.abort_request(rid)
            if not times:
                raise LlmqError(f"batch size {b}: no decode step with all {b} sequences was timed; raise --output-len "
                                f"or --time-limit ({time_limit:g} s)")
            step = float(np.mean(times))
            kv_mean = float(np.mean(kv))
            per_step = made / len(times) if engine.speculator else b  # speculation emits a variable number
            read = (weight_bytes + experts // len(times)) * engine.tp   # every rank reads its slice alike
            rates.append(((read + kv_mean) / step, flops_per_token * per_step / step))
            results.append(OfflineResult(b, len(times), step * 1e3, float(np.median(times)) * 1e3, per_step / step,
                                         prefill, read, kv_mean, None, None))  # MBU / MFU: once all known
            if progress:
                progress(results[-1])
        notes = []
        if hw is not None:  # else time only
            if any(bw > peak_bw or fl > peak_fl for bw, fl in rates):  # the cached peaks understate this machine
                hw = hardware(str(engine.device), refresh=True)
                peak_bw, peak_fl = hw["read_bandwidth"], peak_flops(hw, engine.runner.dtype)
                notes.append("the cached peaks were below what this run achieved; measured them again")
            for r, (bw, fl) in zip(results, rates):
                r.mbu, r.mfu = bw / peak_bw, fl / peak_fl
                if r.mbu > 1 or r.mfu > 1:  # still: the weights sit in a cache faster than memory; no honest figure
                    notes.append(f"batch {r.batch_size}: {bw / 1e9:.1f} GB/s and {fl / 1e9:.1f} GFLOP/s exceed the "
                                 "peaks just measured (the working set fits in cache); MBU / MFU not reported")
                    r.mbu = r.mfu = None
        settings = {"device": str(engine.device), "dtype": str(engine.runner.dtype).removeprefix("torch."),
                    "compile": compile, "int8_activations": int8_activations,
                    "kv_cache_dtype": engine.kv_cache_dtype, "tp": engine.tp, "input_len": input_len,
                    "output_len": output_len, "batch_sizes": list(batch_sizes), "time_limit_s": time_limit,
                    "peak_read_bandwidth": peak_bw, "peak_flops": peak_fl, "machine": (hw or {}).get("machine"),
                    "peaks_measured": (hw or {}).get("measured"),
                    "peaks_load_per_core": (hw or {}).get("load_per_core"),
                    "notes": notes, **{k: getattr(cfg, k) for k in (speculative or {})},
                    "parameters": spec.num_parameters()}
        return results, settings
    finally:
        engine.shutdown()
