"""The report page and `llmq serve`'s chat page in a real browser: the distribution's headless Chromium
(`apt-get install chromium`), driven by Playwright for Python over its executable (no browser download). The chat
page runs against tiny random models: a quantized one whose template writes Hermes-style tool calls, one whose
template opens a thinking block, and a vision-language one (tests/vlm.py).

The screenshots these tests take are the README's (docs/images/report.png, docs/images/chat.png): set
LLMQ_SCREENSHOTS=docs/images to write them there (docs/report.md)."""

import base64
import io
import json
import os
import re
import shutil
from pathlib import Path

import pytest
from helpers import live_server
from report_store import HOSTILE, hostile, replay
from test_server_tools import HERMES, THINKING, WEATHER, _model

from llmq.artifacts import Store

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# without the networking switches Chromium dials out at start (updates, sync, QUIC), which a closed network refuses
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync"]
VIEW = {"width": 1200, "height": 900}
# the page's tools: a call forced to `note` can only write HOSTILE back, which the page must show as text
TOOLS = [WEATHER, {"type": "function", "function": {"name": "note", "parameters": {
    "type": "object", "properties": {"text": {"enum": [HOSTILE]}}, "required": ["text"],
    "additionalProperties": False}}}]
ASK = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """A headless Chromium context with a fresh profile; skipped, in one line, where the binary is not installed."""
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"no chromium binary at {CHROMIUM} (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(str(tmp_path_factory.mktemp("profile")), executable_path=CHROMIUM,
                                                   headless=True, args=ARGS, viewport=VIEW)
        try:
            yield ctx
        finally:
            ctx.close()


def _open(browser, url: str):
    """A page at url and the list its console errors and uncaught exceptions go to."""
    page = browser.new_page()
    errors = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(url)
    return page, errors


def _drawn(png: bytes) -> float:
    """The fraction of a screenshot's pixels away from its most common colour (0: a blank region)."""
    import numpy as np
    from PIL import Image

    a = np.asarray(Image.open(io.BytesIO(png)).convert("L"), dtype=np.int16)
    background = np.bincount(a.ravel()).argmax()
    return float((np.abs(a - background) > 40).mean())


def _keep(png: bytes, name: str, tmp_path: Path) -> None:
    """Write the screenshot to $LLMQ_SCREENSHOTS (the README's images), else beside the test, shrunk to a small
    palette PNG."""
    from PIL import Image

    out = Path(os.environ.get("LLMQ_SCREENSHOTS") or tmp_path)
    out.mkdir(parents=True, exist_ok=True)
    im = Image.open(io.BytesIO(png)).convert("RGB")
    im.quantize(colors=64, method=Image.Quantize.MEDIANCUT).save(out / name, optimize=True)


def test_the_report_renders_every_section(browser, tmp_path):
    """Every section of a report over two recorded artifacts renders without a console error, every figure decodes
    and each section's and figure's screenshot has drawn regions. The same page over the artifacts with HOSTILE in
    every string they provide shows it as text: no injected script or element ran."""
    from llmq.report import ReportOptions, write_report

    for data in ("recorded", "hostile"):
        store = Store(tmp_path / data)
        arts = replay(store, hostile() if data == "hostile" else None)
        out = write_report(store, [arts[1], arts[3]], ReportOptions(output=str(tmp_path / f"{data}.html")))
        page, errors = _open(browser, out.as_uri())
        sections = page.locator("section")
        assert [sections.nth(i).get_attribute("id") for i in range(sections.count())] == [
            "artifacts", "lineage", "size", "kld", "experts", "eval", "bench"]
        images = page.evaluate("[...document.images].map(i => [i.alt, i.complete && i.naturalWidth > 0])")
        assert len(images) == 8, images
        assert all(ok for _, ok in images), images
        if data == "recorded":
            _keep(page.screenshot(clip={"x": 0, "y": 0, "width": VIEW["width"], "height": 1500}, full_page=True),
                  "report.png", tmp_path)
            for i in range(sections.count()):
                assert _drawn(sections.nth(i).screenshot()) > 0.01, sections.nth(i).get_attribute("id")
            for fig in page.locator("img").all():
                assert _drawn(fig.screenshot()) > 0.01, fig.get_attribute("alt")
        else:
            assert page.evaluate("window.__pwned") is None
            assert page.locator("img[onerror]").count() == 0
            assert HOSTILE in page.locator("#lineage").inner_text()   # shown as text
        assert errors == [], data
        page.close()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A quantized (RTN INT4, probe measured) tiny model with a Hermes tool-call template in a store, behind `llmq
    serve`'s app with an API key and the loopback Host / Origin checks."""
    from llmq.models import resolve_model
    from llmq.pipeline.quantize import QuantizeOptions, quantize
    from llmq.runtime import EngineConfig
    from llmq.runtime.server.browser import allowed_hosts

    d = tmp_path_factory.mktemp("served")
    store = Store(d / "store")
    src = resolve_model(str(_model(d / "tiny", HERMES)), store)
    art = quantize(src, QuantizeOptions(method="rtn", bits=4, group_size=32, probe_tokens=128), store,
                   progress=False)
    cfg = EngineConfig(max_num_seqs=2, max_model_len=2048, kv_cache_memory=8 << 20)
    with live_server(art.path, cfg, name="tiny-chat", api_key="sekrit",
                     allowed_hosts=allowed_hosts("127.0.0.1", None, "127.0.0.1")) as live:
        yield live, art


