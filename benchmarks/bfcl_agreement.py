"""Do llmq's BFCL scores agree with BFCL's own checker on the same model outputs?

llmq scores the `tools` task with BFCL's AST-match rules written in its own code (llmq/evals/tasks/ast_match.py).
This script hands the same decoded calls to both: llmq's `ast_match`, and `bfcl_eval`'s `ast_checker` (irrelevance /
relevance by its `is_empty_output`) running in a separate virtual environment, since bfcl-eval's pins rule it out as
a dependency. Set that up once, outside the repository:

    python3 -m venv /tmp/bfcl/venv && /tmp/bfcl/venv/bin/pip install bfcl-eval==2026.3.23 soundfile

Cases: (1) what a model answers: the model REF (default: the default model) asked each category's first --limit
questions through llmq's tools task, its calls read by models.tool_calls; (2) every question's possible answer written
as calls, and variants of it that the rules must judge (a parameter dropped, a value changed, a type changed, a
string re-cased and re-punctuated, parallel calls reversed, a call added). It prints, per category and case kind,
how many verdicts agree, and every disagreement.

    python benchmarks/bfcl_agreement.py --bfcl-python /tmp/bfcl/venv/bin/python [--model REF] [--limit 5] [--save F]
"""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

CHECKER = r"""
import json, sys
from bfcl_eval.constants.enums import Language
from bfcl_eval.eval_checker.ast_eval.ast_checker import ast_checker
from bfcl_eval.utils import is_empty_output

BFCL_CATEGORY = {"simple": "simple_python"}
out = []
for line in open(sys.argv[1]):
    c = json.loads(line)
    calls = c["calls"]
    decoded = None if calls is None else [{name: args} for name, args in calls]
    if c["answer"] is None:
        made = decoded is not None and not is_empty_output(decoded)
        out.append(not made if "irrelevance" in c["category"] else made)
        continue
    if decoded is None:
        out.append(False)
        continue
    try:
        r = ast_checker(c["functions"], decoded, c["answer"], Language.PYTHON,
                        BFCL_CATEGORY.get(c["category"], c["category"]), "gorilla-openfunctions-v2")
        out.append(bool(r["valid"]))
    except Exception as e:  # the checker itself failing on an input: reported, not judged
        out.append("error: " + type(e).__name__ + ": " + str(e)[:100])
print(json.dumps(out))
"""


def pick(v):
    """A value BFCL's possible answers allow: an object's (or a list of objects') own first allowed values."""
    if isinstance(v, dict):
        return {k: pick(a[0]) if isinstance(a, list) else a for k, a in v.items()
                if not isinstance(a, list) or (a and a[0] != "")}
    if isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
        return [pick(x) for x in v]
    return v


def answer_calls(answer: list[dict]) -> list[tuple[str, dict]]:
    """The possible answer as calls: each parameter's first allowed value, optional ones ("" allowed) left out."""
    calls = []
    for expected in answer:
        (name, params), = expected.items()
        calls.append((name, {p: pick(allowed[0]) for p, allowed in params.items() if allowed and allowed[0] != ""}))
    return calls


def variants(functions: list[dict], answer: list[dict]) -> list[tuple[str, list]]:
    """(kind, calls) that the rules judge in different ways."""
    base = answer_calls(answer)
    out = [("answer", base)]
    name, args = base[0]
    if args:
        p = next(iter(args))
        dropped = copy.deepcopy(base)
        del dropped[0][1][p]
        out.append(("dropped", dropped))
        v = args[p]
        changed = copy.deepcopy(base)
        changed[0][1][p] = (v + 1 if isinstance(v, (int, float)) and not isinstance(v, bool) else
                            (not v) if isinstance(v, bool) else v + "x" if isinstance(v, str) else [])
        out.append(("changed", changed))
        retyped = copy.deepcopy(base)
        retyped[0][1][p] = str(v) if not isinstance(v, str) else (int(v) if v.isdigit() else [v])
        out.append(("retyped", retyped))
        strs = [k for k, x in args.items() if isinstance(x, str)]
        if strs:
            styled = copy.deepcopy(base)
            styled[0][1][strs[0]] = args[strs[0]].upper().replace(" ", "_") + "."
            out.append(("restyled", styled))
        floats = [k for k, x in args.items() if isinstance(x, float) and x == int(x)]
        if floats:
            as_int = copy.deepcopy(base)
            as_int[0][1][floats[0]] = int(args[floats[0]])
            out.append(("int_for_float", as_int))
    out.append(("extra_param", [(name, {**args, "zz_unknown": 1})] + base[1:]))
    if len(base) > 1:
        out.append(("reversed", list(reversed(base))))
    out.append(("extra_call", base + [base[0]]))
    out.append(("wrong_name", [(name + "_x", args)] + base[1:]))
    return out


