"""`llmq report`'s options (and a recipe's report stage's), declared once (llmq/options.py)."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import LlmqError
from ..options import Options, option


@dataclass(frozen=True)
class ReportOptions(Options):
    output: str | None = option(None, "The HTML file to write (default: <first artifact's name>-report.html; in a "
                                "recipe, <recipe name>-report.html).", metavar="FILE")

    def check(self) -> None:
        super().check()
        if self.output is not None and not self.output.strip():
            raise LlmqError("--output is empty: name the HTML file to write")