def test_the_chat_page_streams_an_answer_with_its_speed(browser, served, tmp_path):
    """The page at `/` asks for the key (its /card answers 401 without it), then shows the artifact's card and
    sends a prompt: the answer streams in (several updates), equals the API's own answer to the same request, and
    the page shows tokens/s."""
    live, art = served
    page, errors = _open(browser, live.url + "/")
    page.locator("#key-box").wait_for(state="visible")
    assert [e for e in errors if "401 (Unauthorized)" not in e] == []
    assert len(errors) == 1   # /card without the key
    errors.clear()
    _unlock(page)
    text = page.locator("#card dl").inner_text()
    assert art.ref in text
    assert "rtn W4A16-group32-sym" in text
    assert "tiny-chat" in text
    assert f"{art.metrics['probe']['kld_mean']:.4f}" in text
    assert "gates\nnone recorded" in text
    assert "input\ntext\n" in text
    assert not page.locator("#attach-box").is_visible()   # a text-only model
    page.fill("#temperature", "0")
    page.fill("#max_tokens", "24")
    page.evaluate("""() => { window.updates = 0;
        new MutationObserver((records) => { window.updates += records.length; })
            .observe(document.getElementById('log'), {subtree: true, childList: true, characterData: true}); }""")
    page.fill("#prompt", "Write one line about the sea.")
    page.press("#prompt", "Enter")
    page.wait_for_selector("#status[data-done]", timeout=30_000)
    status = page.locator("#status").inner_text()
    assert re.fullmatch(r"\d+ tokens, TTFT \d+ ms, [\d.]+ tok/s", status), status
    shown = page.locator(".msg.assistant .text").inner_text()
    want = live.client("sekrit").chat.completions.create(
        model="tiny-chat", messages=[{"role": "user", "content": "Write one line about the sea."}], temperature=0,
        top_p=1, max_tokens=24)
    assert shown == want.choices[0].message.content
    assert shown
    assert int(status.split()[0]) == want.usage.completion_tokens
    # the user's and the assistant's bubbles, then one text per content chunk of the stream
    assert page.evaluate("window.updates") >= 2 + min(4, want.usage.completion_tokens)
    assert errors == []
    page.close()


def _unlock(page) -> None:
    """Give the page the served fixture's key and wait for the card."""
    page.fill("#key", "sekrit")
    page.click("#key-save")
    page.locator("#card dl").wait_for()


def _ask(page, prompt: str) -> None:
    """Send prompt and wait for its answer to end."""
    page.fill("#prompt", prompt)
    page.press("#prompt", "Enter")
    page.wait_for_selector("#status[data-done]", timeout=60_000)


