"""Calibration text and the quality probe's held-out text, turned into fixed-length token windows.

`--calib` takes a local .txt file, a .jsonl file (one {"text": ...} per line), a directory of those, or, for users
with a network, a Hugging Face dataset name (`name` or `name:config`, field "text", split "train"). The default works
offline: a bundled English text written for llmq plus a fixed list of Python standard-library modules (prose
docstrings and code, both of which the default model is used for). The probe's held-out text is a second bundled
English text plus standard-library modules the calibration never sees. Windows are non-overlapping, shuffled with
`seed` and taken in that order, so the same data and seed give the same samples; the manifest records the source,
a sha256 of the text, and the sample / token counts.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

from ...errors import LlmqError
from ...jsonl import read_jsonl

DATA = Path(__file__).parent / "data"
CALIB_STDLIB = ("textwrap.py", "heapq.py", "bisect.py", "fractions.py", "calendar.py", "statistics.py", "shlex.py",
                "string.py", "colorsys.py", "difflib.py")
PROBE_STDLIB = ("fnmatch.py", "glob.py", "queue.py")
PROBE_WINDOW = 512


@dataclass(frozen=True)
class TokenWindows:
    """Token windows (each a 1-D LongTensor, all the same length) and where they came from."""

    samples: list[torch.Tensor]
    source: str
    sha256: str
    seed: int | None

    @property
    def tokens(self) -> int:
        return sum(len(s) for s in self.samples)

    def manifest(self) -> dict:
        return {"source": self.source, "sha256": self.sha256, "samples": len(self.samples), "tokens": self.tokens,
                "seq_len": len(self.samples[0]), "seed": self.seed}


def _stdlib(names: tuple[str, ...]) -> list[tuple[str, str]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return [(f"stdlib:{n}", (root / n).read_text(encoding="utf-8")) for n in names if (root / n).is_file()]


def _read_texts(p: Path) -> list[str]:
    texts = []
    for i, row in read_jsonl(p):
        if not isinstance(row, dict) or not isinstance(row.get("text"), str):
            raise LlmqError(f"{p}:{i}: each JSONL line needs a string field \"text\"")
        texts.append(row["text"])
    return texts


def _read_file(p: Path) -> list[str]:
    if p.suffix.lower() in (".jsonl", ".json"):
        return _read_texts(p)
    try:
        return [p.read_text(encoding="utf-8")]
    except UnicodeDecodeError:
        raise LlmqError(f"{p}: not a UTF-8 text file") from None


def _dataset(name: str, want_chars: int) -> list[str]:
    """Texts from a Hugging Face dataset (network needed); stops once about `want_chars` characters are read."""
    try:
        import datasets
    except ImportError:
        raise LlmqError("--calib with a dataset name needs the `datasets` package; pass a local .txt/.jsonl file or "
                        "a directory instead") from None
    ds_name, _, config = name.partition(":")
    try:
        ds = datasets.load_dataset(ds_name, config or None, split="train", streaming=True)
        texts, n = [], 0
        for row in ds:
            t = row.get("text")
            if isinstance(t, str) and t.strip():
                texts.append(t)
                n += len(t)
                if n >= want_chars:
                    break
    except Exception as e:  # network, hub and dataset-script errors all mean the same to the user
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise LlmqError(f"cannot load calibration dataset {name!r} ({reason}); without a network pass a local "
                        ".txt/.jsonl file or directory to --calib, or omit it for the bundled text") from None
    return texts


def calibration_texts(calib: str | None, want_chars: int) -> tuple[str, list[str]]:
    """(source description, texts) for a --calib value (None: the bundled offline default)."""
    if calib is None:
        docs = [("bundled:calib_en.txt", (DATA / "calib_en.txt").read_text(encoding="utf-8"))] + _stdlib(CALIB_STDLIB)
        return "+".join(n for n, _ in docs), [t for _, t in docs]
    p = Path(calib).expanduser()
    if p.is_file():
        return f"file:{p.resolve()}", _read_file(p)
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in (".txt", ".jsonl"))
        if not files:
            raise LlmqError(f"{p}: no .txt or .jsonl files to calibrate on")
        return f"dir:{p.resolve()}", [t for f in files for t in _read_file(f)]
    if calib.startswith((".", "/", "~")) or calib.count("/") > 1 or p.suffix.lower() in (".txt", ".jsonl", ".json"):
        raise LlmqError(f"--calib {calib}: no such file or directory")
    return f"dataset:{calib}", _dataset(calib, want_chars)


def _token_stream(tokenizer, texts: list[str]) -> list[int]:
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for t in texts:
        if not t.strip():
            continue
        if ids and eos is not None:
            ids.append(int(eos))
        ids.extend(tokenizer(t, add_special_tokens=False)["input_ids"])
    return ids


def _digest(texts: list[str]) -> str:
    h = hashlib.sha256()
    for t in texts:
        h.update(hashlib.sha256(t.encode()).digest())
    return h.hexdigest()


def load_calibration(calib: str | None, tokenizer, num_samples: int, seq_len: int, seed: int) -> TokenWindows:
    """`num_samples` windows of `seq_len` tokens (fewer when the data is short: every window it has; a single
    shorter window when it has less than `seq_len` tokens). Empty data is an error."""
    source, texts = calibration_texts(calib, want_chars=num_samples * seq_len * 8)
    ids = _token_stream(tokenizer, texts)
    if len(ids) < 2:
        raise LlmqError(f"calibration data {source} is empty (no text to calibrate on)")
    if len(ids) < seq_len:
        windows = [ids]
    else:
        windows = [ids[i:i + seq_len] for i in range(0, len(ids) - seq_len + 1, seq_len)]
        order = torch.randperm(len(windows), generator=torch.Generator().manual_seed(seed)).tolist()
        windows = [windows[i] for i in order[:num_samples]]
    return TokenWindows([torch.tensor(w, dtype=torch.long) for w in windows], source, _digest(texts), seed)


def load_probe_text(tokenizer, tokens: int) -> TokenWindows:
    """About `tokens` held-out tokens (whole windows of up to PROBE_WINDOW), in text order."""
    docs = [("bundled:probe_en.txt", (DATA / "probe_en.txt").read_text(encoding="utf-8"))] + _stdlib(PROBE_STDLIB)
    ids = _token_stream(tokenizer, [t for _, t in docs])
    window = min(PROBE_WINDOW, tokens, len(ids))
    n = max(1, min(tokens, len(ids)) // window)
    samples = [torch.tensor(ids[i * window:(i + 1) * window], dtype=torch.long) for i in range(n)]
    return TokenWindows(samples, "+".join(name for name, _ in docs), _digest([t for _, t in docs]), None)
