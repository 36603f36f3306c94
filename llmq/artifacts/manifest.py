"""The manifest `llmq.json`: what an artifact is, where it came from and what it measured.

Sealing: the id covers only the payload (ids are parent references and recipe reuse keys, and identical payloads must
share one), so the manifest carries its own `digest`: sha256 over the canonical JSON of everything in it except the
digest itself, `created` and the metrics in RUN_MEASUREMENTS. Every read recomputes it (one small JSON, cheap), so a
hand edit of `kind`, `parents`, `config`, `command`, `environment`, `files` or a result metric is an error naming
`llmq.json`. Left out are the measurements of the writing run's time (and memory): they differ between two runs that
computed the same thing, so two reproducible runs have equal digests; an edit of one of them is not detected.
Schema 2 manifests are sealed; schema 1 ones (written before sealing) are still read, unsealed, so existing stores
keep working. The digest is a check against edits and damage, not a signature: whoever can write `llmq.json` can
also recompute it.
"""

from __future__ import annotations

import hashlib
import json
import platform
import re
import shlex
import sys
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

from .secrets import redact_argv, scrub

SCHEMA_VERSION = 2
UNSEALED_SCHEMA = 1  # still read: manifests from before the digest
UNSEALED_KEYS = frozenset({"digest", "created"})
# Metrics that measure the writing run (time, memory), not the artifact: the digest leaves them out (see above).
RUN_MEASUREMENTS = frozenset({"wall_time_s", "wall_s", "layer_times_s", "seconds_by_request_type", "peak_rss_bytes",
                              "peak_device_bytes"})
KINDS = ("model", "quantized", "engine", "eval-report", "bench-report", "deploy")
_REQUIRED = ("schema", "kind", "name", "version", "id", "parents", "files")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_TRACKED_PACKAGES = ("llmq", "torch", "transformers", "compressed-tensors", "safetensors", "lm_eval", "tensorrt_llm")


class ManifestError(ValueError):
    """A manifest that cannot be trusted; `claimed_id` is the id it states, if it states one, so a store can still
    say which artifact a reference to that id hits."""

    def __init__(self, message: str, claimed_id: str | None = None):
        super().__init__(message)
        self.claimed_id = claimed_id


def environment() -> dict:
    """Versions and device, read without importing heavy packages that the caller has not imported itself."""
    env = {"python": platform.python_version(), "platform": platform.platform()}
    for pkg in _TRACKED_PACKAGES:
        try:
            env[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            continue
    torch = sys.modules.get("torch")
    if torch is not None:
        env["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return env


def current_command() -> str:
    """The command line that is writing, as the user typed it (`llmq ...` also for `python -m llmq ...`), its
    secrets masked."""
    argv0 = sys.argv[0] if sys.argv else ""
    if argv0.endswith("llmq") or argv0.endswith("llmq/__main__.py"):
        return shlex.join(["llmq", *redact_argv(sys.argv[1:])])
    return shlex.join(redact_argv(sys.argv))


def digest(manifest: dict) -> str:
    """sha256 over the canonical JSON of the manifest less UNSEALED_KEYS and the metrics in RUN_MEASUREMENTS."""
    sealed = {k: v for k, v in manifest.items() if k not in UNSEALED_KEYS}
    if isinstance(sealed.get("metrics"), dict):
        sealed["metrics"] = {k: v for k, v in sealed["metrics"].items() if k not in RUN_MEASUREMENTS}
    return hashlib.sha256(json.dumps(sealed, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def build(*, kind: str, name: str, version: int, id: str, parents: list[str], command: str | None,
          config: dict, files: dict, metrics: dict) -> dict:
    manifest = {
        "schema": SCHEMA_VERSION,
        "kind": kind,
        "name": name,
        "version": version,
        "id": id,
        "parents": list(parents),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": command if command is not None else current_command(),
        "config": config,
        "environment": environment(),
        "files": files,
        "metrics": metrics,
    }
    manifest = json.loads(json.dumps(manifest, default=str))  # exactly what a reader will parse, digested
    manifest.update(command=scrub(manifest["command"]), config=scrub(manifest["config"]))
    manifest["digest"] = digest(manifest)
    return manifest


def read(path: Path) -> dict:
    """Parse and shape-check a manifest file; any defect is a ManifestError naming the file."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ManifestError(f"{path}: manifest missing (not an llmq artifact, or a damaged one)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ManifestError(f"{path}: manifest is not valid JSON ({e})") from None
    if not isinstance(data, dict) or any(k not in data for k in _REQUIRED):
        raise ManifestError(f"{path}: manifest lacks required keys {', '.join(_REQUIRED)}")
    claimed = data["id"] if isinstance(data["id"], str) else None
    if data["schema"] not in (SCHEMA_VERSION, UNSEALED_SCHEMA):
        raise ManifestError(f"{path}: manifest schema {data['schema']} is not supported "
                            f"(this llmq reads {UNSEALED_SCHEMA} and {SCHEMA_VERSION})", claimed)
    if bad := _malformed(data):
        raise ManifestError(f"{path}: manifest is malformed: {bad}", claimed)
    if data["schema"] == SCHEMA_VERSION and data.get("digest") != digest(data):
        raise ManifestError(f"{path}: manifest was edited after it was written (its digest does not match)", claimed)
    return data


def _malformed(m: dict) -> str | None:
    """What is wrong with a parsed manifest's shape, so that no reader has to guard a field's type itself."""
    def is_int(x):
        return isinstance(x, int) and not isinstance(x, bool)

    if not isinstance(m["kind"], str) or not isinstance(m["name"], str) or not is_int(m["version"]):
        return "kind and name must be strings and version an integer"
    if not isinstance(m["id"], str) or not _HEX64.match(m["id"]):
        return "id must be 64 hex digits"
    if not isinstance(m["parents"], list) or not all(isinstance(p, str) for p in m["parents"]):
        return "parents must be a list of ids"
    files = m["files"]
    if not isinstance(files, dict) or not all(
            isinstance(f, dict) and isinstance(f.get("sha256"), str) and is_int(f.get("size")) for f in files.values()):
        return 'files must map each path to {"sha256", "size"}'
    for key in ("config", "metrics", "environment"):
        if not isinstance(m.get(key, {}), dict):
            return f"{key} must be a mapping"
    for key in ("created", "command", "digest"):
        if not isinstance(m.get(key, ""), str):
            return f"{key} must be a string"
    return None


def write(path: Path, manifest: dict) -> None:
    path.write_text(json.dumps(manifest, indent=2, sort_keys=False, default=str) + "\n")
