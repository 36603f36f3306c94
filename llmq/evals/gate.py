"""Quality gates: `--gate "math>=-2.0,code>=-2.0,kld<=0.05"`, checked against a finished report.

What a gate name measures (see compare.py for the sign conventions):
- a group (`math`, `code`) or an accuracy-type task name: its delta vs the baseline, in points
  (higher is better: `math>=-2.0` allows at most a 2-point loss);
- `ppl`, `code_bpb` or a bits/byte or perplexity task: its delta vs the baseline (lower is better:
  `ppl<=0.5` allows perplexity to rise by at most 0.5);
- `kld`, `kld_p99`: mean / 99th-percentile KL divergence from the baseline (nats per token), absolute;
- `top1`: top-1 agreement with the baseline in points, absolute.
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass

from ..errors import GateFailed, LlmqError

_OPS = {">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt}
_GATE = re.compile(r"^\s*([A-Za-z0-9_.\-:]+)\s*(>=|<=|>|<)\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*$")
ALIASES = {"ppl": "llmq_ppl", "code_bpb": "llmq_code_bpb"}
KLD_NAMES = {"kld": "mean", "kld_p99": "p99", "top1": "top1"}


@dataclass(frozen=True)
class Gate:
    name: str
    op: str
    threshold: float

    def __str__(self) -> str:
        return f"{self.name}{self.op}{self.threshold:g}"


@dataclass
class GateResult:
    gate: Gate
    value: float | None
    what: str
    passed: bool


def parse_gates(expr: str | None) -> list[Gate]:
    if not expr:
        return []
    gates = []
    for part in expr.split(","):
        if not part.strip():
            continue
        m = _GATE.match(part)
        if not m:
            raise LlmqError(f"bad gate {part.strip()!r}: expected NAME OP NUMBER with OP one of >=, <=, >, < "
                            "(e.g. math>=-2.0)")
        gates.append(Gate(m[1], m[2], float(m[3])))
    if not gates:
        raise LlmqError("--gate is empty")
    return gates


def evaluate_gate(g: Gate, report: dict) -> GateResult:
    if g.name in KLD_NAMES:
        kld = report.get("kld")
        if not kld:
            return GateResult(g, None, "kld was not computed (add kld to --tasks and give a baseline)", False)
        v = kld[KLD_NAMES[g.name]]
        unit = "points" if g.name == "top1" else "nats/token"
        bound = f" (from top-{kld['top_k']} logprobs: a lower bound)" if kld.get("top_k") and g.name != "top1" else ""
        return GateResult(g, v, f"{g.name} = {v:.4g} {unit}{bound}", _OPS[g.op](v, g.threshold))
    name = ALIASES.get(g.name, g.name)
    d = report.get("deltas", {}).get(name)
    if d is None:
        known = sorted(set(report.get("deltas", {})) | set(KLD_NAMES))
        why = "no baseline to compare with" if not report.get("baseline") else \
            f"no such score (have: {', '.join(known)})"
        return GateResult(g, None, f"{g.name}: {why}", False)
    v = d["delta"]
    unit = d.get("unit") or ""
    return GateResult(g, v, f"{g.name} delta = {v:+.4g} {unit} (95% CI {d['ci95'][0]:+.3g}..{d['ci95'][1]:+.3g})",
                      _OPS[g.op](v, g.threshold))


def check_gates(gates: list[Gate], report: dict) -> list[GateResult]:
    return [evaluate_gate(g, report) for g in gates]


def enforce(results: list[GateResult]) -> None:
    """Raise GateFailed (exit 1) naming every failing gate."""
    failed = [r for r in results if not r.passed]
    if failed:
        raise GateFailed("gate failed: " + "; ".join(f"{r.gate} ({r.what})" for r in failed))
