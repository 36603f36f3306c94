"""The source checkpoint of a build (a model or quantized artifact directory), read lazily one tensor at a time."""

from __future__ import annotations

from ...errors import LlmqError
from ...models.reader import ATTN, MLP, CheckpointReader, layer_prefix
from .shard import LinearWeights

__all__ = ["ATTN", "MLP", "SourceModel", "layer_prefix", "linear_names"]


def linear_names(i: int) -> list[str]:
    p = layer_prefix(i)
    return [f"{p}.self_attn.{n}" for n in ATTN] + [f"{p}.mlp.{n}" for n in MLP]


class SourceModel(CheckpointReader):
    """The checkpoint being built from; linears come as LinearWeights, which the sharding plan slices."""

    def linear(self, name: str) -> LinearWeights:
        weight, qw, bias = self.linear_tensors(name)
        return LinearWeights(name, weight=weight, qw=qw, bias=bias)

    def lm_head(self) -> LinearWeights:
        if self.has_lm_head():
            return self.linear("lm_head")
        if self.spec.tie_word_embeddings:
            return LinearWeights("lm_head", weight=self.tensor("model.embed_tokens.weight"))
        raise LlmqError(f"{self.path}: no lm_head weights and tie_word_embeddings is false")
