"""Requests shared by the engine-level tests (valen_runtime/test_engine.py, test_plan.py)."""

from __future__ import annotations

import base64
import io

import pytest

QUESTIONS = {
    "q": {"type": "choice", "instructions": "What next?", "criteria": {"refund": "Refund it", "wait": "Wait", "escalate": "Escalate"}},
    "n": {"type": "noul", "instructions": "Is it a duplicate?"},
    "s": {"type": "score", "instructions": "How urgent?", "criteria": ["low", "medium", "high"]},
}


def png_data_url(width: int, height: int) -> str:
    from PIL import Image

    img = Image.new("RGB", (width, height))
    img.putdata([((x * 7) % 256, (y * 3) % 256, (x * y) % 256) for y in range(height) for x in range(width)])
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="session")
def short_request() -> dict:
    """A text state shorter than one 64-token delta-rule chunk: nothing to share, one batched forward."""
    return {"model": "valen-preview-0923", "state": "The card was charged twice for one order.", "questions": QUESTIONS}


@pytest.fixture(scope="session")
def long_image_request() -> dict:
    """An image and a state longer than one chunk: the vision tower and a shared prefix."""
    text = " ".join(["the order was charged twice and the customer asked for a refund"] * 8)
    state = {"messages": [{"role": "user", "content": [{"type": "image", "image": png_data_url(96, 64)}, {"type": "text", "text": text}]}]}
    return {"model": "valen-preview-0923", "state": state, "questions": QUESTIONS}


@pytest.fixture(scope="session")
def batch_requests(short_request, long_image_request) -> list[dict]:
    """A mix for batched runs: an image with a long text (a prefix), a short text (none), a long
    text (two 64-token chunks of prefix), an image alone with one question (one branch)."""
    long_text = " ".join(["a second and much longer account of the same order and of its two charges"] * 10)
    image_only = {"model": "valen-preview-0923", "state": {"image": png_data_url(64, 48)}, "questions": {"q": QUESTIONS["q"]}}
    return [long_image_request, short_request, dict(short_request, state=long_text), image_only]
