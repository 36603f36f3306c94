"""Tool calls and thinking in a chat model's output, read the way its chat template writes them.

A model's family of output formats is declared by its chat template, not by its name: the markers its source holds
(`<tool_call>` for Hermes-style JSON calls (Qwen, SmolLM3, Hermes), `[TOOL_CALLS]` for Mistral's, `<|python_tag|>` for
Llama 3's bare JSON call; `<think>` / `[THINK]` for a thinking block). `output_format(tokenizer)` reads them once;
its `parse(text)` splits an answer into content, tool calls and reasoning, and `stream()` does the same a piece at a
time (what `llmq serve` streams), by the same code, so a streamed answer and a whole one agree.

    fmt = output_format(tokenizer)            # or output_format_for(template_source)
    out = fmt.parse(text)                     # Parsed(content, tool_calls, reasoning, reasoning_closed)
    for call in out.tool_calls:
        call.name, call.arguments             # arguments: a dict, or None when the call did not parse (call.error)

A call that does not parse is kept, marked (`error`), so a quality check can count it; `llmq serve` answers it as
content. `call_grammar` writes the grammar (llguidance's Lark dialect) of the calls a format writes, which serve uses
to force a call (tool_choice required / a named function).

OpenAI's harmony format (GPT-OSS) is read here too, as text with its markers kept (HarmonyStream): the
`openai-harmony` package parses token ids with a vocabulary it downloads at run time, which llmq's offline runs
cannot do, and reading text keeps one parser for a whole answer and a streamed one, as for the other formats.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass, field

# how constrained JSON is written: the separators json.dumps (and so most chat templates' tojson) writes, and no
# other whitespace, so a constrained answer cannot run on in whitespace
JSON_STYLE = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


@dataclass(frozen=True)
class ToolCall:
    name: str | None
    arguments: dict | None  # None: the call did not parse (`error` says why)
    raw: str  # the call as the model wrote it, markers included
    error: str | None = None

    @property
    def parsed(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class Delta:
    """One piece of a parsed answer: kind "content" / "reasoning" (text) or "tool_call" (call)."""

    kind: str
    text: str = ""
    call: ToolCall | None = None


@dataclass(frozen=True)
class Parsed:
    content: str | None  # the answer outside thinking and calls, stripped; None when empty
    tool_calls: list[ToolCall]
    reasoning: str | None  # the thinking block's text, stripped; None when there was none
    reasoning_closed: bool | None  # whether a thinking block that opened also closed (None: none opened)

    @property
    def unparseable(self) -> int:
        return sum(not c.parsed for c in self.tool_calls)


@dataclass(frozen=True)
class Reasoning:
    """A thinking block's markers."""

    start: str
    end: str


@dataclass(frozen=True)
class ToolFormat:
    """How a family writes tool calls. A call opens with `call_start` (or, where `bare_json`, is a JSON object that
    opens the answer) and ends with `call_end`, or where that is None at the next call's start or the answer's end.
    Its body is JSON: an object {"name", arguments_key} or a list of them; with `name_args`, `name[ARGS]{...}`."""

    name: str
    signatures: tuple[str, ...]  # any of these in a chat template's source declares the format
    call_start: str | None
    call_end: str | None = None
    arguments_key: str = "arguments"
    bare_json: bool = False
    name_args: str | None = None  # the marker between a call's name and its arguments (Mistral's newer templates)
    id_chars: int | None = None  # call ids of exactly this many letters and digits (Mistral's templates check it)

    def call_id(self) -> str:
        if self.id_chars:
            return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(self.id_chars))
        return f"call_{secrets.token_hex(12)}"


HERMES = ToolFormat("hermes", ("<tool_call>",), "<tool_call>", "</tool_call>")
MISTRAL = ToolFormat("mistral", ("[TOOL_CALLS]",), "[TOOL_CALLS]", id_chars=9)
MISTRAL_ARGS = ToolFormat("mistral_args", (), "[TOOL_CALLS]", name_args="[ARGS]", id_chars=9)
LLAMA3_JSON = ToolFormat("llama3_json", ("<|python_tag|>",), "<|python_tag|>", arguments_key="parameters",
                         bare_json=True)
