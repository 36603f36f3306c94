"""`llmq eval --endpoint URL`: the same tasks and KLD through a live `llmq serve` as in-process, and one-line errors."""

from __future__ import annotations

import asyncio
import http.server
import json
import random
import re
import shlex
import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from helpers import free_port, live_server
from test_eval import make_rtn, rand_text, req

from llmq.artifacts import Store
from llmq.cli.main import cli
from llmq.models import resolve_model
from llmq.runtime import EngineConfig

ROOT = Path(__file__).resolve().parent.parent

@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_model):
    """A store with a tiny model and its INT4 RTN artifact, the latter served by `llmq serve` on a free port, giving
    whole distributions (--max-logprobs -1)."""
    from llmq.runtime.server import Limits

    root = tmp_path_factory.mktemp("eval-endpoint")
    store = Store(root / "store")
    base = resolve_model(str(tiny_model(name="base", max_position_embeddings=1024)), store)
    cand = make_rtn(store, base, 4, "tiny-rtn4")
    with live_server(cand.path, EngineConfig(max_num_seqs=8, kv_cache_memory=8 << 20), name="tiny",
                     limits=Limits(max_logprobs=-1)) as live:
        yield store, base, cand, live


def _endpoint_lm(live, store, cand):
    from llmq.evals.endpoint import EndpointLM
    from llmq.evals.evaluate import Served, _endpoint_lm
    from llmq.evals.runner import EvalSettings

    served = Served.connect(live.url, None, None, 30.0, store)
    assert served.artifact.id == cand.id  # found through /v1/models' root
    lm = _endpoint_lm(store, EvalSettings(tasks=["math"]), served, lambda todo, done: None, None)
    assert isinstance(lm, EndpointLM)
    return lm


def test_whole_distributions_are_used_only_where_a_window_of_them_is_given(setup):
    """A server that gives the whole vocabulary for a short prompt but bounds positions x vocabulary below a KLD
    window's (512 x 321 here) is scored by top-k KLD, not refused mid-run."""
    from llmq.runtime.server import Limits

    store, _, cand, _ = setup
    with live_server(cand.path, EngineConfig(max_num_seqs=8, kv_cache_memory=8 << 20), name="tiny",
                     limits=Limits(max_logprobs=-1, max_logprob_entries=50_000)) as bounded:
        assert _endpoint_lm(bounded, store, cand).top_k == 20


def _same_top(top, ids, full):
    """The endpoint's top-k is the in-process top-k: the same values, and each named token has its value in-process
    (within float32 noise: near-ties may swap places)."""
    torch.testing.assert_close(top, full.topk(top.shape[1]).values, atol=1e-5, rtol=0)
    torch.testing.assert_close(full.gather(1, ids), top, atol=1e-5, rtol=0)


def test_endpoint_lm_generates_and_scores_as_in_process(setup):
    from llmq.evals.lm import LlmqLM

    store, _, cand, live = setup
    lm = _endpoint_lm(live, store, cand)
    ours = LlmqLM(cand.path, engine_config=EngineConfig(max_num_seqs=8, kv_cache_memory=8 << 20))
    try:
        assert lm.max_length == ours.max_length - 1 == 1023  # from /v1/models' max_model_len
        # llmq serve: vLLM's prompt_logprobs, the whole vocabulary at -1
        assert lm.shape == "prompt_logprobs"
        assert lm.scores_prompts
        assert lm.top_k is None
        rng = random.Random(5)
        reqs = [req(rand_text(rng, rng.randint(5, 60)), {"until": ["=", "\n\n"], "max_gen_toks": rng.randint(1, 12)})
                for _ in range(12)]
        want = ours.generate_until(reqs)
        assert lm.generate_until(reqs) == want
        assert any(want)  # the same token ids in, the same text out
        pairs = [req(rand_text(rng, rng.randint(1, 40)), rand_text(rng, rng.randint(1, 8))) for _ in range(8)]
        got, want = lm.loglikelihood(pairs), ours.loglikelihood(pairs)
        assert [g for _, g in got] == [g for _, g in want]
        assert [x for x, _ in got] == pytest.approx([x for x, _ in want], abs=1e-4)
        w = [ours.prefix_token_id] + ours.encode(rand_text(rng, 40))
        full = lm.logprobs_before(w)
        assert full.shape == (len(w) - 1, 320)
        torch.testing.assert_close(full, ours.full_logprobs(w)[:-1].double(), atol=1e-5, rtol=0)
    finally:
        ours.close()


