"""llama.cpp's own tools as the baseline: finding them, running them, reading what they print and write.

llama-bench times pp<N> (one N-token prompt) and tg<N> (N single-token decode steps) per GGUF; llama-perplexity
cuts a text into chunks of n_ctx tokens and scores the second half of each chunk, and with --kl-divergence-base writes
the reference model's log-probabilities of those tokens to a file that --kl-divergence compares another GGUF against.
What is mirrored here (chunking, the base file's layout, its KLD formula) follows tools/perplexity/perplexity.cpp.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import LlmqError

TOOLS = ("llama-bench", "llama-perplexity", "llama-quantize")
CONVERTER = "convert_hf_to_gguf.py"

HOWTO = """\
How to get llama.cpp's tools: build them from the source vendored in the llama-cpp-python sdist, under /tmp
(never inside the repository; tens of minutes on two cores):
  mkdir -p /tmp/llamacpp && cd /tmp/llamacpp
  pip download --no-deps --no-binary :all: llama-cpp-python && tar xzf llama_cpp_python-*.tar.gz
  cd llama_cpp_python-*/vendor/llama.cpp
  cmake -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \\
        -DLLAMA_BUILD_SERVER=OFF
  cmake --build build -j 2 --target llama-bench llama-perplexity llama-quantize
  pip install --target /tmp/llamacpp/pydeps sentencepiece     # the GGUF converter imports it
then point the benchmark at the tree (or its build/bin):
  python benchmarks/bench_vs_llamacpp.py --llama-cpp /tmp/llamacpp/llama_cpp_python-*/vendor/llama.cpp \\
        --converter-pythonpath /tmp/llamacpp/pydeps
