"""Running model-written code: a separate process in a temporary directory, with limits, without network.

Layers, each enforced outside the model's code:
- rlimits: CPU seconds, address space, file size, no core dumps; a wall-clock timeout kills the process group.
- Linux namespaces via `unshare` when the kernel allows it (unprivileged user namespaces): a network namespace
  with no interfaces, and a mount namespace in which every file system is remounted read-only except the
  temporary directory. Where `unshare` is missing or refused, `network_isolated` is False in the result.
- A Python audit hook installed before the code runs: refuses writes outside the temporary directory, sockets,
  subprocesses, signals and loading native libraries (ctypes), so the limits hold even without namespaces.
"""

from __future__ import annotations

import functools
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

_PRELUDE = r'''
import os as _os, sys as _sys
_ROOT = _os.path.realpath({root!r}) + _os.sep
_WRITE = _os.O_WRONLY | _os.O_RDWR | _os.O_CREAT | _os.O_APPEND | _os.O_TRUNC
_PATHS = {{"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.symlink", "os.link",
          "os.truncate", "os.utime", "shutil.rmtree", "shutil.move", "os.replace"}}
_DENY = ("socket.", "subprocess.", "os.system", "os.exec", "os.posix_spawn", "os.fork", "os.forkpty", "os.kill",
         "os.killpg", "ctypes.", "os.startfile", "pty.", "os.setuid", "signal.pthread_kill", "os.chroot")
def _inside(p):
    try:
        return _os.path.realpath(_os.fsdecode(p)).startswith(_ROOT)
    except Exception:
        return False
def _hook(event, args):
    if event == "open":
        path, mode, flags = args
        if isinstance(path, int) or path is None:
            return
        writes = (mode is not None and any(c in str(mode) for c in "wax+")) or bool((flags or 0) & _WRITE)
        if writes and not _inside(path):
            raise PermissionError("sandbox: writing outside the sandbox directory is not allowed")
    elif event in _PATHS:
        for a in args:
            if isinstance(a, (str, bytes, _os.PathLike)) and not _inside(a):
                raise PermissionError(f"sandbox: {{event}} outside the sandbox directory is not allowed")
    elif event.startswith(_DENY):
        raise PermissionError(f"sandbox: {{event}} is not allowed")
_sys.addaudithook(_hook)
del _hook
_code = open("program.py").read()
exec(compile(_code, "program.py", "exec"), {{"__name__": "__main__"}})
'''

_MOUNT_SCRIPT = r'''
T="$1"; shift
mount --make-rprivate / 2>/dev/null
awk '{print $5}' /proc/self/mountinfo | while read -r mp; do
  case "$mp" in /proc|/proc/*|/sys|/sys/*|/dev|/dev/pts|/dev/pts/*) ;; *) mount -o remount,bind,ro "$mp" 2>/dev/null ;; esac
done
mount --bind "$T" "$T" && mount -o remount,bind,rw "$T" && cd "$T" || exit 97
exec "$@"
'''


@dataclass
class SandboxResult:
    status: str  # "passed" | "failed" (nonzero exit) | "killed" (a signal, e.g. the CPU limit) | "timeout"
    returncode: int | None
    stdout: str
    stderr: str
    network_isolated: bool

    @property
    def passed(self) -> bool:
        return self.status == "passed"


@functools.lru_cache(maxsize=1)
def namespaces_available() -> bool:
    """Whether `unshare` can give us a user + mount + network namespace here (and remount inside it)."""
    exe = shutil.which("unshare")
    if exe is None:
        return False
    try:
        r = subprocess.run([exe, "-rmn", "sh", "-c", "mount --make-rprivate / && mount -o remount,bind,ro / || "
                            "mount -o remount,bind,ro / 2>/dev/null; true"],
                           capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


def _limits(cpu_s: int, memory_bytes: int, file_bytes: int):
    def apply():
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_bytes, file_bytes))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    return apply


def run_sandboxed(code: str, timeout: float = 10.0, cpu_s: int = 10, memory_mb: int = 1024,
                  file_mb: int = 16) -> SandboxResult:
    """Run `code` as a Python program in a fresh temporary directory, within the limits above."""
    with tempfile.TemporaryDirectory(prefix="llmq-sandbox-") as tmp:
        root = os.path.realpath(tmp)
        Path(root, "program.py").write_text(code)
        Path(root, "boot.py").write_text(_PRELUDE.format(root=root))
        cmd = [sys.executable, "-I", "-B", "boot.py"]
        isolated = namespaces_available()
        if isolated:
            cmd = [shutil.which("unshare"), "-rmn", "sh", "-c", _MOUNT_SCRIPT, "sandbox", root, *cmd]
        env = {"PATH": "/usr/bin:/bin", "HOME": root, "TMPDIR": root, "LANG": "C.UTF-8", "PYTHONHASHSEED": "0"}
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True,
                                preexec_fn=_limits(cpu_s, memory_mb << 20, file_mb << 20))
        try:
            out, err = proc.communicate(timeout=timeout)
            status = "passed" if proc.returncode == 0 else "killed" if proc.returncode < 0 else "failed"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            status = "timeout"
        return SandboxResult(status, proc.returncode, out.decode(errors="replace")[-4000:],
                             err.decode(errors="replace")[-4000:], isolated)
