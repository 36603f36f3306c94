"""models.tool_calls: each family's calls and thinking read from text, a stream cut anywhere reading as the whole,
formats found from template markers, and each format's call grammar (llguidance) producing calls its parser reads."""

from __future__ import annotations

import json
import random

import pytest
import torch

from llmq.models.tool_calls import OutputFormat, output_format_for
from llmq.models.tool_formats import HARMONY, HARMONY_REASONING, HERMES, LLAMA3_JSON, MISTRAL, MISTRAL_ARGS, REASONINGS

TEXTS = {
    OutputFormat(HERMES, REASONINGS[0]): (
        '<think>\nweigh it\n</think>\n\nSure.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "g", "arguments": "{\\"b\\": [2]}"}\n</tool_call>',
        "Sure.", [("f", {"a": 1}), ("g", {"b": [2]})], "weigh it"),
    OutputFormat(LLAMA3_JSON, None): (
        ' {"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}', None,
        [("f", {"a": 1}), ("g", {})], None),
    OutputFormat(MISTRAL, None): (
        'ok [TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]', "ok",
        [("f", {"a": 1}), ("g", {})], None),
    OutputFormat(MISTRAL_ARGS, REASONINGS[1]): (
        '[THINK]hm[/THINK]ok[TOOL_CALLS]f[ARGS]{"a": 1}[TOOL_CALLS]g[ARGS]{}', "ok",
        [("f", {"a": 1}), ("g", {})], "hm"),
    # what GPT-OSS writes after its generation prompt: thinking, a preamble, a call (recipient after the channel)
    OutputFormat(HARMONY, HARMONY_REASONING): (
        '<|channel|>analysis<|message|>weigh it<|end|><|start|>assistant<|channel|>commentary<|message|>Sure.'
        '<|end|><|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"a": 1}<|call|>',
        "Sure.", [("f", {"a": 1})], "weigh it"),
}


@pytest.mark.parametrize("fmt", list(TEXTS), ids=lambda f: f.tools.name)
def test_parse_and_stream_agree(fmt):
    text, content, calls, reasoning = TEXTS[fmt]
    p = fmt.parse(text)
    assert (p.content, [(c.name, c.arguments) for c in p.tool_calls], p.reasoning) == (content, calls, reasoning)
    rng = random.Random(0)
    for _ in range(20):  # the same answer fed in random pieces
        cuts = sorted(rng.sample(range(1, len(text)), 6))
        s = fmt.stream()
        deltas = [d for a, b in zip([0, *cuts], [*cuts, len(text)]) for d in s.feed(text[a:b])] + s.feed("", True)
        assert "".join(d.text for d in deltas if d.kind == "content") == (content or "")
        assert [(d.call.name, d.call.arguments) for d in deltas if d.kind == "tool_call"] == calls


def test_unparseable_calls_and_open_thinking():
    fmt = OutputFormat(HERMES, REASONINGS[0])
    p = fmt.parse('<tool_call>\n{"name": "f", "arguments": {"a": ')
    assert p.unparseable == 1
    assert p.tool_calls[0].name == "f"
    assert p.tool_calls[0].arguments is None
    assert fmt.parse("a <tool", tools=True).content == "a <tool"
    assert fmt.parse('<tool_call>{"name": "f", "arguments": {}}</tool_call>', tools=False).tool_calls == []
    p = fmt.parse("still thinking", in_reasoning=True)
    assert (p.content, p.reasoning, p.reasoning_closed) == (None, "still thinking", False)
    assert fmt.opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not fmt.opens_reasoning("<think></think>")


