"""Building a C++ extension (runtime/layers/cpp_build.py, the CPU kernels' builder) when a build was killed, is still
running elsewhere, or belongs to another install (issue 36, item 1). Each build here is a one-function library, so
the tests cost process starts, not compiles."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from llmq.runtime.layers import cpp_build

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="flock and the compiler setup are Linux's here")

# builds `source` in a fresh process (TORCH_EXTENSIONS_DIR from the environment), calls its function, prints it
BUILD = textwrap.dedent("""
    import ctypes, sys, time
    from pathlib import Path
    from llmq.runtime.layers import cpp_build
    t0 = time.monotonic()
    cpp_build.load("llmq_probe", Path(sys.argv[1]), [], wait=float(sys.argv[2]))
    so = cpp_build.build_directory("llmq_probe", Path(sys.argv[1]), []) / "llmq_probe.so"
    print(ctypes.CDLL(str(so)).llmq_probe(), round(time.monotonic() - t0, 1))
""")


def _source(tmp_path, value: int):
    path = tmp_path / f"probe{value}.cpp"
    path.write_text(f'extern "C" int llmq_probe() {{ return {value}; }}\n')
    return path


def _build(tmp_path, source, wait=60.0, timeout=240) -> subprocess.CompletedProcess:
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"))
    return subprocess.run([sys.executable, "-c", BUILD, str(source), str(wait)], env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_a_killed_build_does_not_hang_the_next_load(tmp_path, monkeypatch):
    """The state a build killed mid-compile leaves: torch's lock file in the build directory (its holder is gone).
    A live build elsewhere makes a load wait a bounded time; once that process is killed, a new load builds."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    source = _source(tmp_path, 7)
    directory = cpp_build.build_directory("llmq_probe", source, [])
    directory.mkdir(parents=True)
    # a build in progress: holds llmq's flock and torch's baton, as cpp_build.load does while torch compiles
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import fcntl, time
        f = open({str(directory / "llmq.lock")!r}, "a")
        fcntl.flock(f, fcntl.LOCK_EX)
        open({str(directory / "lock")!r}, "w").close()
        print("building", flush=True)
        time.sleep(600)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "building"
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="another process has been building"):
            cpp_build.load("llmq_probe", source, [], wait=1.0)
        assert time.monotonic() - t0 < 5
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert (directory / "lock").exists()  # the killed build's baton, which torch alone would wait on forever
    done = _build(tmp_path, source)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[0] == "7"
    assert not (directory / "lock").exists()


def test_builds_are_keyed_by_the_source(tmp_path):
    """Two installs with different sources build in two directories; neither rebuilds the other's."""
    a, b = _source(tmp_path, 1), _source(tmp_path, 2)
    dir_a, dir_b = (cpp_build.build_directory("llmq_probe", s, []) for s in (a, b))
    assert dir_a != dir_b
    assert dir_a == cpp_build.build_directory("llmq_probe", a, [])
    assert dir_a != cpp_build.build_directory("llmq_probe", a, ["-O3"])
    twin = tmp_path / "other-checkout" / a.name   # the same source in another checkout: PyTorch's build file names
    twin.parent.mkdir()                          # the source's path, so one directory would rebuild for each
    twin.write_bytes(a.read_bytes())
    assert cpp_build.build_directory("llmq_probe", twin, []) != dir_a
    for source, value in ((a, "1"), (b, "2")):
        run = _build(tmp_path, source)
        assert run.returncode == 0, run.stderr
        assert run.stdout.split()[0] == value, run.stderr
    so_a = tmp_path / "ext" / dir_a.name / "llmq_probe.so"
    built = so_a.stat().st_mtime_ns
    again = _build(tmp_path, a)
    assert again.returncode == 0, again.stderr
    assert again.stdout.split()[0] == "1", again.stderr
    assert so_a.stat().st_mtime_ns == built  # loaded, not rebuilt after b's build
