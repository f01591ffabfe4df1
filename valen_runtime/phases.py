"""Wall-clock seconds per phase of a request's compile (`Compiler.compile(..., timings=)`)."""

from __future__ import annotations

import time

# What `Compiler.compile(..., timings=)` reports, seconds per phase. On the calling thread: json
# (compile_bytes only), validate (wire.validate_request: the whole contract, base64 included),
# state_parse (the messages into the chat template's shape), image_open (headers and limits, and
# starting each decode), template (chat template), tokenize (tokenizer, image-token expansion and
# types), image_wait (blocked on the decode threads), on_images (the caller's callback), questions
# (branch layout). Where the images were decoded, summed over them: decode (PIL: inflate,
# unfilter, EXIF turn, RGB), to_tensor (the copy out of PIL), resize. A video state has instead
# video_probe (pass 1: decode without converting, count the frames, check the limits; and the
# plan) before the template, and video_decode (pass 2: convert and resize the sampled frames)
# after the questions.
PHASES = ("json", "validate", "state_parse", "image_open", "template", "tokenize", "image_wait", "on_images",
          "questions", "decode", "to_tensor", "resize", "video_probe", "video_decode")


class Phases:
    """Adds the wall-clock seconds since the last lap to `timings[name]`; nothing when it is None."""

    def __init__(self, timings: dict | None):
        self.timings = timings
        self.last = time.perf_counter() if timings is not None else 0.0

    def lap(self, name: str) -> None:
        if self.timings is not None:
            now = time.perf_counter()
            self.timings[name] = self.timings.get(name, 0.0) + (now - self.last)
            self.last = now

    def add(self, seconds: dict[str, float]) -> None:
        if self.timings is not None:
            for name, value in seconds.items():
                self.timings[name] = self.timings.get(name, 0.0) + value
