"""The tools / json / chat eval tasks: BFCL's AST-match rules, JSON scoring, role-header leaks, the runner end to end
(a scripted LM and a tiny model), gates, and an endpoint answering as in-process."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from helpers import byte_tokenizer, make_tiny_model

from llmq.artifacts import Store
from llmq.cli.main import cli
from llmq.errors import LlmqError
from llmq.evals.chat import leaks, role_headers, run_chat_tasks
from llmq.evals.lm import EvalLM, Generation
from llmq.evals.tasks import json_task
from llmq.evals.tasks.ast_match import ast_match, call_matches
from llmq.models import resolve_model

FN = {"name": "area", "parameters": {"type": "dict", "required": ["base", "height"], "properties": {
    "base": {"type": "integer"}, "height": {"type": "float"}, "unit": {"type": "string"},
    "tags": {"type": "array", "items": {"type": "string"}}, "opts": {"type": "dict", "properties": {}}}}}
ANS = {"area": {"base": [10], "height": [5.0], "unit": ["square meters", ""], "tags": [["a", "b"], ""],
                "opts": [{"round": [True]}, ""]}}
OTHER = {"name": "volume", "parameters": {"type": "dict", "required": ["side"], "properties": {
    "side": {"type": "integer"}}}}


def test_ast_match_follows_bfcls_rules():
    ok = ("area", {"base": 10, "height": 5.0})
    assert call_matches(FN, ok, ANS)
    assert call_matches(FN, ("area", {"base": 10, "height": 5}), ANS)  # an integer passes for a float
    assert not call_matches(FN, ("area", {"base": 10.0, "height": 5.0}), ANS)  # not a float for an integer
    assert not call_matches(FN, ("area", {"base": True, "height": 5.0}), ANS)  # a bool is not an integer
    assert not call_matches(FN, ("area", {"base": 10}), ANS)  # a required parameter missing
    assert not call_matches(FN, ("area", {"base": 11, "height": 5.0}), ANS)
    assert not call_matches(FN, ("other", {"base": 10, "height": 5.0}), ANS)
    assert not call_matches(FN, ("area", {"base": 10, "height": 5.0, "color": "red"}), ANS)  # undocumented
    assert call_matches(FN, ("area", {"base": 10, "height": 5.0, "unit": "Square-Meters."}), ANS)  # normalized
    assert not call_matches(FN, ("area", {"base": 10, "height": 5.0, "unit": "square feet"}), ANS)
    assert call_matches(FN, ("area", {"base": 10, "height": 5.0, "tags": ["A", "b"]}), ANS)
    assert not call_matches(FN, ("area", {"base": 10, "height": 5.0, "tags": ["b", "a"]}), ANS)  # lists in order
    assert call_matches(FN, ("area", {"base": 10, "height": 5.0, "opts": {"round": True}}), ANS)
    assert not call_matches(FN, ("area", {"base": 10, "height": 5.0, "opts": {"round": False}}), ANS)
    strict = {"area": {**ANS["area"], "unit": ["square meters"]}}  # no "": not optional
    assert not call_matches(FN, ok, strict)
    variable = {"area": {"base": ["b"], "height": [5.0]}}  # BFCL writes a variable's name where a value goes
    assert call_matches(FN, ("area", {"base": "b", "height": 5.0}), variable)
    assert not call_matches(FN, ("area", {"base": "B", "height": 5.0}), variable)  # compared as it is

    two = [{"area": {"base": [1], "height": [2.0]}}, {"area": {"base": [3], "height": [4.0]}}]
    c1, c2 = ("area", {"base": 1, "height": 2.0}), ("area", {"base": 3, "height": 4.0})
    assert ast_match("parallel", [FN], [c2, c1], two)  # any order
    assert not ast_match("parallel", [FN], [c1, c1], two)
    assert not ast_match("parallel", [FN], [c1], two)
    assert ast_match("multiple", [OTHER, FN], [ok], [ANS])
    assert not ast_match("simple", [FN], [ok, ok], [ANS])
    assert not ast_match("simple", [FN], None, [ANS])  # calls that did not parse
    assert ast_match("irrelevance", [FN], [], None)
    assert ast_match("live_irrelevance", [FN], None, None)
    assert not ast_match("irrelevance", [FN], [ok], None)
    assert ast_match("live_relevance", [FN], [ok], None)
    assert not ast_match("live_relevance", [FN], [], None)


def test_json_scoring():
    row = {"schema": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                                       "tags": {"type": "array", "items": {"type": "string"}}},
                      "required": ["name", "age"], "additionalProperties": False},
           "expected": {"name": "Ana Silva", "age": 30, "tags": ["x", "y"]}}
    assert json_task.score(row, '```json\n{"name": "ana  silva", "age": 30, "tags": ["y", "x"]}\n```') == \
        {"valid": 1.0, "fields": 1.0}
    assert json_task.score(row, 'Sure: {"name": "Ana Silva", "age": "30"}') == {"valid": 0.0, "fields": 1 / 3}
    assert json_task.score(row, '{"name": "Ana Silva", "age": 30, "extra": 1}')["valid"] == 0.0
    assert json_task.score(row, "no JSON here {") == {"valid": 0.0, "fields": 0.0}
    assert json_task.score(row, '{"age": 30.0, "name": "Ana Silva", "tags": ["x"]}')["fields"] == pytest.approx(2 / 3)


def test_role_headers_come_from_the_template():
    tok = byte_tokenizer()
    heads = role_headers(tok)
    assert "<|im_end|>\n<|im_start|>user" in heads
    assert "user" in heads
    assert "assistant" in heads
    assert leaks("Paris.<|im_start|>user\nAnd Rome?", heads)
    assert leaks("Paris.\nuser\nAnd Rome?", heads)  # the header as a server returns it, specials skipped
    assert not leaks("The user asked about Paris; the assistant answered.", heads)


def pick(v):
    """A value BFCL's possible answers allow: an object's (or a list of objects') own first allowed values."""
    if isinstance(v, dict):
        return {k: pick(a[0]) if isinstance(a, list) else a for k, a in v.items()
                if not isinstance(a, list) or (a and a[0] != "")}
    if isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
        return [pick(x) for x in v]
    return v


class ScriptedLM(EvalLM):
    """Answers each prompt by `answer(prompt text)`, ended or not; `skipped`: whether it was asked to leave special
    tokens out of its answers."""

    def __init__(self, answer, max_length: int = 100_000, tokenizer=None):
        super().__init__(tokenizer or byte_tokenizer(), max_length)
        self.answer = answer
        self.skipped = None

    def generate_ids(self, prompts, max_tokens, stops, temperatures, skip_special=True):
        self.skipped = skip_special
        return [Generation(*self.answer(self.tokenizer.decode(p))) for p in prompts]


def _plan(tasks: list[str], limit: int):
    from llmq.evals.runner import EvalSettings, plan

    s = EvalSettings(tasks=tasks, limit=limit)
    return s, plan(s)


def test_right_answers_score_100_and_broken_calls_are_counted(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMQ_CACHE", str(tmp_path / "cache"))
    s, ts = _plan(["tools", "json", "chat"], 2)
    assert ts.info["tools_data"].startswith("bfcl-eval==")
    rows = {}
    for f in ts.include_path.glob("*.jsonl"):
        if f.name.startswith(("tools_", "json_tasks")):
            for r in map(json.loads, f.read_text().splitlines()[:2]):
                rows[r["text"] if "text" in r else r["messages"][-1]["content"]] = r

    def right(prompt: str):
        keys = [k for k in rows if k in prompt]
        if not keys:  # a chat prompt: end the turn
            return "Sure.", True
        key = max(keys, key=len)
        r = rows[key]
        if "expected" in r:
            return json.dumps(r["expected"]), True
        if not r["answer"]:
            calls = [{"name": r["functions"][0]["name"], "arguments": {}}] if "live_relevance" in r["id"] else []
            return "".join(f"<tool_call>\n{json.dumps(c)}\n</tool_call>" for c in calls) or "I cannot.", True
        calls = [{"name": n, "arguments": {p: pick(v[0]) for p, v in a.items() if v[0] != ""}}
                 for ans in r["answer"] for n, a in ans.items()]
        return "".join(f"<tool_call>\n{json.dumps(c)}\n</tool_call>\n" for c in calls), True

    samples: list = []
    out = run_chat_tasks(ScriptedLM(right), ts, s.lm_tasks, 2, samples)
    for name, score in out.items():
        want = 0.0 if name == "llmq_tools_unparsed" else 100.0
        assert score["value"] == want, (name, [x for x in samples if not x.get("verdict", True)][:1])
    assert out["llmq_tools_simple"]["tools_prompt"].startswith("system prompt")  # CHATML declares no tools
    assert "llmq_chat_think" not in out
    assert out["llmq_chat_end"]["n"] == 2
    assert {x["source"] for x in samples} >= {"json", "chat", "tools:simple", "tools:live_irrelevance"}

    def broken(prompt: str):
        if "<tools>" in prompt:
            return '<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>', False  # a brace short
        return "{}<|im_start|>user\nmore", False

    out = run_chat_tasks(ScriptedLM(broken), ts, s.lm_tasks, 2)
    assert out["llmq_tools_unparsed"]["value"] == 100.0
    assert out["llmq_tools_unparsed"]["calls"] > 0
    assert out["llmq_tools_simple"]["value"] == 0.0
    assert out["llmq_tools_irrelevance"]["value"] == 100.0
    assert out["llmq_chat_end"]["value"] == 0.0
    assert out["llmq_chat_leak"]["value"] == 0.0
    assert out["llmq_json_valid"]["value"] == 0.0
    short = run_chat_tasks(ScriptedLM(right, max_length=600), ts, ["llmq_tools_live_multiple"], 2)
    assert not short  # every prompt longer than the context: left out, no score


def test_harmony_answers_are_read_with_their_markers(tmp_path, monkeypatch):
    """A harmony template (GPT-OSS's format): the answers are asked for with special tokens kept, thinking on the
    analysis channel is split off (and counted closed), a call message is a call, and the answer's own markers are
    no leak where another role's turn is."""
    from test_server_tools import HARMONY_CHAT

    from llmq.models.tool_calls import OutputFormat
    from llmq.models.tool_formats import HARMONY

    monkeypatch.setenv("LLMQ_CACHE", str(tmp_path / "cache"))
    tok = byte_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": list(OutputFormat(HARMONY, None).markers)})
    tok.chat_template = HARMONY_CHAT
    _, ts = _plan(["tools", "chat"], 2)
    names = ["llmq_tools_simple", "llmq_chat_end", "llmq_chat_leak", "llmq_chat_think"]
    row = {json.loads(x)["messages"][-1]["content"]: json.loads(x)
           for x in (ts.include_path / "tools_simple.jsonl").read_text().splitlines()[:2]}

    def answer(prompt: str, leak: bool = False):
        think = "<|channel|>analysis<|message|>Let me see.<|end|><|start|>assistant"
        r = next((r for k, r in row.items() if k in prompt), None)
        if r is None:
            return think + "<|channel|>final<|message|>Sure." + ("<|end|><|start|>user<|message|>Hm" * leak), True
        ((name, args),) = r["answer"][0].items()
        call = {p: pick(v[0]) for p, v in args.items() if v[0] != ""}
        return f"{think}<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>{json.dumps(call)}", True

    lm = ScriptedLM(answer, tokenizer=tok)
    out = run_chat_tasks(lm, ts, names, 2)
    assert lm.skipped is False
    assert out["llmq_tools_simple"]["tools_prompt"] == "template"
    for name in names:
        assert out[name]["value"] == 100.0, name
    out = run_chat_tasks(ScriptedLM(lambda p: answer(p, leak=True), tokenizer=tok), ts, ["llmq_chat_leak"], 2)
    assert out["llmq_chat_leak"]["value"] == 0.0


def test_gates_on_the_new_tasks_run_in_the_cli(tmp_path, monkeypatch):
    from test_eval import make_rtn

    from llmq.evals import chat
    from llmq.evals.runner import EvalOptions

    monkeypatch.setenv("LLMQ_CACHE", str(tmp_path / "cache"))
    for budget in ("CHAT_MAX_TOKENS", "TOOLS_MAX_TOKENS"):  # what a gate reads, not what a random model writes
        monkeypatch.setattr(chat, budget, 16)
    monkeypatch.setattr(json_task, "MAX_TOKENS", 16)
    with pytest.raises(LlmqError, match="json is not a score"):
        EvalOptions(tasks=["tools"], gate="tools>=-3,json>=-2").check()
    store = Store(tmp_path / "store")
    base = resolve_model(str(make_tiny_model(tmp_path / "base", seed=0, max_position_embeddings=4096)), store)
    cand = make_rtn(store, base, 4, "tiny-rtn4")
    args = ["--store", str(store.root), "eval", cand.ref, "--tasks", "tools,json,chat", "--limit", "1", "--json",
            "--gate", "tools>=-100,json>=-100,chat>=-100,llmq_tools_unparsed<=100,chat>0.5"]
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 1, r.output
    assert "gate failed: chat>0.5" in r.output
    assert "tools>=-100" not in r.output.split("gate failed:")[1]
    rep = json.loads(r.output[r.output.index("{"):r.output.rindex("}") + 1])
    assert {"tools", "json", "chat"} <= set(rep["deltas"])
    assert rep["deltas"]["chat"]["ci95"][0] <= 0
    assert rep["scores"]["tasks"]["llmq_chat_end"]["n"] == 1


def test_an_endpoint_answers_the_chat_tasks_as_in_process(tmp_path, monkeypatch):
    """On a harmony template, whose markers are special tokens: both ask for them kept in the answers' text
    (skip_special_tokens false through the endpoint) and read the same."""
    from helpers import live_server
    from test_server_tools import HARMONY_CHAT

    from llmq.evals.endpoint import EndpointLM
    from llmq.evals.evaluate import Served
    from llmq.evals.lm import LlmqLM
    from llmq.runtime import EngineConfig

    monkeypatch.setenv("LLMQ_CACHE", str(tmp_path / "cache"))
    store = Store(tmp_path / "store")
    tok = byte_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|start|>", "<|channel|>", "<|message|>", "<|end|>"]})
    tok.chat_template = HARMONY_CHAT
    art = resolve_model(str(make_tiny_model(tmp_path / "m", seed=1, tokenizer=tok, max_position_embeddings=4096)),
                        store)
    s, ts = _plan(["json", "chat"], 2)
    cfg = EngineConfig(max_num_seqs=8, kv_cache_memory=16 << 20)
    ours = LlmqLM(art.path, engine_config=cfg)
    with live_server(art.path, cfg, name="tiny") as live:
        served = Served.connect(live.url, None, None, 30.0, store)
        remote = EndpointLM(served.endpoint, ours.tokenizer)
        a, b = [], []
        got = run_chat_tasks(remote, ts, s.lm_tasks, 2, a)
        want = run_chat_tasks(ours, ts, s.lm_tasks, 2, b)
    ours.close()
    assert got == want
    assert [x["text"] for x in a] == [x["text"] for x in b]
    assert any(x["text"] for x in a)
    assert any("<|" in x["text"] for x in a)  # the random model wrote special tokens, and they were kept
    assert [x["ended"] for x in a] == [x["ended"] for x in b]
