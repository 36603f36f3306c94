"""Rotary position embedding with a precomputed cos/sin table indexed by each token's absolute position.

The inverse frequencies (and any rope_scaling such as llama3 / linear / yarn) come from transformers' own rotary
module for the model's config, so every scaling variant the reference supports is reproduced exactly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from ...models import ModelSpec

RopeTable = tuple[torch.Tensor, float]  # (inverse frequencies, attention scaling)
RopeTables = tuple[RopeTable, RopeTable | None]  # the global layers' and the local layers' (rope_tables)


def rope_inv_freq(hf_config, rotary: str | None = None, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """(inv_freq, attention_scaling) exactly as transformers computes them for this config: Llama's one table, or
    the family's own rotary class's (Arch.rotary, a dotted path): its table, or `layer_type`'s where each type has
    its own."""
    if rotary is None:
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        rot = LlamaRotaryEmbedding(config=hf_config)
        return rot.inv_freq.detach().float().cpu(), float(getattr(rot, "attention_scaling", 1.0))
    import importlib

    module, _, name = rotary.rpartition(".")
    rot = getattr(importlib.import_module(module), name)(config=hf_config)
    prefix = f"{layer_type}_" if layer_type else ""   # one table (a partial one: Qwen3.5's), or a layer type's
    return (getattr(rot, f"{prefix}inv_freq").detach().float().cpu(),
            float(getattr(rot, f"{prefix}attention_scaling", 1.0)))


def rope_tables(config: dict, spec: ModelSpec) -> RopeTables:
    """A model's rotary tables (its language config and ModelSpec): the global layers' (a model whose layers all
    slide looks the local one up for them, unused) and the local layers' where it has any (the same table where the
    family gives them none of their own, Arch.local_rotary). Tensor-parallel rank 0
    computes them and hands them to the other ranks, which then never import transformers (its modelling modules
    are most of a fresh process's start)."""
    from ...models.config_fields import checked_hf_config

    hf, arch = checked_hf_config(config), spec.arch
    own = arch.window == "per_layer" and arch.local_rotary   # each layer type its own table (Gemma 3)
    glob = rope_inv_freq(hf, arch.rotary, None if not own else
                         "full_attention" if len(spec.local_layers) < spec.num_layers else "sliding_attention")
    if not spec.local_layers:
        return glob, None
    return glob, rope_inv_freq(hf, arch.rotary, "sliding_attention") if own else glob


class RotaryEmbedding(nn.Module):
    def __init__(self, inv_freq: torch.Tensor, max_positions: int, scaling: float = 1.0, device=None,
                 dtype=torch.float32):
        super().__init__()
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq.float())
        emb = torch.cat([freqs, freqs], dim=-1)
        sin = emb.sin() * scaling
        sin[:, :sin.shape[1] // 2] *= -1  # folds rotate_half's sign in: rotate_half(x) * sin == roll(x) * this
        self.register_buffer("cos", (emb.cos() * scaling).to(device=device, dtype=dtype), persistent=False)
        self.register_buffer("sin", sin.to(device=device, dtype=dtype), persistent=False)

    def table(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, 1, D] of the step's positions, looked up once per step and shared by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [T, heads, D] (the half-split convention of Llama checkpoints)."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)
