"""`llmq serve`'s tools, tool_choice, response_format and reasoning_content, through the official openai client on a
tiny random model whose chat template declares Hermes-style calls: a forced call and a schema answer parse and
validate whatever the random weights say (the grammar), streamed and not; each bad input is a one-line 400 and the
server keeps serving."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
from helpers import byte_tokenizer, live_server, make_tiny_model

from llmq.models import load_tokenizer
from llmq.models.tool_calls import OutputFormat, output_format_for
from llmq.models.tool_formats import HARMONY
from llmq.runtime import EngineConfig

# a ChatML template that renders tools and earlier calls the Hermes way (<tool_call> JSON </tool_call>)
HERMES = ("{%- if tools %}<|im_start|>system\nYou may call these functions:\n<tools>\n{%- for t in tools %}\n"
          "{{ t | tojson }}{%- endfor %}\n</tools>\nCall one as <tool_call>\n{\"name\": ..., \"arguments\": ...}\n"
          "</tool_call><|im_end|>\n{% endif %}"
          "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n{%- if m.tool_calls %}{%- for tc in m.tool_calls %}"
          "\n<tool_call>\n{{ {'name': tc.function.name, 'arguments': tc.function.arguments} | tojson }}\n</tool_call>"
          "{%- endfor %}{%- else %}\n{{ m['content'] }}{%- endif %}<|im_end|>\n{% endfor %}"
          "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# one that writes earlier thinking back and opens a thinking block in the generation prompt
THINKING = HERMES.replace("{%- else %}\n{{ m['content'] }}", "{%- else %}\n{% if m.reasoning_content %}<think>"
                          "{{ m.reasoning_content }}</think>{% endif %}{{ m['content'] }}").replace(
    "<|im_start|>assistant\n{% endif %}", "<|im_start|>assistant\n<think>\n{% endif %}")

# a template in OpenAI's harmony format (GPT-OSS's): tools as a namespace, calls as messages to functions.NAME
HARMONY_CHAT = (
    "<|start|>system<|message|>Reasoning: low<|end|>{%- if tools %}<|start|>developer<|message|>"
    "namespace functions {{ '{' }}{%- for t in tools %}\ntype {{ t.function.name }} = "
    "(_: {{ t.function.parameters | tojson }}) => any;"
    "{%- endfor %}\n}<|end|>{% endif %}{%- for m in messages %}{%- if m.tool_calls %}{%- for tc in m.tool_calls %}"
    "<|start|>assistant to=functions.{{ tc.function.name }}<|channel|>commentary json<|message|>"
    "{{ tc.function.arguments }}<|call|>{%- endfor %}{%- elif m.role == 'tool' %}<|start|>functions.tool "
    "to=assistant<|channel|>commentary<|message|>{{ m.content }}<|end|>{%- elif m.role == 'assistant' %}"
    "<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>{%- else %}<|start|>{{ m.role }}<|message|>"
    "{{ m.content }}<|end|>{%- endif %}{%- endfor %}{%- if add_generation_prompt %}<|start|>assistant{% endif %}")

# Mistral's templates: tools and calls in [TOOL_CALLS] JSON (each call id 9 letters and digits, which the template
# checks), or in the newer tokenizers' [TOOL_CALLS]name[ARGS]{...}; results in [TOOL_RESULTS]
_MISTRAL_HEAD = ("{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
                 "{%- for m in messages %}{%- if m.role == 'user' %}[INST]{{ m.content }}[/INST]"
                 "{%- elif m.tool_calls %}{%- for tc in m.tool_calls %}{%- if tc.id | length != 9 %}"
                 "{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{%- endif %}"
                 "{%- endfor %}")
_MISTRAL_TAIL = ("</s>{%- elif m.role == 'tool' %}[TOOL_RESULTS]{{ {'content': m.content, 'call_id': m.tool_call_id} "
                 "| tojson }}[/TOOL_RESULTS]{%- else %}{{ m.content }}</s>{%- endif %}{%- endfor %}")
MISTRAL_CHAT = (_MISTRAL_HEAD + "[TOOL_CALLS][{%- for tc in m.tool_calls %}{{ {'name': tc.function.name, 'arguments': "
                "tc.function.arguments, 'id': tc.id} | tojson }}{{ ', ' if not loop.last }}{%- endfor %}]"
                + _MISTRAL_TAIL)
MISTRAL_ARGS_CHAT = (_MISTRAL_HEAD + "{%- for tc in m.tool_calls %}[TOOL_CALLS]{{ tc.function.name }}[ARGS]"
                     "{{ tc.function.arguments | tojson }}{%- endfor %}" + _MISTRAL_TAIL)
# Llama 3.1's: the tools in the last user turn, a call as a bare {"name", "parameters"} object (<|python_tag|> for
# its built-in tools), results from the ipython role
LLAMA3_CHAT = (
    "{%- for m in messages %}<|start_header_id|>{{ 'ipython' if m.role == 'tool' else m.role }}<|end_header_id|>\n\n"
    "{%- if m.role == 'user' and loop.last and tools %}Respond with a JSON for a function call: {\"name\": function "
    "name, \"parameters\": its arguments}.\n{%- for t in tools %}{{ t | tojson }}\n{%- endfor %}{%- endif %}"
    "{%- if m.tool_calls %}{%- for tc in m.tool_calls %}{%- if tc.function.name == 'python' %}<|python_tag|>"
    "{%- endif %}{{ {'name': tc.function.name, 'parameters': tc.function.arguments} | tojson }}{%- endfor %}"
    "<|eom_id|>{%- else %}{{ m.content }}<|eot_id|>{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{%- endif %}")

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 6}}, "required": ["zone"],
    "additionalProperties": False}}}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "pets": {"type": "array", "items": {"enum": ["cat", "dog"]},
                                                    "maxItems": 3}},
          "required": ["name", "age", "pets"], "additionalProperties": False}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _model(path, template):
    tok = byte_tokenizer()
    tok.chat_template = template
    return make_tiny_model(path, seed=7, tokenizer=tok, max_position_embeddings=2048)


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    with live_server(_model(tmp_path_factory.mktemp("tools") / "tiny", HERMES),
                     EngineConfig(max_num_seqs=8, kv_cache_memory=4 << 20)) as live:
        yield live


def _streamed(c, **kw) -> tuple[str, list[dict], str | None, str]:
    """(content, calls, finish_reason, reasoning) accumulated from a stream's deltas, as OpenAI's clients do."""
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in c.chat.completions.create(model="tiny", stream=True, **kw):
        ch = chunk.choices[0]
        d = ch.delta
        content += d.content or ""
        reasoning += (d.model_extra or {}).get("reasoning_content") or ""
        for tc in d.tool_calls or []:
            slot = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            slot["id"] = tc.id or slot["id"]
            slot["name"] += tc.function.name or ""
            slot["arguments"] += tc.function.arguments or ""
        finish = ch.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish, reasoning


def _valid(schema: dict, value) -> bool:
    return jsonschema.Draft202012Validator(schema).is_valid(value)


def test_forced_tool_calls_parse_and_validate(srv):
    c = srv.client()
    named = {"type": "function", "function": {"name": "get_weather"}}

    def sampled(seed):
        return c.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER, TIME], tool_choice=named,
                                         max_tokens=120, seed=seed)

    with ThreadPoolExecutor(3) as pool:  # sampled, in one batch: each answer differs, each is a call that validates
        answers = list(pool.map(sampled, range(3)))
    for r in answers:
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls"
        assert ch.message.content is None
        (call,) = ch.message.tool_calls
        assert call.type == "function"
        assert call.function.name == "get_weather"
        assert call.id.startswith("call_")
        assert _valid(WEATHER["function"]["parameters"], json.loads(call.function.arguments))
    # greedy: the stream's accumulated deltas are the whole answer's call
    kw = dict(messages=ASK, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False, max_tokens=120,
              temperature=0)
    with ThreadPoolExecutor(2) as pool:
        streamed = pool.submit(_streamed, c, **kw)
        whole = c.chat.completions.create(model="tiny", **kw).choices[0]
        content, calls, finish, _ = streamed.result()
    assert finish == whole.finish_reason == "tool_calls"
    assert content == ""
    assert [(x["name"], json.loads(x["arguments"])) for x in calls] == [
        (t.function.name, json.loads(t.function.arguments)) for t in whole.message.tool_calls]
    fn = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    assert _valid(fn[calls[0]["name"]], json.loads(calls[0]["arguments"]))
    # the call goes back into the conversation: the template renders it and the tool's answer
    back = ASK + [whole.message.model_dump(exclude_none=True),
                  {"role": "tool", "tool_call_id": whole.message.tool_calls[0].id, "content": "sunny"}]
    r = c.chat.completions.create(model="tiny", messages=back, tools=[WEATHER], tool_choice="none", max_tokens=4)
    assert r.choices[0].message.tool_calls is None


def test_json_schema_and_json_object(srv):
    c = srv.client()
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}

    def sampled(seed):
        return c.chat.completions.create(model="tiny", messages=ASK, response_format=fmt, max_tokens=120, seed=seed)

    with ThreadPoolExecutor(3) as pool:
        streamed = pool.submit(_streamed, c, messages=ASK, response_format=fmt, max_tokens=120, seed=11)
        for r in pool.map(sampled, range(2)):
            assert r.choices[0].finish_reason == "stop"
            assert _valid(PERSON, json.loads(r.choices[0].message.content))
        content, calls, finish, _ = streamed.result()
    assert finish == "stop"
    assert not calls
    assert _valid(PERSON, json.loads(content))
    r = c.chat.completions.create(model="tiny", messages=ASK, response_format={"type": "json_object"},
                                  max_tokens=60, temperature=0)
    ch = r.choices[0]
    if ch.finish_reason == "stop":  # an object the random model closes within the budget
        assert isinstance(json.loads(ch.message.content), dict)
    else:
        assert ch.message.content.startswith("{")


def test_bad_tool_and_schema_input_is_one_line_400(srv):
    def post(**body):
        r = httpx.post(f"{srv.url}/v1/chat/completions", json={"model": "tiny", "messages": ASK, "max_tokens": 4,
                                                               **body}, timeout=30)
        return r.status_code, r.json().get("error", r.json())

    def tool(params):
        return [{"type": "function", "function": {"name": "f", "parameters": params}}]

    deep = {}
    for _ in range(300):
        deep = {"type": "object", "properties": {"a": deep}}
    cases = {
        "not a JSON Schema": dict(tools=tool({"type": "nonsense"})),
        "parameters not an object": dict(tools=tool(5)),
        "nested past the parser's depth": dict(tools=tool(deep)),
        "a schema that only refers to itself": dict(response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"$ref": "#"}}}),
        "a 1 MB schema": dict(tools=tool({"type": "object", "description": "x" * (1 << 20)})),
        "rejected by the grammar library": dict(response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"not": {"type": "string"}}}}),
        "tool_choice naming an absent function": dict(tools=[WEATHER], tool_choice={
            "type": "function", "function": {"name": "nope"}}),
        "tool_choice without tools": dict(tool_choice="required"),
        "a remote $ref": dict(response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"$ref": "http://example.com/s.json"}}}),
    }
    for why, body in cases.items():
        status, err = post(**body)
        assert status == 400, (why, err)
        assert err["type"] == "invalid_request_error", (why, err)
        assert err["message"], (why, err)
        assert "\n" not in err["message"], (why, err)
    # a grammar that cannot compile within --grammar-timeout: a 400 too
    limits = srv.fe.limits
    srv.fe.limits = type(limits)(**{**limits.__dict__, "grammar_timeout": 1e-6})
    try:
        wide = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(1500)}}
        status, err = post(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": wide}})
        assert status == 400
        assert "--grammar-timeout" in err["message"]
    finally:
        srv.fe.limits = limits
    r = srv.client().chat.completions.create(model="tiny", messages=ASK, max_tokens=3)  # still serving
    assert r.choices[0].finish_reason in ("stop", "length")


def test_no_tool_support_and_reasoning(tmp_path):
    from helpers import CHATML

    with live_server(_model(tmp_path / "plain", CHATML), EngineConfig(kv_cache_memory=2 << 20)) as live:
        with pytest.raises(openai.BadRequestError, match="tool"):
            live.client().chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], max_tokens=4)
        assert live.client().chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], tool_choice="none",
                                                     max_tokens=2).choices[0].message.content is not None
    # a template that opens a thinking block: what the model writes before </think> is reasoning_content, not content
    think = _model(tmp_path / "think", THINKING)
    prompt = load_tokenizer(think).apply_chat_template(ASK, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<think>\n")
    with live_server(think, EngineConfig(kv_cache_memory=2 << 20)) as live:
        c = live.client()
        plain = c.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
        r = c.chat.completions.create(model="tiny", messages=ASK, max_tokens=12, temperature=0)
        msg = r.choices[0].message
        assert "</think>" not in plain.choices[0].text  # the random model never closes it within 12 tokens
        assert msg.content in ("", None)
        assert msg.model_extra["reasoning_content"] == plain.choices[0].text.strip()
        content, _, _, reasoning = _streamed(c, messages=ASK, max_tokens=12, temperature=0)
        assert content == ""
        assert reasoning == plain.choices[0].text.strip()


# each family's template, its special tokens (the format's markers among them) and its end-of-turn tokens
FAMILY_FORMATS = {
    "harmony": (HARMONY_CHAT, OutputFormat(HARMONY, None).markers, ("<|return|>", "<|call|>")),
    "mistral": (MISTRAL_CHAT, ("[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[INST]", "[/INST]", "[TOOL_CALLS]",
                               "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "</s>"), ("</s>",)),
    "mistral_args": (MISTRAL_ARGS_CHAT, ("[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[INST]", "[/INST]",
                                         "[TOOL_CALLS]", "[ARGS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "</s>"),
                     ("</s>",)),
    "llama3_json": (LLAMA3_CHAT, ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
                                  "<|python_tag|>"), ("<|eot_id|>", "<|eom_id|>")),
}


@pytest.mark.parametrize("family", FAMILY_FORMATS)
def test_family_tool_calls(tmp_path, family):
    """Each family's call format, declared by its template (GPT-OSS's harmony, Mistral's [TOOL_CALLS] JSON and
    [ARGS] forms, Llama 3.1's bare JSON), its markers special tokens as in the real tokenizers: a forced call (the
    grammar writes the family's form) comes back as tool_calls, streamed the same, and renders back into the
    conversation through the family's template (Mistral's checks the call id's form)."""
    template, specials, ends = FAMILY_FORMATS[family]
    tok = byte_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": list(specials)})
    tok.chat_template = template
    assert output_format_for(template).tools.name == family   # declared by the template, read from it
    path = make_tiny_model(tmp_path / "m", seed=7, tokenizer=tok, max_position_embeddings=2048,
                           eos_token_id=tok.convert_tokens_to_ids(list(ends)))
    with live_server(path, EngineConfig(kv_cache_memory=2 << 20)) as live:
        c = live.client()
        kw = dict(messages=ASK, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False,
                  max_tokens=120, temperature=0)   # one call: a random model may repeat calls past any budget
        whole = c.chat.completions.create(model="tiny", **kw).choices[0]
        content, calls, finish, _ = _streamed(c, **kw)
        assert whole.finish_reason == finish == "tool_calls"
        assert whole.message.content is None
        (call,) = whole.message.tool_calls
        args = json.loads(call.function.arguments)
        fn = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
        assert _valid(fn[call.function.name], args)
        assert (content, [(x["name"], json.loads(x["arguments"])) for x in calls]) == ("", [(call.function.name, args)])
        back = ASK + [whole.message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
        r = c.chat.completions.create(model="tiny", messages=back, tools=[WEATHER], tool_choice="none", max_tokens=4)
        assert r.choices[0].message.tool_calls is None
