"""Images into a vision-language model's prompt: bytes decoded within bounds, then the checkpoint's own processor
(transformers' AutoProcessor: resize, normalise, the placeholder tokens an image takes) turns the rendered chat text
and the images into token ids and pixel values for LLMEngine.add_request. Nothing is fetched: images arrive as bytes
(serve takes `data:` URLs only)."""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass

from ..errors import LlmqError

FORMATS = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG"}


@dataclass(frozen=True)
class ImageLimits:
    max_images: int = 8            # images in one request
    max_bytes: int = 8 << 20       # one image's encoded bytes
    max_pixels: int = 16_000_000   # one image's width x height, checked from its header before it is decoded


def data_url_bytes(url: str, limits: ImageLimits) -> tuple[str, bytes]:
    """(MIME type, bytes) of a `data:<type>;base64,<payload>` URL; one line for anything else (remote URLs are
    refused: nothing is fetched)."""
    if not url.startswith("data:"):
        scheme = url.split(":", 1)[0][:16] if ":" in url else "a relative"
        raise LlmqError(f"image_url: only data: URLs (base64 PNG / JPEG) are accepted; {scheme} URLs are refused "
                        "(this server fetches nothing)")
    head, sep, payload = url[5:].partition(",")
    mime, _, enc = head.partition(";")
    if not sep or enc != "base64":
        raise LlmqError("image_url: a data: URL must be data:<image/png|image/jpeg>;base64,<payload>")
    if mime.lower() not in FORMATS:
        raise LlmqError(f"image_url: MIME type {mime[:40]!r} is not accepted; send image/png or image/jpeg")
    if len(payload) > (limits.max_bytes * 4) // 3 + 4:
        raise LlmqError(f"image_url: an image of more than {limits.max_bytes:,} bytes is refused")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise LlmqError("image_url: the data: URL's payload is not valid base64") from None
    return mime.lower(), data


def decode_image(mime: str, data: bytes, limits: ImageLimits):
    """An RGB PIL image from PNG / JPEG bytes: the format must be what the MIME type says, and the size its header
    declares is checked against limits.max_pixels before any pixel is decoded (a decompression bomb never expands);
    a truncated or corrupt image is one line."""
    from PIL import Image, UnidentifiedImageError

    try:
        im = Image.open(io.BytesIO(data), formats=[FORMATS[mime]])
        w, h = im.size
    except Image.DecompressionBombError:   # PIL's own bound, past ours, checked on the header too
        raise LlmqError(f"image_url: an image of more than {limits.max_pixels:,} pixels is refused") from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError):
        raise LlmqError(f"image_url: not a readable {FORMATS[mime]} image") from None
    if w < 1 or h < 1 or w * h > limits.max_pixels:
        raise LlmqError(f"image_url: a {w} x {h} image is refused; at most {limits.max_pixels:,} pixels")
    try:
        im.load()
    except (OSError, ValueError, Image.DecompressionBombError, SyntaxError):
        raise LlmqError(f"image_url: the {FORMATS[mime]} image is truncated or corrupt") from None
    return im.convert("RGB")


class ImagePrompt:
    """A vision-language model's processor, loaded once: `__call__(text, images)` -> (token ids, pixel values or
    None) for LLMEngine.add_request. The text is the rendered chat template, which places one image marker (the
    processor's image token) per image; the processor expands each into the model's placeholder tokens."""

    def __init__(self, path):
        from ..models.vision import load_processor

        self.processor = load_processor(path)
        self.marker = self.processor.image_token

    def __call__(self, text: str, images: list):
        if not images:
            return self.processor.tokenizer(text, add_special_tokens=False)["input_ids"], None
        if text.count(self.marker) != len(images):
            raise LlmqError(f"{len(images)} image(s) but the chat template placed {text.count(self.marker)}")
        try:
            out = self.processor(text=text, images=images, add_special_tokens=False, return_tensors="pt")
        except (ValueError, TypeError) as e:   # the processor's own checks (image count, sizes)
            raise LlmqError(f"the processor refused the images: {(str(e).splitlines() or [''])[0][:200]}") from None
        return out["input_ids"][0].tolist(), out["pixel_values"]
