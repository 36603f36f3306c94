"""Reading and writing .safetensors files one tensor at a time, so that memory never holds more than one tensor.

The safetensors package maps a whole file and copies tensors out of the map: every page it touched stays in the
process's resident set until the file is closed, so reading an 8B checkpoint tensor by tensor still shows 16 GB of
RSS, and its writer needs every tensor of a file in memory at once. Both are fine for small models and wrong for a
16 GB checkpoint on a 24 GB machine. The format is small (an 8-byte header length, a JSON header of dtype / shape /
byte range per tensor, then the bytes back to back), so llmq reads it with positioned reads into fresh buffers and
writes it by appending each tensor's bytes to a body file and putting the header in front when the file is done.
Files written here are read by safetensors, transformers and every other loader (tests check it).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import torch

from ..errors import LlmqError

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
          "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64}
NAMES = {v: k for k, v in DTYPES.items()}
MAX_HEADER = 100 << 20  # the safetensors package's own limit


class TensorFile:
    """The tensors of one .safetensors file, each read from disk when asked for (the file stays open)."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_RDONLY)
        try:
            self.entries, self.metadata, self._base = _parse_header(self._fd, os.fstat(self._fd).st_size)
        except LlmqError as e:
            self.close()
            raise LlmqError(f"{self.path}: not a readable safetensors file ({e})") from None

    def keys(self) -> list[str]:
        return list(self.entries)

    def get(self, name: str) -> torch.Tensor:
        dtype, shape, (begin, end) = self.entries[name]
        buf = torch.empty(end - begin, dtype=torch.uint8)
        view, done = memoryview(buf.numpy()), 0
        while done < len(view):
            n = os.preadv(self._fd, [view[done:]], self._base + begin + done)
            if n <= 0:
                raise LlmqError(f"{self.path}: file ended inside tensor {name}")
            done += n
        return buf.view(dtype).reshape(shape)

    def close(self) -> None:
        if getattr(self, "_fd", -1) >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self):
        self.close()


def _parse_header(fd: int, size: int) -> tuple[dict, dict, int]:
    """{name: (dtype, shape, (begin, end))}, the __metadata__ dict and the data's offset in the file, checked as
    strictly as the safetensors package checks them (byte ranges cover the data exactly, in order, no overlap)."""
    if size < 8:
        raise LlmqError("shorter than its 8-byte header length")
    (n,) = struct.unpack("<Q", os.pread(fd, 8, 0))
    if n > MAX_HEADER or 8 + n > size:
        raise LlmqError(f"header length {n} does not fit the file's {size} bytes")
    try:
        header = json.loads(os.pread(fd, n, 8))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LlmqError(f"header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise LlmqError("header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    entries, spans = {}, []
    for name, e in header.items():
        try:
            dtype = DTYPES[e["dtype"]]
            shape = [int(d) for d in e["shape"]]
            begin, end = (int(x) for x in e["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise LlmqError(f"tensor {name!r} has a malformed entry {str(e)[:80]}") from None
        numel = 1
        for d in shape:
            if d < 0:
                raise LlmqError(f"tensor {name!r} has a negative dimension")
            numel *= d
        if end - begin != numel * dtype.itemsize:
            raise LlmqError(f"tensor {name!r}: {end - begin} bytes for shape {shape} of {e['dtype']}")
        entries[name] = (dtype, shape, (begin, end))
        spans.append((begin, end))
    pos = 0
    for begin, end in sorted(spans):
        if begin != pos:
            raise LlmqError("tensor byte ranges overlap or leave a gap")
        pos = end
    if 8 + n + pos != size:
        raise LlmqError(f"the tensors take {pos} bytes but the file holds {size - 8 - n} after its header")
    return entries, metadata, 8 + n


class SafetensorsWriter:
    """One .safetensors file, written a tensor at a time: each `add` appends the tensor's bytes to a body file at once
    (nothing is kept); `close` writes header + body to `path`. Used as a context manager, an error removes both."""

    def __init__(self, path: Path | str, metadata: dict[str, str] | None = None):
        self.path = Path(path)
        self.metadata = dict(metadata or {"format": "pt"})
        self._body_path = self.path.with_name(self.path.name + ".body")
        self._body = open(self._body_path, "wb")
        self._header: dict[str, dict] = {}
        self.nbytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._header or name == "__metadata__":
            raise LlmqError(f"{self.path.name}: tensor {name} written twice")
        t = tensor.detach().to("cpu").contiguous()
        raw = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
        self._body.write(memoryview(raw.numpy()))
        end = self.nbytes + raw.numel()
        self._header[name] = {"dtype": NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [self.nbytes, end]}
        self.nbytes = end

    def close(self) -> None:
        self._body.close()
        header = json.dumps({"__metadata__": self.metadata, **self._header}, separators=(",", ":")).encode()
        header += b" " * (-len(header) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        with open(self.path, "wb") as out, open(self._body_path, "rb") as body:
            out.write(struct.pack("<Q", len(header)) + header)
            shutil.copyfileobj(body, out, 16 << 20)
        self._body_path.unlink()

    def abort(self) -> None:
        self._body.close()
        self._body_path.unlink(missing_ok=True)
        self.path.unlink(missing_ok=True)

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, exc_type, *_) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()
