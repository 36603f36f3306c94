"""What the docs quote from the code stays what the code says: the architecture registry docs/extending.md lists."""

from __future__ import annotations

import re
from pathlib import Path

from llmq.models.arch import ARCHS

DOCS = Path(__file__).resolve().parents[1] / "docs"


def test_extending_lists_exactly_the_registry():
    text = " ".join((DOCS / "extending.md").read_text().split())
    listed = re.search(r"The registry holds (\w+): (.*?); `tests/test_docs.py`", text)
    assert listed, "docs/extending.md no longer lists the registry"
    named = set(re.findall(r"`(\w+ForCausalLM)`", listed.group(2)))
    assert named == {a.architecture for a in ARCHS.values()}
    numbers = {"ten": 10, "eleven": 11, "twelve": 12, "thirteen": 13, "fourteen": 14}
    assert numbers.get(listed.group(1)) == len(ARCHS), listed.group(1)
