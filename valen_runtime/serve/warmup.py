"""Warmup: the requests (and, for an engine that batches, the groups of them) run before the worker reports ready."""

from __future__ import annotations

import base64
import io

from ..wire import MODEL_NAME


def _png_data_url(width: int, height: int, colour=None) -> str:
    from PIL import Image

    image = Image.new("RGB", (width, height), colour or "white")
    if colour is None:  # a gradient, so the vision tower sees varied pixels
        image.putdata([((x * 7) % 256, (y * 5) % 256, ((x + y) * 3) % 256) for y in range(height) for x in range(width)])
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def warmup_requests(full: bool) -> list[dict]:
    """Requests run before the worker reports ready.

    Basic (the upstream worker's pair): one text request and one 2 x 2 white PNG request. Full
    adds, for the CUDA fast path, each family its compiled functions and graphs specialise on,
    each at two sizes so torch.compile has made the sizes symbolic before the first client: a
    state under 64 tokens (every branch a row of one batch) and a longer one (the one-pass layout), one
    branch and several (choice, noul, score), and images of two sizes (the vision tower).
    """
    words = ("the agent reviewed the order and found two identical charges on the card while "
             "the customer waited for an answer about the refund policy of the bank").split()

    def text(n: int) -> str:
        return " ".join(words[(i * 7) % len(words)] for i in range(n))

    def request(state, questions) -> dict:
        return {"model": MODEL_NAME, "state": state, "questions": questions}

    only = {"_warmup": {"type": "choice", "instructions": "Choose the only candidate.", "criteria": {"ok": "OK"}}}
    requests = [request("Warmup: choose the only candidate.", only), request({"image": _png_data_url(2, 2, "white")}, only)]
    if not full:
        return requests
    choice2 = {"q": {"type": "choice", "instructions": "Refund?", "criteria": {"refund": "Refund it", "wait": "Wait"}}}
    mixed = {
        "next": {"type": "choice", "instructions": "Which move is best?", "criteria": {"up": "Move up", "down": "Move down", "left": "Move left", "right": "Move right"}},
        "blocked": {"type": "noul", "instructions": "Is the player blocked?"},
        "progress": {"type": "score", "instructions": "How close is it?", "criteria": ["not at all", "a little", "half way", "almost", "done"]},
    }
    for n in (8, 20, 120, 400):  # short states (rows), long states (one-pass)
        requests += [request(text(n), choice2), request(text(n + 3), mixed)]
    for side in (448, 320):
        state = {"messages": [{"role": "user", "content": [{"type": "image", "image": _png_data_url(side, side)}, {"type": "text", "text": text(30)}]}]}
        requests += [request(state, mixed), request({"image": _png_data_url(side, side * 3 // 4)}, choice2)]
    return requests



def warmup_batches(requests: list[dict], max_batch: int) -> list[list[dict]]:
    """Groups of the full warmup's requests run together after them, so the CUDA fast path has
    compiled the combined one-pass sweep's variants (requests without a prefix only, several
    prefixes, a mix with images) before the first client: basic warmups (two requests) have none."""
    if max_batch < 2 or len(requests) <= 2:
        return []
    # warmup_requests(True): [basic (2) | short, short, short, short, long, long, long, long | images (4)]
    return [requests[2:4], requests[6:10][:max_batch], [requests[2], requests[8], *requests[10:12]][:max_batch]]


def warmup_steps(requests: list[dict], max_batch: int) -> list[tuple[str, dict | list[dict]]]:
    """The warmup in order: ("request", r) for each request alone, then ("batch", group) for the
    groups run together (`warmup_batches`; none when max_batch is 1)."""
    return [("request", r) for r in requests] + [("batch", group) for group in warmup_batches(requests, max_batch)]


def run_warmup_step(engine, step: tuple[str, dict | list[dict]]) -> None:
    """One warmup step on `engine`; a request of a batch that fails raises its exception."""
    kind, item = step
    if kind == "request":
        engine.run(item)
        return
    for result in engine.run_many(item):
        if isinstance(result, Exception):
            raise result
