"""The wire's size limits for images and videos (docs/wire-contract.md), in a module of their own
so the request validator (wire.py) and the command lines read them without importing torch."""

from __future__ import annotations

# One image of the /v1/systemone worker.
MAX_IMAGE_BYTES = 4 * 1024 * 1024
MAX_PIXELS = 1_048_576
MAX_SIDE = 2048
MAX_ASPECT_RATIO = 200

# One video (this project's choice: the worker contract names no video field; callers may pass others).
MAX_VIDEO_BYTES = 16 * 1024 * 1024
MAX_VIDEO_SECONDS = 60.0
MAX_VIDEO_FRAMES = 3600
MAX_VIDEO_FPS = 120.0
MIN_FRAME_SIDE = 32  # the video smart_resize refuses a smaller side
MAX_FRAME_SIDE = 2048
MAX_FRAME_PIXELS = 1_048_576
