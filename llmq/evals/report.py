"""The eval-report artifact: report.json (scores, standard errors, deltas, settings, seeds, versions) + report.md."""

from __future__ import annotations

import json
import math

from ..artifacts import Artifact, Store

REPORT_JSON = "report.json"
REPORT_MD = "report.md"


def _fmt(v, unit: str | None = None) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    if unit == "points":
        return f"{v:.1f}"
    return f"{v:.4g}" if abs(v) < 1e4 else f"{v:.3e}"


def markdown(report: dict) -> str:
    ev, base = report["evaluated"], report.get("baseline")
    def ref(a: dict) -> str:
        if a.get("kind") == "endpoint":
            return f"{a['name']} at {a['url']}" + (f" ({a['id'][:12]})" if a.get("id") else "")
        return f"{a['name']} ({a['id'][:12]})"

    lines = [f"# llmq eval: {ref(ev)}" + (f" vs {ref(base)}" if base else ""), ""]
    s = report["settings"]
    lines += [f"backend `{s['backend']}`, limit {s['limit']}, seed {s['seed']}, lm-eval {report.get('lm_eval')}, "
              f"task data {report['task_data'].get('fingerprint')} (python {report['task_data'].get('python')})", ""]
    has_base = bool(report.get("baseline_scores"))
    rows = [(g, "mean of " + ", ".join(v["tasks"]), v, "groups") for g, v in report["scores"]["groups"].items()]
    rows += [(t, v["metric"], v, "tasks") for t, v in report["scores"]["tasks"].items()]
    head = "| score | metric | value ± se |" + (" baseline ± se | delta | 95% CI |" if has_base else "")
    if rows:
        lines += [head, "|" + "---|" * (head.count("|") - 1)]
    for name, metric, v, section in rows:
        unit = v.get("unit")
        label = f"**{name}**" if section == "groups" else name
        cell = f"| {label} | {metric} ({unit}) | {_fmt(v['value'], unit)} ± {_fmt(v.get('stderr'), unit)} |"
        if has_base:
            b = report["baseline_scores"].get(section, {}).get(name)
            d = report["deltas"].get(name)
            if b and d:
                cell += (f" {_fmt(b['value'], unit)} ± {_fmt(b.get('stderr'), unit)} | {d['delta']:+.3g} |"
                         f" {d['ci95'][0]:+.3g} .. {d['ci95'][1]:+.3g} |")
            else:
                cell += " – | – | – |"
        lines.append(cell)
    if report.get("kld"):
        k = report["kld"]
        line = (f"KL divergence vs baseline over {k['tokens']} tokens: mean {k['mean']:.4f} ± {k['stderr']:.4f}, "
                f"p99 {k['p99']:.4f}, top-1 agreement {k['top1']:.1f} ± {k['top1_stderr']:.1f} points; ")
        if k.get("top_k"):
            line += f"baseline perplexity {k['ppl_baseline']:.3f}. From top-{k['top_k']} logprobs: {k['exact']}."
        else:
            line += (f"perplexity {k['ppl']:.3f} vs {k['ppl_baseline']:.3f} on the same tokens (exact: full "
                     "distributions).")
        lines += ["", line]
    if report.get("refused"):
        lines += [""] + [f"{r}." for r in report["refused"]]
    if report.get("gates"):
        lines += ["", "| gate | value | result |", "|---|---|---|"]
        lines += [f"| `{g['gate']}` | {g['what']} | {'pass' if g['passed'] else '**FAIL**'} |" for g in report["gates"]]
    lines += ["", "Deltas are evaluated − baseline; accuracy-type scores are in points (higher is better, so a loss "
              "is negative); bits/byte and perplexity are lower-is-better."]
    return "\n".join(lines) + "\n"


def summary_metrics(report: dict) -> dict:
    """The manifest's metrics: group/task primary values and deltas, flat enough for `llmq inspect`."""
    m = {name: round(v["value"], 6) for section in ("groups", "tasks") for name, v in report["scores"][section].items()}
    m.update({f"{name}_delta": round(d["delta"], 6) for name, d in report.get("deltas", {}).items()})
    if report.get("kld"):
        m.update(kld=report["kld"]["mean"], kld_p99=report["kld"]["p99"], top1=report["kld"]["top1"])
    if report.get("gates"):
        m["gates_passed"] = all(g["passed"] for g in report["gates"])
    return m


def write_report(store: Store, report: dict, parents: list[str], name: str, command: str | None,
                 run_metrics: dict | None = None) -> Artifact:
    """Commit `report` (deterministic: same settings, same bytes, same id) as `name`, child of `parents` (the evaluated
    artifact, when there is one, then the baseline); `run_metrics` (wall time, where the baseline's scores came from)
    go to the manifest's metrics only, which are not part of the content id."""
    base = report.get("baseline")
    config = {"scores_key": report["scores_key"], "settings": report["settings"],
              "baseline": base["id"] if base else None}
    with store.create("eval-report", name, parents=parents, config=config, command=command) as w:
        (w.dir / REPORT_JSON).write_text(json.dumps(report, indent=1, sort_keys=True, default=str))
        (w.dir / REPORT_MD).write_text(markdown(report))
        w.metrics.update(summary_metrics(report), **(run_metrics or {}))
    return w.artifact


def find_cached_scores(store: Store, artifact: Artifact, key: str) -> tuple[Artifact, dict] | None:
    """An earlier eval-report of `artifact` itself with the same scores key: its scores, computed once."""
    for rep in reversed(store.list(kind="eval-report")):
        if rep.parents[:1] == [artifact.id] and rep.config.get("scores_key") == key:
            rep.verify()
            return rep, json.loads(rep.file(REPORT_JSON).read_text())["scores"]
    return None