def model_cases(model: str | None, limit: int) -> list[dict]:
    from llmq.artifacts import Store
    from llmq.evals.chat import run_chat_tasks
    from llmq.evals.lm import LlmqLM
    from llmq.evals.runner import EvalSettings, plan
    from llmq.models import resolve_model

    store = Store(Path(tempfile.mkdtemp(prefix="bfcl-agree-")))
    art = resolve_model(model, store)
    settings = EvalSettings(tasks=["tools"], limit=limit)
    ts = plan(settings)
    lm = LlmqLM(art.path)
    samples: list = []
    try:
        run_chat_tasks(lm, ts, settings.lm_tasks, limit, samples)
    finally:
        lm.close()
    return [{"kind": "model", "category": s["source"].split(":", 1)[1], "functions": s["row"]["functions"],
             "answer": s["row"]["answer"], "calls": s["calls"], "id": s["row"]["id"]} for s in samples]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bfcl-python", required=True, help="python of a venv with bfcl-eval==2026.3.23 installed")
    ap.add_argument("--model", default=None, help="model REF whose answers are checked (default: the default model)")
    ap.add_argument("--limit", type=int, default=5, help="questions per category the model answers (0: no model)")
    ap.add_argument("--save", default=None, help="JSON file keeping the model's cases (read back when it exists)")
    args = ap.parse_args()

    from llmq.evals.tasks.ast_match import ast_match
    from llmq.evals.tasks.bfcl import category_rows

    saved = Path(args.save) if args.save else None
    if saved is not None and saved.is_file():
        cases = json.loads(saved.read_text())
    else:
        cases = model_cases(args.model, args.limit) if args.limit else []
        if saved is not None:
            saved.write_text(json.dumps(cases))
    for cat, rows in category_rows(0).items():
        for r in rows:
            if r["answer"] is None:
                cases.append({"kind": "none", "category": cat, "functions": r["functions"], "answer": None,
                              "calls": [], "id": r["id"]})
                call = (r["functions"][0]["name"] if r["functions"] else "any_function", {})
                cases.append({"kind": "a_call", "category": cat, "functions": r["functions"], "answer": None,
                              "calls": [call], "id": r["id"]})
                continue
            for kind, calls in variants(r["functions"], r["answer"]):
                cases.append({"kind": kind, "category": cat, "functions": r["functions"], "answer": r["answer"],
                              "calls": calls, "id": r["id"]})
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        for c in cases:
            f.write(json.dumps(c) + "\n")
    proc = subprocess.run([args.bfcl_python, "-c", CHECKER, f.name], capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"bfcl's checker failed: {(proc.stderr.strip().splitlines() or ['no output'])[-1]}")
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])
    agree, total, passed = Counter(), Counter(), Counter()
    errors = Counter()
    for c, t in zip(cases, theirs):
        ours = ast_match(c["category"], c["functions"], c["calls"], c["answer"])
        key = (c["category"], "model" if c["kind"] == "model" else "constructed")
        if isinstance(t, str):
            errors[key] += 1
            continue
        total[key] += 1
        passed[key] += int(t)
        if ours == t:
            agree[key] += 1
        else:
            print(f"DISAGREE {c['id']} {c['kind']}: llmq {ours}, bfcl {t}; calls {json.dumps(c['calls'])[:300]}")
    print(f"\n{'category':<24} {'cases':<12} {'n':>6} {'bfcl pass':>9} {'agree':>7} {'checker errors':>14}")
    for key in sorted(total):
        print(f"{key[0]:<24} {key[1]:<12} {total[key]:>6} {passed[key]:>9} {agree[key]:>7} {errors[key]:>14}")
    n, a = sum(total.values()), sum(agree.values())
    print(f"\nall: {a} / {n} verdicts agree ({100.0 * a / max(n, 1):.2f}%); bfcl's checker raised on "
          f"{sum(errors.values())} cases (not counted)")


if __name__ == "__main__":
    main()
