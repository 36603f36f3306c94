"""Running model-written code under bubblewrap (`bwrap`, Debian package `bubblewrap`): the kernel confines it.

Nothing inside the program's process guards anything, so nothing the program rewrites can loosen its confinement:
- fresh user, mount, pid, network, IPC, UTS and cgroup namespaces; no capabilities; no nested user namespaces;
- a root holding only read-only binds of the interpreter, its shared library, its stdlib and the system's shared
  libraries (/usr/lib, /lib, /lib64), a minimal read-only /dev (null, zero, random, ...), and a private
  size-limited tmpfs at /tmp, the working directory and the only writable place;
- the program runs as uid/gid 65534 inside its user namespace, which maps to the uid that runs llmq (for root:
  root without any capability, which matters only for root-owned files it can see, all read-only system files);
- rlimits: CPU seconds, address space, file size, no core dumps;
- the program is pid 1's only child in its pid namespace: when it exits, or when the timeout kills bwrap, the
  kernel kills every process left in the namespace, including ones that called setsid().
"""

from __future__ import annotations

import functools
import os
import resource
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass

from ..errors import LlmqError

NOBODY = 65534
_SYSTEM_LIBS = ("/usr/lib", "/usr/lib64", "/lib", "/lib64")
_ENV = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8", "PYTHONHASHSEED": "0"}


@dataclass
class SandboxResult:
    status: str  # "passed" | "failed" (nonzero exit) | "killed" (a signal, e.g. the CPU limit) | "timeout"
    returncode: int | None
    stdout: str
    stderr: str

    @property
    def passed(self) -> bool:
        return self.status == "passed"


def _bwrap() -> str:
    exe = shutil.which("bwrap")
    if exe is None:
        raise LlmqError("--allow-code-execution needs bubblewrap's bwrap on PATH: apt-get install -y bubblewrap")
    return exe


@functools.lru_cache(maxsize=1)
def _probe() -> str | None:
    """The first line of bwrap's error when it cannot build the sandbox here (e.g. user namespaces refused)."""
    r = run_sandboxed("print(6 * 7)", timeout=30)
    return None if r.stdout.strip() == "42" else (r.stderr.strip().splitlines() or [r.status])[-1]


def require_sandbox() -> None:
    """Refuse --allow-code-execution, in one line, where the sandbox cannot be built."""
    _bwrap()
    error = _probe()
    if error:
        raise LlmqError(f"--allow-code-execution: bubblewrap cannot build the sandbox here: {error}")


def _python_files() -> list[str]:
    """What the interpreter needs from outside /usr/lib: itself, its libpython (if shared) and its stdlib."""
    files = [os.path.realpath(sys.executable), sysconfig.get_path("stdlib")]
    if sysconfig.get_config_var("Py_ENABLE_SHARED"):
        lib = os.path.join(sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("INSTSONAME"))
        if os.path.exists(lib):
            files.append(lib)
    return files


def _limits(cpu_s: int, memory_bytes: int, file_bytes: int):
    def apply():
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_bytes, file_bytes))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    return apply


def run_sandboxed(code: str, timeout: float = 10.0, cpu_s: int = 10, memory_mb: int = 1024,
                  file_mb: int = 16) -> SandboxResult:
    """Run `code` as a Python program in /tmp of a fresh bubblewrap sandbox, within the limits above."""
    with tempfile.TemporaryFile() as program:
        program.write(code.encode())
        program.seek(0)
        cmd = [_bwrap(), "--unshare-all", "--unshare-user", "--disable-userns", "--uid", str(NOBODY), "--gid",
               str(NOBODY), "--cap-drop", "ALL", "--die-with-parent", "--new-session", "--clearenv",
               *[a for k, v in _ENV.items() for a in ("--setenv", k, v)], "--dev", "/dev",
               "--size", str(file_mb << 20), "--tmpfs", "/tmp", "--file", str(program.fileno()), "/tmp/program.py",
               "--chdir", "/tmp"]
        for d in _SYSTEM_LIBS:
            if os.path.islink(d):
                cmd += ["--symlink", os.readlink(d), d]
            elif os.path.isdir(d):
                cmd += ["--ro-bind", d, d]
        for path in _python_files():
            cmd += ["--ro-bind", path, path]
        cmd += ["--remount-ro", "/dev", "--remount-ro", "/",
                "--", os.path.realpath(sys.executable), "-I", "-S", "-B", "program.py"]
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True, pass_fds=(program.fileno(),),
                                preexec_fn=_limits(cpu_s, memory_mb << 20, file_mb << 20))
        try:
            out, err = proc.communicate(timeout=timeout)
            # bwrap reports a program killed by signal N as exit status 128 + N.
            rc = proc.returncode if proc.returncode <= 128 else 128 - proc.returncode
            status = "passed" if rc == 0 else "killed" if rc < 0 else "failed"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # bwrap dies; --die-with-parent takes the pid namespace with it
            out, err = proc.communicate()
            rc, status = proc.returncode, "timeout"
        return SandboxResult(status, rc, out.decode(errors="replace")[-4000:], err.decode(errors="replace")[-4000:])
