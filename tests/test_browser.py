"""The report page and `llmq serve`'s chat page in a real browser: the distribution's headless Chromium
(`apt-get install chromium`), driven by Playwright for Python over its executable (no browser download).

The screenshots these tests take are the README's (docs/images/report.png, docs/images/chat.png): set
LLMQ_SCREENSHOTS=docs/images to write them there (docs/report.md)."""

import io
import os
import re
import shutil
from pathlib import Path

import pytest
from helpers import live_server, make_tiny_model
from report_store import HOSTILE, hostile, replay

from llmq.artifacts import Store

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# without the networking switches Chromium dials out at start (updates, sync, QUIC), which a closed network refuses
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync"]
VIEW = {"width": 1200, "height": 900}


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
        assert len(images) == 8 and all(ok for _, ok in images), images
        if data == "recorded":
            _keep(page.screenshot(clip={"x": 0, "y": 0, "width": VIEW["width"], "height": 1500}, full_page=True),
                  "report.png", tmp_path)
            for i in range(sections.count()):
                assert _drawn(sections.nth(i).screenshot()) > 0.01, sections.nth(i).get_attribute("id")
            for fig in page.locator("img").all():
                assert _drawn(fig.screenshot()) > 0.01, fig.get_attribute("alt")
        else:
            assert page.evaluate("window.__pwned") is None and page.locator("img[onerror]").count() == 0
            assert HOSTILE in page.locator("#lineage").inner_text()   # shown as text
        assert errors == [], data
        page.close()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A quantized (RTN INT4, probe measured) tiny model in a store, behind `llmq serve`'s app with an API key and
    the loopback Host / Origin checks."""
    from llmq.models import resolve_model
    from llmq.pipeline.quantize import QuantizeOptions, quantize
    from llmq.runtime import EngineConfig
    from llmq.runtime.server.browser import allowed_hosts

    d = tmp_path_factory.mktemp("served")
    store = Store(d / "store")
    src = resolve_model(str(make_tiny_model(d / "tiny", seed=5)), store)
    art = quantize(src, QuantizeOptions(method="rtn", bits=4, group_size=32, probe_tokens=128), store,
                   progress=False)
    cfg = EngineConfig(max_num_seqs=2, max_model_len=256, kv_cache_memory=8 << 20)
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
    assert [e for e in errors if "401 (Unauthorized)" not in e] == [] and len(errors) == 1   # /card without the key
    errors.clear()
    page.fill("#key", "sekrit")
    page.click("#key-save")
    card = page.locator("#card dl")
    card.wait_for()
    text = card.inner_text()
    assert art.ref in text and "rtn W4A16-group32-sym" in text and "tiny-chat" in text
    assert f"{art.metrics['probe']['kld_mean']:.4f}" in text and "gates\nnone recorded" in text
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
    assert shown == want.choices[0].message.content and shown
    assert int(status.split()[0]) == want.usage.completion_tokens
    # the user's and the assistant's bubbles, then one text per content chunk of the stream
    assert page.evaluate("window.updates") >= 2 + min(4, want.usage.completion_tokens)
    assert errors == []
    _keep(page.screenshot(), "chat.png", tmp_path)
    page.close()


def test_the_page_is_same_origin_only(served):
    """The page and its files carry a policy that lets them reach this origin only; an unknown static file is a 404
    in OpenAI's error shape; the card is behind the key like the API."""
    import httpx

    live, _ = served
    page = httpx.get(live.url + "/")
    assert page.status_code == 200 and "script-src 'self'" in page.headers["content-security-policy"]
    assert httpx.get(live.url + "/static/chat.js").headers["content-type"].startswith("text/javascript")
    missing = httpx.get(live.url + "/static/page.py")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    assert httpx.get(live.url + "/static/..%2Fpage.py").status_code == 404
    assert httpx.get(live.url + "/card").status_code == 401
    card = httpx.get(live.url + "/card", headers={"Authorization": "Bearer sekrit"}).json()
    assert card["served_name"] == "tiny-chat"
    assert httpx.get(live.url + "/", headers={"Host": "evil.example"}).status_code == 403   # a rebound name
