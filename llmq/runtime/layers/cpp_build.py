"""Build and load a C++ extension with PyTorch's builder, safe against killed builds and other installs.

torch.utils.cpp_extension.load guards its build directory with a lock *file* (its FileBaton) that only the builder
removes: a build killed in that window (SIGKILL, OOM) leaves the file, and every later load waits on it forever.
Here a build runs under an flock of llmq's own on `<dir>/llmq.lock`, which the kernel releases when its holder dies:
whoever holds it knows no live process is building there, so a baton found then is stale and is removed. Waiting
for the flock is bounded: a build elsewhere that takes longer is a TimeoutError, never a hang.

The directory is named by a hash of what the binary depends on (the source and its path, the flags, torch's and
Python's versions), so two installs never share one and rebuild each other's: PyTorch's build file records the
source's path, so two checkouts of the same source in one directory would rebuild it in turn.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import sys
import time
from pathlib import Path

import torch


def build_directory(name: str, source: Path, cflags: list[str]) -> Path:
    """`<TORCH_EXTENSIONS_DIR or ~/.cache/torch_extensions>/<name>-<hash of the source, its path, the flags and
    versions>`."""
    from torch.utils.cpp_extension import get_default_build_root

    h = hashlib.sha256()
    for part in (source.read_bytes(), str(source.resolve()).encode(), "\0".join(cflags).encode(),
                 torch.__version__.encode(), sys.version.encode()):
        h.update(part + b"\0")
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    return Path(root) / f"{name}-{h.hexdigest()[:16]}"


def load(name: str, source: Path, cflags: list[str], wait: float) -> None:
    """Build the library `name` from `source` (or find it built) and load it into this process; TimeoutError after
    `wait` seconds spent waiting for another process's build of the same source."""
    from torch.utils.cpp_extension import load as torch_load

    directory = build_directory(name, source, cflags)
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "llmq.lock", "a") as lock:  # closing it releases the flock; so does dying
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"another process has been building {directory} for over {wait:.0f} s") \
                        from None
                time.sleep(0.1)
        (directory / "lock").unlink(missing_ok=True)  # torch's baton, left by a killed build: nobody else is here
        torch_load(name=name, sources=[str(source)], build_directory=str(directory), is_python_module=False,
                   extra_cflags=cflags)
