"""Rules of the test suite itself: every test checks something (an assert, pytest.raises / warns, or a helper that
does), so none can pass by running code and looking at nothing; ruff's PT018 keeps each assert to one fact."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
CHECKS = {"raises", "warns", "fail", "deprecated_call"}   # and every call whose name starts with `assert`


def _calls_and_checks(node: ast.AST) -> tuple[bool, set[str]]:
    """(whether `node` checks something itself, the names of the functions it calls)."""
    calls = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Assert):
            return True, calls
        if isinstance(n, ast.Call):
            f = n.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            if name in CHECKS or name.startswith("assert"):
                return True, calls
            calls.add(name)
    return False, calls


def idle_tests(sources: dict[str, str]) -> list[str]:
    """The test functions of `sources` (file name -> text) that check nothing, directly or through any function of
    `sources` that does (a helper is known by its name)."""
    functions: dict[str, list[tuple[bool, set[str]]]] = {}
    tests = []
    for name, text in sources.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                functions.setdefault(node.name, []).append(_calls_and_checks(node))
                if name.startswith("test_") and node.name.startswith("test_"):
                    tests.append((f"{name}::{node.name}", _calls_and_checks(node)))
    checking: set[str] = set()
    while True:
        more = {f for f, found in functions.items() if any(direct or calls & checking for direct, calls in found)}
        if more <= checking:
            break
        checking |= more
    return [where for where, (direct, calls) in tests if not direct and not calls & checking]


def test_the_rule_finds_a_test_that_checks_nothing():
    helper = "def assert_ok(x):\n    assert x\n"
    module = ("def test_runs(): run()\ndef test_asserts(): assert run()\ndef test_helper(): via()\n"
              "def via(): assert_ok(1)\ndef test_raises(): pytest.raises(ValueError)\n")
    assert idle_tests({"helpers.py": helper, "test_x.py": module}) == ["test_x.py::test_runs"]


def test_every_test_checks_something():
    sources = {p.name: p.read_text() for p in sorted(TESTS.glob("*.py"))}
    assert sum(n.startswith("test_") for n in sources) > 50
    assert idle_tests(sources) == []
