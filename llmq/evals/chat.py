"""Tasks asked through the model's chat template: `tools` (BFCL v4), `json` (schema-following extraction), `chat`
(template behaviour). What quantization breaks in an agent shows here before it shows in perplexity: calls that stop
parsing, JSON that leaves its schema, a turn or a thinking block that never ends. And for a vision-language model,
`images`: questions about generated images (llmq.image_questions: which digit, how many shapes, what colour, which
word, which bar), each answer's first word or number against the drawn one.

Each item is a conversation (with tools for `tools`) rendered by the evaluated model's own chat template, in one
bounded render (models.chat.render_chats), generated greedily through the same LM as every other task (in-process, or
an endpoint's /v1/completions with the same token ids), and read with the output formats the template declares
(models.tool_calls). A template that declares no tool-call format (SmolLM2's, the default model's, has none) gets the
tools in a system prompt that asks for Hermes-style `<tool_call>` blocks, read as such; the report says which
(`tools_prompt`). Items whose prompt and token budget do not fit the model's context are left out and counted.

Scores are shares of items in points with their standard errors (compare.mean_stderr), so deltas, intervals and
gates work as for the lm-eval tasks; `llmq_tools_unparsed` is the share of calls written that do not parse (lower is
better; a ratio over items, compare.ratio_stderr).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from ..errors import LlmqError
from ..models.tool_calls import OutputFormat, output_format
from ..models.tool_formats import HERMES
from .compare import mean_stderr, ratio_stderr
from .tasks import json_task
from .tasks.ast_match import ast_match
from .tasks.bfcl import tool_schema

CHAT_MAX_TOKENS = 256
THINKING_MAX_TOKENS = 1024  # a template with a thinking block: room to think and still end the turn
TOOLS_MAX_TOKENS = 256
TOOLS_PROMPT = ("You can call functions to answer. Each one is described by a JSON Schema inside <tools></tools>:\n"
                "<tools>\n{tools}\n</tools>\n"
                "To call functions, answer only with one block per call, each written as\n"
                "<tool_call>\n{{\"name\": \"<function name>\", \"arguments\": {{<argument names and values>}}}}\n"
                "</tool_call>\n"
                "If no function fits the request, answer in plain text and call nothing.")
_PROBE = ("\x01U\x01", "\x01A\x01", "\x01V\x01")  # contents no template changes, to find its role headers


IMAGES_N = 100        # the images task's items without --limit
IMAGES_MAX_TOKENS = 8  # an answer is a digit, a number, a word or a letter


@dataclass
class Item:
    source: str  # "json", "chat", "tools:<category>" or "images"
    row: dict
    messages: list[dict]
    tools: list[dict] | None = None  # OpenAI tools for the template's `tools`
    max_tokens: int = CHAT_MAX_TOKENS
    prompt: str = ""
    ids: list[int] = field(default_factory=list)
    image: object = None  # the images task's PIL image (its messages hold {"type": "image"} where it goes)


def image_answer(text: str) -> str:
    """An answer to an images item as it is scored: its first run of letters or digits, lower case."""
    m = re.search(r"[A-Za-z0-9]+", text)
    return m.group(0).lower() if m else ""


def sources(names: list[str]) -> list[str]:
    """The item sources the requested task names need (`llmq_tools_unparsed` alone: every tools category)."""
    from .tasks import CHAT_TASKS, TOOL_CATEGORIES

    out = [CHAT_TASKS[n] for n in names if CHAT_TASKS.get(n)]
    if "llmq_tools_unparsed" in names and not any(s.startswith("tools:") for s in out):
        out += [f"tools:{c}" for c in TOOL_CATEGORIES]
    return list(dict.fromkeys(out))


def _template(tokenizer) -> str:
    try:
        t = tokenizer.get_chat_template()
    except (ValueError, AttributeError):
        t = None
    if not t:
        raise LlmqError("the tools, json and chat tasks are asked through the model's chat template, and its "
                        "tokenizer has none")
    return t


def _tools_native(template: str, fmt: OutputFormat) -> bool:
    """The template renders `tools` itself and declares how calls are written."""
    return fmt.tools is not None and re.search(r"\btools\b", template) is not None


def _with_system(messages: list[dict], system: str) -> list[dict]:
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": f"{system}\n\n{messages[0]['content']}"}, *messages[1:]]
    return [{"role": "system", "content": system}, *messages]


def _items(ts, srcs: list[str], limit: int | None, native_tools: bool, thinking: bool) -> list[Item]:
    def rows(name: str) -> list[dict]:
        lines = (ts.include_path / f"{name}.jsonl").read_text(encoding="utf-8").splitlines()
        return [json.loads(x) for x in lines[:limit] if x.strip()]

    items = []
    for src in srcs:
        if src == "images":
            from .. import image_questions

            for q in image_questions.image_questions(limit or IMAGES_N, ts.info["seed"]):
                items.append(Item(src, {"kind": q.kind, "question": q.question, "answer": q.answer},
                                  image_questions.conversation(q)[:1], max_tokens=IMAGES_MAX_TOKENS, image=q.image))
        elif src == "json":
            items += [Item(src, r, json_task.messages(r), max_tokens=json_task.MAX_TOKENS * (4 if thinking else 1))
                      for r in rows("json_tasks")]
        elif src == "chat":
            n = THINKING_MAX_TOKENS if thinking else CHAT_MAX_TOKENS
            items += [Item(src, r, r["messages"], max_tokens=n) for r in rows("chat_prompts")]
        else:
            cat = src.split(":", 1)[1]
            path = ts.include_path / f"tools_{cat}.jsonl"
            if not path.is_file():
                raise LlmqError(f"the tools task's data is not in {ts.include_path} (it is fetched when tools is "
                                "in --tasks)")
            for r in rows(f"tools_{cat}"):
                tools = [tool_schema(f) for f in r["functions"]]
                if native_tools:
                    items.append(Item(src, r, r["messages"], tools, TOOLS_MAX_TOKENS))
                else:
                    listed = "\n".join(json.dumps(t["function"]) for t in tools)
                    items.append(Item(src, r, _with_system(r["messages"], TOOLS_PROMPT.format(tools=listed)), None,
                                      TOOLS_MAX_TOKENS))
    return items


def _render(tokenizer, items: list[Item]) -> None:
    """Each item's prompt through the template (a template that refuses a system turn gets it in the first user
    turn), in one bounded render."""
    from ..models.chat import render_chats

    def kwargs(it: Item) -> dict:
        return {"add_generation_prompt": True, **({"tools": it.tools} if it.tools else {})}

    out = render_chats(tokenizer, [(it.messages, kwargs(it)) for it in items])
    retry = [i for i, (kind, _) in enumerate(out) if kind == "rejected" and len(items[i].messages) > 1
             and items[i].messages[0]["role"] == "system" and items[i].messages[1]["role"] == "user"]
    if retry:
        for i in retry:
            system, user, *rest = items[i].messages
            items[i].messages = [{**user, "content": f"{system['content']}\n\n{user['content']}"}, *rest]
        again = render_chats(tokenizer, [(items[i].messages, kwargs(items[i])) for i in retry])
        for i, o in zip(retry, again):
            out[i] = o
    for it, (kind, text) in zip(items, out):
        if kind != "ok":
            raise LlmqError(f"the chat template cannot render a {it.source} item ({text})")
        it.prompt = text


def role_headers(tokenizer) -> list[str]:
    """What a new turn's header looks like in an answer, derived from the template: each header as rendered
    (special tokens as text) and as it reads once special tokens are skipped (what servers return), stripped."""
    from ..models.chat import render_chats

    u, a, v = _PROBE
    conv = [{"role": "user", "content": u}, {"role": "assistant", "content": a}, {"role": "user", "content": v}]
    (kind, text), = render_chats(tokenizer, [(conv, {})])
    if kind != "ok" or not all(p in text for p in _PROBE):
        return []
    raw = [text[text.index(u) + len(u):text.index(a)], text[text.index(a) + len(a):text.index(v)]]
    specials = [t for t in tokenizer.all_special_tokens if t]
    out = set()
    for h in raw:
        out.add(h.strip())
        # the next turn's header alone, without the end of the turn before it: from each special token on
        out.update(h[i:].strip() for i in range(1, len(h)) if any(h.startswith(t, i) for t in specials))
        out.add(tokenizer.decode(tokenizer.encode(h, add_special_tokens=False), skip_special_tokens=True).strip())
    return sorted(h for h in out if h)


def leaks(text: str, headers: list[str]) -> bool:
    """Does an answer hold another turn's header (a header with markup anywhere, a bare one as a line of its own)?"""
    for h in headers:
        if re.search(r"[^\w\s]", h):
            if h in text:
                return True
        elif re.search(rf"(?:^|\n)[ \t]*{re.escape(h)}[ \t]*(?:\n|$)", text):
            return True
    return False


