"""Calibration text and the quality probe's held-out text, turned into fixed-length token windows.

`--calib` takes a local .txt file, a .jsonl file, a directory of those, or, for users with a network, a Hugging
Face dataset name (`name` or `name:config`, split "train"). A JSONL line / dataset row is either {"text": ...} or
{"messages": [{"role", "content"}, ...]}, an OpenAI-style conversation (an assistant turn may carry
"reasoning_content", its thinking).

Conversations are rendered through the tokenizer's chat template (`apply_chat_template`, the text the model sees
when served): an instruct or thinking model calibrated on text that lacks its turn markers loses exactly the chat
behaviour it is used for (auto-round#2071: GSM8K 0.37 -> 0.00 on Llama-3.1-8B; llm-compressor#2680: AWQ broke
Qwen's `</think>`). Without a template (or with --no-chat-template) a turn is a plain "role: text" line. A template
that reads `enable_thinking` (Qwen3 style) gets it per conversation: `auto` thinks in the conversations that carry
reasoning and not in the others, so both modes are calibrated; `on` / `off` set it for all (`off` also drops the
reasoning). A template that refuses a system turn gets it folded into the first user turn.

The default works offline and mixes three domains, each written for or chosen by llmq: chat (bundled
calib_chat.jsonl: conversations, half multi-turn: coding, arithmetic with reasoning, writing, science, a little French),
prose (calib_en.txt) and code (a fixed list of Python standard-library modules). Windows are drawn chat : prose :
code = 2 : 1 : 1 (most use of an instruct model is chat; code and prose keep the base distribution calibrated); a
domain that runs out leaves its share to the others. User data is drawn in proportion to what each domain holds.
Where the template renders tools and declares a tool-call format (supports_tools), a fourth domain joins at share 1:
tool-call conversations (bundled calib_tools.jsonl: calls, parallel calls, their results, and requests no tool fits),
rendered with their `tools`, since an agent's calls are exactly what an uncalibrated quantization breaks. A user's
JSONL row {"messages", "tools"} is such a conversation (domain "tools"), refused in one line for a template that cannot
render it.

Each domain is cut into windows of its own, and a window starts where a document (a conversation) starts when one
began inside the window before it, so a conversation cut at a window's end is seen again from its first turn
(only a document longer than a window continues mid-way). Windows are shuffled per domain with `seed` and
interleaved by share, so the same data and seed give the same windows and any prefix has the mix. The manifest
records the source, a sha256 of the rendered text, sample / token counts, tokens per domain and how conversations
were rendered. The probe's held-out text is a second bundled English text plus standard-library modules the
calibration never sees.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import sysconfig
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from ...errors import LlmqError
from ...jsonl import read_jsonl

DATA = Path(__file__).parent / "data"
CALIB_CHAT = "calib_chat.jsonl"
CALIB_TOOLS = "calib_tools.jsonl"
PROBE_TOOLS = "probe_tools.jsonl"
CALIB_STDLIB = ("textwrap.py", "heapq.py", "bisect.py", "fractions.py", "calendar.py", "statistics.py", "shlex.py",
                "string.py", "colorsys.py", "difflib.py")
PROBE_STDLIB = ("fnmatch.py", "glob.py", "queue.py")
PROBE_WINDOW = 512
DEFAULT_SHARES = {"chat": 2, "prose": 1, "code": 1, "tools": 1}  # windows of the bundled default, per domain

# a text, a conversation (its messages), or a conversation with tools ({"messages", "tools"}: OpenAI's tools, calls in
# the assistant turns' "tool_calls", results in "tool" turns)
Content = str | list[dict] | dict


@dataclass(frozen=True)
class TokenWindows:
    """Token windows (each a 1-D LongTensor, all the same length), each one's domain, and where they came from."""

    samples: list[torch.Tensor]
    source: str
    sha256: str
    seed: int | None
    domains: tuple[str, ...] = ()
    chat: dict | None = None  # how the data's conversations were rendered; None: it has none
    # a vision-language model's generated image conversations (calib_images.with_images: token ids, pixel values),
    # after the windows, and what the manifest records of them
    images: tuple[tuple[list[int], torch.Tensor], ...] = ()
    image_record: dict | None = None

    @property
    def tokens(self) -> int:
        return sum(len(s) for s in self.samples)

    def head(self, n: int) -> TokenWindows:
        """The first n windows (the order interleaves the domains, so a prefix keeps the mix)."""
        return dataclasses.replace(self, samples=self.samples[:n], domains=self.domains[:n])

    def manifest(self) -> dict:
        per_domain = Counter()
        for d, s in zip(self.domains, self.samples):
            per_domain[d] += len(s)
        out = {"source": self.source, "sha256": self.sha256, "samples": len(self.samples), "tokens": self.tokens,
               "seq_len": len(self.samples[0]), "seed": self.seed, "domains": dict(sorted(per_domain.items())),
               "chat": self.chat}
        if self.images:
            out["image_conversations"] = {**(self.image_record or {}), "share": round(
                len(self.images) / (len(self.images) + len(self.samples)), 4)}
        return out