def test_tool_calls_render_as_blocks_of_their_own(browser, served, tmp_path):
    """Given tools and a function to call, the page sends them and shows the streamed call as a block: the name and
    the arguments, indented, equal to the API's own call for the same request. The call goes back into the
    conversation as OpenAI's clients send it, and the next one, whose arguments are markup, shows it as text."""
    live, _ = served
    page, errors = _open(browser, live.url + "/")
    page.locator("#key-box").wait_for(state="visible")
    errors.clear()   # /card without the key
    _unlock(page)
    page.click("#tools-box summary")
    page.fill("#tools", json.dumps(TOOLS, indent=1))
    page.fill("#temperature", "0")
    calls = []
    for name, prompt in [("get_weather", ASK), ("note", "Note that down.")]:
        page.select_option("#tool_choice", f"function:{name}")
        with page.expect_request(lambda r: r.url.endswith("/v1/chat/completions")) as sent:
            _ask(page, prompt)
        body = sent.value.post_data_json
        assert body["tools"] == TOOLS
        assert body["tool_choice"] == {"type": "function", "function": {"name": name}}
        want = live.client("sekrit").chat.completions.create(
            **{k: body[k] for k in ("model", "messages", "tools", "tool_choice", "temperature", "top_p", "max_tokens")})
        (call,) = want.choices[0].message.tool_calls
        args = json.loads(call.function.arguments)
        block = page.locator(".msg.assistant").last
        assert block.locator(".tool-call").count() == 1
        assert block.locator(".text").text_content() == ""
        assert block.locator(".tool-name").inner_text() == name
        assert block.locator(".tool-args").inner_text() == json.dumps(args, indent=2, ensure_ascii=False)
        if name == "get_weather":
            _keep(page.screenshot(), "chat.png", tmp_path)
        calls.append(call.function.arguments)
    assert body["messages"][1] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": body["messages"][1]["tool_calls"][0]["id"], "type": "function",
         "function": {"name": "get_weather", "arguments": calls[0]}}]}
    assert json.loads(calls[1]) == {"text": HOSTILE}   # shown as its JSON text (above)
    assert page.evaluate("window.__pwned") is None
    assert page.locator("#log script, #log img").count() == 0
    assert page.locator(".msg.error").count() == 0
    assert page.locator(".thinking").count() == 0
    status = page.locator("#status").inner_text()
    assert re.fullmatch(r"\d+ tokens, TTFT \d+ ms, [\d.]+ tok/s", status), status
    assert int(status.split()[0]) == want.usage.completion_tokens
    assert errors == []
    page.close()


@pytest.fixture(scope="module")
def thinking(tmp_path_factory):
    """A tiny model whose template opens a thinking block in the generation prompt (it never closes it in a few
    tokens: the answer is all reasoning_content)."""
    from llmq.runtime import EngineConfig

    with live_server(_model(tmp_path_factory.mktemp("think") / "tiny", THINKING),
                     EngineConfig(kv_cache_memory=2 << 20)) as live:
        yield live


def test_thinking_shows_collapsed_apart_from_the_content(browser, thinking):
    """The answer's reasoning_content is a collapsed block of its own, equal to the API's, apart from the content."""
    page, errors = _open(browser, thinking.url + "/")
    page.locator("#card dl").wait_for()
    page.fill("#temperature", "0")
    page.fill("#max_tokens", "12")
    _ask(page, ASK)
    want = thinking.client().chat.completions.create(model="tiny", messages=[{"role": "user", "content": ASK}],
                                                      temperature=0, top_p=1, max_tokens=12).choices[0].message
    reasoning = page.locator(".thinking .reasoning")
    assert reasoning.text_content() == want.model_extra["reasoning_content"]
    assert reasoning.text_content()
    assert page.locator(".msg.assistant .text").text_content() == (want.content or "")
    assert not reasoning.is_visible()   # collapsed until asked for
    page.click(".thinking summary")
    assert reasoning.is_visible()
    assert errors == []
    page.close()


def test_invalid_tools_show_inline_and_send_nothing(browser, thinking):
    """Tools that are not JSON, not an array or not function tools: the error shows beside them, the prompt stays
    and no request leaves the page; once the tools are fixed the same prompt goes."""
    page, errors = _open(browser, thinking.url + "/")
    page.locator("#card dl").wait_for()
    sent = []
    page.on("request", lambda r: sent.append(r.url) if r.url.endswith("/v1/chat/completions") else None)
    page.click("#tools-box summary")
    page.fill("#max_tokens", "1")
    page.fill("#prompt", ASK)
    for tools, why in [('[{"type": "function", "function": {"name": "f"}}', "tools: not JSON: "),
                       ('{"type": "function"}', "tools: not a JSON array of tools"),
                       ('[{"name": "f"}]', 'tools: tools[0] is not {"type": "function"'),
                       ('[{"type": "function", "function": {"name": "f", "parameters": []}}]',
                        "tools: tools[0].function.parameters is not an object")]:
        page.fill("#tools", tools)
        page.click("#send")
        err = page.locator("#tools-error")
        assert err.is_visible(), (tools, err.inner_text())
        assert err.inner_text().startswith(why), (tools, err.inner_text())
        assert page.input_value("#prompt") == ASK
        assert page.locator("#log .msg").count() == 0
    page.fill("#tools", "")
    assert not page.locator("#tools-error").is_visible()
    assert sent == []
    page.click("#send")
    page.wait_for_selector("#status[data-done]", timeout=30_000)
    assert len(sent) == 1
    assert errors == []
    page.close()


