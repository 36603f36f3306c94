"""Generated images with a question whose answer can be checked: which digit, how many shapes, what colour, which
word, which bar of a chart is tallest. Drawn with Pillow from a seed (nothing downloaded, the same seed the same
image), so a vision-language model's calibration sees images (`calibration_conversations`) from data that ships
with llmq."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from PIL.Image import Image

KINDS = ("digit", "count", "colour", "word", "chart")
SIZE = 224   # pixels a side: the processor resizes to its own
COLOURS = {"red": (220, 30, 30), "green": (30, 160, 60), "blue": (30, 70, 220), "yellow": (240, 210, 30),
           "black": (10, 10, 10), "white": (245, 245, 245), "orange": (245, 140, 20), "purple": (130, 50, 170)}
WORDS = ("cat", "tree", "lamp", "river", "bread", "stone", "cloud", "horse", "paper", "music", "glass", "chair")
QUESTIONS = {"digit": "Which digit is shown in the image? Answer with the digit.",
             "count": "How many shapes are in the image? Answer with a number.",
             "colour": "What colour fills the image? Answer with one word.",
             "word": "What word is written in the image? Answer with the word.",
             "chart": "Which bar of the chart is the tallest? Answer with its letter."}


@dataclass(frozen=True)
class ImageQuestion:
    kind: str
    image: Image   # RGB, SIZE x SIZE
    question: str
    answer: str


def _font(size: int):
    from PIL import ImageFont

    return ImageFont.load_default(size=size)   # Pillow's bundled font (a bitmap one where FreeType is missing)


def _contrast(rng: random.Random) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A light background and a dark ink, or the other way round."""
    light, dark = tuple(rng.randrange(170, 256) for _ in range(3)), tuple(rng.randrange(0, 80) for _ in range(3))
    return (light, dark) if rng.random() < 0.5 else (dark, light)


def image_question(kind: str, seed: int) -> ImageQuestion:
    """One generated image of `kind` (KINDS) with its question and answer."""
    from PIL import Image, ImageDraw

    rng = random.Random(f"{kind}:{seed}")
    background, ink = _contrast(rng)
    im = Image.new("RGB", (SIZE, SIZE), background)
    d = ImageDraw.Draw(im)
    if kind == "digit":
        answer = str(rng.randrange(10))
        d.text((rng.randrange(40, 100), rng.randrange(10, 50)), answer, fill=ink, font=_font(140))
    elif kind == "count":
        n = rng.randrange(1, 7)
        cells = rng.sample(range(9), n)   # one shape per cell of a 3 x 3 grid: none overlap
        for c in cells:
            x, y = 20 + 70 * (c % 3) + rng.randrange(10), 20 + 70 * (c // 3) + rng.randrange(10)
            r = rng.randrange(18, 26)
            colour = tuple(rng.randrange(256) for _ in range(3)) if rng.random() < 0.5 else ink
            shape = rng.choice(("ellipse", "rectangle", "triangle"))
            if shape == "triangle":
                d.polygon([(x, y + 2 * r), (x + r, y), (x + 2 * r, y + 2 * r)], fill=colour, outline=ink)
            else:
                getattr(d, shape)((x, y, x + 2 * r, y + 2 * r), fill=colour, outline=ink)
        answer = str(n)
    elif kind == "colour":
        answer = rng.choice(sorted(COLOURS))
        base = COLOURS[answer]
        im = Image.new("RGB", (SIZE, SIZE), base)
        d = ImageDraw.Draw(im)
        for _ in range(40):   # faint speckle, so the image is not one value
            x, y = rng.randrange(SIZE), rng.randrange(SIZE)
            d.point((x, y), fill=tuple(min(255, max(0, c + rng.randrange(-20, 21))) for c in base))
    elif kind == "word":
        answer = rng.choice(WORDS)
        d.text((rng.randrange(10, 40), rng.randrange(60, 120)), answer, fill=ink, font=_font(48))
    elif kind == "chart":
        n = rng.randrange(3, 6)
        heights = rng.sample(range(30, 180), n)
        width = (SIZE - 40) // n
        for i, h in enumerate(heights):
            x = 20 + i * width
            d.rectangle((x + 6, SIZE - 30 - h, x + width - 6, SIZE - 30), fill=ink)
            d.text((x + width // 2 - 6, SIZE - 26), "ABCDE"[i], fill=ink, font=_font(20))
        answer = "ABCDE"[heights.index(max(heights))]
    else:
        raise ValueError(f"unknown image kind {kind!r}; one of {', '.join(KINDS)}")
    return ImageQuestion(kind, im, QUESTIONS[kind], answer)


def image_questions(n: int, seed: int) -> list[ImageQuestion]:
    """n generated images, the kinds in turn."""
    return [image_question(KINDS[i % len(KINDS)], seed * 100_003 + i) for i in range(n)]


def conversation(q: ImageQuestion) -> list[dict]:
    """The chat a calibration sample renders: the user's image and question, the assistant's answer."""
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": q.question}]},
            {"role": "assistant", "content": q.answer}]


def summary(questions: list[ImageQuestion]) -> dict:
    """What a manifest records of the generated images: how many of each kind, their size, the generator."""
    return {"images": len(questions), "kinds": dict(sorted(Counter(q.kind for q in questions).items())),
            "size": [SIZE, SIZE], "source": "generated (llmq.image_questions)"}
