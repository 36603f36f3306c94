"""One linear layer of a checkpoint as the stages and the runtime pass it around.

Its own module so that the checkpoint reader (which produces it) and the sharding plan (which slices it) can both
import it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import bnbformat, qformat


@dataclass
class LinearWeights:
    """One linear layer of a checkpoint: a dense weight [out, in] or a quantized one (a qformat QuantizedWeight or a
    bnbformat weight), plus an optional bias."""

    name: str
    weight: torch.Tensor | None = None
    qw: qformat.QuantizedWeight | bnbformat.NF4Weight | bnbformat.Int8Weight | None = None
    bias: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape) if self.weight is not None else tuple(self.qw.shape)

    @property
    def out_features(self) -> int:
        return self.shape[0]

    def dense(self, dtype=torch.float32) -> torch.Tensor:
        return self.weight.to(dtype) if self.qw is None else self.qw.dequantize(dtype)
