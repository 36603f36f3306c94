"""A vision-language model's image calibration: how many samples are image conversations (`image_count`), the
generated image + question conversations as the model sees them when served (`image_samples`), calibration windows
with their share of them (`with_images`), and for the
layer-by-layer pass each one as its language model receives it (`image_windows`): the token embeddings with the
images' features (llmq's runtime tower and projector: what serve computes) in place of the image tokens, and the
attention masks in which an image's tokens see each other both ways (the family's own mask functions from
transformers: the masks its conditional-generation model hands its language model)."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import torch

from ...errors import LlmqError
from ...models import qformat
from .calib import ChatFormat, TokenWindows, texts_digest

IMAGE_SHARE = 0.25   # of a vision-language model's calibration samples, by default: generated image conversations


def image_count(spec, share: float | None, samples: int) -> int:
    """How many of `samples` calibration samples are image conversations: --image-share of them (default
    IMAGE_SHARE) for a model whose images the runtime takes, none otherwise (an --image-share there is refused)."""
    from ...models.vision import TEXT_ONLY, runs_images

    if not runs_images(spec.vision):
        if share:
            raise LlmqError("--image-share: this model takes no images"
                            + (f" ({TEXT_ONLY[spec.vision]})" if spec.vision in TEXT_ONLY else ""))
        return 0
    return round(samples * (IMAGE_SHARE if share is None else share))


def image_samples(path, tokenizer, n: int, seed: int, chat_template: bool = True
                  ) -> tuple[list[tuple[list[int], torch.Tensor]], dict]:
    """n generated image + question conversations (llmq.image_questions) as the vision-language model in `path` sees
    them when served: rendered by its chat template (without one: the processor's image marker, the question and the
    answer on lines of their own), each image placed and preprocessed by the checkpoint's own processor
    (runtime.images.ImagePrompt). Returns [(token ids, pixel values [1, 3, H, W])] and what the manifest records."""
    from ... import image_questions
    from ...runtime.images import ImagePrompt

    questions = image_questions.image_questions(n, seed)
    prompt = ImagePrompt(path)
    fmt = ChatFormat.of(tokenizer, chat_template)
    if fmt.template is None:
        texts = [f"{prompt.marker}\n{q.question}\n{q.answer}" for q in questions]
    else:
        texts = [t for t, _ in fmt.render_all(tokenizer, [image_questions.conversation(q) for q in questions])]
    samples = []
    for text, q in zip(texts, questions):
        ids, pixels = prompt(text, [q.image])
        samples.append((ids, pixels))
    return samples, {**image_questions.summary(questions), "seed": seed,
                     "tokens": sum(len(ids) for ids, _ in samples),
                     "sha256": texts_digest(texts + [hashlib.sha256(q.image.tobytes()).hexdigest() for q in questions])}


def with_images(windows: TokenWindows, path, tokenizer, n: int, chat_template: bool = True) -> TokenWindows:
    """`windows`, the last n of them replaced by n generated image conversations (image_samples, with the windows'
    seed): the share a vision-language model's calibration gives images."""
    if not n:
        return windows
    samples, record = image_samples(path, tokenizer, n, windows.seed or 0, chat_template)
    kept = max(1, len(windows.samples) - n)
    return dataclasses.replace(windows, samples=windows.samples[:kept], domains=windows.domains[:kept],
                               images=tuple(samples), image_record=record)


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

    if not samples:
        return []
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