def _stats(values: list[float]) -> tuple[float, float | None]:
    m, se = mean_stderr(values)
    return m * 100.0, (se * 100.0 if se == se else None)


def run_chat_tasks(lm, ts, names: list[str], limit: int | None, samples: list | None = None) -> dict[str, dict]:
    """{task name: score} for the requested chat-template tasks (tasks.CHAT_TASKS); `samples`, when given, receives
    each item's record (its source, row, prompt, answer, whether it ended, and the parsed calls of a tools item)."""
    import time

    from .tasks import CHAT_TASKS, TASKS

    tok = lm.tokenizer
    template = _template(tok)
    fmt = output_format(tok)
    native = _tools_native(template, fmt)
    read_tools = fmt if native else OutputFormat(HERMES, fmt.reasoning)
    srcs = sources(names)
    items = _items(ts, srcs, limit, native, fmt.reasoning is not None)
    _render(tok, items)
    fits, left_out = [], {}
    with_images = [it for it in items if it.image is not None]
    for it in items:
        if it.image is not None:
            continue
        it.ids = lm.encode(it.prompt)
        if len(it.ids) + it.max_tokens <= lm.max_length:
            fits.append(it)
        else:
            left_out[it.source] = left_out.get(it.source, 0) + 1
    lm.progress(len(fits) + len(with_images), 0)
    t = time.monotonic()
    keep = bool(fmt.special_markers(tok) or read_tools.special_markers(tok))  # markers to read, kept in the text
    gens = lm.generate_ids([it.ids for it in fits], [it.max_tokens for it in fits], [[] for _ in fits],
                           [0.0 for _ in fits], skip_special=not keep) if fits else []
    if with_images:   # the LM places the images (its processor, or the endpoint's chat API)
        gens += lm.generate_images([(it.messages, it.prompt, it.image) for it in with_images], IMAGES_MAX_TOKENS)
        fits += with_images
    lm.seconds["generate_until"] += time.monotonic() - t
    headers = role_headers(tok) if "chat" in srcs else []
    per: dict[str, list[float]] = {}
    calls_made, calls_bad = [], []
    for it, g in zip(fits, gens):
        opens = fmt.opens_reasoning(it.prompt)
        record = {"source": it.source, "row": it.row, "prompt": it.prompt, "text": g.text, "ended": g.ended}
        if it.source == "images":
            parsed = fmt.parse(g.text, in_reasoning=opens, tools=False)
            got = image_answer(parsed.content or "")
            per.setdefault("llmq_images", []).append(float(got == it.row["answer"].lower()))
            record["answer"] = got
        elif it.source == "chat":
            parsed = fmt.parse(g.text, in_reasoning=opens, tools=False)
            per.setdefault("llmq_chat_end", []).append(float(g.ended))
            # where markers are kept (special tokens read by the format), the answer's own are not leaks: its content
            per.setdefault("llmq_chat_leak", []).append(float(not leaks(parsed.content or "" if keep else g.text,
                                                                        headers)))
            if fmt.reasoning is not None:
                per.setdefault("llmq_chat_think", []).append(float(parsed.reasoning_closed is not False))
        elif it.source == "json":
            parsed = fmt.parse(g.text, in_reasoning=opens, tools=False)
            s = json_task.score(it.row, parsed.content or "")
            per.setdefault("llmq_json_valid", []).append(s["valid"])
            per.setdefault("llmq_json_fields", []).append(s["fields"])
        else:
            cat = it.source.split(":", 1)[1]
            parsed = read_tools.parse(g.text, in_reasoning=opens)
            bad = parsed.unparseable
            calls = None if bad else [(c.name, c.arguments) for c in parsed.tool_calls]
            verdict = ast_match(cat, it.row["functions"], calls, it.row["answer"])
            per.setdefault(f"llmq_tools_{cat}", []).append(float(verdict))
            calls_made.append(float(len(parsed.tool_calls)))
            calls_bad.append(float(bad))
            record.update(calls=calls, unparsed=bad, verdict=verdict)
        if samples is not None:
            samples.append(record)
    budget = {it.source: it.max_tokens for it in items}
    out = {}
    how = {"tools_prompt": "template" if native else "system prompt (Hermes <tool_call>)"}
    for name in names:
        if name == "llmq_tools_unparsed":
            if not calls_made:
                continue
            if sum(calls_made):
                r, se = ratio_stderr(calls_bad, calls_made)
                value, stderr = r * 100.0, (se * 100.0 if se == se else None)
            else:
                value, stderr = 0.0, None
            out[name] = {"task": name, "metric": TASKS[name], "n": len(calls_made), "value": value,
                         "stderr": stderr, "unit": "points", "higher_is_better": False,
                         "calls": int(sum(calls_made)), **how}
            continue
        vals = per.get(name)
        if not vals:
            continue
        value, stderr = _stats(vals)
        src = CHAT_TASKS[name]
        out[name] = {"task": name, "metric": TASKS[name], "n": len(vals), "value": value, "stderr": stderr,
                     "unit": "points", "higher_is_better": True, "max_tokens": budget[src],
                     **({"left_out_too_long": left_out[src]} if left_out.get(src) else {}),
                     **(how if src.startswith("tools:") else {})}
    return out