@pytest.fixture(scope="module")
def vision(tmp_path_factory):
    """A tiny random Gemma 3 vision-language model (tests/vlm.py) behind `llmq serve`'s app."""
    from vlm import make_tiny_vlm

    from llmq.runtime import EngineConfig

    with live_server(make_tiny_vlm(tmp_path_factory.mktemp("vlm") / "src"),
                     EngineConfig(kv_cache_memory=8 << 20, max_model_len=160)) as live:
        yield live


def test_an_attached_image_goes_as_an_image_url_part(browser, vision):
    """On a model that takes images the page offers to attach them: a file that is not PNG or JPEG is refused with
    its name; a PNG is previewed (and can be taken off again), then sent as a data: URL image_url part before the
    text, shown in the user's message, and answered as the API answers the same message."""
    from vlm import encoded, image

    png = encoded(image("digit", seed=3))
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    page, errors = _open(browser, vision.url + "/")
    page.locator("#card dl").wait_for()
    assert "input\ntext and images" in page.locator("#card dl").inner_text()
    assert page.locator("#attach-button").is_visible()
    page.set_input_files("#attach", files=[{"name": "notes.txt", "mimeType": "text/plain", "buffer": b"hi"}])
    assert page.locator("#status").inner_text() == "notes.txt: only PNG and JPEG images are sent"
    preview = page.locator("#attached img")
    for _ in range(2):   # twice, then the first taken off
        page.set_input_files("#attach", files=[{"name": "digit.png", "mimeType": "image/png", "buffer": png}])
        preview.last.wait_for()
    assert preview.count() == 2
    page.click("#attached button >> nth=0")
    assert preview.count() == 1
    assert preview.get_attribute("src") == url
    assert page.evaluate("() => document.querySelector('#attached img').naturalWidth") == 40   # decoded
    page.fill("#temperature", "0")
    page.fill("#max_tokens", "4")
    with page.expect_request(lambda r: r.url.endswith("/v1/chat/completions")) as sent:
        _ask(page, "abc the")
    message = sent.value.post_data_json["messages"][-1]
    assert message == {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                   {"type": "text", "text": "abc the"}]}
    want = vision.client().chat.completions.create(model="tiny", messages=[message], temperature=0, top_p=1,
                                                    max_tokens=4)
    assert page.locator(".msg.assistant .text").text_content() == want.choices[0].message.content
    assert int(page.locator("#status").inner_text().split()[0]) == want.usage.completion_tokens
    assert page.locator(".msg.user img").get_attribute("src") == url
    assert preview.count() == 0
    assert page.locator(".msg.error").count() == 0
    assert errors == []
    page.close()


def test_the_page_is_same_origin_only(served):
    """The page and its files carry a policy that lets them reach this origin only; an unknown static file is a 404
    in OpenAI's error shape; the card is behind the key like the API."""
    import httpx

    live, _ = served
    page = httpx.get(live.url + "/")
    assert page.status_code == 200
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert httpx.get(live.url + "/static/chat.js").headers["content-type"].startswith("text/javascript")
    missing = httpx.get(live.url + "/static/page.py")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "not_found"
    assert httpx.get(live.url + "/static/..%2Fpage.py").status_code == 404
    assert httpx.get(live.url + "/card").status_code == 401
    card = httpx.get(live.url + "/card", headers={"Authorization": "Bearer sekrit"}).json()
    assert card["served_name"] == "tiny-chat"
    assert httpx.get(live.url + "/", headers={"Host": "evil.example"}).status_code == 403   # a rebound name
