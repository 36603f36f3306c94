"""Reading a checkpoint directory (dense or compressed-tensors) lazily, one tensor at a time.

Shared by the build stage (which slices it into rank shards) and the runtime (which loads it): tensors are opened
from the safetensors files on demand, so neither ever holds two copies of a large model. Quantized linears and
KV-cache scales are read through `qformat`, the one reader of that format.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from ..errors import LlmqError
from . import qformat
from .checkpoint import read_config, safetensors_files
from .spec import ModelSpec

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def layer_prefix(i: int) -> str:
    return f"model.layers.{i}"


class LazyTensors(Mapping):
    """name -> tensor over every *.safetensors file of a directory, each tensor read when first asked for."""

    def __init__(self, files: list[Path]):
        from safetensors import safe_open

        self._where = {}
        for f in files:
            try:
                h = safe_open(str(f), framework="pt")
            except Exception as e:  # safetensors raises its own error types for damaged headers
                raise LlmqError(f"{f}: not a readable safetensors file ({e})") from None
            for k in h.keys():
                self._where[k] = h

    def __getitem__(self, name: str) -> torch.Tensor:
        try:
            return self._where[name].get_tensor(name)
        except KeyError:
            raise KeyError(name) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


class CheckpointReader:
    """A Llama-family checkpoint directory: config, spec, and its tensors, dense or quantized."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        self.config = read_config(self.path)
        self.spec = ModelSpec.from_config(self.config)
        files = safetensors_files(self.path)
        if not files:
            raise LlmqError(f"{self.path}: no *.safetensors weights found")
        self.tensors = LazyTensors(files)
        self.qconfig = qformat.parse_quantization_config(self.config)

    @property
    def quantized(self) -> bool:
        return self.qconfig is not None

    def tensor(self, name: str) -> torch.Tensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise LlmqError(f"{self.path}: tensor {name} is missing from the checkpoint") from None

    def linear_tensors(self, name: str) -> tuple[torch.Tensor | None, qformat.QuantizedWeight | None,
                                                 torch.Tensor | None]:
        """(dense weight, quantized weight, bias) of one linear: exactly one of the first two is set."""
        bias = self.tensors.get(f"{name}.bias")
        qw = qformat.read_linear(self.tensors, name, self.qconfig) if self.qconfig is not None else None
        return (None if qw is not None else self.tensor(f"{name}.weight")), qw, bias

    def has_lm_head(self) -> bool:
        return any(k.startswith("lm_head.") for k in self.tensors)

    def kv_scales(self, i: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(k_scale, v_scale) of layer i when the checkpoint carries calibrated KV-cache scales."""
        return qformat.read_kv_scales(self.tensors, f"{layer_prefix(i)}.self_attn", self.qconfig)

    def kv_cache_dtype(self) -> str | None:
        """'int8' / 'fp8' when the checkpoint carries a KV-cache scheme, else None."""
        return qformat.kv_cache_dtype(self.qconfig)