def test_harmony_messages():
    """Harmony's other shapes: the recipient before the channel (as GPT-OSS's template writes a call into the
    history), a final answer, an analysis that never ends, text off the format, a call whose JSON breaks."""
    fmt = OutputFormat(HARMONY, HARMONY_REASONING)
    p = fmt.parse(' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Oslo"}')
    assert ([(c.name, c.arguments) for c in p.tool_calls], p.content, p.reasoning) == (
        [("get_weather", {"city": "Oslo"})], None, None)
    p = fmt.parse("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>final<|message|>4<|return|>")
    assert (p.content, p.reasoning, p.reasoning_closed) == ("4", "a", True)
    p = fmt.parse("<|channel|>analysis<|message|>still going")
    assert (p.content, p.reasoning, p.reasoning_closed) == (None, "still going", False)
    assert fmt.parse("plain words <|end|>").content == "plain words <|end|>"
    # running on into the user's turn: that message is content, header and all (what a leak check sees)
    p = fmt.parse("<|channel|>final<|message|>4<|end|><|start|>user<|message|>and 5?")
    assert p.content == "4<|start|>user<|message|>and 5?"
    p = fmt.parse('<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"a": ')
    assert (p.unparseable, p.tool_calls[0].name) == (1, "f")
    p = fmt.parse('<|channel|>commentary to=functions.f<|message|>[1]<|call|>')
    assert p.tool_calls[0].error == "the call's arguments are not a JSON object"
    # tools not read: the call's message is content; thinking is still split off
    p = fmt.parse('<|channel|>analysis<|message|>x<|end|><|channel|>commentary to=functions.f<|message|>{}',
                  tools=False)
    assert (p.tool_calls, p.content, p.reasoning) == ([], "{}", "x")
    assert not fmt.opens_reasoning("<|start|>assistant<|channel|>analysis<|message|>x<|end|><|start|>assistant")
    assert {"<|call|>", "<|constrain|>"} <= set(fmt.markers)


def test_formats_from_template_markers():
    assert output_format_for("{{ '<tool_call>' }}{{ '<think>' }}{{ '</think>' }}") == OutputFormat(
        HERMES, REASONINGS[0])
    assert output_format_for("[AVAILABLE_TOOLS][TOOL_CALLS][ARGS]").tools is MISTRAL_ARGS
    assert output_format_for("<|python_tag|>").tools is LLAMA3_JSON
    assert output_format_for("{{ '<|start|>assistant<|channel|>final<|message|>' }}") == OutputFormat(
        HARMONY, HARMONY_REASONING)
    assert output_format_for("{{ m.content }}") == OutputFormat(None, None)


@pytest.mark.parametrize("tf", [HERMES, LLAMA3_JSON, MISTRAL, MISTRAL_ARGS, HARMONY], ids=lambda f: f.name)
def test_call_grammar_writes_what_the_parser_reads(tf):
    """Random logits under each format's grammar (the marker a special token where the format's is) parse into calls
    of the given tools whose arguments satisfy their schemas."""
    import jsonschema
    from helpers import byte_tokenizer

    from llmq.runtime.grammar import Grammars, advance, constrain

    tok = byte_tokenizer()
    harmony = OutputFormat(HARMONY, None).markers
    tok.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]", "[ARGS]", *harmony]})
    special = {t.content: i for i, t in tok.added_tokens_decoder.items() if t.special}
    tools = [{"type": "function", "function": {"name": n, "parameters": {
        "type": "object", "properties": {"x": {"enum": ["a", "bc"]}, "n": {"type": "integer", "minimum": 0,
                                                                          "maximum": 9}},
        "required": ["x", "n"], "additionalProperties": False}}} for n in ("f", "g")]
    fmt = OutputFormat(tf, None)
    g = Grammars(tok, 320, {tok.eos_token_id})
    for seed in range(3):
        m = g.lark(fmt.call_grammar(tools, parallel=True, token=special.get)).claim()
        gen, ids = torch.Generator().manual_seed(seed), []
        while len(ids) < 400:
            t = int(constrain(torch.randn(1, 320, generator=gen), [m]).argmax())
            if t == tok.eos_token_id:
                break
            advance(m, t)
            ids.append(t)
        p = fmt.parse(tok.decode(ids, skip_special_tokens=False))
        assert p.tool_calls
        assert p.unparseable == 0
        assert p.content is None
        for c in p.tool_calls:
            assert c.name in ("f", "g")
            jsonschema.validate(c.arguments, tools[0]["function"]["parameters"])
        assert json.dumps(p.tool_calls[0].arguments)
