"""Stamps: what a load checks instead of re-reading every byte of an artifact.

A stamp records, for each payload file, the (device, inode, size, mtime in ns) it had when it was last hashed and the
sha256 that hashing gave. A load trusts a file whose current (device, inode, size, mtime) equals its stamp's and whose
stamped sha256 equals the manifest's, and re-hashes every other file; `llmq verify` re-hashes every file regardless.

Where stamps live: `<store>/.stamps/<name>/v<N>.json`, beside the versions and not inside the artifact directory. The
artifact directory stays exactly what its writer committed (payload + `llmq.json`, never modified after), nothing that
walks or hard-links an artifact's files can pick a stamp up as payload, and the id never sees one. A stamp is a cache
and only that: a missing, unreadable or foreign stamp (an artifact copied to another machine or another store has
other inodes) just means the files are re-hashed once and the stamp rewritten. Artifacts outside a store's
`<name>/v<N>` layout, or in a store we cannot write, have no stamp and are re-hashed on every load, as before.

Why not ctime: hard links (quantize-kv links its source's weight files into the new artifact) and chmod change a
file's ctime but not its content, and each would cost a full re-hash of a multi-GB artifact.

Racy files (git's "racily clean" entries): a file rewritten within the same filesystem clock tick as its stamped
mtime keeps its mtime. So a stamp keeps only files whose mtime is strictly older than the stamp file itself (the
filesystem's clock when the stamp was written); any later rewrite of those gets a later mtime and is noticed. The
rest are re-hashed on the next load, which stamps them then.

The trade-off: a content change that leaves size and mtime alone (bit rot on the disk, or a tool that rewrites a file
in place and restores its mtime) is not caught by a load; `llmq verify REF` catches it.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

from . import hashing

STAMP_DIR = ".stamps"
_FORMAT = 1


def key(st: os.stat_result) -> list[int]:
    """What a stamp compares: device, inode, size, mtime (ns)."""
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]


def read(path: Path | None, artifact_id: str) -> dict[str, dict]:
    """{rel: {"stat": key, "sha256": hex}} from the stamp at `path`; empty when absent, damaged or another
    artifact's."""
    if path is None:
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("format") != _FORMAT or data.get("id") != artifact_id:
        return {}
    files = data.get("files")
    return files if isinstance(files, dict) else {}


def matches(entry, st: os.stat_result, sha256: str) -> bool:
    return isinstance(entry, dict) and entry.get("stat") == key(st) and entry.get("sha256") == sha256


def write(path: Path | None, artifact_id: str, files: dict[str, dict]) -> None:
    """Atomically replace the stamp at `path` with `files` ({rel: {"stat", "sha256"}}), less the racy ones.

    Best effort: a store we cannot write (read-only mount, another user's) just keeps re-hashing on load."""
    if path is None:
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "x") as f:
            clock = os.fstat(f.fileno()).st_mtime_ns  # the filesystem's clock, now
            keep = {rel: e for rel, e in files.items() if e["stat"][3] < clock}
            json.dump({"format": _FORMAT, "id": artifact_id, "files": keep}, f, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        try:
            tmp.unlink()
        except OSError:
            pass


def remove(path: Path | None) -> None:
    if path is not None:
        try:
            path.unlink()
        except OSError:
            pass


def hash_file(path: Path) -> tuple[str, dict | None]:
    """The file's sha256, and its stamp entry unless the file changed (stat-wise) while it was being read."""
    before = key(path.stat())
    digest = hashing.sha256_file(path)
    after = key(path.stat())
    return digest, ({"stat": after, "sha256": digest} if after == before else None)
