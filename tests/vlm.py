"""A tiny random Gemma 3 vision-language checkpoint (Gemma3ForConditionalGeneration: the tiny Gemma 3 text model of
helpers.FAMILIES, a 2-layer SigLIP tower over 32 x 32 images in 4 x 4 patches, 4 tokens an image) with its processor,
and generated images (digits, shapes, colours drawn with PIL: nothing downloaded)."""

from __future__ import annotations

import json
from pathlib import Path

from helpers import FAMILIES, gemma_tokenizer

IMAGE_TOKENS = {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>", "eoi_token": "<end_of_image>"}
# Gemma 3's template, its image parts where the user put them
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else "
            "m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
            "{% if p['type'] == 'image' %}<start_of_image>{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}"
            "{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n"
            "{% endif %}")


def make_tiny_vlm(path: Path, seed: int = 5, tokens_per_image: int = 4, dtype=None) -> Path:
    import torch
    from tokenizers import AddedToken
    from transformers import (
        AutoConfig,
        Gemma3ForConditionalGeneration,
        Gemma3ImageProcessor,
        Gemma3Processor,
        GemmaTokenizer,
    )

    path = Path(path)
    tok_dir = path / "_tok"
    tok = gemma_tokenizer()
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in IMAGE_TOKENS.values()],
                   special_tokens=True)
    tok.save_pretrained(tok_dir)
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(cfg | {"extra_special_tokens": IMAGE_TOKENS}))
    tok = GemmaTokenizer.from_pretrained(tok_dir)
    text = dict(vocab_size=320, hidden_size=96, intermediate_size=128, num_hidden_layers=2, num_attention_heads=6,
                num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.1,
                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                **FAMILIES["gemma3_text"] | {"final_logit_softcapping": None})  # which conditional Gemma 3 ignores
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32,
                  patch_size=4, vision_use_head=False)
    config = AutoConfig.for_model("gemma3", text_config=text, vision_config=vision, initializer_range=0.1,
                                  mm_tokens_per_image=tokens_per_image, image_token_index=tok.image_token_id,
                                  boi_token_index=tok.boi_token_id, eoi_token_index=tok.eoi_token_id)
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():   # the (1 + w) norms and the projection start at 0: random ones exercise them
        for n, p in model.named_parameters():
            if n.endswith("norm.weight") or "multi_modal_projector" in n:
                p.normal_(0, 0.3)
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(path)
    proc = Gemma3Processor(Gemma3ImageProcessor(size={"height": 32, "width": 32}), tok, chat_template=TEMPLATE,
                           image_seq_length=tokens_per_image)
    proc.save_pretrained(path)
    for f in tok_dir.iterdir():
        f.unlink()
    tok_dir.rmdir()
    return path


def image(kind: str, size: tuple[int, int] = (40, 30), seed: int = 0):
    """A generated RGB image: a digit, shapes or a flat colour on a noisy background."""
    import random

    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    im = Image.new("RGB", size, tuple(rng.randrange(256) for _ in range(3)))
    d = ImageDraw.Draw(im)
    if kind == "digit":
        d.text((size[0] // 3, size[1] // 4), str(rng.randrange(10)), fill=(255, 255, 255))
    elif kind == "shapes":
        for _ in range(3):
            x, y = rng.randrange(size[0] - 8), rng.randrange(size[1] - 8)
            d.ellipse((x, y, x + 8, y + 8), fill=tuple(rng.randrange(256) for _ in range(3)))
    return im


def encoded(im, fmt: str = "PNG") -> bytes:
    import io

    buf = io.BytesIO()
    im.save(buf, format=fmt)
    return buf.getvalue()
