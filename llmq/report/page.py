"""The report as one self-contained HTML page: inline CSS, figures as SVG data URLs (plots.py), no script, nothing
fetched at view time. Every string that comes from an artifact (names, commands, task names, model names a
server reported) goes through `esc`; the page's own markup is the only markup in it."""

from __future__ import annotations

import html

from .. import __version__
from ..options import human_bytes
from . import gather, plots

CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;margin:0;color:#1d2330;background:#f6f7f9}
header{background:#1d2330;color:#fff;padding:18px 28px}header h1{margin:0 0 6px;font-size:22px}
main{padding:8px 28px 40px}section{background:#fff;border:1px solid #dde1e7;border-radius:8px;margin:16px 0;
padding:12px 18px}h2{font-size:17px;margin:4px 0 10px}h3{font-size:14px;margin:12px 0 6px}
table{border-collapse:collapse;margin:6px 0}td,th{border:1px solid #dde1e7;padding:3px 8px;text-align:left;
vertical-align:top}th{background:#eef1f5}code{font-size:12px;word-break:break-all}
.warn{background:#ffe8a3;color:#4a3800;padding:6px 10px;border-radius:6px;display:inline-block;margin-top:6px}
.missing{color:#8a5a00;font-style:italic}.chain{display:flex;flex-wrap:wrap;align-items:center;gap:6px;margin:6px 0}
.node{border:1px solid #b9c2cf;border-radius:6px;padding:4px 8px;background:#f9fafc;max-width:360px}
.node b{display:block}.arrow{color:#7a8494}.letter{display:inline-block;min-width:18px;text-align:center;
color:#fff;border-radius:4px;padding:0 4px;margin-right:4px;font-weight:bold}
.pass{color:#17692c;font-weight:bold}.fail{color:#b00020;font-weight:bold}img{max-width:100%;height:auto}
.grid{display:flex;flex-wrap:wrap;gap:12px}.grid>div{flex:1 1 420px}
"""


def esc(value) -> str:
    return html.escape(str(value), quote=True)


def _bytes(n) -> str:
    return "–" if n is None else human_bytes(n)


def _num(v, fmt: str = "{:.4g}") -> str:
    return "–" if v is None else fmt.format(v)


def _tag(s: gather.Subject) -> str:
    return f'<span class="letter" style="background:{plots.color(s.index)}">{s.letter}</span>'


def _missing(s: gather.Subject, section: str) -> str:
    return f'<p class="missing">{_tag(s)}not measured: {esc(s.why.get(section, "no data"))}</p>'


def _img(url: str, alt: str) -> str:
    return f'<img src="{url}" alt="{esc(alt)}">'


def _section(sid: str, title: str, body: list[str]) -> str:
    return f'<section id="{sid}"><h2>{esc(title)}</h2>{"".join(body)}</section>'


def header(subs: list[gather.Subject]) -> str:
    models = {s.card["model"]["id"] for s in subs}
    rows = "".join(
        f"<tr><td>{_tag(s)}</td><td><b>{esc(s.art.ref)}</b></td><td>{esc(s.art.kind)}</td>"
        f"<td><code>{esc(s.art.id[:12])}</code></td><td>{esc(s.card['model']['ref'])} "
        f"({esc(s.card['model']['architecture'] or '?')}, <code>{esc(s.card['model']['id'][:12])}</code>)</td></tr>"
        for s in subs)
    warn = ""
    if len(models) > 1:
        warn = ('<div class="warn">These artifacts come from different models ('
                + ", ".join(f"{s.letter}: {esc(s.card['model']['ref'])}" for s in subs)
                + "): their numbers are each against their own baseline, not comparable one to one.</div>")
    return (f"<header><h1>llmq report</h1><div>{len(subs)} artifact{'s' if len(subs) > 1 else ''}, "
            f"written by llmq {esc(__version__)}</div>{warn}</header><main><section id=\"artifacts\">"
            "<h2>Artifacts</h2><table><tr><th></th><th>artifact</th><th>kind</th><th>id</th><th>source model</th></tr>"
            f"{rows}</table></section>")


def lineage(subs) -> str:
    body = []
    for s in subs:
        nodes = [f'<div class="node"><b>{esc(n["ref"])}</b>{esc(n["kind"])} <code>{esc(n["id"][:12])}</code>'
                 + (f'<br><code>{esc(n["command"])}</code>' if n["command"] else "") + "</div>"
                 for n in reversed(gather.lineage(s))]
        body.append(f'<div class="chain">{_tag(s)}' + '<span class="arrow">→</span>'.join(nodes) + "</div>")
    return _section("lineage", "Lineage (source model first)", body)


def size_bits(subs) -> str:
    head = ("<tr><th></th><th>artifact size</th><th>weights</th><th>bf16 weights</th><th>smaller than bf16</th>"
            "<th>linear layers</th><th>scheme</th><th>bits / weight (linears)</th></tr>")
    rows, figs, bit_data = [], [], {}
    for s in subs:
        z, b = gather.size(s), gather.bits(s)
        bit_data[s.index] = b
        scheme = "16-bit" if b is None else b.get("uniform") or "mixed: " + ", ".join(
            f"{n}× {k}" for k, n in b["count"].items() if n)
        bpw = _num(b.get("bpw"), "{:.3f}") + (f" (target {b['target_bpw']:g})" if b.get("target_bpw") else "") \
            if b and "bpw" in b else "–"
        rows.append(f"<tr><td>{_tag(s)}</td><td>{_bytes(z['bytes'])}</td><td>{_bytes(z['weights_bytes'])}</td>"
                    f"<td>{_bytes(z['bf16_bytes'])}</td><td>{_num(z['ratio_vs_bf16'], '{:.2f}x')}</td>"
                    f"<td>{_num(z['linear_ratio_vs_bf16'], '{:.2f}x')}</td><td>{esc(scheme)}</td><td>{bpw}</td></tr>")
    body = [f"<table>{head}{''.join(rows)}</table>"]
    if len(subs) > 1:
        body.append(_img(plots.bars([(s.index, s.art.payload_bytes / 2**20) for s in subs], "MiB",
                                    "artifact size"), "artifact sizes"))
    body.append("<h3>Bits per unit (layers × units)</h3>")
    for s in subs:
        b = bit_data[s.index]
        if b is None:
            figs.append(_missing(s, "bits"))
        elif "units" not in b:
            figs.append(f"<p>{_tag(s)}one scheme for every unit: {esc(b['uniform'])} ({esc(b['from'])})</p>")
        else:
            figs.append(f"<div><p>{_tag(s)}mixed precision ({esc(b['from'])})</p>" + _img(plots.heatmap(
                b["bits"], "layer", b["units"], f"{s.letter}: bits per unit", "bits", b["schemes"]),
                f"{s.letter} bits per unit") + "</div>")
    body.append(f'<div class="grid">{"".join(figs)}</div>')
    return _section("size", "Size and bits", body)


def kld(subs) -> str:
    rows = []
    for s in subs:
        k = s.card["kld"]
        rows.append(f"<tr><td>{_tag(s)}</td><td>{_num(k and k['mean'])}</td><td>{_num(k and k['top1'], '{:.1f}%')}"
                    f"</td><td>{esc(k['from']) if k else 'not measured'}</td></tr>")
    body = ["<table><tr><th></th><th>mean KLD (nats/token)</th><th>top-1 agreement</th><th>from</th></tr>"
            + "".join(rows) + "</table>", "<h3>KLD per layer</h3>"]
    series = []
    for s in subs:
        layers = gather.kld_per_layer(s, gather.bits(s))
        if layers is None:
            body.append(_missing(s, "kld_layers"))
        else:
            series.append((s.index, layers))
    if series:
        body.append(_img(plots.layer_lines(series, "KLD (nats/token)", "KLD with one layer's units alone at INT4"),
                         "KLD per layer"))
    body.append("<h3>KLD per position</h3>")
    hist = []
    for s in subs:
        found = gather.kld_histograms(s)
        if not found:
            body.append(_missing(s, "kld_hist"))
        hist += [(s.index, what, edges, counts) for what, edges, counts in found]
    if hist:
        body.append(_img(plots.histograms(hist, "per-position KL divergence from the baseline"),
                         "KLD per-position histogram"))
    return _section("kld", "KL divergence from the baseline", body)


def expert_coverage(subs) -> str:
    body = []
    for s in subs:
        e = gather.experts(s)
        if e is None:
            body.append(_missing(s, "experts"))
            continue
        routed = e["routed"]
        never = {(i, j) for i, j in e["never"]}
        marks = [["0" if (i, j) in never else "" for j in range(len(row))] for i, row in enumerate(routed)]
        cols = [str(j) for j in range(max(map(len, routed), default=0))]
        fig = plots.heatmap(routed, "layer", cols, f"{s.letter}: calibration tokens routed to each expert", "tokens",
                            marks)
        body.append(f"<div><p>{_tag(s)}{esc(e['scheme'])} ({esc(e['from'])}); {len(never)} (layer, expert) "
                    f"pairs never routed, marked 0</p>{_img(fig, f'{s.letter} expert coverage')}</div>")
    return _section("experts", "Mixture-of-experts coverage", [f'<div class="grid">{"".join(body)}</div>'])


def evaluation(subs) -> str:
    rows, gate_rows, body = [], [], []
    for s in subs:
        ev = gather.evaluation(s)
        if ev is None:
            body.append(_missing(s, "eval"))
            continue
        by_name = {g["name"]: g for g in ev["gates"] if not g["kld"]}
        for name, d in ev["deltas"].items():
            g = by_name.get(name)
            rows.append({"score": name, "subject": s.index, "delta": d["delta"], "lo": d["ci95"][0],
                         "hi": d["ci95"][1], "unit": d.get("unit") or "", "passed": g and g["passed"],
                         "gate": (g["op"], g["threshold"]) if g else None})
        for g in ev["gates"]:
            gate_rows.append(f"<tr><td>{_tag(s)}</td><td><code>{esc(g['gate'])}</code></td><td>{esc(g['what'])}</td>"
                             f"<td class=\"{'pass' if g['passed'] else 'fail'}\">"
                             f"{'pass' if g['passed'] else 'FAIL'}</td></tr>")
        body.append(f"<p>{_tag(s)}{esc(ev['from'])}: {esc(ev['evaluated'] or '?')} against "
                    f"{esc(ev['baseline'] or '?')}</p>")
    if rows:
        body.append(_img(plots.forest(rows, "task deltas with 95% intervals"), "eval forest plot"))
    if gate_rows:
        body.append("<h3>Gates</h3><table><tr><th></th><th>gate</th><th>value</th><th>result</th></tr>"
                    + "".join(gate_rows) + "</table>")
    return _section("eval", "Evaluation against the baseline", body)


def bench(subs) -> str:
    body, online, offline = [], [], []
    for s in subs:
        b = gather.bench(s)
        if b is None:
            body.append(_missing(s, "bench"))
            continue
        body.append(f"<p>{_tag(s)}{esc(b['from'])} ({b['mode']})</p>")
        (online if b["mode"] == "online" else offline).append((s.index, b))
    if online:
        def series(key, pick):
            return [(i, [lv["value"] for lv in b["levels"]], [pick(lv["summary"], key) for lv in b["levels"]])
                    for i, b in online]

        def ms(summary, key):
            v = (summary.get(key) or {}).get("p50")
            return None if v is None else v * 1e3

        kinds = {lv["kind"] for _, b in online for lv in b["levels"]}
        body.append(_img(plots.curves(
            [("output tokens/s", "throughput", True, series("output_throughput", lambda sm, k: sm.get(k))),
             ("ms (p50)", "TTFT", True, series("ttft", ms)), ("ms (p50)", "TPOT", True, series("tpot", ms))],
            " / ".join(sorted(kinds)), "serving load test"), "bench curves (online)"))
    if offline:
        def rows(key):
            return [(i, [r["batch_size"] for r in b["rows"]], [r.get(key) for r in b["rows"]]) for i, b in offline]

        body.append(_img(plots.curves([("tokens/s", "decode throughput", True, rows("tokens_per_s")),
                                       ("ms", "decode step", True, rows("step_ms"))],
                                      "batch size", "offline decode sweep"), "bench curves (offline)"))
    return _section("bench", "Speed", body)


def render(subs: list[gather.Subject]) -> str:
    title = "llmq report: " + ", ".join(s.art.ref for s in subs)
    parts = [header(subs), lineage(subs), size_bits(subs), kld(subs), expert_coverage(subs), evaluation(subs),
             bench(subs)]
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><meta name="viewport" '
            f'content="width=device-width,initial-scale=1"><title>{esc(title)}</title><style>{CSS}</style></head>'
            f"<body>{''.join(parts)}</main></body></html>\n")
