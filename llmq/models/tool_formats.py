"""The tool-call and thinking formats chat templates declare (each family's markers) and what a parsed answer is
made of; tool_calls.py tells a template's formats apart and reads answers by them."""

from __future__ import annotations

import secrets
import string
from dataclasses import dataclass


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
