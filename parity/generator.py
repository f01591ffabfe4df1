"""Deterministic, seeded parity requests: enough questions for statistics over every input kind.

`generate(seed, questions)` walks a fixed rotation of state kinds and question kinds and draws
the details (sizes, texts, keys, grade counts) from `random.Random(seed)`, so the same seed gives
the same requests byte for byte (images are drawn with numpy arithmetic and PIL, then encoded in
process). `ci_set()` is the CPU gate's set, `gpu_set()` the GPU gate's (>= 200 questions).

State kinds: short ASCII text, Unicode text (CJK, Devanagari, Arabic, combining marks, emoji
sequences), a JSON object, a system/user/assistant conversation, a long text (over two 64-token
chunks of the delta rule), and images: PNG, JPEG, odd non-square sizes, EXIF orientations 2-8,
RGBA PNG, below min_pixels, sizes whose patch grid lands exactly on .5 (where smart_resize's
half-to-even rounding matters), two images in one conversation. Question kinds: choice (1-5
options, Unicode keys, null criteria), noul, score with 2-10 grades; requests carry 1-3 questions
of mixed kinds. Every set ends with the `video` case group's requests (parity/cases.py: MP4 and
WebM clips, short and long, one with an odd sampled-frame count, text before and after the video,
every question type); they come after the rotation, so the rotation's draws do not depend on them.
"""

from __future__ import annotations

import random

import numpy as np
from PIL import Image, ImageDraw

from .cases import jpeg_data_url, png_data_url, video_case

MODEL = "valen-preview-0923"
CI_QUESTIONS = 40
GPU_QUESTIONS = 210

STATE_KINDS = (
    "text", "png", "unicode", "jpeg", "json", "half", "messages", "exif", "long", "rgba", "small", "two_images",
)
IMAGE_KINDS = ("png", "jpeg", "half", "exif", "rgba", "small", "two_images")
# A quarter of the questions are scores: each grade is a branch of its own (the costly kind).
QUESTION_KINDS = ("choice", "noul", "score", "choice")

# Sides of 32k + 16 with k even: height / 32 and width / 32 end in exactly .5 and Python's round
# goes down to the even k (a half-up rounding would take k + 1); k >= 8 keeps the rounded image
# at or above min_pixels (256 x 256), so the .5 rounding decides the grid.
HALF_SIDES = (272, 336, 400)

WORDS = ("order", "refund", "package", "late", "broken", "customer", "invoice", "board", "player", "move", "light",
         "door", "window", "screen", "button", "queue", "ticket", "delivery", "account", "password")
UNICODE_SNIPPETS = ("白色棋子在棋盘上。", "客户非常生气 😡", "नमस्ते दुनिया", "مرحبا بالعالم", "e\u0301 a\u0308 n\u0303 (combining)",
                    "👨\u200d👩\u200d👧 👍🏽 ✅", "Ünïcödé café — très bien ✓", "灯是开着的，门开着。", "Привет, мир", "ελληνικά γράμματα")
CHOICE_KEYS = ("yes", "no", "wait", "refund", "up", "down", "left", "right", "白色", "黑色", "🤷", "é", "billing", "support")
DESCRIPTIONS = ("Refund now", "Wait for the bank", "白色玩家 (white) ♙", "黑色玩家 (black) ♟", "नहीं पता — unknown 🤔",
                "Move up ↑", "Move down ↓", "Send a replacement", "Ask for a photo", "Nobody is ahead", "Both 中文 and English")
GRADES = ("Calm 平静", "Slightly annoyed", "Annoyed 😒", "Angry", "Furious 🤬", "Far", "Halfway", "Close", "Low", "Medium",
          "High", "Critical", "Level")


def _data_url(img: Image.Image, fmt: str, exif_orientation: int | None = None) -> str:
    return png_data_url(img) if fmt == "PNG" else jpeg_data_url(img, exif_orientation)


