"""The Berkeley Function Calling Leaderboard's questions (BFCL v4), from the `bfcl-eval` wheel on PyPI (Apache-2.0).

The wheel is fetched once with `pip download --no-deps` and checked against its pinned sha256, like the default
model's package (models/default.py): its own dependency pins (numpy==1.26.4, a dozen vendor SDKs) rule it out as a
dependency, and only its data files are read, straight from the wheel. Every single-turn Python category with an
AST-checkable answer or a relevance rule is used; the function documents keep BFCL's own type names (dict, float,
tuple, any), which the scorer reads (ast_match.py), and `tool_schema` turns them into the JSON Schema a chat
template's `tools` carry.
"""

from __future__ import annotations

import copy
import json
import random
import tempfile
import zipfile
from pathlib import Path

from ...errors import LlmqError
from ...models.default import Wheel, cache_dir, download_wheels

WHEEL = Wheel("bfcl-eval", "2026.3.23", "bfcl_eval-2026.3.23-py3-none-any.whl",
              "3bb6dfa5f0c68ad403c9ec50b00db2bb3b4cc9b38ab1ff33f48fe30d853d3a0a")
# llmq's category name -> BFCL's file stem; answers: whether BFCL ships possible answers (the others are judged by
# whether a call is made at all)
CATEGORIES = {"simple": "simple_python", "multiple": "multiple", "parallel": "parallel",
              "parallel_multiple": "parallel_multiple", "irrelevance": "irrelevance", "live_simple": "live_simple",
              "live_multiple": "live_multiple", "live_parallel": "live_parallel",
              "live_parallel_multiple": "live_parallel_multiple", "live_irrelevance": "live_irrelevance",
              "live_relevance": "live_relevance"}
NO_ANSWER = ("irrelevance", "live_irrelevance", "live_relevance")
# BFCL's Python type names -> JSON Schema's
SCHEMA_TYPES = {"dict": "object", "float": "number", "tuple": "array", "any": "string", "integer": "integer",
                "string": "string", "boolean": "boolean", "array": "array", "object": "object", "number": "number"}
LANGUAGE_HINT = " The function is written in Python 3 syntax."


def wheel_path() -> Path:
    """The pinned bfcl-eval wheel in llmq's cache, fetched on first use (a one-line LlmqError without PyPI)."""
    target = cache_dir() / "bfcl-eval" / WHEEL.filename
    if target.is_file():
        from ...artifacts import sha256_file

        if sha256_file(target) == WHEEL.sha256:
            return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        (got,) = download_wheels((WHEEL,), "the tools task's data (BFCL v4)", Path(tmp))
        got.replace(target)
    return target


def _read_jsonl(z: zipfile.ZipFile, member: str) -> list[dict]:
    try:
        text = z.read(member).decode("utf-8")
    except KeyError:
        raise LlmqError(f"{WHEEL.filename} has no {member}") from None
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def category_rows(seed: int) -> dict[str, list[dict]]:
    """{category: rows}, each row {"id", "messages", "functions", "answer"} (answer: BFCL's possible answers, a list
    of {function: {parameter: [allowed values]}}, or None), shuffled with `seed` so any prefix samples the whole
    category (BFCL's files run topic by topic)."""
    out = {}
    with zipfile.ZipFile(wheel_path()) as z:
        for cat, stem in CATEGORIES.items():
            questions = _read_jsonl(z, f"bfcl_eval/data/BFCL_v4_{stem}.json")
            answer_file = f"bfcl_eval/data/possible_answer/BFCL_v4_{stem}.json"
            answers = {} if cat in NO_ANSWER else {r["id"]: r["ground_truth"] for r in _read_jsonl(z, answer_file)}
            rows = []
            for q in questions:
                if len(q["question"]) != 1:  # a multi-turn entry: not an AST category's
                    continue
                if cat not in NO_ANSWER and q["id"] not in answers:
                    raise LlmqError(f"{WHEEL.filename}: {q['id']} has no possible answer")
                rows.append({"id": q["id"], "messages": q["question"][0], "functions": q["function"],
                             "answer": answers.get(q["id"])})
            random.Random(f"bfcl-{cat}-{seed}").shuffle(rows)
            out[cat] = rows
    return out


def _schema(p: dict) -> dict:
    """One BFCL parameter document as JSON Schema (its own type names mapped, nested ones too)."""
    p = dict(p)
    p["type"] = SCHEMA_TYPES.get(p.get("type"), "string")
    if isinstance(p.get("properties"), dict):
        p["properties"] = {k: _schema(v) for k, v in p["properties"].items()}
    if isinstance(p.get("items"), dict):
        p["items"] = _schema(p["items"])
    return p


def tool_schema(function: dict) -> dict:
    """A BFCL function document as an OpenAI tool ({"type": "function", "function": {...}}), the way a chat template's
    `tools` take it: JSON Schema types, the language hint BFCL adds to a Python function's description."""
    fn = copy.deepcopy(function)
    fn["description"] = fn.get("description", "") + LANGUAGE_HINT
    fn["parameters"] = {**_schema(fn.get("parameters") or {"properties": {}}), "type": "object"}
    return {"type": "function", "function": fn}
