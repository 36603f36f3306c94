"""JSONL files given by users (calibration text, benchmark prompts): one JSON value per line, errors naming
file:line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from .errors import LlmqError


def read_jsonl(path: Path) -> Iterator[tuple[int, object]]:
    """(line number, value) of every non-blank line; a line that is not JSON is a one-line LlmqError."""
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield n, json.loads(line)
        except json.JSONDecodeError as e:
            raise LlmqError(f"{path}:{n}: not valid JSON ({e.msg})") from None