def picture(width: int, height: int, rng: random.Random) -> Image.Image:
    """Gradients, stripes and a few shapes from integer arithmetic (resizing has edges to work on)."""
    a, b, c, d = (rng.randrange(1, 13) for _ in range(4))
    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack([(x * a + y * b) % 256, (y * c + (x // 7) * 29) % 256, ((x ^ y) * d) % 256], axis=-1).astype(np.uint8)
    img = Image.fromarray(rgb, "RGB")
    draw = ImageDraw.Draw(img)
    for _ in range(3):
        x0, y0 = rng.randrange(width), rng.randrange(height)
        x1, y1 = min(width - 1, x0 + rng.randrange(4, max(5, width // 2))), min(height - 1, y0 + rng.randrange(4, max(5, height // 2)))
        colour = tuple(rng.randrange(256) for _ in range(3))
        (draw.rectangle if rng.random() < 0.5 else draw.ellipse)([x0, y0, x1, y1], fill=colour)
    draw.line([0, height - 1, width - 1, 0], fill=(0, 180, 40), width=3)
    return img


def _odd_size(rng: random.Random, low: int = 97, high: int = 451) -> tuple[int, int]:
    while True:
        w, h = rng.randrange(low, high) | 1, rng.randrange(low, high) | 1
        if w != h:
            return w, h


def _image_state(kind: str, rng: random.Random) -> dict:
    if kind == "png":
        return {"image": _data_url(picture(*_odd_size(rng), rng), "PNG")}
    if kind == "jpeg":
        return {"image": _data_url(picture(*_odd_size(rng), rng), "JPEG")}
    if kind == "half":
        w, h = rng.choice(HALF_SIDES), rng.choice(HALF_SIDES)
        return {"image": _data_url(picture(w, h, rng), rng.choice(("PNG", "JPEG")))}
    if kind == "exif":
        return {"image": _data_url(picture(*_odd_size(rng), rng), "JPEG", exif_orientation=rng.randrange(2, 9))}
    if kind == "rgba":
        w, h = _odd_size(rng)
        img = picture(w, h, rng).convert("RGBA")
        img.putalpha(Image.linear_gradient("L").resize((w, h)))
        return {"image": _data_url(img, "PNG")}
    if kind == "small":  # under min_pixels (65536): upscaled
        return {"image": _data_url(picture(rng.randrange(40, 160) | 1, rng.randrange(30, 120), rng), "PNG")}
    if kind == "two_images":
        first, second = picture(*_odd_size(rng, 64, 300), rng), picture(*_odd_size(rng, 64, 300), rng)
        return {"messages": [{"role": "user", "content": [
            {"type": "text", "text": "Before:"},
            {"type": "image_url", "image_url": {"url": _data_url(first, "PNG")}},
            {"type": "text", "text": "After 之后:"},
            {"type": "image_url", "image_url": _data_url(second, "JPEG")},
        ]}]}
    raise ValueError(kind)


def _sentence(rng: random.Random, words: int) -> str:
    text = " ".join(rng.choice(WORDS) for _ in range(words))
    return text[0].upper() + text[1:] + "."


def _text_state(kind: str, rng: random.Random):
    if kind == "text":
        return _sentence(rng, rng.randrange(5, 16))
    if kind == "unicode":
        return " ".join([_sentence(rng, 4)] + rng.sample(UNICODE_SNIPPETS, 3))
    if kind == "json":
        return {"board": [[rng.randrange(3) for _ in range(3)] for _ in range(3)], "player": rng.choice(("white", "black")),
                "note": rng.choice(UNICODE_SNIPPETS), "count": rng.randrange(100)}
    if kind == "messages":
        return {"messages": [
            {"role": "system", "content": "You judge customer support cases."},
            {"role": "user", "content": [{"type": "text", "text": "  " + _sentence(rng, 6) + "  "}]},
            {"role": "assistant", "content": "Sorry to hear that. " + _sentence(rng, 4)},
            {"role": "user", "content": _sentence(rng, 7) + "\n\t" + rng.choice(UNICODE_SNIPPETS)},
        ]}
    if kind == "long":  # 200-450 tokens with the fixture's tokenizer: three to seven delta-rule chunks
        parts = [_sentence(rng, rng.randrange(8, 20)) for _ in range(rng.randrange(5, 9))]
        parts.insert(rng.randrange(len(parts)), rng.choice(UNICODE_SNIPPETS))
        return " ".join(parts)
    raise ValueError(kind)


CHOICE_COUNTS = (2, 3, 1, 4, 2, 5, 3)  # options per choice question, in turn


def _question(kind: str, rng: random.Random, grades: int, options: int) -> dict:
    instructions = rng.choice(("Which option fits best?", "What should happen next?", "哪个选项最好？ Which is best?",
                               "How severe is it? 严重程度", "Is the condition met?", "Who is ahead?"))
    if kind == "noul":
        return {"type": "noul", "instructions": rng.choice(("Is the light on?", "Is this a duplicate request?", "灯开着吗？满足条件吗？"))}
    if kind == "score":
        criteria = [f"{rng.choice(GRADES)} {i}" for i in range(grades)]
        return {"type": "score", "instructions": instructions, "criteria": criteria}
    keys = rng.sample(CHOICE_KEYS, options)
    return {"type": "choice", "instructions": instructions,
            "criteria": {k: (None if rng.random() < 0.15 else rng.choice(DESCRIPTIONS)) for k in keys}}


def generate(seed: int = 0, questions: int = GPU_QUESTIONS) -> list[tuple[str, str, dict]]:
    """[(case, name, request)] with at least `questions` questions in total."""
    rng = random.Random(f"valen-parity-generator/{seed}")
    out, total, q_index, grade_index, choice_index = [], 0, 0, 0, 0
    while total < questions:
        n = len(out)
        state_kind = STATE_KINDS[n % len(STATE_KINDS)]
        state = _image_state(state_kind, rng) if state_kind in IMAGE_KINDS else _text_state(state_kind, rng)
        count = min(questions - total, rng.choice((1, 1, 2, 2, 3)))
        qs = {}
        for j in range(count):
            kind = QUESTION_KINDS[q_index % len(QUESTION_KINDS)]
            q_index += 1
            grades = 2 + grade_index % 9  # 2..10 in turn
            options = CHOICE_COUNTS[choice_index % len(CHOICE_COUNTS)]
            grade_index += kind == "score"
            choice_index += kind == "choice"
            qs[f"q{j}_{kind}"] = _question(kind, rng, grades, options)
        case = "image" if state_kind in IMAGE_KINDS else "text"
        out.append((f"gen-{case}", f"{n:03d}-{state_kind}", {"model": MODEL, "state": state, "questions": qs}))
        total += count
    return out


def with_videos(requests: list[tuple[str, str, dict]]) -> list[tuple[str, str, dict]]:
    """`requests` followed by the video group's requests (case "video")."""
    return requests + [("video", name, request) for name, request in video_case()]


def ci_set(seed: int = 0) -> list[tuple[str, str, dict]]:
    return with_videos(generate(seed, CI_QUESTIONS))


def gpu_set(seed: int = 0) -> list[tuple[str, str, dict]]:
    return with_videos(generate(seed, GPU_QUESTIONS))


def video_set(seed: int = 0) -> list[tuple[str, str, dict]]:
    """The video group alone: a gate run on video states where the whole set does not fit (the
    seed changes nothing: the group is fixed)."""
    return with_videos([])


SETS = {"ci": ci_set, "gpu": gpu_set, "video": video_set}
