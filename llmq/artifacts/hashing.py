"""Content hashing: an artifact's id is a function of its payload bytes alone."""

from __future__ import annotations

import hashlib
from pathlib import Path

MANIFEST_NAME = "llmq.json"
_CHUNK = 1 << 20


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def payload_files(root: Path) -> list[Path]:
    """Every regular file under root except the manifest, in a stable order."""
    files = [p for p in root.rglob("*") if p.is_file() and p.relative_to(root).as_posix() != MANIFEST_NAME]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def hash_payload(root: Path) -> dict[str, dict]:
    """{relative path: {sha256, size}} for every payload file."""
    return {
        p.relative_to(root).as_posix(): {"sha256": sha256_file(p), "size": p.stat().st_size}
        for p in payload_files(root)
    }


def content_id(files: dict[str, dict]) -> str:
    """sha256 over the sorted (path, file hash) pairs: identical payloads give identical ids."""
    h = hashlib.sha256()
    for rel in sorted(files):
        h.update(rel.encode())
        h.update(b"\0")
        h.update(files[rel]["sha256"].encode())
        h.update(b"\n")
    return h.hexdigest()