def _complete(live, **body) -> dict:
    import httpx

    r = httpx.post(f"{live.url}/v1/completions", json={"temperature": 0, **body}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0] | {"usage": r.json()["usage"]}


def test_echo_and_prompt_logprobs_are_the_engines_prompt_logprobs(setup):
    """`echo` + `logprobs` and vLLM's `prompt_logprobs` answer LLMEngine.prompt_logprobs of the served artifact (float
    noise: the server batches and chunks differently), in OpenAI's and vLLM's shapes."""
    from llmq.runtime import LLMEngine

    _, _, cand, live = setup
    eng = LLMEngine(cand.path, EngineConfig(max_num_seqs=2, kv_cache_memory=8 << 20))
    try:
        text = "The quick brown fox jumps over the lazy dog, twice: 1 + 1 = 2."
        ids = eng.tokenizer.encode(text)
        want = eng.prompt_logprobs(ids).double()[:-1]  # the distributions before ids[1:]
    finally:
        eng.shutdown()
    tgt = torch.tensor(ids[1:])[:, None]
    own = want.gather(1, tgt)[:, 0]

    echo = _complete(live, prompt=text, echo=True, logprobs=5, max_tokens=0, return_tokens_as_token_ids=True)
    lp = echo["logprobs"]
    assert echo["text"] == text
    assert echo["finish_reason"] == "length"
    assert echo["usage"]["completion_tokens"] == 0
    assert lp["tokens"] == [f"token_id:{t}" for t in ids]
    assert lp["token_logprobs"][0] is None
    assert lp["top_logprobs"][0] is None
    assert lp["text_offset"][0] == 0
    assert lp["text_offset"] == sorted(lp["text_offset"])
    torch.testing.assert_close(torch.tensor(lp["token_logprobs"][1:], dtype=torch.float64), own, atol=1e-5, rtol=0)
    for j, top in enumerate(lp["top_logprobs"][1:]):
        vals, top_ids = want[j].topk(5)
        assert {int(k.split(":")[1]) for k in top} == set(top_ids.tolist()) | {ids[j + 1]}
        assert max(top.values()) == pytest.approx(float(vals[0]), abs=1e-5)

    vllm = _complete(live, prompt=ids, prompt_logprobs=3, max_tokens=2, logprobs=1)
    plp = vllm["prompt_logprobs"]
    assert len(plp) == len(ids)
    assert plp[0] is None
    assert len(vllm["logprobs"]["tokens"]) == 2
    for j, entry in enumerate(plp[1:]):
        first = next(iter(entry))
        assert int(first) == ids[j + 1]  # the prompt token's own entry first, then the top 3
        assert entry[first]["rank"] == int((want[j] >= own[j]).sum())
        assert entry[first]["decoded_token"] == live.app.state.frontend.token_text(ids[j + 1])
        top = sorted(((v["rank"], int(k), v["logprob"]) for k, v in entry.items() if v["rank"] <= 3))[:3]
        assert [r for r, _, _ in top] == [1, 2, 3]
        assert [t for _, t, _ in top] == want[j].topk(3).indices.tolist()
        assert entry[first]["logprob"] == pytest.approx(float(own[j]), abs=1e-5)

    # echo with a completion: the prompt's tokens, then the generated ones exactly as without echo
    plain = _complete(live, prompt=ids, max_tokens=4, logprobs=2, ignore_eos=True)
    both = _complete(live, prompt=ids, max_tokens=4, logprobs=2, ignore_eos=True, echo=True)
    assert both["text"] == eng.tokenizer.decode(ids) + plain["text"]
    n = len(ids)
    assert both["logprobs"]["tokens"][n:] == plain["logprobs"]["tokens"]
    assert both["logprobs"]["token_logprobs"][n:] == pytest.approx(plain["logprobs"]["token_logprobs"], abs=1e-5)
    assert both["logprobs"]["token_logprobs"][1:n] == pytest.approx(own.tolist(), abs=1e-5)


