"""Secrets are never written: no API key or bearer token a command was given reaches a manifest, a report or an
error line. A secret is the value of a SECRET_OPTIONS option on the command line, the value of an environment
variable named `*_API_KEY`, or the token after `Bearer `.
"""

from __future__ import annotations

import os
import re
import sys

SECRET_OPTIONS = ("--api-key",)
MASK = "***"
# shorter values (an empty or placeholder variable) are masked where they stand on the command line only: found in
# any text they would also mask pieces of hashes and words
MIN_LEN = 8
_BEARER = re.compile(r"(?i)\b(bearer\s+)[^\s\"',;]+")


def redact_argv(argv: list[str]) -> list[str]:
    """`argv` with the value of each SECRET_OPTIONS option masked, whatever its length, and other secrets in it."""
    out, hide = [], False
    for word in argv:
        opt, eq, _ = word.partition("=")
        if hide:
            word = MASK
        elif eq and opt in SECRET_OPTIONS:
            word = f"{opt}={MASK}"
        hide = word in SECRET_OPTIONS
        out.append(redact(word))
    return out


def secrets() -> list[str]:
    """What this process must not write, longest first."""
    found = {v for k, v in os.environ.items() if k.upper().endswith("_API_KEY")}
    argv = sys.argv[1:]
    found.update(v for opt, v in zip(argv, argv[1:]) if opt in SECRET_OPTIONS)
    found.update(w.partition("=")[2] for w in argv if w.partition("=")[0] in SECRET_OPTIONS)
    return sorted((s for s in found if len(s) >= MIN_LEN), key=len, reverse=True)


def redact(text: str, found: list[str] | None = None) -> str:
    """`text` with every secret (`found`, by default secrets()) masked."""
    for s in secrets() if found is None else found:
        text = text.replace(s, MASK)
    return _BEARER.sub(rf"\g<1>{MASK}", text)


def scrub(value, found: list[str] | None = None):
    """A JSON-like value with every string in it redacted."""
    found = secrets() if found is None else found
    if isinstance(value, str):
        return redact(value, found)
    if isinstance(value, dict):
        return {scrub(k, found): scrub(v, found) for k, v in value.items()}
    if isinstance(value, list):
        return [scrub(v, found) for v in value]
    return value
