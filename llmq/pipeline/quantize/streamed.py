"""A transformers model streamed from its checkpoint one module at a time: the skeleton on the meta device, each
module given its tensors when its turn comes, the hidden states entering decoder layer 0. Shared by the layer-by-layer
quantizer (layerwise.py) and the mixed-precision sensitivity pass (mixed.py); names come from the family's Arch."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from ...models import qformat
from ...models.arch import Arch
from .layer_inputs import StreamLayout


class _Captured(Exception):
    pass


class _Recorder(nn.Module):
    """Stands in for a decoder layer: records the keyword arguments the model passes it and hands the hidden states
    on unchanged (the last one stops the forward: nothing after the layers has its weights)."""

    def __init__(self, seen: list, last: bool):
        super().__init__()
        self.seen, self.last = seen, last

    def forward(self, hidden_states, *args, **kwargs):
        self.seen.append((hidden_states, kwargs, args))
        if self.last:
            raise _Captured
        return hidden_states


@torch.no_grad()
def capture_layer0(model, arch: Arch, windows: list[torch.Tensor], device, layout: StreamLayout | None = None,
                   images: Sequence[tuple[torch.Tensor, dict]] = ()) -> tuple[list[torch.Tensor], list[list[dict]]]:
    """The float32 hidden states entering decoder layer 0 for each window (the text windows all the same length;
    widened by `layout` with what Gemma 4's layers read besides them: layer_inputs), then for each image window
    (its inputs_embeds [1, T, hidden], the image features already in place, and its attention-mask mapping: the
    images' tokens see each other both ways; calib_images.image_windows), and per layer each window's keyword
    arguments the model passes the layer (its mask and position embeddings: a family may give layer types their
    own; position embeddings recomputed in float32). The text windows share one set."""
    body = model.get_submodule(arch.layers.rpartition(".")[0])
    layers = model.get_submodule(arch.layers)
    real, seen = list(layers), []
    for i in range(len(real)):
        layers[i] = _Recorder(seen, last=i == len(real) - 1)
    types = getattr(model.config, "layer_types", None)

    def run(**inputs) -> torch.Tensor:
        seen.clear()
        try:
            body(**inputs, use_cache=False)
        except _Captured:
            pass
        h = seen[0][0].float()
        return layout.widen(h, [a[0] for _, _, a in seen]) if layout is not None else h

    def kwargs(h: torch.Tensor) -> list[dict]:
        per_layer = []
        for i, (_, kw, _) in enumerate(seen):
            kw = {k: v for k, v in kw.items() if k not in ("hidden_states", "past_key_values", "use_cache",
                                                            "shared_kv_states")}
            if "position_embeddings" in kw:
                extra = {"layer_type": types[i]} if arch.window == "per_layer" and arch.local_rotary else {}
                kw["position_embeddings"] = tuple(t.float() for t in body.rotary_emb(h, kw["position_ids"], **extra))
            per_layer.append(kw)
        return per_layer

    hidden, per_window = [], []
    try:
        for w in windows:
            hidden.append(run(input_ids=w[None].to(device)))
        shared = kwargs(hidden[0]) if windows else []
        per_window = [shared] * len(windows)
        for embeds, masks in images:
            hidden.append(run(inputs_embeds=embeds.to(device), attention_mask=masks))
            per_window.append(kwargs(hidden[-1]))
    finally:
        for i, layer in enumerate(real):
            layers[i] = layer
    return hidden, [[w[i] for w in per_window] for i in range(len(real))]


def logits(h: torch.Tensor, head: torch.Tensor, rows: int = 16384) -> torch.Tensor:
    """h @ head.T in float32 with the (16-bit) head turned into float32 a slice of rows at a time."""
    return torch.cat([h @ head[i:i + rows].float().T for i in range(0, head.shape[0], rows)], dim=-1)


def capped(z: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Logits as the model gives them: c tanh(z / c) where it caps them (ModelSpec.final_softcap: Gemma)."""
    return z if softcap is None else torch.tanh(z / softcap) * softcap


def progress_bar(enabled: bool):
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TextColumn("left"), TimeRemainingColumn(), console=Console(stderr=True), disable=not enabled,
                    transient=False)


def source_tensors(path: Path, spec=None, rotate: str = "none", seed: int = 0):
    """A checkpoint's tensors, read as asked for; with its ModelSpec, a stacked MoE's experts (Experts.stacked) as
    each expert's linears (reader.UnstackedTensors: what install's blocks hold), and with `rotate` (--rotate) too as
    the rotated model's (rotation.RotatedTensors, seeded by `seed`)."""
    from ...models.checkpoint import safetensors_files
    from ...models.reader import LazyTensors, UnstackedTensors

    tensors = LazyTensors(safetensors_files(path))
    if spec is None:
        return tensors
    if spec.stacked_experts():
        tensors = UnstackedTensors(tensors, spec)
    if rotate != "none":
        from .rotation import RotatedTensors

        tensors = RotatedTensors(tensors, spec, seed)
    return tensors


def stored_dtype(model_dir: Path) -> torch.dtype:
    """The dtype the checkpoint stores its float tensors in (scales and dense tensors keep it)."""
    from ...models.checkpoint import read_config

    cfg = read_config(model_dir)
    name = str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32")
    return {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(name, torch.float32)


def skeleton(model_dir: Path, arch: Arch, dtype: torch.dtype, device):
    """The model with every weight on the meta device (no memory), its rotary embedding real: modules get their
    tensors from the checkpoint one at a time (`load`), so the whole model is never in memory."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    config = AutoConfig.from_pretrained(str(model_dir)).get_text_config()   # a vision-language model's language model
    # SDPA where transformers has it for the family (GPT-OSS's sinks have only the eager attention)
    attention = "sdpa" if getattr(MODEL_FOR_CAUSAL_LM_MAPPING[type(config)], "_supports_sdpa", True) else "eager"
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attention).eval()
    if arch.moe is not None:  # one linear per expert, under the checkpoint's names
        from .experts import install

        with torch.device("meta"):
            install(model, arch, config)
    rotary = model.model.rotary_emb
    model.model.rotary_emb = type(rotary)(config=model.config).to(device)
    if arch.embed_scale:  # transformers' scaled embedding keeps sqrt(hidden) in a buffer no checkpoint holds
        model.get_submodule(qformat.EMBEDDING).embed_scale = torch.tensor(config.hidden_size ** 0.5, device=device)
    ple = arch.per_layer_inputs
    if ple is not None and getattr(config, ple.size_field):   # Gemma 4's per-layer table likewise, by sqrt(size)
        model.get_submodule(ple.table).embed_scale = torch.tensor(getattr(config, ple.size_field) ** 0.5,
                                                                   device=device)
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
