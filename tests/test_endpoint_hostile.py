"""`llmq eval --endpoint`, `deploy verify` and `bench serve` against hostile OpenAI-compatible servers (issue 54): every
answer bounded in time as a whole and in size, no secret in anything a keyed run writes, impossible logprobs and
tasks the server cannot give refused in one line."""

from __future__ import annotations

import json
import math
import re
import resource
import sys
import threading
import time
from types import SimpleNamespace

import pytest
from click.testing import CliRunner
from helpers import live_server
from test_eval import make_rtn
from test_eval_endpoint import _fake

from llmq.artifacts import Store
from llmq.cli.main import cli
from llmq.models import resolve_model
from llmq.runtime import EngineConfig

KEY = "sk-llmq-test-0123456789abcdef"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tiny_model):
    """A store with a tiny model (the tokenizer and baseline of the fake servers' model) and its INT4 RTN artifact."""
    root = tmp_path_factory.mktemp("endpoint-hostile")
    store = Store(root / "store")
    base = resolve_model(str(tiny_model(name="base", max_position_embeddings=1024)), store)
    return store, base, make_rtn(store, base, 4, "tiny-rtn4")


def _llmq(monkeypatch, store: Store, *args: str, seconds: float = 30.0):
    """`llmq --store STORE ARGS` in-process, as typed (sys.argv: what a manifest records), in a thread that must end
    within `seconds`: a hang fails the test instead of blocking the suite."""
    argv = ["--store", str(store.root), *args]
    monkeypatch.setattr(sys, "argv", ["llmq", *argv])
    out = {}
    t = threading.Thread(target=lambda: out.update(r=CliRunner().invoke(cli, argv)), daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"llmq {' '.join(args)} still running after {seconds} s"
    return out["r"]


def _one_line_error(out, pattern: str) -> str:
    assert out.exit_code == 2, out.output
    lines = out.output.strip().splitlines()
    assert lines[-1].startswith("error: "), out.output
    assert len([x for x in lines if x.startswith("error")]) == 1, out.output
    assert "Traceback" not in out.output, lines[-1]
    assert re.search(pattern, lines[-1]), lines[-1]
    return lines[-1]


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10


@pytest.mark.parametrize("command", ["eval", "verify", "bench"])
@pytest.mark.parametrize("kind,message", [
    ("sse", "no complete answer within 1 s|warm-up request failed: timed out"),
    ("drip", "no complete answer within 1 s|warm-up request failed: timed out"),
    ("endless", r"the answer is larger than 8(\.\d+)? MiB"), ("huge", "/v1/models: the answer is larger than 8 MiB")])
def test_hostile_answers_end_in_one_line_within_their_deadline(tiny, monkeypatch, kind, message, command):
    """An event stream that never ends, an answer dripped a byte at a time, an endless chunked body, a 1 GB
    Content-Length: each command ends with one line and exit 2 within --timeout (bench: its --time-limit) of the
    hostile answer, holding at most its answer's size bound (before: hung, or grew by gigabytes)."""
    store, base, cand = tiny
    args = {"eval": ["eval", "--tasks", "math", "--limit", "1", "--baseline", base.ref, "--timeout", "1"],
            "verify": ["deploy", "verify", cand.ref, "--tasks", "math", "--limit", "1", "--timeout", "1"],
            "bench": ["bench", "serve", "--num-prompts", "1", "--output-len", "4", "--time-limit", "2", "--no-save"]}
    peak = _peak_rss()
    with _fake(kind) as url:
        t = time.monotonic()
        out = _llmq(monkeypatch, store, *args[command], "--endpoint", url)
        took = time.monotonic() - t
    _one_line_error(out, message)
    assert took < 15, took
    assert _peak_rss() - peak < 256 << 20


def test_a_keyed_run_writes_its_key_nowhere(tiny, monkeypatch, tmp_path):
    """--api-key K (and LLMQ_API_KEY=K) for eval --endpoint, deploy verify and bench serve against a server that
    requires K: no file of the store, no line printed, no `llmq inspect` holds K; the manifests record the command with
    the key masked. A server that quotes the key in its errors gets it masked in the error line and in the report
    (before: K in every manifest's command, printed by inspect)."""
    monkeypatch.setenv("LLMQ_CACHE", str(tmp_path / "cache"))
    store, base, cand = tiny
    outputs = []
    with live_server(cand.path, EngineConfig(max_num_seqs=4, kv_cache_memory=8 << 20), name="tiny",
                     api_key=KEY) as live:
        for args in (["eval", "--endpoint", live.url, "--api-key", KEY, "--tasks", "math,kld", "--limit", "2"],
                     ["deploy", "verify", cand.ref, "--endpoint", live.url, f"--api-key={KEY}", "--tasks", "math",
                      "--limit", "2"]):
            out = _llmq(monkeypatch, store, *args, seconds=120)
            assert out.exit_code == 0, out.output
            outputs.append(out.output)
        monkeypatch.setenv("LLMQ_API_KEY", KEY)
        out = _llmq(monkeypatch, store, "bench", "serve", "--endpoint", live.url, "--num-prompts", "2",
                    "--output-len", "4", "--time-limit", "30", seconds=60)
        assert out.exit_code == 0, out.output
        outputs.append(out.output)
    with _fake("nologprobs", key=KEY) as url:  # the key from the environment only, quoted back by the server
        for skip in ([], ["--skip-unsupported"]):
            out = _llmq(monkeypatch, store, "eval", "--endpoint", url, "--tasks", "math", "--limit", "1",
                        "--baseline", base.ref, *skip)
            assert out.exit_code == (0 if skip else 2), out.output
            outputs.append(out.output)
    assert "no logprobs for key ***" in outputs[-2]
    assert outputs[-1].count("no logprobs for key ***") == 1
    manifests = sorted(store.root.rglob("llmq.json"))
    commands = [json.loads(m.read_text())["command"] for m in manifests]
    assert sum("--api-key '***'" in c or "--api-key=***" in c for c in commands) >= 4, commands
    for m in manifests:
        out = _llmq(monkeypatch, store, "inspect", f"{m.parent.parent.name}/{m.parent.name}")
        assert out.exit_code == 0, out.output
        outputs.append(out.output)
    written = [p for p in store.root.rglob("*") if p.is_file()]
    assert len(written) > 20
    assert not [p for p in written if KEY.encode() in p.read_bytes()]
    assert not [o for o in outputs if KEY in o]


def test_secrets_are_masked_on_the_command_line_and_in_any_text(monkeypatch):
    """--api-key's value whatever its length (as the next word or after `=`), `*_API_KEY` values, bearer tokens."""
    from llmq.artifacts.manifest import current_command
    from llmq.artifacts.secrets import redact

    monkeypatch.setenv("SOME_PROVIDER_API_KEY", "provider-secret-value")
    monkeypatch.setattr(sys, "argv", ["llmq", "eval", "--api-key", "k1", "--name", "provider-secret-value",
                                      "--api-key=k2"])
    assert current_command() == "llmq eval --api-key '***' --name '***' '--api-key=***'"
    assert redact("no provider-secret-value; Authorization: Bearer abc.def") == "no ***; Authorization: Bearer ***"


def test_impossible_logprobs_are_refused_in_one_line(tiny, monkeypatch):
    """Logprobs of 1e308 at every entry (before: KLD 0 and a passing `kld<=1` gate) end the run in one line, exit 2,
    nothing stored; so do probabilities summing past 1 and NaN, while float32 rounding passes."""
    from llmq.errors import LlmqError
    from llmq.evals.endpoint import MASS_SLACK, EndpointLM

    store, base, _ = tiny
    reports = len(store.list(kind="eval-report"))
    with _fake("impossible") as url:
        out = _llmq(monkeypatch, store, "eval", "--endpoint", url, "--tasks", "kld", "--limit", "1", "--baseline",
                    base.ref, "--gate", "kld<=1")
    _one_line_error(out, r"answered a logprob of 1e\+308, which no probability has; refused")
    assert len(store.list(kind="eval-report")) == reports
    lm = SimpleNamespace(ep=SimpleNamespace(base="http://x"))
    for bad, message in (([math.log(0.6)] * 2, "summing to 1.2 "), ([-1.0, math.nan], "summing to nan"),
                         ([math.nan, -1.0], "logprob of nan"), ([math.inf], "logprob of inf")):
        with pytest.raises(LlmqError, match=message):
            EndpointLM._possible(lm, bad)
    EndpointLM._possible(lm, [math.log(0.5 + 1e-6), math.log(0.5), -math.inf])  # float32 rounding of a top k
    EndpointLM._possible(lm, [MASS_SLACK / 2])


def test_a_task_the_server_cannot_give_fails_the_run_unless_skipped(tiny, monkeypatch):
    """A server answering 500 to everything (before: exit 0 and a stored report with kld refused) fails in one line
    that says what it answered, exit 2, nothing stored; --skip-unsupported cannot make a run of nothing pass."""
    store, base, _ = tiny
    reports = len(store.list(kind="eval-report"))
    with _fake("error500") as url:
        args = ["eval", "--endpoint", url, "--tasks", "kld", "--limit", "1", "--baseline", base.ref]
        _one_line_error(_llmq(monkeypatch, store, *args), r"kld refused: .* its last error answer: HTTP 500: internal "
                        r"error\) \(--skip-unsupported runs the rest\)$")
        _one_line_error(_llmq(monkeypatch, store, *args, "--skip-unsupported"),
                        "the endpoint can give none of the tasks: kld refused")
    assert len(store.list(kind="eval-report")) == reports
