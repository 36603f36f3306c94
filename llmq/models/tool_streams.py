"""The parsers behind OutputFormat.stream and .parse (tool_calls.py): an answer fed a piece at a time, split into
content, reasoning and tool calls by its format's markers; harmony's messages (GPT-OSS) by their headers."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from .tool_formats import (
    H_CALL,
    H_CHANNEL,
    H_END,
    H_MESSAGE,
    H_RETURN,
    H_START,
    HARMONY,
    Delta,
    Reasoning,
    ToolCall,
    ToolFormat,
)


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

    calls: ToolFormat | None  # the format's tool calls and thinking block (OutputFormat's)
    thinking: Reasoning | None
    in_reasoning: bool = False
    tools: bool = True
    buf: str = ""
    state: str = "start"
    reasoning_opened: bool = False
    reasoning_closed: bool = False
    _pending: dict = field(default_factory=lambda: {"content": "", "reasoning": ""})
    _started: dict = field(default_factory=lambda: {"content": False, "reasoning": False})

    def __post_init__(self):
        if self.in_reasoning and self.thinking is not None:
            self.state, self.reasoning_opened = "reasoning", True
        if not self.tools or self.calls is None:
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
        r, f = self.thinking, self.calls
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
        if self.calls is not HARMONY:
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
