// llmq serve's chat page: the model card (GET /card) and a streamed chat over /v1/chat/completions, with the
// server's API key when it has one: tools, the answer's tool calls and thinking, and images where the model takes
// them. Text from the model, the card or the user is only ever set as textContent.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY = "llmq-api-key";
const history = [];          // this conversation's messages, as /v1/chat/completions takes them
let controller = null;       // the running request's AbortController
let served = undefined;      // the model name the server serves (from the card)
const attached = [];         // data: URLs of the images that go with the next message
const IMAGE_TYPES = ["image/png", "image/jpeg"];   // what the server decodes (runtime/images.py)

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

function bubble(role, text, images) {
  const div = el("div", "msg " + role);
  div.append(el("span", "role", role));
  for (const url of images || []) div.append(thumb(url));
  div.append(el("span", "text", text));
  $("log").append(div);
  $("log").scrollTop = $("log").scrollHeight;
  return div;
}

function thumb(url) {
  const img = el("img", "thumb");
  img.alt = "attached image";
  img.src = url;
  return img;
}

// Arguments as indented JSON once they parse; while their fragments still arrive (or if they never parse), as sent.
function pretty(args) {
  try {
    return JSON.stringify(JSON.parse(args), null, 2);
  } catch {
    return args;
  }
}

// An assistant bubble filled from stream deltas: thinking in a collapsed block of its own, the text, and each tool
// call a block (name and arguments), its fragments joined by their index as OpenAI's clients do.
class Answer {
  constructor() {
    this.div = bubble("assistant", "");
    this.text = this.div.querySelector(".text");
    this.content = "";
    this.reasoning = "";
    this.thinking = null;
    this.calls = [];
  }

  add(delta) {
    if (delta.reasoning_content) {
      if (!this.thinking) {
        const box = el("details", "thinking");
        this.thinking = el("div", "reasoning");
        box.append(el("summary", "", "thinking"), this.thinking);
        this.text.before(box);
      }
      this.reasoning += delta.reasoning_content;
      this.thinking.textContent = this.reasoning;
    }
    if (delta.content) {
      this.content += delta.content;
      this.text.textContent = this.content;
    }
    for (const tc of delta.tool_calls || []) {
      let call = this.calls[tc.index];
      if (!call) {
        call = this.calls[tc.index] = { id: "", name: "", arguments: "", box: el("div", "tool-call") };
        call.box.append(el("div", "tool-name"), el("pre", "tool-args"));
        this.div.append(call.box);
      }
      const fn = tc.function || {};
      call.id = tc.id || call.id;
      call.name += fn.name || "";
      call.arguments += fn.arguments || "";
      call.box.firstChild.textContent = call.name;
      call.box.lastChild.textContent = pretty(call.arguments);
    }
  }