def test_topk_kl_is_a_lower_bound_and_exact_at_full_k():
    from llmq.evals.kld import token_kl, topk_token_kl

    g = torch.Generator().manual_seed(0)
    lp_e = (torch.randn(30, 50, generator=g, dtype=torch.float64) * 2).log_softmax(-1)
    lp_b = (lp_e + torch.randn(30, 50, generator=g, dtype=torch.float64) * 0.5).log_softmax(-1)
    full, same_full = token_kl(lp_e, lp_b)
    for k in (1, 5, 20, 50):
        top, ids = lp_e.topk(k)
        kl, same, rest = topk_token_kl(top, ids, lp_b)
        assert torch.equal(same, same_full)  # top-1 agreement is exact at any k
        assert (kl <= full + 1e-12).all()
        torch.testing.assert_close(rest, (1 - top.exp().sum(-1)).clamp_min(1e-7))
    torch.testing.assert_close(kl, full)  # k = vocabulary: the full KL
    # by hand, k = 1: bins {argmax_e, rest}
    top, ids = lp_e.topk(1)
    pe, pb = top[:, 0].exp(), lp_b.gather(1, ids)[:, 0].exp()
    want = pb * (pb / pe).log() + (1 - pb) * ((1 - pb) / (1 - pe)).log()
    torch.testing.assert_close(topk_token_kl(top, ids, lp_b)[0], want)


def _report(out) -> dict:
    return json.loads(out[out.index("{"):out.rindex("}") + 1])


def test_cli_endpoint_eval_equals_in_process(setup, tmp_path, monkeypatch):
    monkeypatch.setenv("LLMQ_CACHE", str(tmp_path / "cache"))
    store, base, cand, live = setup
    # the command docs/eval.md shows, at this server, and the same without --endpoint URL on the served artifact
    doc = next(x for x in (ROOT / "docs" / "eval.md").read_text().splitlines() if x.startswith("llmq eval --endpoint"))
    argv = shlex.split(doc, comments=True)[2:]
    i = argv.index("--endpoint")
    assert argv[i + 1] == "http://127.0.0.1:8000"
    assert "kld" in argv[argv.index("--tasks") + 1]
    common = ["--json", *argv[:i], *argv[i + 2:]]
    run = CliRunner()
    inproc = run.invoke(cli, ["--store", str(store.root), "eval", cand.ref, *common])
    assert inproc.exit_code == 0, inproc.output
    via = run.invoke(cli, ["--store", str(store.root), "eval", "--endpoint", live.url, *common])
    assert via.exit_code == 0, via.output
    a, b = _report(inproc.output), _report(via.output)
    assert b["evaluated"] == {"name": "tiny", "id": cand.id, "kind": "endpoint", "url": live.url,
                              "logprobs": "prompt_logprobs"}
    assert b["baseline"]["id"] == base.id  # the served artifact's lineage gives the default baseline
    assert b["settings"]["backend"] == "endpoint"
    # task scores identical: the generation task by its text, the multiple-choice one by the prompt log-probs
    assert "llmq_arith_mc" in b["scores"]["tasks"]
    assert not b.get("refused")
    assert b["scores"]["tasks"] == a["scores"]["tasks"]
    # KLD exact (the server gives whole distributions): the same figures within float32 noise (~1e-6 a logprob; the
    # server computes each window in batches and chunks of its own)
    ka, kb = a["kld"], b["kld"]
    assert ka["top_k"] is None
    assert kb["top_k"] is None
    assert "exact" not in kb
    assert kb["tokens"] == ka["tokens"]
    assert kb["top1"] == ka["top1"]
    assert kb["ppl_baseline"] == pytest.approx(ka["ppl_baseline"], rel=1e-9)
    for key in ("mean", "p99", "max", "ppl"):
        assert kb[key] == pytest.approx(ka[key], rel=1e-3, abs=1e-5), key
    md = (store.resolve(b["artifact"]["ref"]).path / "report.md").read_text()
    assert f"tiny at {live.url}" in md
    assert "From top-" not in md
    assert "refused" not in md