def _stdlib(names: tuple[str, ...]) -> list[tuple[str, str]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return [(f"stdlib:{n}", (root / n).read_text(encoding="utf-8")) for n in names if (root / n).is_file()]


def _turn_ok(m) -> bool:
    """A turn: a role and text, or an assistant turn of tool calls (its text may be empty or null)."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        return False
    if isinstance(m.get("tool_calls"), list) and m["tool_calls"]:
        return m["role"] == "assistant" and (m.get("content") is None or isinstance(m.get("content"), str))
    return isinstance(m.get("content"), str)


def _content(row) -> Content | None:
    """A JSONL line's or dataset row's text, its conversation, or its conversation with tools; None when it has
    none of them."""
    if not isinstance(row, dict):
        return None
    if isinstance(row.get("text"), str):
        return row["text"]
    msgs = row.get("messages")
    if not (isinstance(msgs, list) and msgs and all(map(_turn_ok, msgs))):
        return None
    tools = row.get("tools")
    if tools is not None:
        return {"messages": msgs, "tools": tools} if isinstance(tools, list) and tools else None
    return None if any("tool_calls" in m for m in msgs) else msgs


def _read_rows(p: Path) -> list[Content]:
    out = []
    for i, row in read_jsonl(p):
        c = _content(row)
        if c is None:
            raise LlmqError(f"{p}:{i}: each JSONL line needs a string field \"text\" or a \"messages\" list of "
                            "{\"role\": ..., \"content\": ...} strings (with a non-empty \"tools\" list where an "
                            "assistant turn has \"tool_calls\")")
        out.append(c)
    return out


def _read_file(p: Path) -> list[Content]:
    if p.suffix.lower() in (".jsonl", ".json"):
        return _read_rows(p)
    try:
        return [p.read_text(encoding="utf-8")]
    except UnicodeDecodeError:
        raise LlmqError(f"{p}: not a UTF-8 text file") from None


def _messages(c: Content) -> list[dict]:
    return c["messages"] if isinstance(c, dict) else c  # type: ignore[return-value]


def _chars(c: Content) -> int:
    return len(c) if isinstance(c, str) else sum(len(m.get("content") or "") for m in _messages(c))


def _dataset(name: str, want_chars: int) -> list[Content]:
    """Texts / conversations from a Hugging Face dataset (network needed); stops once about `want_chars` characters
    are read."""
    try:
        import datasets
    except ImportError:
        raise LlmqError("--calib with a dataset name needs the `datasets` package; pass a local .txt/.jsonl file or "
                        "a directory instead") from None
    ds_name, _, config = name.partition(":")
    try:
        ds = datasets.load_dataset(ds_name, config or None, split="train", streaming=True)
        out, n = [], 0
        for row in ds:
            c = _content(row)
            if c and (not isinstance(c, str) or c.strip()):
                out.append(c)
                n += _chars(c)
                if n >= want_chars:
                    break
    except Exception as e:  # network, hub and dataset-script errors all mean the same to the user
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise LlmqError(f"cannot load calibration dataset {name!r} ({reason}); without a network pass a local "
                        ".txt/.jsonl file or directory to --calib, or omit it for the bundled text") from None
    return out


def _user(contents: list[Content]) -> list[tuple[str, Content]]:
    return [("tools" if isinstance(c, dict) else "chat" if isinstance(c, list) else "text", c) for c in contents]


def supports_tools(template: str | None) -> bool:
    """The chat template renders `tools` and declares how calls are written (models.tool_calls)."""
    from ...models.tool_calls import output_format_for

    return template is not None and "tools" in template and output_format_for(template).tools is not None


def calibration_documents(calib: str | None, want_chars: int, tools: bool = False
                          ) -> tuple[str, list[tuple[str, Content]]]:
    """(source description, [(domain, text or conversation)]) for a --calib value (None: the bundled default, with
    its tool-call conversations where `tools`: the template renders them)."""
    if calib is None:
        code = _stdlib(CALIB_STDLIB)
        docs = [("prose", (DATA / "calib_en.txt").read_text(encoding="utf-8"))]
        docs += [("chat", c) for c in _read_rows(DATA / CALIB_CHAT)] + [("code", t) for _, t in code]
        bundled = ["bundled:calib_en.txt", CALIB_CHAT]
        if tools:
            docs += [("tools", c) for c in _read_rows(DATA / CALIB_TOOLS)]
            bundled.append(CALIB_TOOLS)
        return "+".join(bundled + [n for n, _ in code]), docs
    p = Path(calib).expanduser()
    if p.is_file():
        return f"file:{p.resolve()}", _user(_read_file(p))
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in (".txt", ".jsonl"))
        if not files:
            raise LlmqError(f"{p}: no .txt or .jsonl files to calibrate on")
        return f"dir:{p.resolve()}", _user([c for f in files for c in _read_file(f)])
    if calib.startswith((".", "/", "~")) or calib.count("/") > 1 or p.suffix.lower() in (".txt", ".jsonl", ".json"):
        raise LlmqError(f"--calib {calib}: no such file or directory")
    return f"dataset:{calib}", _user(_dataset(calib, want_chars))


def _template(tokenizer) -> str | None:
    """The chat template's source (the default one of a set of named templates), or None."""
    try:
        return tokenizer.get_chat_template()
    except ValueError:  # transformers' "tokenizer.chat_template is not set"
        return None


@dataclass(frozen=True)
class ChatFormat:
    """How conversations become text for one tokenizer. template: the chat template's source (None: plain
    "role: text" turns); thinking: auto / on / off for a template that reads `enable_thinking`, else None."""

    template: str | None
    thinking: str | None

    @classmethod
    def of(cls, tokenizer, use_template: bool = True, thinking: str = "auto") -> ChatFormat:
        """The format for `tokenizer`; --thinking on / off for a template without the switch is refused."""
        template = _template(tokenizer) if use_template else None
        switch = template is not None and "enable_thinking" in template
        if thinking != "auto" and not switch:
            why = ("the model's chat template has no thinking switch (enable_thinking)" if template is not None
                   else "no chat template is applied")
            raise LlmqError(f"--thinking {thinking}: {why}; drop --thinking")
        return cls(template, thinking if switch else None)

    def render(self, tokenizer, messages: list[dict]) -> tuple[str, bool | None]:
        """(the conversation as text, whether it was rendered thinking: None without a thinking switch)."""
        return self.render_all(tokenizer, [messages])[0]

    def render_all(self, tokenizer, conversations: list) -> list[tuple[str, bool | None]]:
        """render() of each conversation (its messages, or {"messages", "tools"}), all in one bounded render
        (models.chat.render_chats). Conversations with tools need a template that renders them (supports_tools)."""
        if not conversations:
            return []
        tools = [c.get("tools") if isinstance(c, dict) else None for c in conversations]
        conversations = [_messages(c) for c in conversations]
        if any(tools) and not supports_tools(self.template):
            raise LlmqError("calibration conversations with tools need a chat template that renders tools and "
                            "declares a tool-call format, and " + ("this model's does not" if self.template else
                                                                   "no chat template is applied"))
        thinks = [None if self.thinking is None else self.thinking == "on" or (
            self.thinking == "auto" and any(m.get("reasoning_content") for m in messages))
            for messages in conversations]
        conversations = [messages if think else [{k: v for k, v in m.items() if k != "reasoning_content"}
                                                 for m in messages] for messages, think in zip(conversations, thinks)]
        if self.template is None:
            return [("\n".join(f"{m['role']}: {m['content']}" for m in messages), None) for messages in conversations]
        from ...models.chat import TemplateError, render_chats

        def rendered(chats: list[list[dict]]) -> list[tuple[str, str]]:
            try:
                return render_chats(tokenizer, [(m, ({} if t is None else {"enable_thinking": t}) |
                                                 ({"tools": tl} if tl else {}))
                                                for m, t, tl in zip(chats, thinks, tools)])
            except TemplateError as e:
                raise self._refused(e) from None

        out = rendered(conversations)
        # a template that rejects system turns: the system prompt goes into the first user turn
        retry = [i for i, (kind, _) in enumerate(out) if kind == "rejected" and self._merges(conversations[i])]
        if retry:
            merged = list(conversations)
            for i in retry:
                system, user, *rest = conversations[i]
                merged[i] = [{**user, "content": f"{system['content']}\n\n{user['content']}"}, *rest]
            again = rendered(merged)
            out = [again[i] if i in retry else o for i, o in enumerate(out)]
        for kind, value in out:
            if kind != "ok":
                raise self._refused(value)
        return [(text, think) for (_, text), think in zip(out, thinks)]

    @staticmethod
    def _merges(messages: list[dict]) -> bool:
        return len(messages) > 1 and messages[0]["role"] == "system" and messages[1]["role"] == "user"

    @staticmethod
    def _refused(why) -> LlmqError:
        return LlmqError(f"the chat template cannot render a calibration conversation ({why}); "
                         "--no-chat-template renders plain 'role: text' turns instead")

    def manifest(self, thinking: Counter) -> dict:
        """What the manifest records, given how many conversations were rendered thinking (True) or not (False)."""
        out = {"conversations": sum(thinking.values()), "chat_template": self.template is not None,
               "template_sha256": hashlib.sha256(self.template.encode()).hexdigest() if self.template else None,
               "thinking": self.thinking}
        if self.thinking is not None:
            out.update(thinking_on=thinking[True], thinking_off=thinking[False])
        return out


def _stream(tokenizer, texts: list[str], sep: bool) -> tuple[list[int], list[int]]:
    """(token ids of the texts in order, each one's start offset); `sep`: an EOS token between texts."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    starts: list[int] = []
    for t in texts:
        if not t.strip():
            continue
        if ids and sep and eos is not None:
            ids.append(int(eos))
        starts.append(len(ids))
        ids.extend(tokenizer(t, add_special_tokens=False)["input_ids"])
    return ids, starts


def _cut(ids: list[int], starts: list[int], seq_len: int) -> list[list[int]]:
    """Windows of `seq_len` tokens. Each next window begins at the last document start inside the one before it,
    so a document cut at a window's end is seen whole from its start; with no start inside, where that one
    ended."""
    out, pos = [], 0
    while pos + seq_len <= len(ids):
        end = pos + seq_len
        out.append(ids[pos:end])
        j = bisect.bisect_right(starts, end) - 1
        pos = starts[j] if j >= 0 and starts[j] > pos else end
    return out


def _interleave(pools: dict[str, list], shares: dict[str, float], n: int) -> list[tuple[str, list[int]]]:
    """Up to n (domain, window), taken in each pool's order: each next one from the domain furthest behind its
    share among those with windows left."""
    taken = dict.fromkeys(pools, 0)
    out: list[tuple[str, list[int]]] = []
    while len(out) < n:
        left = [d for d in pools if taken[d] < len(pools[d])]
        if not left:
            break
        total = sum(shares[d] for d in left)
        d = max(left, key=lambda d: shares[d] * (len(out) + 1) / total - taken[d])
        out.append((d, pools[d][taken[d]]))
        taken[d] += 1
    return out


def texts_digest(texts: list[str]) -> str:
    h = hashlib.sha256()
    for t in texts:
        h.update(hashlib.sha256(t.encode()).digest())
    return h.hexdigest()


def load_calibration(calib: str | None, tokenizer, num_samples: int, seq_len: int, seed: int,
                     chat_template: bool = True, thinking: str = "auto") -> TokenWindows:
    """`num_samples` windows of `seq_len` tokens (fewer when the data is short: every window it has; a single
    shorter window of all of it when no domain fills one). Empty data is an error."""
    fmt = ChatFormat.of(tokenizer, chat_template, thinking)
    source, docs = calibration_documents(calib, want_chars=num_samples * seq_len * 8,
                                         tools=supports_tools(fmt.template))
    texts: dict[str, list[str]] = {}
    thinks: Counter = Counter()
    chats = iter(fmt.render_all(tokenizer, [c for _, c in docs if not isinstance(c, str)]))
    for domain, content in docs:
        if not isinstance(content, str):
            content, think = next(chats)
            thinks[think] += 1
        texts.setdefault(domain, []).append(content)
    streams = {d: _stream(tokenizer, t, sep=d not in ("chat", "tools") or fmt.template is None)
               for d, t in texts.items()}
    if sum(len(ids) for ids, _ in streams.values()) < 2:
        raise LlmqError(f"calibration data {source} is empty (no text to calibrate on)")
    gen = torch.Generator().manual_seed(seed)
    pools = {}
    for d, (ids, starts) in streams.items():
        windows = _cut(ids, starts, seq_len)
        pools[d] = [windows[i] for i in torch.randperm(len(windows), generator=gen).tolist()]
    if any(pools.values()):
        shares = DEFAULT_SHARES if calib is None else {d: len(w) for d, w in pools.items()}
        picked = _interleave(pools, shares, num_samples)
    else:
        picked = [("+".join(streams), [t for ids, _ in streams.values() for t in ids][:seq_len])]
    return TokenWindows([torch.tensor(w, dtype=torch.long) for _, w in picked], source,
                        texts_digest([t for ts in texts.values() for t in ts]), seed, tuple(d for d, _ in picked),
                        fmt.manifest(thinks) if thinks else None)


def load_probe_text(tokenizer, tokens: int, chat_template: bool = True) -> TokenWindows:
    """About `tokens` held-out tokens (whole windows of up to PROBE_WINDOW), in text order: held-out tool-call
    conversations first where the chat template renders tools (calibration's domain; none of them calibrated), then
    English text and standard-library code. chat_template False: no conversations (quantize's --no-chat-template)."""
    docs = [("bundled:probe_en.txt", (DATA / "probe_en.txt").read_text(encoding="utf-8"))] + _stdlib(PROBE_STDLIB)
    fmt = ChatFormat.of(tokenizer, chat_template)
    if supports_tools(fmt.template):
        rendered = fmt.render_all(tokenizer, _read_rows(DATA / PROBE_TOOLS))
        docs = [(f"bundled:{PROBE_TOOLS}", "".join(text for text, _ in rendered))] + docs
    ids, _ = _stream(tokenizer, [t for _, t in docs], sep=True)
    window = min(PROBE_WINDOW, tokens, len(ids))
    n = max(1, min(tokens, len(ids)) // window)
    samples = [torch.tensor(ids[i * window:(i + 1) * window], dtype=torch.long) for i in range(n)]
    return TokenWindows(samples, "+".join(name for name, _ in docs), texts_digest([t for _, t in docs]), None)
