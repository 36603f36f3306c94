"""A transformers model streamed from its checkpoint one module at a time: the skeleton on the meta device, each
module given its tensors when its turn comes, the hidden states entering decoder layer 0. Shared by the layer-by-layer
quantizer (layerwise.py) and the mixed-precision sensitivity pass (mixed.py); names come from the family's Arch."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ...models import qformat
from ...models.arch import Arch


class _Captured(Exception):
    pass


@torch.no_grad()
def capture_layer0(model, arch: Arch, windows: list[torch.Tensor], device) -> tuple[list[torch.Tensor], dict]:
    """The float32 hidden states entering decoder layer 0 for each window (all the same length), and the keyword
    arguments the model passes every layer (position embeddings recomputed in float32)."""
    got: list[tuple[torch.Tensor, dict]] = []

    def hook(module, args, kwargs):
        got.append((args[0] if args else kwargs["hidden_states"], kwargs))
        raise _Captured

    body = model.get_submodule(arch.layers.rpartition(".")[0])
    h = model.get_submodule(arch.layers)[0].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        for w in windows:
            try:
                body(input_ids=w[None].to(device), use_cache=False)
            except _Captured:
                pass
    finally:
        h.remove()
    hidden = [x.float() for x, _ in got]
    kwargs = {k: v for k, v in got[0][1].items() if k not in ("hidden_states", "past_key_values", "use_cache")}
    if "position_embeddings" in kwargs:
        kwargs["position_embeddings"] = tuple(t.float() for t in body.rotary_emb(hidden[0], kwargs["position_ids"]))
    return hidden, kwargs


def logits(h: torch.Tensor, head: torch.Tensor, rows: int = 16384) -> torch.Tensor:
    """h @ head.T in float32 with the (16-bit) head turned into float32 a slice of rows at a time."""
    return torch.cat([h @ head[i:i + rows].float().T for i in range(0, head.shape[0], rows)], dim=-1)


def progress_bar(enabled: bool):
    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TextColumn("left"), TimeRemainingColumn(), console=Console(stderr=True), disable=not enabled,
                    transient=False)


def source_tensors(path: Path):
    from ...models.checkpoint import safetensors_files
    from ...models.reader import LazyTensors

    return LazyTensors(safetensors_files(path))


def stored_dtype(model_dir: Path) -> torch.dtype:
    """The dtype the checkpoint stores its float tensors in (scales and dense tensors keep it)."""
    from ...models.checkpoint import read_config

    cfg = read_config(model_dir)
    name = str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32")
    return {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(name, torch.float32)


def skeleton(model_dir: Path, dtype: torch.dtype, device):
    """The model with every weight on the meta device (no memory), its rotary embedding real: modules get their
    tensors from the checkpoint one at a time (`load`), so the whole model is never in memory."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_dir))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").eval()
    rotary = model.model.rotary_emb
    model.model.rotary_emb = type(rotary)(config=model.config).to(device)
    return model


def load(module: nn.Module, prefix: str, source, device) -> nn.Module:
    """Give a meta-device module its tensors from the checkpoint (as stored), on `device`."""
    names = list(module.state_dict())
    module.load_state_dict({n: source[f"{prefix}.{n}"].to(device) for n in names}, assign=True)
    return module


def drop(model: nn.Module, name: str) -> None:
    """Replace the submodule `name` with an empty one (its tensors are read again from the checkpoint later)."""
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent), attr, nn.Module())


def head_name(source) -> str:
    """The output head's tensor: lm_head's, or the embedding table's where the model ties them."""
    head = f"{qformat.LM_HEAD}.weight"
    return head if head in source else f"{qformat.EMBEDDING}.weight"
