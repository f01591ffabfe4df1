"""The benchmark requests (issue #5), built deterministically. Used by latency.py and the reference worker."""

from __future__ import annotations

import base64
import io

from PIL import Image

WORDS = (
    "the support agent reviewed the order history and found two identical charges on the same card "
    "within one minute while the customer waited for an answer about the refund policy and the bank"
).split()


def text_of(n_words: int, seed: int = 0) -> str:
    return " ".join(WORDS[(i * 7 + seed) % len(WORDS)] for i in range(n_words))


def png_data_url(width: int, height: int, seed: int = 0) -> str:
    img = Image.new("RGB", (width, height))
    img.putdata([((x * 3 + seed) % 256, (y * 5) % 256, ((x ^ y) + seed) % 256) for y in range(height) for x in range(width)])
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def image_state(width: int, height: int, text: str) -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "image", "image": png_data_url(width, height)}, {"type": "text", "text": text}]}]}


def benchmark_requests() -> dict[str, dict]:
    choice4 = {"type": "choice", "instructions": "Which move is best?", "criteria": {"up": "Move up", "down": "Move down", "left": "Move left", "right": "Move right"}}
    mixed = {
        "next": choice4,
        "blocked": {"type": "noul", "instructions": "Is the player blocked?"},
        "progress": {"type": "score", "instructions": "How close is the puzzle to solved?", "criteria": ["not at all", "a little", "half way", "almost", "solved"]},
    }
    many = {}
    for i in range(8):
        kind = ("choice", "noul", "score")[i % 3]
        q = {"type": kind, "instructions": f"Question {i}: {text_of(8, i)}?"}
        if kind == "choice":
            q["criteria"] = {f"k{j}": text_of(5, i + j) for j in range(3)}
        elif kind == "score":
            q["criteria"] = [text_of(3, i + j) for j in range(4)]
        many[f"q{i}"] = q
    return {
        "a_image448_7branch": {"model": "valen-preview-0923", "state": image_state(448, 448, text_of(30)), "questions": mixed},
        "b_text48_choice2": {
            "model": "valen-preview-0923",
            "state": text_of(12),
            "questions": {"q": {"type": "choice", "instructions": "Refund?", "criteria": {"refund": "Refund it", "wait": "Wait"}}},
        },
        "c_text2000_8q": {"model": "valen-preview-0923", "state": text_of(700), "questions": many},
        "d_image1024_choice4": {"model": "valen-preview-0923", "state": image_state(1024, 1024, "Pick a move."), "questions": {"next": choice4}},
    }