# harmony (GPT-OSS): calls are messages addressed to `functions.NAME`, read by HarmonyStream, not by markers
HARMONY = ToolFormat("harmony", ("<|channel|>",), None)
# in the order they are looked for: Mistral's templates may mention the others' markers, not the reverse
FORMATS = {f.name: f for f in (HARMONY, MISTRAL, MISTRAL_ARGS, HERMES, LLAMA3_JSON)}
REASONINGS = (Reasoning("<think>", "</think>"), Reasoning("[THINK]", "[/THINK]"))

# harmony's markers: a message is [<|start|>role] header <|message|> text, ended by <|end|> (more messages follow),
# <|call|> (a call: the turn waits for its result) or <|return|> (the turn's end)
H_START, H_CHANNEL, H_MESSAGE, H_CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
H_END, H_CALL, H_RETURN = "<|end|>", "<|call|>", "<|return|>"
HARMONY_REASONING = Reasoning(H_CHANNEL + "analysis", H_END)  # the analysis channel is the thinking


@dataclass(frozen=True)
class OutputFormat:
    """A chat template's output formats: its tool calls (None: it declares none) and thinking block (None: none)."""

    tools: ToolFormat | None
    reasoning: Reasoning | None

    @property
    def markers(self) -> tuple[str, ...]:
        """Every marker the formats read: they must survive detokenization (as text, not skipped specials)."""
        if self.tools is HARMONY:
            return H_START, H_CHANNEL, H_MESSAGE, H_CONSTRAIN, H_END, H_CALL, H_RETURN
        out = []
        if self.tools is not None:
            out += [m for m in (self.tools.call_start, self.tools.call_end, self.tools.name_args) if m]
        if self.reasoning is not None:
            out += [self.reasoning.start, self.reasoning.end]
        return tuple(out)

    def special_markers(self, tokenizer) -> dict[str, int]:
        """{marker: token id} of the markers that are special tokens of `tokenizer`: an answer read by this format
        is decoded with special tokens kept where there are any (they would be skipped otherwise)."""
        special = {t.content: i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.special}
        return {m: special[m] for m in self.markers if m in special}

    def opens_reasoning(self, prompt: str) -> bool:
        """Whether a rendered prompt leaves a thinking block open, so the answer starts inside it (templates that
        write the start marker into the generation prompt)."""
        r = self.reasoning
        return r is not None and prompt.rfind(r.start) > prompt.rfind(r.end)

    def stream(self, in_reasoning: bool = False, tools: bool = True) -> OutputStream:
        """A parser fed the answer a piece at a time. in_reasoning: the prompt left a thinking block open
        (opens_reasoning); tools: read tool calls (False: a call's text stays content)."""
        return (HarmonyStream if self.tools is HARMONY else OutputStream)(self, in_reasoning, tools)

    def parse(self, text: str, in_reasoning: bool = False, tools: bool = True) -> Parsed:
        """A whole answer split into content, tool calls and reasoning (see stream for the arguments)."""
        s = self.stream(in_reasoning, tools)
        deltas = s.feed(text, final=True)
        content = "".join(d.text for d in deltas if d.kind == "content")
        reasoning = "".join(d.text for d in deltas if d.kind == "reasoning")
        return Parsed(content or None, [d.call for d in deltas if d.kind == "tool_call"],
                      reasoning if s.reasoning_opened else None, s.reasoning_closed if s.reasoning_opened else None)

    def call_grammar(self, tools: list[dict], parallel: bool = False, token=None) -> str:
        """The grammar (llguidance's Lark) of an answer that is only calls of `tools` (OpenAI's
        [{"type": "function", "function": {"name", "parameters"}}]), one, or one or more where `parallel`.
        token(marker): the id of a marker that is one special token (None: written as text)."""
        f = self.tools
        if f is None:
            raise ValueError("this chat template declares no tool-call format")

        def lit(marker: str) -> str:
            t = token(marker) if token is not None else None
            return f"<[{t}]>" if t is not None else json.dumps(marker)

        fns = [t["function"] for t in tools]
        params = [fn.get("parameters") or {"type": "object", "properties": {}} for fn in fns]
        if f is HARMONY:  # one message to functions.NAME: a call ends the turn (<|call|>), so never several
            alts = [f"{lit(H_CHANNEL)} {json.dumps('commentary to=functions.' + fn['name'] + ' ')} "
                    f"{lit(H_CONSTRAIN)} \"json\" {lit(H_MESSAGE)} %json {json.dumps(_styled(p))} {lit(H_CALL)}"
                    for fn, p in zip(fns, params)]
            return "\n".join(["start: " + " | ".join(f"call_{i}" for i in range(len(alts)))]
                             + [f"call_{i}: {a}" for i, a in enumerate(alts)])
        if f.name_args:  # name[ARGS]{...}, one alternative per function
            alts = [f"{json.dumps(fn['name'])} {lit(f.name_args)} %json {json.dumps(_styled(p))}"
                    for fn, p in zip(fns, params)]
            lines = ["call: " + " | ".join(f"call_{i}" for i in range(len(alts)))]
            lines += [f"call_{i}: {a}" for i, a in enumerate(alts)]
            one = f"{lit(f.call_start)} call"
            return "\n".join([f"start: {one}" + (f" ({one})*" if parallel else "")] + lines)
        obj = [{"type": "object", "properties": {"name": {"const": fn["name"]}, f.arguments_key: p},
                "required": ["name", f.arguments_key], "additionalProperties": False} for fn, p in zip(fns, params)]
        one_call = obj[0] if len(obj) == 1 else {"anyOf": obj}
        if f is MISTRAL:  # [TOOL_CALLS][{...}, ...]
            body = {"type": "array", "items": one_call, "minItems": 1} | ({} if parallel else {"maxItems": 1})
            return f"start: {lit(f.call_start)} %json {json.dumps(_styled(body))}"
        call = f"%json {json.dumps(_styled(one_call))}"
        if f.call_end:  # <tool_call>\n{...}\n</tool_call>
            call = f"{lit(f.call_start)} \"\\n\" {call} \"\\n\" {lit(f.call_end)}"
            sep = '"\\n"'
        else:  # Llama 3: a bare object; several separated by "; "
            sep = '"; "'
        return f"start: call ({sep} call)*\ncall: {call}" if parallel else f"start: call\ncall: {call}"