(or set LLAMA_CPP_DIR)."""


class LlamaCppNotFound(LlmqError):
    """No llama.cpp build with the tools this comparison runs."""


@dataclass(frozen=True)
class LlamaCpp:
    bin_dir: Path
    converter: Path | None  # convert_hf_to_gguf.py of the source tree, when the tree is there
    pythonpath: tuple[str, ...]  # what the converter imports: the tree's gguf-py, then what the user added

    def tool(self, name: str) -> str:
        return str(self.bin_dir / name)

    def converter_env(self) -> dict[str, str]:
        path = [*self.pythonpath, *filter(None, [os.environ.get("PYTHONPATH")])]
        return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}


def _has_tools(d: Path) -> bool:
    return all(os.access(d / t, os.X_OK) and (d / t).is_file() for t in TOOLS)


def locate(where: str | None = None, extra_pythonpath: tuple[str, ...] = ()) -> LlamaCpp:
    """The llama.cpp build at `where` (a source tree or its build/bin; default $LLAMA_CPP_DIR, then PATH)."""
    where = where or os.environ.get("LLAMA_CPP_DIR")
    if where:
        root = Path(where).expanduser().resolve()
        bins = [root, root / "build" / "bin", root / "bin"]
        searched = f"{root} (and its build/bin, bin)"
    else:
        found = shutil.which(TOOLS[0])
        bins = [Path(found).resolve().parent] if found else []
        searched = "PATH (no --llama-cpp or LLAMA_CPP_DIR given)"
    bin_dir = next((d for d in bins if _has_tools(d)), None)
    if bin_dir is None:
        why = f"llama.cpp's tools ({', '.join(TOOLS)}) were not found in {searched}."
        if importlib.util.find_spec("llama_cpp") is not None:
            why += (" The installed llama_cpp Python package is only the library: it ships none of these command-line"
                    " tools, so it cannot run this comparison.")
        raise LlamaCppNotFound(f"{why}\n{HOWTO}")
    trees = [bin_dir, bin_dir.parent, bin_dir.parent.parent] + ([root] if where else [])
    tree = next((t for t in trees if (t / CONVERTER).is_file()), None)
    gguf_py = [str(tree / "gguf-py")] if tree is not None and (tree / "gguf-py").is_dir() else []
    return LlamaCpp(bin_dir, tree / CONVERTER if tree else None, tuple(gguf_py) + tuple(extra_pythonpath))


def run(cmd: list[str], what: str, env: dict | None = None) -> str:
    """Run one tool; its stdout and stderr together, or an LlmqError carrying their tail."""
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    out = p.stdout + p.stderr
    if p.returncode != 0:
        raise LlmqError(f"{what} failed (exit {p.returncode}): {' '.join(cmd)}\n{out[-2000:]}")
    return out


def stop(proc: subprocess.Popen, grace: float = 30.0) -> None:
    """End a server a benchmark started: SIGTERM, then SIGKILL if it is still there after `grace` seconds."""
    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# -- llama-bench ------------------------------------------------------------------------------------------------------
def parse_bench_json(text: str) -> dict[str, dict]:
    """`llama-bench -o json` -> {"pp128": {...}, "tg128": {...}}: tokens/s (mean over its repetitions) and samples."""
    out = {}
    for t in json.loads(text):
        name = f"pp{t['n_prompt']}" if t["n_prompt"] else f"tg{t['n_gen']}"
        if t.get("n_depth"):
            name += f"@d{t['n_depth']}"
        out[name] = {"tokens_per_s": t["avg_ts"], "samples": t["samples_ts"], "threads": t["n_threads"],
                     "model_bytes": t["model_size"], "params": t["model_n_params"], "build": t["build_commit"]}
    return out


# -- llama-perplexity -------------------------------------------------------------------------------------------------
def chunks(tokens: list[int], n_ctx: int, add_bos: bool = False, bos_id: int | None = None) -> list[list[int]]:
    """llama-perplexity's chunks of a text's tokens: (BOS +) tokens cut into len // n_ctx whole chunks of n_ctx, the
    remainder dropped; with add_bos the first token of every chunk is replaced by BOS. Scored in each chunk: the
    predictions made at positions scored(n_ctx), of the token after each."""
    toks = ([bos_id] if add_bos else []) + list(tokens)
    n = len(toks) // n_ctx
    if n < 2:
        raise LlmqError(f"llama-perplexity needs at least {2 * n_ctx} tokens for -c {n_ctx}; the text has {len(toks)}")
    out = [toks[i * n_ctx:(i + 1) * n_ctx] for i in range(n)]
    for c in out if add_bos else []:
        c[0] = bos_id
    return out


def scored(n_ctx: int) -> slice:
    """Positions whose next-token prediction is scored: the second half of the chunk, up to the one before last."""
    return slice(n_ctx // 2, n_ctx - 1)


_NUM = r"(-?[\d.]+(?:e[-+]?\d+)?)"


def parse_kld_output(text: str) -> dict:
    """The summary `llama-perplexity --kl-divergence` prints: mean KLD, same-top-token rate (%), both perplexities."""
    pats = {"kld": rf"Mean\s+KLD:\s+{_NUM}\s+±\s+{_NUM}", "top1": rf"Same top p:\s+{_NUM}\s+±\s+{_NUM}\s*%",
            "ppl": rf"Mean PPL\(Q\)\s+:\s+{_NUM}\s+±\s+{_NUM}",
            "ppl_base": rf"Mean PPL\(base\)\s+:\s+{_NUM}\s+±\s+{_NUM}"}
    out = {}
    for key, pat in pats.items():
        m = re.search(pat, text)
        if m is None:
            raise LlmqError(f"llama-perplexity printed no '{key}' summary (fewer than 100 scored tokens?):\n"
                            f"{text[-1500:]}")
        out[key], out[f"{key}_stderr"] = float(m.group(1)), float(m.group(2))
    return out


class KldBase:
    """The file `llama-perplexity --kl-divergence-base` writes: "_logits_", n_ctx (u32), n_vocab, n_chunk (i32), the
    n_chunk x n_ctx tokens (i32), then for every scored position of every chunk nv = 2*((n_vocab+1)/2) + 4 uint16: a
    float32 scale and minimum log-prob, then log p(v) = scale * q(v) + min (q = 0 for everything more than 16 nats
    below the maximum logit)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            head = f.read(20)
        if len(head) < 20 or head[:8] != b"_logits_":
            raise LlmqError(f"{self.path} is not a `llama-perplexity --kl-divergence-base` file")
        self.n_ctx, self.n_vocab, self.n_chunk = (int(x) for x in np.frombuffer(head[8:20], dtype="<i4"))
        self.tokens = np.fromfile(self.path, dtype="<i4", count=self.n_chunk * self.n_ctx, offset=20)
        self.rows = len(range(self.n_ctx)[scored(self.n_ctx)])
        self.nv = 2 * ((self.n_vocab + 1) // 2) + 4
        offset = 20 + 4 * self.n_chunk * self.n_ctx
        expect = offset + 2 * self.n_chunk * self.rows * self.nv
        if self.path.stat().st_size != expect:
            raise LlmqError(f"{self.path}: {self.path.stat().st_size} bytes, its header promises {expect}")
        self._data = np.memmap(self.path, dtype="<u2", mode="r", offset=offset,
                               shape=(self.n_chunk, self.rows, self.nv))

    def logprobs(self, chunk: int) -> np.ndarray:
        """[rows, n_vocab] float32 log-probabilities of one chunk's scored positions, as llama.cpp decodes them."""
        d = np.ascontiguousarray(self._data[chunk])
        sm = d[:, :4].view("<f4")  # [rows, 2]: scale, min log-prob
        return sm[:, :1] * d[:, 4:4 + self.n_vocab].astype(np.float32) + sm[:, 1:2]

    def chunk_tokens(self, add_bos: bool, bos_id: int | None) -> list[list[int]]:
        """The chunks exactly as llama.cpp evaluated them: the file's tokens (llama.cpp's tokenization of the text),
        each chunk's first replaced by BOS where the model adds one (gguf_bos). Feeding these ids to llmq compares the
        same predictions whether or not llmq's tokenizer splits the text the same way."""
        out = self.tokens.reshape(self.n_chunk, self.n_ctx).tolist()
        for c in out if add_bos else []:
            c[0] = bos_id
        return out

    def add_bos(self, tokens: list[int], bos_id: int | None) -> bool:
        """Whether llama.cpp put BOS before `tokens` (the same text tokenized by llmq): the file's tokens must be
        exactly the leading tokens of one or the other, or the two tokenizers disagree."""
        have = self.tokens.tolist()
        for bos in (False, True):
            if bos and bos_id is None:
                continue
            mine = (([bos_id] if bos else []) + list(tokens))[:len(have)]
            if mine == have:
                return bos
        mine = list(tokens)
        at = next((i for i, (a, b) in enumerate(zip(have, mine)) if a != b), min(len(have), len(mine)))
        raise LlmqError(f"llama.cpp's tokens of the text differ from llmq's at position {at}; the KLDs would not "
                        "compare the same predictions")


def gguf_bos(path: str | Path) -> tuple[bool, int | None]:
    """(whether llama.cpp puts BOS first, its id) from a GGUF's tokenizer keys, as llama-perplexity reads them."""
    import gguf

    fields = gguf.GGUFReader(path).fields

    def value(key: str):
        f = fields.get(key)
        return None if f is None else f.parts[f.data[0]][0].item()

    return bool(value("tokenizer.ggml.add_bos_token")), value("tokenizer.ggml.bos_token_id")


def kld_vs_base(base_lp: np.ndarray, lp):
    """llama.cpp's KLD of a model against the base file's rows, exactly as --kl-divergence sums it: over the vocabulary
    entries whose base log-prob exceeds -16, p_base (log p_base - log p_model); and whether the argmaxes agree.
    base_lp: [T, V] from KldBase.logprobs; lp: [T, V] log-softmax of the model (torch). Returns float64 tensors."""
    import torch

    b = torch.from_numpy(np.asarray(base_lp))
    keep = b > -16
    terms = torch.where(keep, b.double().exp() * (b.double() - lp.double()), torch.zeros((), dtype=torch.float64))
    return terms.sum(-1), lp.argmax(-1) == b.argmax(-1)
