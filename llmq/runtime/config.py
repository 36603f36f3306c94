"""The runtime's settings, declared once: EngineConfig (read by the engine, its worker and a draft model's worker),
ServerOptions and Limits (the HTTP server's). `llmq serve`'s flags, their help, defaults and bounds are these fields
(`llmq.options`); code builds the same dataclasses. Imports nothing heavy: the command line reads them."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import LlmqError
from ..options import Options, SpeculativeOptions, option

DEFAULT_MAX_MODEL_LEN = 4096
DEFAULT_KV_CACHE_FRACTION = 0.25
KV_QUANTIZED = ("int8", "fp8")   # cache element types with scales (`llmq quantize-kv`); their grids live in llmq.quant
KV_DTYPES = ("auto", *KV_QUANTIZED)  # what serve, build and the recipes accept: auto is the compute dtype


@dataclass(frozen=True)
class EngineConfig(SpeculativeOptions):
    """The engine's settings. Its speculative fields are SpeculativeOptions': on the command line `speculative` is a
    REF, which engine_fields() resolves to the draft model's directory before an engine reads it."""

    max_num_seqs: int = option(64, "Sequences in the running batch.", flag="--max-batch-size",
                               aliases=("max_num_seqs",), ge=1)
    max_num_batched_tokens: int = option(512, "Tokens per engine step (chunked prefill budget).", ge=1)
    max_model_len: int | None = option(None, f"Context length (default: the model's, at most {DEFAULT_MAX_MODEL_LEN}).",
                                       flag="--max-seq-len", aliases=("max_model_len",), ge=1)
    block_size: int = option(16, "Paged KV-cache block size (tokens).", ge=1)
    kv_cache_memory: int | None = option(None, "KV-cache budget per rank, e.g. 512MiB or 2GiB (overrides the "
                                         "fraction).", size=True, ge=1)
    kv_cache_fraction: float | None = option(None, "Fraction of free memory for the KV cache when no size is given "
                                             f"(default {DEFAULT_KV_CACHE_FRACTION}).", gt=0, le=1)
    kv_cache_dtype: str = option("auto", "KV-cache dtype. auto: the compute dtype, or the checkpoint's calibrated KV "
                                 "scheme.", choices=KV_DTYPES, flag="--kv", aliases=("kv_cache_dtype",))
    enable_prefix_caching: bool = option(True, "Automatic prefix caching (hash-based, per block).",
                                         flag="--prefix-caching/--no-prefix-caching")
    tp: int = option(1, "Tensor-parallel ranks (one process each).", ge=1)
    device: str | None = option(None, "cpu or cuda (default: cuda when available).")
    dtype: str | None = option(None, "Compute dtype (default: float32 on CPU, the checkpoint's 16-bit dtype on GPU).",
                               choices=("float32", "bfloat16", "float16"))
    compile: bool = option(False, "torch.compile the decode step (tp 1; the first batches of each shape wait for "
                           "compilation).")
    # the quantize probe and the exports do not compute this, hence opt-in
    int8_activations: bool = option(False, "INT4 / INT8 weight-only products with activations rounded to int8 per "
                                    "block of 32 (llama.cpp's Q8_0 arithmetic; x86 CPUs with AVX512-VNNI): ~2x faster "
                                    "decode, a little less accurate than what quantize's probe and eval measured.")

    @property
    def kv_fraction(self) -> float:
        """The fraction of free memory the KV cache takes when no kv_cache_memory is given."""
        return DEFAULT_KV_CACHE_FRACTION if self.kv_cache_fraction is None else self.kv_cache_fraction

    def check(self) -> None:
        super().check()
        if self.kv_cache_memory is not None and self.kv_cache_fraction is not None:
            raise LlmqError("give --kv-cache-memory or --kv-cache-fraction, not both")


@dataclass(frozen=True)
class ServerOptions(Options):
    """How `llmq serve` listens and whom it answers."""

    host: str = option("127.0.0.1", "Address to bind (0.0.0.0 exposes the server).")
    port: int = option(8000, "Port to listen on.", ge=0, le=65535)
    served_model_name: str | None = option(None, "Model id in the API (default: the artifact's name).")
    api_key: str | None = option(None, "Require `Authorization: Bearer KEY` on /v1, /metrics and /openapi.json (env "
                                 "LLMQ_API_KEY).", envvar="LLMQ_API_KEY")
    allowed_hosts: str | None = option(None, "Host names requests may be addressed to, comma-separated ('*': any), "
                                       "e.g. a proxy's public name. Also refuses cross-origin requests and non-JSON "
                                       "POSTs. Default: the loopback names on a loopback --host without --api-key, "
                                       "any elsewhere.")
    max_queue: int = option(256, "Requests allowed to wait beyond the running batch; more get 429.", ge=0)
    drain_timeout: float = option(30.0, "Seconds to let in-flight requests finish on SIGTERM / Ctrl-C.", ge=0)
    log_level: str = option("info", "uvicorn's log level.", choices=("critical", "error", "warning", "info", "debug"))


@dataclass(frozen=True)
class Limits(Options):
    """What one request may ask for and one client may hold, so that none can stall the event loop, the engine or
    the server for the others (the connection limits: server/connections.py)."""

    max_stop_strings: int = option(16, "Most stop strings (and stop_token_ids) one request may give; more get 400.",
                                   ge=0)
    max_stop_chars: int = option(1024, "Longest stop string in characters; longer get 400.", flag="--max-stop-length",
                                 ge=0)
    max_logprobs: int = option(20, "Most log-probabilities per position one request may ask for (logprobs, "
                               "top_logprobs, prompt_logprobs); -1: the whole vocabulary, which a request asks for as "
                               "-1 (as vLLM's --max-logprobs).", ge=-1)
    # every log-probability answered is a JSON object the server builds in memory: bounded whatever --max-logprobs
    # allows (docs/serve.md has what one costs)
    max_logprob_entries: int = option(1 << 18, "Most log-probabilities one answer may hold (positions x (top N + "
                                      "the position's token); -1 counts the whole vocabulary); more get 400.", ge=0)
    max_logprob_entries_in_flight: int = option(1 << 20, "Most log-probabilities the requests in flight may hold "
                                                "together; a request past it gets 429.", ge=0)
    max_schema_bytes: int = option(64 << 10, "Largest JSON schema text one request may give (its tools' parameters "
                                   "and response_format's schema together); larger get 400.", size=True, ge=0)
    grammar_timeout: float = option(5.0, "Seconds a request's grammar (response_format, a forced tool call) may take "
                                    "to compile; slower get 400.", gt=0)
    max_body_bytes: int = option(8 << 20, "Largest request body; larger get 413.", flag="--max-body-size", size=True,
                                 ge=0)
    header_timeout: float = option(10.0, "Seconds a client has to send a request's headers; slower connections are "
                                   "closed.", gt=0)
    body_timeout: float = option(30.0, "Seconds a client has to send a request's body once its headers are in.", gt=0)
    keep_alive_timeout: float = option(5.0, "Seconds an idle connection stays open between requests.", gt=0)
    max_connections: int = option(1024, "Connections open at once; more are closed as they arrive (one log line).",
                                  ge=1)
