"""Bench reports: the JSON (every request's timings and every setting), the terminal table and the PNG plot.

A report is a `bench-report` artifact holding report.json and plot.png; its manifest's metrics carry the headline
numbers of each load level, so `llmq inspect` shows them without opening the JSON.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from ..artifacts import Artifact, Store
from ..errors import LlmqError

SCHEMA = 1
HEADLINE = (("ttft", "p50"), ("ttft", "p99"), ("tpot", "p50"), ("tpot", "p99"), ("itl", "p50"), ("e2e", "p50"))


def level(kind: str, value: float, summary: dict, requests: list[dict]) -> dict:
    label = f"{kind}={value:g}" if kind != "rate" else f"rate={value:g}/s"
    return {"label": label, "kind": kind, "value": value, "summary": summary, "requests": requests}


def headline_metrics(report: dict) -> dict:
    """Flat numbers for the manifest: `<level>/<metric>`."""
    out = {}
    if report["mode"] == "offline":
        for r in report["offline"]:
            for k in ("tokens_per_s", "step_ms", "mbu", "mfu"):
                if r[k] is not None:
                    out[f"batch={r['batch_size']}/{k}"] = r[k]
        return out
    for lv in report["levels"]:
        s = lv["summary"]
        for k in ("completed", "failed", "request_throughput", "output_throughput", "goodput",
                  "cost_per_1m_output_tokens"):
            if s.get(k) is not None:
                out[f"{lv['label']}/{k}"] = s[k]
        for m, p in HEADLINE:
            if s[m][p] is not None:
                out[f"{lv['label']}/{m}_{p}"] = s[m][p]
    return out


def _slug(text: str) -> str:
    s = re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-._").lower()
    return s[:100] or "run"


def default_name(report: dict) -> str:
    st = report["settings"]
    return "bench-" + _slug(Path(st.get("engine", "")).name if report["mode"] == "offline" else st.get("model", ""))


def save(store: Store, report: dict, name: str | None = None, parents: list[str] | None = None,
         command: str | None = None) -> Artifact:
    """Write the report (JSON + PNG) as one bench-report artifact."""
    import matplotlib.pyplot as plt

    with store.create("bench-report", name or default_name(report), parents=parents or [],
                      config={"mode": report["mode"], "settings": report["settings"]}, command=command) as w:
        (w.dir / "report.json").write_text(json.dumps(report, indent=1))
        fig = make_plot(report)
        fig.savefig(w.dir / "plot.png", dpi=100)
        plt.close(fig)
        w.metrics.update(headline_metrics(report))
    return w.artifact


def load(store: Store, ref: str) -> dict:
    """A report from a bench-report artifact ref, its directory or a report.json path."""
    p = Path(ref).expanduser()
    if p.is_file():
        try:
            return json.loads(p.read_text())
        except ValueError:
            raise LlmqError(f"{p}: not a JSON bench report") from None
    art = store.resolve(ref)
    if art.kind != "bench-report":
        raise LlmqError(f"{art.ref} is a {art.kind} artifact, not a bench-report")
    return json.loads(art.file("report.json").read_text())


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def _num(x: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def table(report: dict):
    """A rich Table: one row per load level (online) or batch size (offline)."""
    from rich.table import Table

    if report["mode"] == "offline":
        st = report["settings"]
        t = Table(title=f"offline decode  ({st['device']}, {st['dtype']}, input {st['input_len']}, "
                        f"output {st['output_len']})")
        for c in ("batch", "step ms", "tok/s", "prefill s", "weights MB", "KV MB/step", "MBU", "MFU"):
            t.add_column(c, justify="right")
        for r in report["offline"]:
            t.add_row(str(r["batch_size"]), f"{r['step_ms']:.2f}", f"{r['tokens_per_s']:.1f}", f"{r['prefill_s']:.2f}",
                      f"{r['weight_bytes'] / 1e6:.1f}", f"{r['kv_bytes'] / 1e6:.2f}", _num(r["mbu"], "{:.1%}"),
                      _num(r["mfu"], "{:.2%}"))
        return t
    st = report["settings"]
    t = Table(title=f"{st['endpoint']}  model {st['model']}  ({st['api']})")
    cols = ["level", "ok/fail", "req/s", "out tok/s", "TTFT p50/p99 ms", "TPOT p50/p99 ms", "ITL p50 ms",
            "E2E p50 s"]
    if any(lv["summary"]["goodput"] is not None for lv in report["levels"]):
        cols.append("goodput req/s")
    if st.get("cost_per_hour") is not None:
        cols.append("$/1M out tok")
    for c in cols:
        t.add_column(c, justify="right")
    for lv in report["levels"]:
        s = lv["summary"]
        row = [lv["label"], f"{s['completed']}/{s['failed'] + s['cancelled']}", _num(s["request_throughput"]),
               _num(s["output_throughput"], "{:.1f}"), f"{_ms(s['ttft']['p50'])}/{_ms(s['ttft']['p99'])}",
               f"{_ms(s['tpot']['p50'])}/{_ms(s['tpot']['p99'])}", _ms(s["itl"]["p50"]),
               _num(s["e2e"]["p50"], "{:.3f}")]
        if "goodput req/s" in cols:
            row.append(_num(s["goodput"]))
        if "$/1M out tok" in cols:
            row.append(_num(s["cost_per_1m_output_tokens"], "{:.3f}"))
        t.add_row(*row)
    return t


def make_plot(report: dict):
    """The figure: throughput vs latency across levels, plus TTFT and TPOT distributions (online), or throughput
    vs step latency and MBU/MFU per batch size (offline). Uses the Agg backend: no display needed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if report["mode"] == "offline":
        rows = report["offline"]
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
        a1.plot([r["step_ms"] for r in rows], [r["tokens_per_s"] for r in rows], "o-")
        for r in rows:
            a1.annotate(f"B={r['batch_size']}", (r["step_ms"], r["tokens_per_s"]), textcoords="offset points",
                        xytext=(4, 4), fontsize=8)
        a1.set_xlabel("decode step latency (ms per token)")
        a1.set_ylabel("output throughput (tokens/s)")
        a1.set_title("throughput vs latency")
        b = [r["batch_size"] for r in rows]
        a2.plot(b, [float("nan") if r["mbu"] is None else r["mbu"] * 100 for r in rows], "o-", label="MBU")
        a2.plot(b, [float("nan") if r["mfu"] is None else r["mfu"] * 100 for r in rows], "s-", label="MFU")
        a2.set_xscale("log", base=2)
        a2.set_xticks(b, [str(x) for x in b])
        a2.set_xlabel("batch size")
        a2.set_ylabel("utilization (% of measured peak)")
        a2.set_title("MBU / MFU")
        a2.legend()
        fig.tight_layout()
        return fig
    levels = report["levels"]
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(16, 4.5))
    pts = [(lv["summary"]["output_throughput"], lv["summary"]["tpot"]["p50"], lv["label"]) for lv in levels
           if lv["summary"]["output_throughput"] and lv["summary"]["tpot"]["p50"] is not None]
    if pts:
        a1.plot([p[1] * 1e3 for p in pts], [p[0] for p in pts], "o-")
        for x, y, lab in pts:
            a1.annotate(lab, (y * 1e3, x), textcoords="offset points", xytext=(4, 4), fontsize=8)
    a1.set_xlabel("median TPOT (ms)")
    a1.set_ylabel("output throughput (tokens/s)")
    a1.set_title("throughput vs latency")
    for ax, key, title in ((a2, "ttft", "TTFT distribution"), (a3, "tpot", "TPOT distribution")):
        per_level = [(lv["label"], [v * 1e3 for v in _per_request(lv["requests"], key)]) for lv in levels]
        every = [v for _, vals in per_level for v in vals]
        bins = np.histogram_bin_edges(every, 30) if every else 30  # one set of bins, so levels compare
        for label, vals in per_level:
            if vals:
                ax.hist(vals, bins=bins, alpha=0.5, label=label)
        ax.set_xlabel(f"{key.upper()} (ms)")
        ax.set_ylabel("requests")
        ax.set_title(title)
        if levels:
            ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def _per_request(requests: list[dict], key: str) -> list[float]:
    from .stats import RequestRecord

    recs = [RequestRecord.from_dict(r) for r in requests]
    return [v for r in recs if r.ok and (v := getattr(r, key)) is not None]
