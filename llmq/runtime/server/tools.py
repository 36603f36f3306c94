"""`tools`, `tool_choice` and `response_format` in chat completions, and the answer's tool calls and thinking.

A request is checked before it costs anything (plan: each schema a JSON Schema, within --max-schema-bytes, the named
function among the tools, a template that renders tools and declares a call format llmq reads); its grammar (a JSON
schema, or a forced call's) compiles on a thread of its own within --grammar-timeout, never on the event loop or
the engine thread. The answer is read by the template's formats (models.tool_calls): calls become `tool_calls`
(finish_reason "tool_calls"), thinking becomes `reasoning_content`, a call that does not parse stays content.
"""

from __future__ import annotations

import asyncio
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ...errors import LlmqError
from ...models.tool_calls import JSON_STYLE, OutputFormat, output_format
from ..grammar import Grammar, Grammars
from .protocol import ChatCompletionRequest, NamedToolChoice, bad_request

_PROBE = "llmq_probe_function"  # a tool whose name shows whether a template renders the tools it is given


class ChatTools:
    """Per app: the template's output formats, the grammar compiler and its thread, whether the template renders
    tools (asked once, through the bounded renderer)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: set[int]):
        self.format: OutputFormat = output_format(tokenizer)
        self.grammars = Grammars(tokenizer, vocab_size, eos_token_ids)
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="llmq-grammar")
        # the library's tokenizer, built once at start on the grammar thread: no request's deadline pays for it
        self.ready = self.thread.submit(self.grammars.prepare)
        self.special = self.format.special_markers(tokenizer)
        self._renders: bool | None = None
        self._lock = threading.Lock()

    def renders_tools(self, renderer) -> bool:
        """Whether the chat template writes the tools it is given into the prompt (call off the event loop)."""
        with self._lock:
            if self._renders is None:
                probe = [{"type": "function", "function": {"name": _PROBE, "description": "", "parameters": {
                    "type": "object", "properties": {}}}}]
                try:
                    kind, text = renderer.render([{"role": "user", "content": "?"}], tools=probe,
                                                 add_generation_prompt=True)
                except LlmqError:
                    kind, text = "failed", ""
                self._renders = kind == "ok" and _PROBE in text
            return self._renders

    def close(self) -> None:
        self.thread.shutdown(wait=False, cancel_futures=True)


@dataclass
class ToolPlan:
    tools: list[dict] | None  # what the template renders (None: none)
    parse_tools: bool  # read calls out of the answer
    forced: list[dict] | None  # the tools a grammar forces one call of (tool_choice required / named)
    parallel: bool
    schema: dict | None  # response_format's
    param: str | None  # the field a grammar comes from (for its errors)


def _meta_check(schema, what: str, param: str) -> None:
    """A 400 unless `schema` is a JSON Schema (its meta-schema's verdict)."""
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as e:
        raise bad_request(f"{what} is not a JSON Schema: {str(e).splitlines()[0][:200]}", param) from None
    except (RecursionError, ValueError, TypeError) as e:  # nested past the validator, an unknown $schema
        raise bad_request(f"{what} cannot be checked as a JSON Schema: {str(e).splitlines()[0][:200]}",
                          param) from None


def plan_tools(ct: ChatTools, body: ChatCompletionRequest, max_schema_bytes: int) -> ToolPlan:
    """What a request asks of tools and structured output, or a 400 (nothing compiled or rendered yet)."""
    tools = body.tools or []
    choice = body.tool_choice
    if choice is not None and choice != "none" and not tools:
        raise bad_request("tool_choice needs tools", "tool_choice")
    names = [t.function.name for t in tools]
    if len(set(names)) < len(names):
        raise bad_request("tools: two functions share a name", "tools")
    rf = body.response_format
    schema = None
    if rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise bad_request("response_format json_schema needs json_schema.schema", "response_format")
        schema = rf.json_schema.schema_
    elif rf is not None and rf.type == "json_object":
        schema = {"type": "object"}
    size = sum(len(json.dumps(t.function.parameters or {})) for t in tools) + len(json.dumps(schema or {}))
    if size > max_schema_bytes:
        raise bad_request(f"the request's JSON schemas hold {size:,} characters; this server takes at most "
                          f"{max_schema_bytes:,} (--max-schema-bytes)", "tools" if tools else "response_format")
    for i, t in enumerate(tools):
        if t.function.parameters is not None:
            _meta_check(t.function.parameters, f"tools[{i}].function.parameters", "tools")
    if schema is not None:
        _meta_check(schema, "response_format.json_schema.schema", "response_format")
    mode = "none" if not tools else choice if isinstance(choice, str) else "auto" if choice is None else "named"
    forced = None
    if mode == "named":
        name = choice.function.name if isinstance(choice, NamedToolChoice) else ""
        if name not in names:
            raise bad_request(f"tool_choice names the function {name!r}, which is not among the tools", "tool_choice")
        forced = [t.model_dump(exclude_none=True) for t in tools if t.function.name == name]
    elif mode == "required":
        forced = [t.model_dump(exclude_none=True) for t in tools]
    if mode != "none" and ct.format.tools is None:
        raise bad_request("this model's chat template declares no tool-call format llmq reads, so it cannot be "
                          "given tools", "tools")
    if forced and schema is not None:
        raise bad_request("response_format cannot be combined with a forced tool call (tool_choice required or "
                          "a named function)", "response_format")
    if (forced or schema is not None) and body.ignore_eos:
        raise bad_request("ignore_eos cannot be combined with response_format or a forced tool call", "ignore_eos")
    rendered = [t.model_dump(exclude_none=True) for t in tools] if mode != "none" else None
    return ToolPlan(rendered, mode != "none", forced, bool(body.parallel_tool_calls) and mode == "required", schema,
                    "tools" if forced else "response_format" if schema is not None else None)


async def prepare_tools(ct: ChatTools, p: ToolPlan, renderer, off_loop, timeout: float) -> Grammar | None:
    """The request's grammar, compiled on the grammar thread within `timeout` seconds (None: unconstrained); a 400
    when the template does not render tools or the grammar does not compile in time or at all."""
    if p.tools and not await off_loop(ct.renders_tools, renderer):
        raise bad_request("this model's chat template does not render tools (it has no tool support)", "tools")
    if p.param is None:
        return None

    def build() -> Grammar:
        if p.forced:
            return ct.grammars.lark(ct.format.call_grammar(p.forced, p.parallel, ct.special.get))
        return ct.grammars.json_schema(p.schema, JSON_STYLE)

    try:
        await asyncio.wrap_future(ct.ready)
    except LlmqError as e:  # llguidance missing, or a tokenizer it cannot read
        raise bad_request(f"{p.param}: {e}", p.param) from None
    fut = asyncio.get_running_loop().run_in_executor(ct.thread, build)
    fut.add_done_callback(lambda f: f.cancelled() or f.exception())  # one that ends after its deadline: no warning
    try:
        return await asyncio.wait_for(asyncio.shield(fut), timeout)
    except asyncio.TimeoutError:
        raise bad_request(f"the {p.param} grammar did not compile within {timeout:g} s (--grammar-timeout)",
                          p.param) from None
    except LlmqError as e:  # GrammarError, or llguidance missing
        raise bad_request(f"{p.param}: {e}", p.param) from None


class ChatAnswer:
    """One answer's text, as it arrives, turned into OpenAI's message or stream deltas."""

    def __init__(self, fmt: OutputFormat, in_reasoning: bool, parse_tools: bool):
        self.fmt, self.tools = fmt, fmt.tools
        self.stream = fmt.stream(in_reasoning, parse_tools)
        self.calls = 0

    def _parts(self, text: str, final: bool) -> tuple[str, str, list[dict]]:
        content, reasoning, calls = [], [], []
        for d in self.stream.feed(text, final):
            if d.kind == "reasoning":
                reasoning.append(d.text)
            elif d.kind == "content":
                content.append(d.text)
            elif d.call.parsed:
                calls.append(self._call(d.call.name, d.call.arguments))
            else:  # a call that does not parse is answered as the text the model wrote
                content.append(d.call.raw)
        return "".join(content), "".join(reasoning), calls

    def _call(self, name: str, arguments: dict) -> dict:
        call = {"index": self.calls, "id": self.tools.call_id() if self.tools else "", "type": "function",
                "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}
        self.calls += 1
        return call

    def delta(self, text: str, final: bool) -> dict:
        """A stream chunk's delta: text, thinking and whole calls (each with its name and arguments at once)."""
        content, reasoning, calls = self._parts(text, final)
        out: dict = {}
        if reasoning:
            out["reasoning_content"] = reasoning
        if content:
            out["content"] = content
        if calls:
            out["tool_calls"] = calls
        return out

    def message(self, text: str) -> dict:
        content, reasoning, calls = self._parts(text, True)
        msg: dict = {"role": "assistant", "content": content or (None if calls else "")}
        if self.fmt.reasoning is not None:
            msg["reasoning_content"] = reasoning if self.stream.reasoning_opened else None
        if calls:
            msg["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in calls]
        return msg

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if self.calls and reason == "stop" else reason