def _styled(schema: dict) -> dict:
    return {**schema, "x-guidance": JSON_STYLE} if isinstance(schema, dict) else schema


def output_format_for(template: str | None) -> OutputFormat:
    """The formats a chat template's source declares (None, or no markers: no tool calls, no thinking)."""
    t = template or ""
    tools = next((f for f in FORMATS.values() if f.signatures and any(s in t for s in f.signatures)), None)
    if tools is MISTRAL and MISTRAL_ARGS.name_args in t:
        tools = MISTRAL_ARGS
    if tools is HARMONY:
        return OutputFormat(HARMONY, HARMONY_REASONING)
    reasoning = next((r for r in REASONINGS if r.start in t and r.end in t), None)
    return OutputFormat(tools, reasoning)


def output_format(tokenizer) -> OutputFormat:
    """The formats of a tokenizer's chat template (its default one, where it has several)."""
    try:
        template = tokenizer.get_chat_template()
    except (ValueError, AttributeError):  # transformers' "tokenizer.chat_template is not set"
        template = None
    return output_format_for(template)


def _partial(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker` (text to hold back: it may become the marker)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


@dataclass
class OutputStream:
    """OutputFormat.stream's parser: feed(piece) returns the Deltas that piece settles. Text that may still turn
    into a marker is held back; a call is answered once it is whole (its end marker, the next call or the end);
    content and reasoning come without their leading and trailing whitespace."""

    fmt: OutputFormat
    in_reasoning: bool = False
    tools: bool = True
    buf: str = ""
    state: str = "start"
    reasoning_opened: bool = False
    reasoning_closed: bool = False
    _pending: dict = field(default_factory=lambda: {"content": "", "reasoning": ""})
    _started: dict = field(default_factory=lambda: {"content": False, "reasoning": False})

    def __post_init__(self):
        if self.in_reasoning and self.fmt.reasoning is not None:
            self.state, self.reasoning_opened = "reasoning", True
        if not self.tools or self.fmt.tools is None:
            self.tools = False

    def feed(self, piece: str, final: bool = False) -> list[Delta]:
        self.buf += piece
        out: list[Delta] = []
        while self._step(final, out):
            pass
        return out

    def _as_is(self) -> bool:
        """Nothing is cut out of the text (no calls read, no thinking opened): it is the answer as written."""
        return not (self.tools or self.reasoning_opened)

    def _emit(self, kind: str, text: str, out: list[Delta]) -> None:
        if self._as_is():
            if text:
                out.append(Delta(kind, text))
            return
        s = self._pending[kind] + text
        if not self._started[kind]:
            s = s.lstrip()
        body = s.rstrip()
        self._pending[kind] = s[len(body):]
        if body:
            self._started[kind] = True
            out.append(Delta(kind, body))

    def _emit_held(self, kind: str, marker: str | None, final: bool, out: list[Delta]) -> None:
        """Emit the buffer but for an end that may begin `marker`."""
        keep = 0 if final or not marker else _partial(self.buf, marker)
        self._emit(kind, self.buf[:len(self.buf) - keep], out)
        self.buf = self.buf[len(self.buf) - keep:]

    def _step(self, final: bool, out: list[Delta]) -> bool:
        """Advance by one transition; False once the buffer can go no further until more text comes."""
        r, f = self.fmt.reasoning, self.fmt.tools
        if self.state == "start":
            s = self.buf.lstrip()
            if r is not None and s.startswith(r.start):
                self.buf, self.state, self.reasoning_opened = s[len(r.start):], "reasoning", True
                return True
            if r is not None and r.start.startswith(s) and not final:
                return False
            self.state = "content"
            return True
        if self.state == "reasoning":
            i = self.buf.find(r.end)
            if i < 0:
                self._emit_held("reasoning", r.end, final, out)
                return False
            self._emit("reasoning", self.buf[:i], out)
            self.buf, self.state, self.reasoning_closed = self.buf[i + len(r.end):], "content", True
            return True
        if self.state == "content":
            if not self.tools:
                self._emit_held("content", None, final, out)
                return False
            if f.bare_json and not self._started["content"]:
                s = self.buf.lstrip()
                if not s and not final:
                    return False
                if s.startswith("{"):
                    self.buf, self.state = s, "call"
                    return True
            i = self.buf.find(f.call_start)
            if i < 0:
                self._emit_held("content", f.call_start, final, out)
                return False
            self._emit("content", self.buf[:i], out)
            self.buf, self.state = self.buf[i:], "call"
            return True
        # a call: self.buf begins with its start marker (or, bare, its JSON)
        start = f.call_start if self.buf.startswith(f.call_start) else ""
        if f.call_end is not None:
            j = self.buf.find(f.call_end, len(start))
            end = j + len(f.call_end) if j >= 0 else None
        else:
            j = self.buf.find(f.call_start, len(start))
            end = j if j >= 0 else None
        if end is None and not final:
            return False
        raw = self.buf if end is None else self.buf[:end]
        body = raw[len(start):len(raw) - (len(f.call_end) if f.call_end and raw.endswith(f.call_end) else 0)]
        for call in _calls(f, body, raw):
            out.append(Delta("tool_call", call=call))
        self.buf, self.state = ("" if end is None else self.buf[end:]), "content"
        return True


_H_ENDS = (H_END, H_CALL, H_RETURN)
_H_OPENS = (H_START, H_CHANNEL, "to=")  # what a header may begin with (leading whitespace aside)


@dataclass
class HarmonyStream(OutputStream):
    """OutputFormat.stream's parser for harmony: the answer is messages, each a header (`<|channel|>` analysis /
    commentary / final, a recipient ` to=functions.NAME` before or after the channel, `<|constrain|>json`) then
    `<|message|>` and its text up to `<|end|>`, `<|call|>`, `<|return|>` or the answer's end. analysis is reasoning,
    a message to functions.NAME one call of NAME with the message as its JSON arguments, the rest (final, a
    commentary preamble) content. Text that opens no header, or another role's message (a model off the format, or
    running on past its turn), is content from there on, markers and all."""

    header: str = ""
    kind: str = "content"  # the open message's: content / reasoning / call
    name: str = ""  # the function a call message is addressed to

    def __post_init__(self):  # harmony's messages say what they are: nothing is open before the first
        if self.fmt.tools is not HARMONY:
            raise ValueError("HarmonyStream reads the harmony format only")
        self.state = "header"

    def _as_is(self) -> bool:  # the headers are always cut out
        return False

    def _step(self, final: bool, out: list[Delta]) -> bool:
        if self.state == "header":
            s = self.buf.lstrip()
            if not s:
                return False
            if not any(s.startswith(m) or (m.startswith(s) and not final) for m in _H_OPENS):
                self.state = "raw"
                return True
            i = self.buf.find(H_MESSAGE)
            if i < 0:
                if final:  # a header that never opened its message: what the model wrote is the answer
                    self.state = "raw"
                    return True
                return False
            if s.startswith(H_START) and not s[len(H_START):].startswith("assistant"):
                self.state = "raw"
                return True
            self.header, self.buf = self.buf[:i + len(H_MESSAGE)], self.buf[i + len(H_MESSAGE):]
            channel = re.search(re.escape(H_CHANNEL) + r"\s*(\w+)", self.header)
            to = re.search(r"\bto=functions\.([^\s<]+)", self.header)
            if to is not None and self.tools:
                self.kind, self.name = "call", to.group(1)
            elif channel is not None and channel.group(1) == "analysis":
                self.kind, self.reasoning_opened, self.reasoning_closed = "reasoning", True, False
            else:
                self.kind = "content"
            self.state = "body"
            return True
        if self.state == "raw":
            self._emit("content", self.buf, out)
            self.buf = ""
            return False
        ends = [(j, m) for m in _H_ENDS if (j := self.buf.find(m)) >= 0]
        j, m = min(ends) if ends else (-1, "")
        if j < 0 and not final:
            if self.kind != "call":  # hold back only what may begin an end marker
                keep = max(_partial(self.buf, e) for e in _H_ENDS)
                self._emit(self.kind, self.buf[:len(self.buf) - keep], out)
                self.buf = self.buf[len(self.buf) - keep:]
            return False
        body = self.buf if j < 0 else self.buf[:j]
        if self.kind == "call":
            out.append(Delta("tool_call", call=_harmony_call(self.name, body, self.header + body + m)))
        else:
            self._emit(self.kind, body, out)
            if self.kind == "reasoning" and m:
                self.reasoning_closed = True
        self.buf, self.state = ("" if j < 0 else self.buf[j + len(m):]), "header"
        return j >= 0


def _harmony_call(name: str, body: str, raw: str) -> ToolCall:
    try:
        args = _one_json(body)
    except ValueError as e:
        return ToolCall(name, None, raw, str(e).splitlines()[0][:200])
    if not isinstance(args, dict):
        return ToolCall(name, None, raw, "the call's arguments are not a JSON object")
    return ToolCall(name, args, raw)


def _calls(f: ToolFormat, body: str, raw: str) -> list[ToolCall]:
    """The calls a call's body holds (one unparseable ToolCall when it holds none that parse)."""
    try:
        if f.name_args:
            name, sep, args = body.partition(f.name_args)
            if not sep:
                raise ValueError(f"no {f.name_args} after the function's name")
            values = [{"name": name.strip(), f.arguments_key: _one_json(args)}]
        else:
            values = _json_values(body)
        calls = []
        for v in values:
            for d in v if isinstance(v, list) else [v]:
                calls.append(_call(f, d, raw if len(values) == 1 and not isinstance(v, list) else json.dumps(d)))
        if not calls:
            raise ValueError("no call in it")
        return calls
    except ValueError as e:
        m = re.search(r'"name"\s*:\s*"([^"\\]*)"', body)
        return [ToolCall(m.group(1) if m else None, None, raw, str(e).splitlines()[0][:200] or "not JSON")]


def _call(f: ToolFormat, d, raw: str) -> ToolCall:
    if not isinstance(d, dict):
        raise ValueError(f"a call is a JSON object, not {type(d).__name__}")
    name = d.get("name")
    args = d.get(f.arguments_key, d.get("arguments" if f.arguments_key != "arguments" else "parameters"))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        args = _one_json(args)
    if not isinstance(name, str) or not name:
        return ToolCall(None, None, raw, "the call names no function")
    if not isinstance(args, dict):
        return ToolCall(name, None, raw, "the call's arguments are not a JSON object")
    return ToolCall(name, args, raw)


def _one_json(text: str):
    values = _json_values(text)
    if len(values) != 1:
        raise ValueError(f"{len(values)} JSON values where one belongs")
    return values[0]


def _json_values(text: str) -> list:
    """The JSON values `text` holds one after another (whitespace, ';' or ',' between them)."""
    dec = json.JSONDecoder()
    out, i = [], 0
    while True:
        while i < len(text) and text[i] in " \t\r\n;,":
            i += 1
        if i >= len(text):
            return out
        try:
            v, i = dec.raw_decode(text, i)
        except json.JSONDecodeError as e:
            raise ValueError(f"not JSON: {e.msg} at character {e.pos}") from None
        out.append(v)
