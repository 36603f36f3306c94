"""`llmq report REF...`: one self-contained HTML page over one artifact or several side by side (lineage, size and
bits, KLD, expert coverage, eval deltas against the gates, bench curves). Entry point: `write_report`."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..artifacts import Artifact, Store
from ..errors import LlmqError
from .options import ReportOptions

__all__ = ["ReportOptions", "default_output", "write_report"]


def default_output(arts: list[Artifact]) -> Path:
    return Path(f"{arts[0].name}-report.html")


def write_report(store: Store, arts: list[Artifact], opts: ReportOptions, gate: str | None = None,
                 reports: Sequence[Artifact] = ()) -> Path:
    """Write the page over `arts` to opts.output (default: default_output(arts)) and return its path. `gate`: a
    gate expression to judge each artifact's eval with instead of the gates stored with it (a recipe's); `reports`:
    eval / bench reports to show ahead of the newest ones made from the artifacts' lineages (a recipe's own)."""
    from . import gather, page

    opts.check()
    out = Path(opts.output) if opts.output else default_output(arts)
    text = page.render(gather.subjects(store, arts, gate, reports))
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(out)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise LlmqError(f"cannot write the report to {out}: {e.strerror or e}") from None
    return out
