"""The online benchmark: probe the endpoint, build the prompts, run every load level, return the report dict."""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from ..artifacts import Artifact, ArtifactError, Store
from ..errors import LlmqError
from . import prompts as P
from .loadgen import Endpoint, LoadGenerator, probe
from .report import SCHEMA, level
from .stats import summarize


@dataclass
class OnlineSettings:
    endpoint: str
    model: str | None = None
    api: str = "completions"
    concurrency: list[int] = field(default_factory=list)
    request_rate: list[float] = field(default_factory=list)
    num_prompts: int = 64
    input_len: int = 128
    input_len_std: float = 0.0
    input_len_range: tuple[int, int] | None = None
    output_len: int = 128
    dataset: str | None = None
    tokenizer: str | None = None
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    cost_per_hour: float | None = None
    time_limit: float = 300.0  # per load level
    seed: int = 0
    warmup: int = 1  # requests sent (and not recorded) before the first level
    temperature: float = 0.0
    ignore_eos: bool = True
    api_key: str | None = None


def _load_tokenizer(ref: str, store: Store | None):
    from ..models import load_tokenizer

    p = Path(ref).expanduser()
    if not (p.is_dir() and any((p / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))):
        if store is None:
            raise LlmqError(f"--tokenizer {ref}: not a directory with a tokenizer")
        try:
            p = store.resolve(ref, verify=False).path
        except ArtifactError:
            raise LlmqError(f"--tokenizer {ref}: neither a tokenizer directory nor an artifact in the store") from None
        if (p / "rank0" / "tokenizer.json").is_file() and not (p / "tokenizer.json").is_file():
            p = p / "rank0"
    try:
        return load_tokenizer(p)
    except (OSError, ValueError) as e:
        raise LlmqError(f"cannot load a tokenizer from {p}: {str(e).splitlines()[0][:200]}") from None


def find_tokenizer(ep: Endpoint, explicit: str | None, store: Store | None):
    """--tokenizer when given; else the served model's local directory (llmq and vLLM report it as `root`) or an
    llmq artifact named like the served model; else None (prompt lengths are then approximate)."""
    if explicit:
        return _load_tokenizer(explicit, store)
    for ref in (ep.root, ep.model):
        if not ref:
            continue
        p = Path(ref).expanduser()
        if p.is_dir() and any((p / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
            return _load_tokenizer(str(p), store)
        if store is not None:
            try:
                store.resolve(ref, verify=False)
            except (ArtifactError, OSError):
                continue
            return _load_tokenizer(ref, store)
    return None


def served_artifact(ep: Endpoint, store: Store | None) -> Artifact | None:
    """The artifact of this store the endpoint serves, when it serves one (llmq reports `name/vN` as `root`)."""
    if store is None:
        return None
    for ref in (ep.root, ep.model):
        if ref:
            try:
                return store.resolve(ref, verify=False)
            except (ArtifactError, OSError):
                continue
    return None


def parent_ids(ep: Endpoint, store: Store | None) -> list[str]:
    """The served artifact's id, for a report's lineage."""
    art = served_artifact(ep, store)
    return [art.id] if art is not None else []


def run_online(s: OnlineSettings, store: Store | None = None, warn: Callable[[str], None] = print,
               progress: Callable[[dict], None] | None = None) -> tuple[dict, Endpoint]:
    if not s.concurrency and not s.request_rate:
        s.concurrency = [1]
    if s.num_prompts < 1:
        raise LlmqError("--num-prompts must be >= 1")
    if s.output_len < 1:
        raise LlmqError("--output-len must be >= 1")
    if s.time_limit <= 0:
        raise LlmqError("--time-limit must be > 0")
    ep = asyncio.run(probe(s.endpoint, s.model, s.api_key))
    tok = find_tokenizer(ep, s.tokenizer, store)
    if s.dataset:
        dataset = P.from_jsonl(s.dataset, s.num_prompts, s.output_len)
    elif tok is None:
        warn(f"no tokenizer for {ep.model!r} (give --tokenizer REF); synthetic prompt lengths are approximate")
    low, high = s.input_len_range or (None, None)

    def prompts_for(n: int, seed: int) -> list[P.Prompt]:
        # fresh synthetic prompts per level: repeating them would hand later levels prefix-cache hits
        if s.dataset:
            return dataset[:n]
        return P.synthetic(tok, P.input_lengths(n, s.input_len, s.input_len_std, low, high, seed), s.output_len, seed)

    gen = LoadGenerator(ep, s.api, s.temperature, s.ignore_eos, tok, warn)
    if s.warmup:
        warm = [replace(p, output_len=min(p.output_len, 4)) for p in prompts_for(s.warmup, s.seed + 999_983)]
        recs = asyncio.run(gen.closed_loop(warm, len(warm), s.time_limit))
        if not any(r.ok for r in recs):
            raise LlmqError(f"the warm-up request failed: {next((r.error for r in recs if r.error), 'timed out')}")
    slo_ttft = None if s.slo_ttft_ms is None else s.slo_ttft_ms / 1e3
    slo_tpot = None if s.slo_tpot_ms is None else s.slo_tpot_ms / 1e3
    plan = [("concurrency", c) for c in s.concurrency] + [("rate", r) for r in s.request_rate]
    levels = []
    for i, (kind, value) in enumerate(plan):
        started = time.time()
        prompts = prompts_for(s.num_prompts, s.seed + 1000 * i)
        if kind == "concurrency":
            recs = asyncio.run(gen.closed_loop(prompts, int(value), s.time_limit))
        else:
            recs = asyncio.run(gen.open_loop(prompts, float(value), s.time_limit, s.seed))
        lv = level(kind, value, summarize(recs, slo_ttft, slo_tpot, s.cost_per_hour), [r.to_dict() for r in recs])
        lv["started"] = started
        levels.append(lv)
        if progress:
            progress(lv)
    settings = {k: v for k, v in vars(s).items() if k != "api_key"}
    settings.update(endpoint=ep.base, model=ep.model, served_root=ep.root, tokenizer_found=tok is not None,
                    request_rate=[("inf" if math.isinf(r) else r) for r in s.request_rate])
    return {"schema": SCHEMA, "mode": "online", "settings": settings, "levels": levels}, ep
