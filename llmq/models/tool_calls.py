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
from dataclasses import dataclass

from .tool_formats import (
    FORMATS,
    H_CALL,
    H_CHANNEL,
    H_CONSTRAIN,
    H_END,
    H_MESSAGE,
    H_RETURN,
    H_START,
    HARMONY,
    HARMONY_REASONING,
    MISTRAL,
    MISTRAL_ARGS,
    REASONINGS,
    Parsed,
    Reasoning,
    ToolFormat,
)
from .tool_streams import HarmonyStream, OutputStream

# how constrained JSON is written: the separators json.dumps (and so most chat templates' tojson) writes, and no
# other whitespace, so a constrained answer cannot run on in whitespace
JSON_STYLE = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


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
        stream = HarmonyStream if self.tools is HARMONY else OutputStream
        return stream(self.tools, self.reasoning, in_reasoning, tools)

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
