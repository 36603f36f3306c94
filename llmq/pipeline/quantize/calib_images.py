"""A vision-language model's image calibration windows for the layer-by-layer pass: each generated image + question
conversation (calib.image_samples) as its language model receives it when served: the token embeddings with the
images' features (llmq's runtime tower and projector: what serve computes) in place of the image tokens, and the
attention masks in which an image's tokens see each other both ways (the family's own mask functions from
transformers: the masks its conditional-generation model hands its language model)."""

from __future__ import annotations

from pathlib import Path

import torch

from ...models import qformat


def _gemma3_masks(text_config, embeds: torch.Tensor, is_image: torch.Tensor) -> dict:
    from transformers.models.gemma3.modeling_gemma3 import (
        create_masks_for_vision_model,
        get_block_sequence_ids_for_mask,
    )

    return create_masks_for_vision_model(text_config, embeds, None, None, None,
                                         get_block_sequence_ids_for_mask(is_image.long(), device=embeds.device))


MASKS = {"gemma3": _gemma3_masks}   # vision-language family (models.vision.FAMILIES) -> its masks


@torch.no_grad()
def image_windows(model_dir: Path, model, samples: list[tuple[list[int], torch.Tensor]], device
                  ) -> list[tuple[torch.Tensor, dict]]:
    """(inputs_embeds [1, T, hidden], attention-mask mapping) of each (token ids, pixel values) sample, for
    streamed.capture_layer0: `model` is the streamed skeleton with its embedding loaded."""
    from ...models.checkpoint import read_config
    from ...runtime.models.vision import load_vision
    from .streamed import source_tensors

    config = read_config(model_dir)
    masks = MASKS[config["model_type"]]
    vision = load_vision(source_tensors(model_dir), config, torch.float32, device)
    embed = model.get_submodule(qformat.EMBEDDING)
    out = []
    for ids, pixels in samples:
        ids_t = torch.tensor([ids], device=device)
        embeds = embed(ids_t)
        is_image = ids_t == vision.image_token
        features = vision(pixels.to(device)).to(embeds.dtype)   # [images, tokens, hidden]
        embeds = embeds.masked_scatter(is_image[..., None].expand_as(embeds), features)
        out.append((embeds, masks(model.config, embeds, is_image)))
    return out
