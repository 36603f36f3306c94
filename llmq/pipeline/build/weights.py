"""A model's (or one rank's) weights as float32 values, the form the reference check computes with: every target's
reader produces it from what that target stores, applying the target's own dequantization."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Lin:
    weight: torch.Tensor            # float32 [out, in]
    bias: torch.Tensor | None = None


@dataclass
class RankWeights:
    """One rank's slice of the model, dequantized to float32, under the Hugging Face module names."""

    embed: torch.Tensor                     # [vocab, hidden] or, with a parallel embedding, this rank's rows
    layers: list[dict[str, Lin]]            # q_proj ... down_proj
    norms: list[tuple[torch.Tensor, torch.Tensor]]
    final_norm: torch.Tensor
    lm_head: torch.Tensor                   # this rank's vocab rows
    kv_scales: list = field(default_factory=list)   # per layer: (k_scale, v_scale) as stored, or None
