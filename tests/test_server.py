"""`llmq serve`: the OpenAI-compatible server over the engine, exercised live (uvicorn on a free port)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from helpers import free_port, live_server, wait_for

from llmq.runtime import EngineConfig, LLMEngine


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return tiny_model(seed=5)


@pytest.fixture(scope="module")
def srv(tiny):
    # small step budget and batch: prompts are chunked, requests queue and join the batch mid-flight
    with live_server(tiny, EngineConfig(max_num_seqs=6, max_num_batched_tokens=48, block_size=8,
                                        kv_cache_memory=2 << 20)) as live:
        yield live


def greedy_ids(client: openai.OpenAI, prompt, max_tokens: int) -> list[int]:
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0, logprobs=0,
                                  extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    assert r.usage.completion_tokens == max_tokens
    assert r.choices[0].finish_reason == "length"
    return [int(t.split(":")[1]) for t in r.choices[0].logprobs.tokens]


def test_openai_client_completions_and_chat(srv, tiny):
    from llmq.models import load_tokenizer

    tok = load_tokenizer(tiny)
    c = srv.client()
    assert [m.id for m in c.models.list().data] == ["tiny"]

    prompt = "The quick brown fox"
    r = c.completions.create(model="tiny", prompt=prompt, max_tokens=9, temperature=0, logprobs=3,
                             extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    ch = r.choices[0]
    assert r.object == "text_completion"
    assert ch.finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
        len(tok.encode(prompt)), 9, len(tok.encode(prompt)) + 9)
    lp = ch.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 9
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):  # greedy: the chosen token is the most likely
        assert len(top) == 3
        assert chosen == pytest.approx(max(top.values()))
        assert chosen < 0
    assert [t for t in lp.tokens] == [max(top, key=top.get) for top in lp.top_logprobs]
    # the same request streamed gives the same text
    chunks = list(c.completions.create(model="tiny", prompt=prompt, max_tokens=9, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True}))
    assert "".join(x.choices[0].text for x in chunks) == ch.text
    assert chunks[-1].choices[0].finish_reason == "length"

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    n_prompt = len(tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                              add_special_tokens=False))
    r = c.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=7, temperature=0,
                                  logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n_prompt, 7)
    assert len(r.choices[0].logprobs.content) == 7
    stream = list(c.chat.completions.create(model="tiny", messages=messages, max_tokens=7, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(x.choices[0].delta.content or "" for x in stream if x.choices) == r.choices[0].message.content
    assert stream[-1].choices == []
    assert stream[-1].usage.completion_tokens == 7
    assert stream[-1].usage.prompt_tokens == n_prompt
    assert [x.choices[0].finish_reason for x in stream if x.choices][-1] == "length"

    # seeded sampling repeats; a stop string cuts the text (and is not part of it)
    kw = dict(model="tiny", prompt=prompt, max_tokens=12, temperature=1.0, top_p=0.9, seed=7,
              extra_body={"top_k": 50, "ignore_eos": True})
    assert c.completions.create(**kw).choices[0].text == c.completions.create(**kw).choices[0].text
    full = c.completions.create(model="tiny", prompt=[65, 66, 67], max_tokens=20, temperature=0,
                                extra_body={"ignore_eos": True}).choices[0].text
    stop = next(ch for ch in full[3:] if ch != "\ufffd")
    cut = c.completions.create(model="tiny", prompt=[65, 66, 67], max_tokens=20, temperature=0, stop=[stop],
                               extra_body={"ignore_eos": True}).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full[:full.index(stop)]
    streamed = list(c.completions.create(model="tiny", prompt=[65, 66, 67], max_tokens=20, temperature=0,
                                         stop=[stop], stream=True, extra_body={"ignore_eos": True}))
    assert "".join(x.choices[0].text for x in streamed) == cut.text


def test_stream_text_deltas_hold_back_unstable_text():
    """Streamed text never shows what may still change: a partial stop string or an unfinished UTF-8 character."""
    from llmq.runtime.server.streaming import TextDeltas

    d = TextDeltas(["END", "x"])
    steps = [("ab", False), ("abE", False), ("abEN", False), ("abENd", False), ("abENd\ufffd", False),
             ("abENdé", False), ("abENdéEN", False), ("abENdé", True)]
    got = [d(text, fin) for text, fin in steps]
    assert got == ["ab", "", "", "ENd", "", "é", "", ""]
    assert "".join(got) == "abENdé"


def test_concurrent_equals_one_at_a_time(srv):
    rng = random.Random(0)
    jobs = [([rng.randrange(256) for _ in range(n)], m)
            for n, m in zip([3, 70, 15, 130, 1, 40, 9, 95, 22, 60, 5, 33], [6, 14, 3, 9, 20, 5, 11, 7, 16, 4, 12, 8])]
    c = srv.client(timeout=120)
    out: list = [None] * len(jobs)

    def run(i):
        out[i] = greedy_ids(c, *jobs[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    alone = [greedy_ids(c, p, m) for p, m in jobs]
    assert out == alone
    assert [len(x) for x in out] == [m for _, m in jobs]


def test_prefix_cache_hits_in_metrics(srv):
    c = srv.client()
    prompt = [random.Random(3).randrange(256) for _ in range(45)]
    before = srv.metrics()
    first = c.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    second = c.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    after = srv.metrics()
    # block size 8: the 5 full blocks before the last prompt token are shared
    assert second.usage.prompt_tokens_details.cached_tokens == 40
    assert first.choices[0].text == second.choices[0].text
    assert after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"] >= 40
    assert after["vllm:prefix_cache_queries_total"] - before["vllm:prefix_cache_queries_total"] == 90
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == 90
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 4
    assert after["vllm:time_to_first_token_seconds_count"] - before["vllm:time_to_first_token_seconds_count"] == 2
    assert after["vllm:e2e_request_latency_seconds_count"] - before["vllm:e2e_request_latency_seconds_count"] == 2
    for name in ("vllm:inter_token_latency_seconds_count", "vllm:time_per_output_token_seconds_count",
                 "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:num_preemptions_total", "vllm:request_success_total{length}"):
        assert name in after


def test_soak_with_cancelled_streams_frees_every_block(srv):
    """A few hundred short requests, a quarter of them streams the client drops after the first chunk."""
    eng, loop = srv.fe.engine, srv.fe.loop
    before = srv.metrics()

    async def one(client: httpx.AsyncClient, i: int, rng: random.Random):
        body = {"model": "tiny", "prompt": [rng.randrange(256) for _ in range(rng.randrange(1, 40))],
                "max_tokens": rng.randrange(1, 8), "temperature": 0.8, "seed": i}
        if i % 16 == 2:  # a non-streaming client that gives up: its request is aborted too
            body.update(prompt=body["prompt"][:8], max_tokens=480, ignore_eos=True)
            with pytest.raises(httpx.ReadTimeout):
                await client.post("/v1/completions", json=body, timeout=0.3)
            return "gave up"
        if i % 4 == 0:  # cancelled: long generation, dropped after the first event
            # logprobs: a chunk per token; 480 tokens take seconds, far longer than the client stays
            body.update(prompt=body["prompt"][:24], stream=True, max_tokens=480, ignore_eos=True, logprobs=0)
            async with client.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        break
            return "cancelled"
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["finish_reason"]

    async def soak():
        rng = random.Random(1)
        sem = asyncio.Semaphore(12)
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as client:
            async def guarded(i):
                async with sem:
                    return await one(client, i, rng)

            return await asyncio.gather(*(guarded(i) for i in range(320)))

    results = asyncio.run(soak())
    assert results.count("cancelled") == 80
    assert results.count("gave up") == 20
    wait_for(lambda: loop.in_flight == 0 and not eng.has_unfinished())
    assert eng.block_manager.num_used_blocks == 0
    assert not eng.requests
    after = srv.metrics()
    assert after["llmq:kv_cache_blocks_used"] == 0
    assert after["vllm:kv_cache_usage_perc"] == 0
    assert after["vllm:num_requests_running"] == 0
    assert after["vllm:num_requests_waiting"] == 0
    assert after["vllm:request_success_total{abort}"] - before.get("vllm:request_success_total{abort}", 0) == 100


BAD = [
    ("completions", "{not json", None),
    ("completions", '{"prompt": "x", "max_tokens": "3"}', "max_tokens"),
    ("completions", '{"prompt": "x", "temperature": "hot"}', "temperature"),
    ("completions", '{"prompt": "x", "stream": "yes"}', "stream"),
    ("completions", '{"prompt": "x", "stream_options": {"include_usage": 1}}', "stream_options.include_usage"),
    ("completions", '{"prompt": 5}', "prompt"),
    ("completions", '{"max_tokens": 3}', "prompt"),
    ("completions", '[1, 2]', None),
    ("completions", '{"prompt": ""}', "prompt"),
    ("completions", '{"prompt": [1, 99999]}', "prompt"),
    ("completions", json.dumps({"prompt": [7] * 600}), "prompt"),
    ("completions", '{"prompt": "x", "max_tokens": 100000}', "max_tokens"),
    ("completions", '{"prompt": "x", "max_tokens": 0}', "max_tokens"),
    ("completions", '{"prompt": "x", "n": 2}', "n"),
    ("completions", '{"prompt": "x", "top_p": 0}', "top_p"),
    ("completions", '{"prompt": "x", "top_k": -5}', None),
    ("completions", '{"prompt": "x", "logprobs": 50}', "logprobs"),
    ("chat/completions", '{"messages": "hi"}', "messages"),
    ("chat/completions", '{"messages": []}', "messages"),
    ("chat/completions", '{"messages": [{"role": "user", "content": 3}]}', "messages.content"),
    ("chat/completions", '{"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 9999}',
     "max_tokens"),
]


def test_malformed_requests_get_openai_400s(srv):
    for route, body, param in BAD:
        r = httpx.post(f"{srv.url}/v1/{route}", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400, (body, r.status_code, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error", body
        assert err["message"], body
        if param is not None:
            assert err["param"] == param, (body, err)
    # unknown fields are ignored, as OpenAI does; an unknown model is a 404
    r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x", "max_tokens": 1, "frobnicate": {"a": 1}})
    assert r.status_code == 200
    assert r.json()["usage"]["completion_tokens"] == 1
    r = httpx.post(f"{srv.url}/v1/completions", json={"model": "gpt-9", "prompt": "x"})
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        srv.client().completions.create(model="tiny", prompt="x" * 700)
    assert httpx.get(f"{srv.url}/health").status_code == 200


def test_api_key_and_full_queue(tiny):
    with live_server(tiny, EngineConfig(max_num_seqs=1, kv_cache_memory=1 << 20), api_key="sekrit",
                     max_queue=0) as live:
        assert httpx.get(f"{live.url}/health").status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}):
            r = httpx.get(f"{live.url}/v1/models", headers=headers)
            assert r.status_code == 401
            assert r.json()["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            live.client("wrong").completions.create(model="tiny", prompt="x", max_tokens=1)
        good = live.client("sekrit")   # greedy below: a sampled EOS would end a request before its token count
        answer = good.completions.create(model="tiny", prompt="x", max_tokens=2, temperature=0)
        assert answer.usage.completion_tokens == 2

        # one running slot and no waiting room: while a request is in flight (held at the engine's next step by a
        # gate, so no timing is involved) a second one is refused with 429
        engine, gate, done = live.fe.engine, threading.Event(), []
        engine.step = lambda: (gate.wait(), LLMEngine.step(engine))[1]
        first = threading.Thread(target=lambda: done.append(good.completions.create(model="tiny", prompt="hello",
                                                                                      max_tokens=5, temperature=0)))
        first.start()
        wait_for(lambda: live.fe.loop.in_flight == 1)
        with pytest.raises(openai.RateLimitError) as e:
            good.completions.create(model="tiny", prompt="x", max_tokens=1)
        assert e.value.status_code == 429
        assert e.value.body["code"] == "queue_full"
        gate.set()
        first.join()
        del engine.step
        assert done[0].usage.completion_tokens == 5
        wait_for(lambda: live.fe.loop.in_flight == 0)
        assert good.completions.create(model="tiny", prompt="x", max_tokens=1,
                                   temperature=0).choices[0].finish_reason == "length"
        assert live.metrics()["llmq:requests_rejected_total"] == 1

        def boom():
            raise RuntimeError("simulated engine fault")

        live.fe.engine.step = boom  # a failing engine answers 500s and fails its health check, never hangs
        with pytest.raises(openai.InternalServerError):
            good.completions.create(model="tiny", prompt="x", max_tokens=1)
        assert httpx.get(f"{live.url}/health").status_code == 503
        r = httpx.post(f"{live.url}/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer sekrit"})
        assert r.status_code == 503
        assert r.json()["error"]["code"] == "unavailable"


def test_engine_loop_drain_timeout_aborts_the_rest(tiny):
    """Shutdown waits for in-flight requests up to its timeout, then aborts them with an error, freeing blocks."""
    from llmq.runtime import SamplingParams
    from llmq.runtime.server import EngineLoop
    from llmq.runtime.server.engine_loop import NotAccepting
    from llmq.runtime.server.metrics import ServerMetrics

    engine = LLMEngine(tiny, EngineConfig(kv_cache_memory=1 << 20))
    loop = EngineLoop(engine, ServerMetrics("tiny"))
    loop.start()

    async def main():
        short = loop.submit("short", [1, 2, 3], SamplingParams(max_tokens=3, temperature=0), asyncio.get_running_loop())
        long = loop.submit("long", [4, 5], SamplingParams(max_tokens=500, ignore_eos=True),
                           asyncio.get_running_loop())
        while not (await short.get()).finished:
            pass
        await asyncio.to_thread(loop.shutdown, 0.05)
        items = []
        while not long.empty():
            items.append(long.get_nowait())
        return items

    items = asyncio.run(main())
    assert isinstance(items[-1], NotAccepting)
    assert not any(getattr(i, "finished", False) for i in items[:-1])
    assert not engine.has_unfinished()
    assert engine.block_manager.num_used_blocks == 0
    assert loop.in_flight == 0
    with pytest.raises(NotAccepting):
        loop.submit("late", [1], SamplingParams(), asyncio.new_event_loop())
    engine.shutdown()


def test_tp2_server_matches_tp1(srv, tiny):
    prompt = [random.Random(9).randrange(256) for _ in range(37)]
    ref = greedy_ids(srv.client(), prompt, 10)
    with live_server(tiny, EngineConfig(tp=2, kv_cache_memory=1 << 20)) as live:
        assert live.fe.engine.tp == 2
        assert greedy_ids(live.client(timeout=120), prompt, 10) == ref


def _spawn_serve(args: list[str], store: Path, port: int) -> subprocess.Popen:
    env = dict(os.environ, LLMQ_STORE=str(store), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-c", "from llmq.cli.main import main; main()", "serve", *args, "--port", str(port),
           "--log-level", "warning"]
    # a session of its own: a test can signal the server's process group like a terminal's Ctrl-C does
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    deadline = time.monotonic() + 240
    while True:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "server did not come up"
        time.sleep(0.2)


@pytest.mark.parametrize("how", ["sigterm", "ctrl-c-tp2"])
def test_signal_drains_in_flight_request(tiny, tmp_path, how):
    """SIGTERM to the server (docker/k8s), or Ctrl-C to a terminal's whole process group with TP workers in it."""
    port = free_port()
    tp = ["--tp", "2"] if how == "ctrl-c-tp2" else []
    proc = _spawn_serve([str(tiny), "--kv-cache-memory", "2MiB", "--served-model-name", "tiny", *tp],
                        tmp_path / "st", port)
    try:
        body = {"model": "tiny", "prompt": "drain me", "max_tokens": 150, "ignore_eos": True, "stream": True,
                "logprobs": 0, "stream_options": {"include_usage": True}}
        events = []
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 2:
                        if how == "sigterm":
                            proc.send_signal(signal.SIGTERM)
                        else:
                            os.killpg(proc.pid, signal.SIGINT)
        assert events[-1] == "[DONE]"
        assert len(events) >= 150  # a chunk per token: the signal came early
        usage = json.loads(events[-2])["usage"]
        assert usage["completion_tokens"] == 150
        assert proc.wait(60) == 0
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{port}/health")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.integration
def test_default_model_chat_through_llmq_serve(default_model):
    from llmq.models import load_tokenizer

    port = free_port()
    store = default_model.path.parents[1]
    proc = _spawn_serve([str(default_model.path), "--kv-cache-memory", "64MiB", "--max-model-len", "1024"], store,
                        port)
    try:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=300)
        model = c.models.list().data[0].id
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        r = c.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0, logprobs=True)
        text = r.choices[0].message.content
        assert text.strip()
        tok = load_tokenizer(default_model.path)
        n_prompt = len(tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                                  add_special_tokens=False))
        u = r.usage
        assert u.prompt_tokens == n_prompt
        assert u.total_tokens == u.prompt_tokens + u.completion_tokens
        assert 1 <= u.completion_tokens <= 12
        assert (u.completion_tokens == 12) == (r.choices[0].finish_reason == "length")
        assert len(r.choices[0].logprobs.content) == u.completion_tokens
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_engine_is_built_and_stepped_on_one_thread(tiny):
    """`llmq serve` builds the engine on its EngineThread and the loop steps it there: a second OpenMP team on
    another thread made every small CPU op pay a wake-up (engine_loop.py)."""
    from llmq.runtime import SamplingParams
    from llmq.runtime.server import EngineLoop, EngineThread
    from llmq.runtime.server.metrics import ServerMetrics

    thread = EngineThread()
    built_on = thread.call(threading.get_ident)
    engine = thread.call(LLMEngine, tiny, EngineConfig(kv_cache_memory=1 << 20))
    stepped_on = set()
    step = engine.step
    engine.step = lambda: stepped_on.add(threading.get_ident()) or step()
    loop = EngineLoop(engine, ServerMetrics("tiny"), thread=thread)
    loop.start()

    async def main():
        q = loop.submit("r", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0), asyncio.get_running_loop())
        while not (await q.get()).finished:
            pass

    asyncio.run(main())
    loop.shutdown(1.0)
    assert stepped_on == {built_on}
    assert built_on != threading.get_ident()
    with pytest.raises(ZeroDivisionError):  # the caller sees the engine thread's exceptions
        thread.call(lambda: 1 / 0)
    thread.call(engine.shutdown)
    thread.close()
