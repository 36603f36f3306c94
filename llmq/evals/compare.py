"""Scores with standard errors, deltas against a baseline with 95% confidence intervals, and group scores.

Conventions (the report and the gates use exactly these):
- Accuracy-type scores (acc, acc_norm, exact_match, pass@1) are in points: percentage points, 0..100.
- A delta is evaluated minus baseline. For accuracy-type scores higher is better, so a quantization loss is a
  negative delta. For bits/byte and perplexity lower is better, so a loss is a positive delta.
- A group score (`math`, `code`, `tools`, ...) is the unweighted mean, in points, of the accuracy-type primary
  metrics (higher is better) of the group's tasks that ran; its standard error treats the tasks as independent:
  sqrt(sum se_i^2) / k.
- A delta's standard error is sqrt(se_eval^2 + se_base^2) (independent runs, conservative for paired items);
  its 95% interval is delta +- 1.96 se.
"""

from __future__ import annotations

import math

Z95 = 1.959963984540054


def mean_stderr(values: list[float]) -> tuple[float, float]:
    """Mean and its standard error (sample standard deviation, ddof=1, over sqrt(n))."""
    n = len(values)
    if n == 0:
        return float("nan"), float("nan")
    m = sum(values) / n
    if n == 1:
        return m, float("nan")
    var = sum((v - m) ** 2 for v in values) / (n - 1)
    return m, math.sqrt(var / n)


def ratio_stderr(x: list[float], y: list[float]) -> tuple[float, float]:
    """sum(x)/sum(y) and its standard error over documents (delta method for a ratio estimator)."""
    n, sx, sy = len(x), sum(x), sum(y)
    r = sx / sy
    if n < 2:
        return r, float("nan")
    ybar = sy / n
    resid = sum((xi - r * yi) ** 2 for xi, yi in zip(x, y)) / (n - 1)
    return r, math.sqrt(resid / n) / ybar


def delta(ev: dict, base: dict) -> dict:
    d = ev["value"] - base["value"]
    se = math.sqrt(_sq(ev.get("stderr")) + _sq(base.get("stderr")))
    return {"delta": d, "stderr": se, "ci95": [d - Z95 * se, d + Z95 * se],
            "higher_is_better": ev.get("higher_is_better", True), "unit": ev.get("unit")}


def _sq(x) -> float:
    return 0.0 if x is None or (isinstance(x, float) and math.isnan(x)) else float(x) ** 2


def group_scores(tasks: dict[str, dict], groups: dict[str, tuple[str, ...]]) -> dict[str, dict]:
    out = {}
    for g, members in groups.items():
        got = [tasks[t] for t in members if t in tasks and tasks[t].get("unit") == "points"
               and tasks[t].get("higher_is_better", True)]
        if not got:
            continue
        k = len(got)
        se = math.sqrt(sum(_sq(t.get("stderr")) for t in got)) / k
        out[g] = {"value": sum(t["value"] for t in got) / k, "stderr": se, "unit": "points",
                  "higher_is_better": True, "tasks": [t["task"] for t in got]}
    return out


def compare(ev: dict, base: dict) -> dict:
    """Deltas for every task, group and extra score present in both result sets."""
    out = {}
    for section in ("groups", "tasks"):
        for name, s in ev.get(section, {}).items():
            b = base.get(section, {}).get(name)
            if b is not None:
                out[name] = delta(s, b)
    return out
