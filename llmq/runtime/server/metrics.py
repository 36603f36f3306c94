"""Prometheus metrics under vLLM's names, so dashboards and load tools built for vLLM read llmq unchanged.

Each app gets its own CollectorRegistry (several servers can live in one process, e.g. in tests). The engine keeps
running totals; the engine loop turns them into counter increments after every step.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..engine import EngineStats

_LATENCY = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
            80.0, 160.0, 640.0, 2560.0)
_TOKEN_GAP = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
              20.0, 40.0, 80.0)
_TOKENS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        lab = ["model_name"]

        def hist(name, doc, buckets):
            return Histogram(name, doc, lab, buckets=buckets, registry=r).labels(model_name)

        def gauge(name, doc):
            return Gauge(name, doc, lab, registry=r).labels(model_name)

        def counter(name, doc):
            return Counter(name, doc, lab, registry=r).labels(model_name)

        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to first token (from arrival at the server).",
                         _LATENCY)
        self.itl = hist("vllm:inter_token_latency_seconds", "Time between consecutive output tokens.", _TOKEN_GAP)
        self.tpot = hist("vllm:time_per_output_token_seconds", "Time per output token (older name of the "
                         "inter-token latency).", _TOKEN_GAP)
        self.request_tpot = hist("vllm:request_time_per_output_token_seconds", "Per request: (e2e - TTFT) / "
                                 "(output tokens - 1).", _TOKEN_GAP)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "End-to-end request latency.", _LATENCY)
        self.request_prompt_tokens = hist("vllm:request_prompt_tokens", "Prompt tokens per request.", _TOKENS)
        self.request_generation_tokens = hist("vllm:request_generation_tokens", "Generated tokens per request.",
                                              _TOKENS)
        self.running = gauge("vllm:num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).")
        self.kv_usage_legacy = gauge("vllm:gpu_cache_usage_perc", "Older name of vllm:kv_cache_usage_perc.")
        self.kv_blocks_used = gauge("llmq:kv_cache_blocks_used", "KV-cache blocks referenced by live requests.")
        self.kv_blocks_total = gauge("llmq:kv_cache_blocks_total", "KV-cache blocks in the pool.")
        self.prefix_queries = counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prompt tokens served from the prefix cache.")
        self.preemptions = counter("vllm:num_preemptions", "Sequences preempted (to be recomputed).")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens admitted.")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated.")
        self.spec_drafts = counter("vllm:spec_decode_num_drafts", "Speculative drafts verified (sequence-steps).")
        self.spec_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.spec_accepted_tokens = counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self._spec_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by "
                                     "position in the draft.", lab + ["position"], registry=r)
        self.spec_acceptance = gauge("vllm:spec_decode_draft_acceptance_rate", "Accepted / proposed draft tokens "
                                     "since the server started.")
        self._success = Counter("vllm:request_success", "Finished requests by finish reason.",
                                lab + ["finished_reason"], registry=r)
        self._rejected = Counter("llmq:requests_rejected", "Requests refused before reaching the engine "
                                 "(queue full, draining).", lab + ["reason"], registry=r)
        self.model_name = model_name
        self._last = EngineStats(0, 0, 0, 0, 0, 0, 0, 0, 0)
        self._spec_start = self._last  # acceptance rate counts from here

    def set_baseline(self, s: EngineStats) -> None:
        """Count from here: an engine that already ran (offline, or behind an earlier app) starts at its totals."""
        self._last = self._spec_start = s

    def finished(self, reason: str) -> None:
        self._success.labels(self.model_name, reason).inc()

    def rejected(self, reason: str) -> None:
        self._rejected.labels(self.model_name, reason).inc()

    def update(self, s: EngineStats) -> None:
        """Gauges from the engine's state; counters advanced by the totals' growth since the last call."""
        self.running.set(s.num_running)
        self.waiting.set(s.num_waiting)
        usage = s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0
        self.kv_usage.set(usage)
        self.kv_usage_legacy.set(usage)
        self.kv_blocks_used.set(s.kv_blocks_used)
        self.kv_blocks_total.set(s.kv_blocks_total)
        last = self._last
        for c, now, before in ((self.prefix_queries, s.prefix_cache_queries, last.prefix_cache_queries),
                               (self.prefix_hits, s.prefix_cache_hits, last.prefix_cache_hits),
                               (self.preemptions, s.num_preemptions, last.num_preemptions),
                               (self.prompt_tokens, s.prompt_tokens_total, last.prompt_tokens_total),
                               (self.generation_tokens, s.generation_tokens_total, last.generation_tokens_total),
                               (self.spec_drafts, s.spec.num_drafts, last.spec.num_drafts),
                               (self.spec_draft_tokens, s.spec.num_draft_tokens, last.spec.num_draft_tokens),
                               (self.spec_accepted_tokens, s.spec.num_accepted_tokens, last.spec.num_accepted_tokens)):
            if now > before:
                c.inc(now - before)
        for pos, n in enumerate(s.spec.accepted_per_pos):
            before = last.spec.accepted_per_pos[pos] if pos < len(last.spec.accepted_per_pos) else 0
            if n > before:
                self._spec_per_pos.labels(self.model_name, str(pos)).inc(n - before)
        start = self._spec_start.spec
        drafted = s.spec.num_draft_tokens - start.num_draft_tokens
        if drafted:
            self.spec_acceptance.set((s.spec.num_accepted_tokens - start.num_accepted_tokens) / drafted)
        self._last = s

    def render(self) -> bytes:
        return generate_latest(self.registry)
