"""The report's figures, drawn by matplotlib and returned as `data:image/svg+xml;base64,...` URLs: a page that holds
them needs nothing from the network, and an SVG shown through <img> can run no script and cannot break the HTML
around it, whatever text an artifact put into a label.

Each function takes the subjects' data already gathered (gather.py), one series per subject, labelled by the
subject's letter; the page's legend says which artifact a letter is.
"""

from __future__ import annotations

import base64
import io
import math

COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf")
MAX_LABEL = 40


def color(i: int) -> str:
    return COLORS[i % len(COLORS)]


def _label(text, most: int = MAX_LABEL) -> str:
    """An artifact's text as a label: shortened, and its '$' shown as written rather than starting mathtext."""
    text = str(text)
    text = text if len(text) <= most else text[:most - 1] + "…"
    return text.replace("$", r"\$")


def _figure(width: float, height: float):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.figure(figsize=(width, height))


def svg_url(fig) -> str:
    """The figure as a base64 SVG data URL (text as paths: no font needed at view time; no date: same data, same
    bytes)."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="svg", metadata={"Date": None})
    plt.close(fig)
    return "data:image/svg+xml;base64," + base64.b64encode(buf.getvalue()).decode()


def _context():
    import matplotlib

    # no TeX runs, whatever a label says (and _label keeps an artifact's '$' from starting mathtext)
    return matplotlib.rc_context({"text.usetex": False, "svg.fonttype": "path",
                                  "svg.hashsalt": "llmq-report", "font.size": 9})


def heatmap(matrix: list[list[float | None]], rows: str, cols: list[str], title: str, cbar: str,
            marks: list[list[str]] | None = None, log: bool = False) -> str:
    """A layers x columns heat map (None cells blank), each cell optionally marked with a short text."""
    import numpy as np
    from matplotlib.colors import LogNorm

    with _context():
        data = np.array([[np.nan if v is None else v for v in row] for row in matrix], dtype=float)
        n_rows, n_cols = data.shape
        fig = _figure(min(12.0, 2.2 + 0.9 * n_cols), min(10.0, 1.4 + 0.28 * n_rows))
        ax = fig.add_subplot()
        finite = data[np.isfinite(data)]
        norm = LogNorm(vmin=max(finite[finite > 0].min(initial=1.0), 1e-12), vmax=max(finite.max(initial=1.0), 1.0)
                       ) if log and finite.size and (finite > 0).any() else None
        im = ax.imshow(np.where(data > 0, data, np.nan) if norm else data, aspect="auto", cmap="viridis", norm=norm,
                       interpolation="nearest")
        fig.colorbar(im, ax=ax, label=cbar)
        ax.set_xticks(range(n_cols), [_label(c) for c in cols], rotation=30 if n_cols > 4 else 0, ha="right"
                      if n_cols > 4 else "center")
        step = max(1, n_rows // 16)
        ax.set_yticks(range(0, n_rows, step))
        ax.set_ylabel(rows)
        ax.set_title(_label(title, 90))
        if marks is not None and n_rows * n_cols <= 400:
            for i, row in enumerate(marks):
                for j, text in enumerate(row):
                    if text:
                        ax.text(j, i, _label(text, 12), ha="center", va="center", fontsize=7, color="white",
                                bbox={"boxstyle": "round,pad=0.1", "fc": "black", "alpha": 0.35, "lw": 0})
        return svg_url(fig)


def layer_lines(series: list[tuple[int, list[float]]], ylabel: str, title: str) -> str:
    """One line per subject over layer index: (subject index, value per layer)."""
    from matplotlib.ticker import MaxNLocator

    with _context():
        fig = _figure(8, 3.2)
        ax = fig.add_subplot()
        for i, values in series:
            ax.plot(range(len(values)), values, "o-", ms=3, color=color(i), label=chr(65 + i))
        ax.set_xlabel("layer")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(ylabel)
        if any(v > 0 for _, values in series for v in values):
            ax.set_yscale("log")
        ax.set_title(title)
        ax.legend()
        return svg_url(fig)


def histograms(series: list[tuple[int, str, list[float], list[int]]], title: str) -> str:
    """Per-position KL histograms on one log axis: (subject index, which measurement, bin edges, counts), each as
    the fraction of positions per bin."""
    with _context():
        fig = _figure(8, 3.2)
        ax = fig.add_subplot()
        styles = {}
        for i, what, edges, counts in series:
            total = sum(counts) or 1
            lo = edges[1] / 10 ** 0.25   # the first bin [0, edges[1]) drawn one bin wide on the log axis
            xs = [lo, *edges[1:]]
            style = styles.setdefault(what, ("-", "--", ":", "-.")[len(styles) % 4])
            ax.stairs([c / total for c in counts], xs, color=color(i), linestyle=style, label=f"{chr(65 + i)} {what}")
        ax.set_xscale("log")
        ax.set_xlabel("KL divergence at a position (nats; the first bin holds everything below its right edge)")
        ax.set_ylabel("fraction of positions")
        ax.set_title(title)
        ax.legend(fontsize=8)
        return svg_url(fig)


def forest(rows: list[dict], title: str) -> str:
    """Deltas with 95% intervals, one row per (score, subject), grouped by unit in one panel each; a gate on a
    score is drawn as a red bar at its threshold on that score's rows, its side shaded where it fails.
    rows: {score, subject, delta, lo, hi, unit, gate: (op, threshold) | None, passed: bool | None}."""
    units = list(dict.fromkeys(r["unit"] for r in rows))
    with _context():
        per = [len([r for r in rows if r["unit"] == u]) for u in units]
        fig = _figure(8, 1.2 + 0.32 * sum(per) + 0.6 * len(units))
        axes = fig.subplots(len(units), 1, squeeze=False, height_ratios=[p + 1 for p in per])[:, 0]
        for ax, unit in zip(axes, units):
            mine = [r for r in rows if r["unit"] == unit]
            scores = list(dict.fromkeys(r["score"] for r in mine))
            subjects = sorted({r["subject"] for r in mine})
            y_of = {}
            y = 0
            for s in scores:
                for k in subjects:
                    if any(r["score"] == s and r["subject"] == k for r in mine):
                        y_of[(s, k)] = y
                        y += 1
                y += 0.5
            for r in mine:
                yy = y_of[(r["score"], r["subject"])]
                lo, hi = r["lo"], r["hi"]
                ax.errorbar([r["delta"]], [yy], xerr=[[r["delta"] - lo], [hi - r["delta"]]], fmt="o", ms=4,
                            capsize=3, color=color(r["subject"]))
                if r["gate"] is not None:
                    op, thr = r["gate"]
                    ax.plot([thr, thr], [yy - 0.4, yy + 0.4], color="#c00000", lw=2.5)
                    ax.annotate(("✓ " if r["passed"] else "✗ ") + f"{op}{thr:g}", (thr, yy), xytext=(4, 4),
                                textcoords="offset points", fontsize=7, color="#c00000")
            ax.axvline(0, color="grey", lw=0.8)
            ax.set_yticks([y_of[k] for k in y_of], [f"{_label(s)} ({chr(65 + k)})" for s, k in y_of])
            ax.invert_yaxis()
            ax.set_xlabel(f"delta vs baseline ({unit}); bars: 95% interval; red: gate threshold")
            lo = min([r["lo"] for r in mine] + [r["gate"][1] for r in mine if r["gate"]])
            hi = max([r["hi"] for r in mine] + [r["gate"][1] for r in mine if r["gate"]])
            pad = (hi - lo) * 0.08 or 1.0
            if math.isfinite(lo) and math.isfinite(hi):
                ax.set_xlim(lo - pad, hi + pad)
        axes[0].set_title(title)
        return svg_url(fig)


def curves(panels: list[tuple[str, str, bool, list[tuple[int, list[float], list[float | None]]]]], xlabel: str,
           title: str) -> str:
    """Side-by-side panels of lines: (y label, panel title, log x, [(subject index, xs, ys)])."""
    from matplotlib.ticker import NullLocator

    with _context():
        fig = _figure(4.2 * len(panels), 3.4)
        axes = fig.subplots(1, len(panels), squeeze=False)[0]
        for ax, (ylabel, sub, logx, series) in zip(axes, panels):
            for i, xs, ys in series:
                pts = [(x, y) for x, y in zip(xs, ys) if y is not None and math.isfinite(x)]
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", ms=4, color=color(i), label=chr(65 + i))
            if logx:
                ax.set_xscale("log", base=2)
                ticks = sorted({x for _, xs, _ in series for x in xs if math.isfinite(x) and x > 0})
                ax.set_xticks(ticks, [f"{x:g}" for x in ticks])
                ax.xaxis.set_minor_locator(NullLocator())
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
            ax.set_title(sub)
            ax.legend(fontsize=8)
        fig.suptitle(title)
        return svg_url(fig)


def bars(values: list[tuple[int, float]], xlabel: str, title: str) -> str:
    """Horizontal bars, one per subject."""
    with _context():
        fig = _figure(7, 0.9 + 0.4 * len(values))
        ax = fig.add_subplot()
        ax.barh([chr(65 + i) for i, _ in values], [v for _, v in values], color=[color(i) for i, _ in values])
        ax.invert_yaxis()
        ax.set_xlabel(xlabel)
        ax.set_title(title)
        return svg_url(fig)
