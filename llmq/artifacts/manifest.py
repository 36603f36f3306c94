"""The manifest `llmq.json`: what an artifact is, where it came from and what it measured."""

from __future__ import annotations

import json
import platform
import shlex
import sys
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

SCHEMA_VERSION = 1
KINDS = ("model", "quantized", "engine", "eval-report", "bench-report")
_REQUIRED = ("schema", "kind", "name", "version", "id", "parents", "files")
_TRACKED_PACKAGES = ("llmq", "torch", "transformers", "compressed-tensors", "safetensors", "lm_eval", "tensorrt_llm")


class ManifestError(ValueError):
    pass


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
    """The command line that is writing, as the user typed it (`llmq ...` also for `python -m llmq ...`)."""
    argv0 = sys.argv[0] if sys.argv else ""
    if argv0.endswith("llmq") or argv0.endswith("llmq/__main__.py"):
        return shlex.join(["llmq", *sys.argv[1:]])
    return shlex.join(sys.argv)


def build(*, kind: str, name: str, version: int, id: str, parents: list[str], command: str | None,
          config: dict, files: dict, metrics: dict) -> dict:
    return {
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
    if data["schema"] != SCHEMA_VERSION:
        raise ManifestError(f"{path}: manifest schema {data['schema']} is not supported (this llmq reads {SCHEMA_VERSION})")
    return data


def write(path: Path, manifest: dict) -> None:
    path.write_text(json.dumps(manifest, indent=2, sort_keys=False, default=str) + "\n")
