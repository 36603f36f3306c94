// llmq serve's chat page: the model card (GET /card) and a streamed chat over /v1/chat/completions, with the
// server's API key when it has one. Text from the model or the card is only ever set as textContent.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY = "llmq-api-key";
const history = [];          // {role, content} of this conversation, as the chat template receives them
let controller = null;       // the running request's AbortController
let served = undefined;      // the model name the server serves (from the card)

function headers(json) {
  const h = {};
  const key = sessionStorage.getItem(KEY);
  if (key) h["Authorization"] = "Bearer " + key;
  if (json) h["Content-Type"] = "application/json";
  return h;
}

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

function bubble(role, text) {
  const div = el("div", "msg " + role);
  div.append(el("span", "role", role), el("span", "text", text));
  $("log").append(div);
  $("log").scrollTop = $("log").scrollHeight;
  return div.querySelector(".text");
}

function fmt(v, digits) {
  return v === null || v === undefined ? "–" : Number(v).toFixed(digits);
}

function mib(n) {
  return n === null || n === undefined ? "–" : (n / 1048576).toFixed(1) + " MiB";
}

function kvName(kv) {
  return kv === "auto" ? "the compute dtype" : kv;
}

function renderCard(c) {
  served = c.served_name;
  const box = $("card");
  box.replaceChildren();
  const dl = el("dl");
  const row = (k, v, cls) => { dl.append(el("dt", "", k), el("dd", cls || "", v)); };
  row("model", c.served_name);
  if (c.ref && c.ref !== c.served_name) row("artifact", c.ref + (c.kind ? " (" + c.kind + ")" : ""));
  if (c.model) row("from", c.model.ref);
  row("architecture", c.architecture);
  row("context", String(c.max_model_len) + " tokens");
  if (c.size_bytes) row("size", mib(c.size_bytes));
  const q = c.quantization;
  if (q) {
    const w = q.method ? q.method + " " + (q.scheme || (q.bits + " bits")) + (q.bpw ? ", " + q.bpw + " bits/weight" : "")
                       : "16-bit weights";
    row("quantization", w);
    row("KV cache", kvName(q.kv_cache || c.kv_cache_dtype));
  } else {
    row("quantization", "none (16-bit weights)");
    row("KV cache", kvName(c.kv_cache_dtype));
  }
  if (c.kld) row("KLD", fmt(c.kld.mean, 4) + " nats/token, top-1 " + fmt(c.kld.top1, 1) + "% (" + c.kld.from + ")");
  else row("KLD", "not measured");
  if (c.gates) {
    const passed = c.gates.gates.filter((g) => g.passed).length;
    row("gates", passed + " / " + c.gates.gates.length + " passed (" + c.gates.from + ")",
        passed === c.gates.gates.length ? "pass" : "fail");
    for (const g of c.gates.gates) row(g.passed ? "✓" : "✗", g.gate + ": " + g.what, g.passed ? "pass" : "fail");
  } else {
    row("gates", "none recorded");
  }
  box.append(dl);
}

async function loadCard() {
  let r;
  try {
    r = await fetch("/card", { headers: headers(false) });
  } catch (e) {
    $("card").replaceChildren(el("p", "fail", "the server cannot be reached: " + e.message));
    return;
  }
  if (r.status === 401) {
    $("key-box").hidden = false;
    $("card").replaceChildren(el("p", "muted", "this server needs an API key"));
    return;
  }
  if (!r.ok) {
    $("card").replaceChildren(el("p", "fail", "card: HTTP " + r.status));
    return;
  }
  $("key-box").hidden = true;
  renderCard(await r.json());
}

function params() {
  const body = {
    model: served,
    temperature: Number($("temperature").value),
    top_p: Number($("top_p").value),
    max_tokens: Number($("max_tokens").value) || 256,
    stream: true,
    stream_options: { include_usage: true },
  };
  if ($("seed").value !== "") body.seed = Number($("seed").value);
  return body;
}

function messages() {
  const sys = $("system").value.trim();
  return (sys ? [{ role: "system", content: sys }] : []).concat(history);
}

function status(text) {
  $("status").textContent = text;
}

// One SSE stream: calls onEvent(json) for every data line until [DONE].
async function readEvents(response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const event = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        onEvent(JSON.parse(data));
      }
    }
  }
}

async function send(text) {
  history.push({ role: "user", content: text });
  bubble("user", text);
  const out = bubble("assistant", "");
  controller = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  const t0 = performance.now();
  let first = null, chunks = 0, usage = null, answer = "";
  const rate = () => {
    const n = usage ? usage.completion_tokens : chunks;
    const secs = (performance.now() - (first || t0)) / 1000;
    return n + " tokens" + (first ? ", TTFT " + Math.round(first - t0) + " ms" : "") +
      (first && n > 1 && secs > 0 ? ", " + ((n - 1) / secs).toFixed(1) + " tok/s" : "");
  };
  try {
    const r = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(true), signal: controller.signal,
      body: JSON.stringify(Object.assign(params(), { messages: messages() })),
    });
    if (!r.ok) {
      const err = await r.json().catch(() => ({}));
      if (r.status === 401) $("key-box").hidden = false;
      throw new Error((err.error && err.error.message) || "HTTP " + r.status);
    }
    await readEvents(r, (ev) => {
      if (ev.error) throw new Error(ev.error.message);
      if (ev.usage) usage = ev.usage;
      const delta = ev.choices && ev.choices[0] && ev.choices[0].delta;
      if (delta && delta.content) {
        if (first === null) first = performance.now();
        chunks += 1;
        answer += delta.content;
        out.textContent = answer;
        $("log").scrollTop = $("log").scrollHeight;
        status(rate());
      }
    });
    history.push({ role: "assistant", content: answer });
    status(rate());
    $("status").dataset.done = "1";
  } catch (e) {
    history.pop();
    out.parentElement.classList.add("error");
    out.textContent = (answer ? answer + "\n" : "") + (e.name === "AbortError" ? "(stopped)" : "error: " + e.message);
    if (e.name === "AbortError") status(rate());
  } finally {
    controller = null;
    $("send").disabled = false;
    $("stop").disabled = true;
  }
}

function bindRange(id) {
  const show = () => { $(id + "-v").textContent = $(id).value; };
  $(id).addEventListener("input", show);
  show();
}

document.addEventListener("DOMContentLoaded", () => {
  bindRange("temperature");
  bindRange("top_p");
  $("form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const text = $("prompt").value.trim();
    if (!text || controller) return;
    $("prompt").value = "";
    delete $("status").dataset.done;
    send(text);
  });
  $("prompt").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey) {
      ev.preventDefault();
      $("form").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => { if (controller) controller.abort(); });
  $("clear").addEventListener("click", () => {
    if (controller) controller.abort();
    history.length = 0;
    $("log").replaceChildren();
    status("");
  });
  $("key-save").addEventListener("click", () => {
    sessionStorage.setItem(KEY, $("key").value);
    $("key").value = "";
    loadCard();
  });
  loadCard();
});
