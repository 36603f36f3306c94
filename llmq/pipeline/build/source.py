"""Reading the source checkpoint (a model or quantized artifact directory) one layer at a time.

Tensors are opened lazily from the safetensors files, so building a large model never holds two copies of it.
Quantized linears and KV-cache scales are read through llmq.models.qformat, the one reader of that format.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from ...errors import LlmqError
from ...models import ModelSpec
from ...models.checkpoint import read_config, safetensors_files
from .shard import LinearWeights

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


class LazyTensors(Mapping):
    """name -> tensor over every *.safetensors file of a directory, each tensor read when first asked for."""

    def __init__(self, files: list[Path]):
        from safetensors import safe_open

        self._handles, self._where = [], {}
        for f in files:
            try:
                h = safe_open(str(f), framework="pt")
            except Exception as e:  # safetensors raises its own error types for damaged headers
                raise LlmqError(f"{f}: not a readable safetensors file ({e})") from None
            self._handles.append(h)
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


def layer_prefix(i: int) -> str:
    return f"model.layers.{i}"


def linear_names(i: int) -> list[str]:
    p = layer_prefix(i)
    return [f"{p}.self_attn.{n}" for n in ATTN] + [f"{p}.mlp.{n}" for n in MLP]


class SourceModel:
    """A Hugging Face Llama-family checkpoint directory, dense or in the compressed-tensors format."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        self.config = read_config(self.path)
        self.spec = ModelSpec.from_config(self.config)
        files = safetensors_files(self.path)
        if not files:
            raise LlmqError(f"{self.path}: no *.safetensors weights found")
        self.tensors = LazyTensors(files)
        self.qconfig = None
        if "quantization_config" in self.config:
            from ...models import qformat

            self.qconfig = qformat.parse_quantization_config(self.config)

    @property
    def quantized(self) -> bool:
        return self.qconfig is not None

    def tensor(self, name: str) -> torch.Tensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise LlmqError(f"{self.path}: tensor {name} is missing from the checkpoint") from None

    def linear(self, name: str) -> LinearWeights:
        bias = self.tensors.get(f"{name}.bias")
        if self.qconfig is not None:
            from ...models import qformat

            qw = qformat.read_linear(self.tensors, name, self.qconfig)
            if qw is not None:
                return LinearWeights(name, qw=qw, bias=bias)
        return LinearWeights(name, weight=self.tensor(f"{name}.weight"), bias=bias)

    def lm_head(self) -> LinearWeights:
        if "lm_head.weight" in self.tensors or self._has_quantized("lm_head"):
            return self.linear("lm_head")
        if self.spec.tie_word_embeddings:
            return LinearWeights("lm_head", weight=self.tensor("model.embed_tokens.weight"))
        raise LlmqError(f"{self.path}: no lm_head weights and tie_word_embeddings is false")

    def _has_quantized(self, name: str) -> bool:
        return any(k.startswith(f"{name}.weight") for k in self.tensors)

    def kv_scales(self, i: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(k_scale, v_scale) of layer i when the checkpoint carries calibrated KV-cache scales."""
        if self.qconfig is None:
            return None
        from ...models import qformat

        return qformat.read_kv_scales(self.tensors, f"{layer_prefix(i)}.self_attn", self.qconfig)

    def kv_cache_dtype(self) -> str | None:
        """'int8' / 'fp8' when the source carries a KV-cache scheme, else None."""
        if self.qconfig is None:
            return None
        from ...models import qformat

        return qformat.kv_cache_dtype(self.qconfig)