  // The answer as the conversation's next assistant message (its calls as OpenAI's clients send them back).
  message() {
    const calls = this.calls.filter(Boolean);
    if (!calls.length) return { role: "assistant", content: this.content };
    return { role: "assistant", content: this.content || null, tool_calls: calls.map((c) => ({
      id: c.id, type: "function", function: { name: c.name, arguments: c.arguments } })) };
  }
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
  $("attach-box").hidden = !c.vision;
  if (!c.vision) setAttached([]);
  const box = $("card");
  box.replaceChildren();
  const dl = el("dl");
  const row = (k, v, cls) => { dl.append(el("dt", "", k), el("dd", cls || "", v)); };
  row("model", c.served_name);
  if (c.ref && c.ref !== c.served_name) row("artifact", c.ref + (c.kind ? " (" + c.kind + ")" : ""));
  if (c.model) row("from", c.model.ref);
  row("architecture", c.architecture);
  row("context", String(c.max_model_len) + " tokens");
  row("input", c.vision ? "text and images" : "text");
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

// The tools box as OpenAI's `tools` (null when empty), or an Error saying what is wrong with it: the shape the
// request needs; the server checks the rest (names, JSON Schemas) and answers a one-line 400.
function parseTools() {
  const src = $("tools").value.trim();
  if (!src) return null;
  let tools;
  try {
    tools = JSON.parse(src);
  } catch (e) {
    throw new Error("not JSON: " + e.message);
  }
  if (!Array.isArray(tools)) throw new Error("not a JSON array of tools");
  tools.forEach((t, i) => {
    const fn = t && t.function;
    if (!t || t.type !== "function" || !fn || typeof fn.name !== "string" || !fn.name)
      throw new Error("tools[" + i + "] is not {\"type\": \"function\", \"function\": {\"name\": ...}}");
    const p = fn.parameters;
    if (p !== undefined && (p === null || typeof p !== "object" || Array.isArray(p)))
      throw new Error("tools[" + i + "].function.parameters is not an object (a JSON Schema)");
  });
  return tools;
}

// Checks the tools box: shows what is wrong with it inline, or offers its functions as tool_choice. {tools} or null.
function checkTools() {
  const err = $("tools-error");
  let tools;
  try {
    tools = parseTools();
  } catch (e) {
    err.textContent = "tools: " + e.message;
    err.hidden = false;
    return null;
  }
  err.hidden = true;
  const choice = $("tool_choice");
  const was = choice.value;
  choice.querySelectorAll("option.fn").forEach((o) => o.remove());
  for (const t of tools || []) {
    const o = el("option", "fn", "function " + t.function.name);
    o.value = "function:" + t.function.name;   // apart from auto / required / none, whatever the function's name
    choice.append(o);
  }
  choice.value = [...choice.options].some((o) => o.value === was) ? was : "auto";
  choice.disabled = !tools;
  return { tools };
}

function toolChoice() {
  const c = $("tool_choice").value;
  return c.startsWith("function:") ? { type: "function", function: { name: c.slice(9) } } : c;
}

function params(tools) {
  const body = {
    model: served,
    temperature: Number($("temperature").value),
    top_p: Number($("top_p").value),
    max_tokens: Number($("max_tokens").value) || 256,
    stream: true,
    stream_options: { include_usage: true },
  };
  if ($("seed").value !== "") body.seed = Number($("seed").value);
  if (tools) Object.assign(body, { tools, tool_choice: toolChoice() });
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

// The user's message: its text, or where images go with it OpenAI's parts (the images first, as attached).
function userMessage(text, images) {
  if (!images.length) return { role: "user", content: text };
  const parts = images.map((url) => ({ type: "image_url", image_url: { url } }));
  return { role: "user", content: text ? parts.concat([{ type: "text", text }]) : parts };
}

async function send(text, tools, images) {
  history.push(userMessage(text, images));
  bubble("user", text, images);
  const answer = new Answer();
  controller = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  const t0 = performance.now();
  let first = null, chunks = 0, usage = null;
  const rate = () => {
    const n = usage ? usage.completion_tokens : chunks;
    const secs = (performance.now() - (first || t0)) / 1000;
    return n + " tokens" + (first ? ", TTFT " + Math.round(first - t0) + " ms" : "") +
      (first && n > 1 && secs > 0 ? ", " + ((n - 1) / secs).toFixed(1) + " tok/s" : "");
  };
  try {
    const r = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(true), signal: controller.signal,
      body: JSON.stringify(Object.assign(params(tools), { messages: messages() })),
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
      // every chunk after the opening {role} one is text the model wrote, even what the server holds back until
      // it knows what it is (a call being written): the clock and the count run on them all
      if (delta && !delta.role) {
        if (first === null) first = performance.now();
        chunks += 1;
        answer.add(delta);
        $("log").scrollTop = $("log").scrollHeight;
        status(rate());
      }
    });
    history.push(answer.message());
    status(rate());
    $("status").dataset.done = "1";
  } catch (e) {
    history.pop();
    answer.div.classList.add("error");
    answer.text.textContent = (answer.content ? answer.content + "\n" : "") +
      (e.name === "AbortError" ? "(stopped)" : "error: " + e.message);
    if (e.name === "AbortError") status(rate());
  } finally {
    controller = null;
    $("send").disabled = false;
    $("stop").disabled = true;
  }
}

// The images for the next message, each previewed with a button that takes it off.
function setAttached(urls) {
  attached.splice(0, attached.length, ...urls);
  $("attached").replaceChildren(...attached.map((url, i) => {
    const fig = el("figure");
    const drop = el("button", "", "×");
    drop.type = "button";
    drop.title = "remove this image";
    drop.addEventListener("click", () => setAttached(attached.filter((_, j) => j !== i)));
    fig.append(thumb(url), drop);
    return fig;
  }));
}

// Reads the chosen files as data: URLs (the server fetches no other kind).
function attachFiles(files) {
  for (const f of files) {
    if (!IMAGE_TYPES.includes(f.type)) {
      status(f.name + ": only PNG and JPEG images are sent");
      continue;
    }
    const reader = new FileReader();
    reader.addEventListener("load", () => setAttached(attached.concat([reader.result])));
    reader.addEventListener("error", () => status(f.name + ": cannot be read"));
    reader.readAsDataURL(f);
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
    if ((!text && !attached.length) || controller) return;
    const checked = checkTools();
    if (!checked) {   // nothing is sent: the prompt stays, the error shows where the tools are
      $("tools-box").open = true;
      $("tools").focus();
      return;
    }
    $("prompt").value = "";
    delete $("status").dataset.done;
    const images = attached.slice();
    setAttached([]);
    send(text, checked.tools, images);
  });
  $("tools").addEventListener("input", checkTools);
  $("attach-button").addEventListener("click", () => $("attach").click());
  $("attach").addEventListener("change", () => {
    attachFiles([...$("attach").files]);
    $("attach").value = "";   // the same file again is a change too
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
    setAttached([]);
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
