"""`llmq bench compare A B`: the key metrics of two reports side by side, with the ratio B / A.

Levels are matched by label (e.g. concurrency=8, batch=4); a level only one report has is listed as unmatched.
For latencies a ratio below 1 means B is faster; for throughputs above 1 does.
"""

from __future__ import annotations

from ..errors import LlmqError

ONLINE = (("ttft", "mean"), ("ttft", "p50"), ("ttft", "p99"), ("tpot", "p50"), ("tpot", "p99"), ("itl", "p50"),
          ("e2e", "p50"), (None, "request_throughput"), (None, "output_throughput"), (None, "goodput"))
OFFLINE = ("step_ms", "tokens_per_s", "mbu", "mfu")
# settings that change what the numbers mean: a comparison across them is flagged
SETTINGS = ("api", "num_prompts", "input_len", "input_len_std", "input_len_range", "output_len", "dataset",
            "slo_ttft_ms", "slo_tpot_ms", "cost_per_hour", "temperature", "ignore_eos", "batch_sizes", "dtype",
            "kv_cache_dtype", "device")


def _levels(report: dict) -> dict[str, dict]:
    """label -> flat {metric: value}."""
    if report["mode"] == "offline":
        return {f"batch={r['batch_size']}": {k: r[k] for k in OFFLINE} for r in report["offline"]}
    out = {}
    for lv in report["levels"]:
        s = lv["summary"]
        out[lv["label"]] = {(f"{m}_{p}" if m else p): (s[m][p] if m else s.get(p)) for m, p in ONLINE}
    return out


def compare(a: dict, b: dict) -> dict:
    """{"rows": [{level, metric, a, b, ratio}], "only_a": [...], "only_b": [...]}."""
    if a["mode"] != b["mode"]:
        raise LlmqError(f"cannot compare an {a['mode']} report with an {b['mode']} one")
    la, lb = _levels(a), _levels(b)
    rows = []
    for label in [x for x in la if x in lb]:
        for metric, va in la[label].items():
            vb = lb[label][metric]
            ratio = vb / va if va not in (None, 0) and vb is not None else None
            rows.append({"level": label, "metric": metric, "a": va, "b": vb, "ratio": ratio})
    if not rows:
        raise LlmqError(f"the reports share no load level (A: {', '.join(la) or 'none'}; B: {', '.join(lb) or 'none'})")
    sa, sb = a.get("settings", {}), b.get("settings", {})
    differ = {k: [sa.get(k), sb.get(k)] for k in SETTINGS if sa.get(k) != sb.get(k)}
    return {"rows": rows, "only_a": [x for x in la if x not in lb], "only_b": [x for x in lb if x not in la],
            "settings_differ": differ}


def table(result: dict, name_a: str, name_b: str):
    from rich.table import Table

    t = Table(title=f"B / A   (A = {name_a}, B = {name_b})")
    for c in ("level", "metric", "A", "B", "B/A"):
        t.add_column(c, justify="right" if c in ("A", "B", "B/A") else "left")
    for r in result["rows"]:
        def fmt(v):
            return "-" if v is None else f"{v:.4g}"
        t.add_row(r["level"], r["metric"], fmt(r["a"]), fmt(r["b"]), "-" if r["ratio"] is None else f"{r['ratio']:.3f}")
    return t