EVENT = b'data: {"choices": [{"index": 0, "text": "x", "finish_reason": null}]}\n\n'
ANSWER = b'{"choices": [{"index": 0, "text": "1", "finish_reason": "length"}]}'


@contextmanager
def _fake(kind: str, key: str = ""):
    """A server on a free loopback port that is no OpenAI endpoint: `html` answers every GET / POST with a web page,
    `models` lists a model but answers completions with a page, `hang` accepts connections and never answers. The
    hostile ones list a model and then answer completions with: `sse` an event stream that never ends, `drip` a valid
    answer a byte at a time, `endless` a chunked body that never ends, `error500` a 500, `impossible` logprobs of 1e308
    in vLLM's prompt_logprobs shape, `nologprobs` a text answer, or to any logprobs request a 400 quoting the key
    sent (as a careless server might); `huge` answers /v1/models with a 1 GB Content-Length body. The endless
    ones end when the with-block does. `key`: the bearer token every GET must carry."""
    port, stop = free_port(), threading.Event()
    if kind == "hang":
        sock = socket.socket()
        sock.bind(("127.0.0.1", port))
        sock.listen(8)
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            sock.close()
        return

    class H(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _head(self, status: int, ctype: str, **headers):
            self.close_connection = kind in ("sse", "endless", "huge")  # a never-ending answer ends its connection
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            for k, v in headers.items():
                self.send_header(k.replace("_", "-"), str(v))
            self.end_headers()

        def _send(self, body: bytes, ctype: str = "application/json", status: int = 200):
            self._head(status, ctype, Content_Length=len(body))
            self.wfile.write(body)

        def do_GET(self):
            if self.headers.get("Authorization", "") != (f"Bearer {key}" if key else ""):
                return self._send(b'{"error": {"message": "bad key"}}', status=401)
            if kind == "huge":
                self._head(200, "application/json", Content_Length=1 << 30)
                while not stop.is_set():  # or until the client leaves
                    self.wfile.write(b" " * (1 << 16))
                return
            if kind != "html" and self.path == "/v1/models":
                return self._send(b'{"data": [{"id": "m", "max_model_len": 64}]}')
            self._send(b"<html>hello</html>", "text/html")

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            if kind == "sse":
                self._head(200, "text/event-stream", Transfer_Encoding="chunked")
                while not stop.is_set():
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(EVENT), EVENT))
                    time.sleep(0.01)
                return
            if kind == "drip":
                self._head(200, "application/json", Content_Length=len(ANSWER))
                for i in range(len(ANSWER)):
                    self.wfile.write(ANSWER[i:i + 1])
                    self.wfile.flush()
                    time.sleep(0.2)
                return
            if kind == "endless":
                self._head(200, "application/json", Transfer_Encoding="chunked")
                chunk = b"x" * (1 << 16)
                while not stop.is_set():
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                return
            if kind == "error500":
                return self._send(b'{"error": {"message": "internal error"}}', status=500)
            if kind == "impossible":
                k = max(body.get("prompt_logprobs") or 0, 20)
                rows = [None] + [{str(t): {"logprob": 1e308, "rank": 1}, **{str(i): {"logprob": 1e308, "rank": 1}
                                                                             for i in range(k)}}
                                 for t in body["prompt"][1:]]
                return self._send(json.dumps({"choices": [{"text": "1", "prompt_logprobs": rows}]}).encode())
            if kind == "nologprobs":
                if not any(body.get(k) for k in ("logprobs", "prompt_logprobs", "n_probs", "echo")):
                    return self._send(ANSWER)
                msg = f"no logprobs for key {self.headers.get('Authorization', '').split(' ')[-1]}"
                return self._send(json.dumps({"error": {"message": msg}}).encode(), status=400)
            self._send(b"<html>hello</html>", "text/html")

        def log_message(self, *a):
            pass

    class Server(http.server.ThreadingHTTPServer):
        def handle_error(self, request, client_address):
            pass  # a client that left mid-answer: what the hostile kinds wait for

    srv = Server(("127.0.0.1", port), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop.set()
        srv.shutdown()
        srv.server_close()


@pytest.mark.parametrize("kind,message", [
    ("dead", "cannot reach"), ("html", "did not return an OpenAI model list"),
    ("models", "did not answer a JSON object"), ("hang", "cannot reach .*ReadTimeout|no complete answer within 1 s"),
    ("both", "give REF or --endpoint URL, not both")])
def test_bad_endpoints_fail_in_one_line(setup, kind, message):
    store, base, _, _ = setup
    args = ["--store", str(store.root), "eval", "--tasks", "math", "--limit", "1", "--baseline", base.ref,
            "--timeout", "1"]
    t = time.monotonic()
    if kind in ("dead", "both"):
        ref = [base.ref] if kind == "both" else []
        out = CliRunner().invoke(cli, [*args, *ref, "--endpoint", f"http://127.0.0.1:{free_port()}"])
    else:
        with _fake(kind) as url:
            out = CliRunner().invoke(cli, [*args, "--endpoint", url])
    assert time.monotonic() - t < 20
    assert out.exit_code == 2, out.output
    lines = out.output.strip().splitlines()
    assert lines[-1].startswith("error: ")
    assert len([x for x in lines if x.startswith("error")]) == 1
    assert re.search(message, lines[-1]), lines[-1]


@contextmanager
def _shape_server(flavor: str, lm):
    """A server answering in one documented logprobs shape from `lm`'s in-process distributions, on a free port:
    `vllm` (/v1/completions with prompt_logprobs: [None, {"<id>": {"logprob", "rank", "decoded_token"}}, ...], the
    prompt token's own entry first), `echo` (OpenAI's legacy echo + logprobs, tokens named "token_id:N", the prompt
    token's logprob in token_logprobs only), `llama` (llama-server: /v1/completions answers echo with a 500 and
    refuses logprobs here; /completion with n_probs answers completion_probabilities, the generated token first: the
    one a logit_bias forces, with its unbiased logprob)."""

    def answer(path: str, body: dict):
        if path == "/v1/models":
            return {"data": [{"id": "m", "max_model_len": 161}]}
        if -1 in (body.get("prompt_logprobs"), body.get("logprobs")):
            return None  # the whole vocabulary: above these servers' --max-logprobs
        ids = body["prompt"]
        lp = lm.full_logprobs(ids).double()
        top = [(t.tolist(), v.tolist()) for v, t in (lp[j].topk(body.get("prompt_logprobs") or body.get("logprobs")
                                                                 or body.get("n_probs") or 1) for j in range(len(ids)))]
        if flavor == "llama" and path == "/completion" and body.get("n_probs"):
            ts, vs = top[-1]
            entries = [{"id": t, "token": "?", "bytes": [], "logprob": v} for t, v in zip(ts, vs)]
            made = entries[0]  # greedy, unless a logit bias forces a token: its logprob is still the raw model's
            for t, bias in body.get("logit_bias", []):
                if bias > 100:
                    made = {"id": t, "token": "?", "bytes": [], "logprob": float(lp[-1, t])}
            return {"content": "?", "completion_probabilities": [dict(made, top_logprobs=entries)]}
        if flavor == "llama" and body.get("echo"):
            return 500  # llama-server's "Only no echo is supported" is a runtime_error: a server error
        if flavor == "vllm" and path == "/v1/completions" and body.get("prompt_logprobs"):
            def entry(j, tok):
                own = {str(tok): {"logprob": float(lp[j - 1, tok]), "rank": int((lp[j - 1] > lp[j - 1, tok]).sum()) + 1,
                                  "decoded_token": "?"}}
                ts, vs = top[j - 1]
                return {**own, **{str(t): {"logprob": v, "rank": r + 1, "decoded_token": "?"}
                                  for r, (t, v) in enumerate(zip(ts, vs))}}
            return {"choices": [{"text": "?", "prompt_logprobs": [None] + [entry(j, t) for j, t in enumerate(ids) if j],
                                 "logprobs": None}]}
        if flavor == "echo" and path == "/v1/completions" and body.get("echo") and body["return_tokens_as_token_ids"]:
            tops = [None] + [{f"token_id:{t}": v for t, v in zip(*top[j - 1])} for j in range(1, len(ids))]
            return {"choices": [{"text": "?", "logprobs": {
                "tokens": [f"token_id:{t}" for t in ids], "text_offset": list(range(len(ids))), "top_logprobs": tops,
                "token_logprobs": [None] + [float(lp[j - 1, ids[j]]) for j in range(1, len(ids))]}}]}
        return None

    class H(http.server.BaseHTTPRequestHandler):
        def _reply(self, data):
            status = 200 if isinstance(data, dict) else data or 400
            body = json.dumps(data if status == 200 else {"error": {"message": "not supported"}}).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            self._reply(answer(self.path, {}))

        def do_POST(self):
            self._reply(answer(self.path, json.loads(self.rfile.read(int(self.headers["Content-Length"])))))

        def log_message(self, *a):
            pass

    class Server(http.server.HTTPServer):  # one request at a time: the engine is not shared across threads
        request_queue_size = 64

    port = free_port()
    srv = Server(("127.0.0.1", port), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.shutdown()


@pytest.mark.parametrize("flavor,shape", [("vllm", "prompt_logprobs"), ("echo", "echo"), ("llama", "n_probs")])
def test_each_logprobs_shape_reads_the_same_numbers(setup, flavor, shape):
    """All three score given text exactly (what loglikelihood tasks need): vLLM's prompt_logprobs and echo + logprobs
    a prompt at a time, llama-server's n_probs a token at a time, each forced by a logit bias; all three give the
    top-k of every position (these servers refuse k = -1, so the KL would be the top-k form)."""
    from llmq.bench.loadgen import probe
    from llmq.evals.endpoint import EndpointLM
    from llmq.evals.lm import LlmqLM

    _, _, cand, _ = setup
    # the context the fake server reports (161) less the token a prompt-logprobs request generates
    ours = LlmqLM(cand.path, max_length=160, engine_config=EngineConfig(max_num_seqs=8, kv_cache_memory=8 << 20))
    rng = random.Random(11)
    try:
        with _shape_server(flavor, ours) as url:
            lm = EndpointLM(asyncio.run(probe(url, None)), ours.tokenizer, timeout=30)
            assert lm.shape == shape
            assert lm.scores_prompts
            assert lm.top_k == 20
            w = [ours.prefix_token_id] + ours.encode(rand_text(rng, 30))
            top, ids = lm.top_logprobs(w)
            _same_top(top, ids, ours.full_logprobs(w)[:-1].double())
            reqs = [req(rand_text(rng, rng.randint(1, 30)), rand_text(rng, rng.randint(1, 6))) for _ in range(6)]
            got, want = lm.loglikelihood(reqs), ours.loglikelihood(reqs)
            assert [g for _, g in got] == [g for _, g in want]
            assert [x for x, _ in got] == pytest.approx([x for x, _ in want], abs=1e-5)
            assert lm.max_length == 160
            rolling = [req(rand_text(rng, 400))]  # longer than the context: several windows
            # a token a forward (n_probs) sums float32 rounding of 400 forwards of different lengths: 1e-6 relative
            tol = {"rel": 1e-5} if shape == "n_probs" else {"abs": 1e-4}
            assert lm.loglikelihood_rolling(rolling) == pytest.approx(ours.loglikelihood_rolling(rolling), **tol)
    finally:
        ours.close()


def test_deploy_verify_agrees_with_in_process_and_catches_a_different_model(setup, tmp_path, monkeypatch):
    """`llmq deploy verify`: against a server giving only its top 20 logprobs (the default --max-logprobs), llmq's own
    KL of the served artifact is taken from its top 20 the same way, so the two agree to float noise; verifying
    another artifact (8-bit) against the same server fails on kld, with exit 1."""
    from llmq.runtime.server import Limits

    monkeypatch.setenv("LLMQ_CACHE", str(tmp_path / "cache"))
    store, base, cand, _ = setup
    run = CliRunner()
    dep = run.invoke(cli, ["--store", str(store.root), "deploy", cand.ref, "--engine", "vllm", "--json"])
    assert dep.exit_code == 0, dep.output
    deployed = _report(dep.output)["name"]
    args = ["--tasks", "kld,math", "--limit", "8", "--json"]
    with live_server(cand.path, EngineConfig(max_num_seqs=8, kv_cache_memory=8 << 20), name="tiny",
                     limits=Limits(max_logprobs=20)) as top20:
        ok = run.invoke(cli, ["--store", str(store.root), "deploy", "verify", deployed, "--endpoint", top20.url, *args,
                              "--gate", "kld<=5"])
        other = make_rtn(store, base, 8, "tiny-rtn8")
        bad = run.invoke(cli, ["--store", str(store.root), "deploy", "verify", other.ref, "--endpoint", top20.url,
                               *args, "--gate", "top1>=101"])
    assert ok.exit_code == 0, ok.output
    result = _report(ok.output)
    assert result["source"]["id"] == cand.id
    assert result["agree"]
    assert not result["refused"]
    assert [(g["gate"], g["passed"]) for g in result["gates"]] == [("kld<=5", True)]
    got = {f["figure"]: f for f in result["figures"]}
    assert {"kld", "top1", "llmq_arith_mc"} <= set(got)
    assert got["kld"]["endpoint"] == pytest.approx(got["kld"]["in_process"], rel=1e-3)
    assert got["top1"]["difference"] == 0
    assert got["llmq_arith_mc"]["difference"] == 0
    reports = [store.resolve(result["reports"][k]).file("report.json") for k in ("endpoint", "in_process")]
    assert [json.loads(r.read_text())["kld"]["top_k"] for r in reports] == [20, 20]
    assert bad.exit_code == 1, bad.output
    last = bad.output.splitlines()[-1]
    assert "does not compute what llmq evaluated" in last
    assert "kld" in last
    assert "gate failed: top1>=101" in last


def test_deploy_verify_runs_an_exports_source_in_process(setup):
    """A GGUF or TensorRT-LLM engine runs elsewhere: llmq's side of `deploy verify` is the artifact it was built from
    (the values the export carries); a native engine runs as itself."""
    from llmq.evals.deployed import in_process
    from llmq.pipeline.targets import BuildOptions, build_engine

    store, _, cand, _ = setup
    gguf = build_engine(cand, store, BuildOptions(target="gguf"))
    native = build_engine(cand, store, BuildOptions())
    assert in_process(store, gguf).id == cand.id
    assert in_process(store, native).id == native.id
    assert in_process(store, cand).id == cand.id
