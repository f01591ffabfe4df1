"""Built-in parity cases: wire requests covering every question type, text, image and video
states, several questions per request, Unicode (CJK, combining marks, emoji) and images that need
resizing.

Images are drawn in-process with PIL from fixed arithmetic (no randomness, no files); video clips
are encoded in-process by `valen_export.clips.encode_clip` (fixed seeds, bitexact muxing, encoded
once per process), so every run sends identical bytes. Each case is a list of (name, request).
"""

from __future__ import annotations

import base64
import functools
import io
from fractions import Fraction

from PIL import Image, ImageDraw

MODEL = "valen-preview-0923"
CASE_NAMES = ("text", "image", "noul", "score", "mixed", "video")


def _pattern(width: int, height: int, seed: int) -> Image.Image:
    """A deterministic RGB picture with gradients, edges and a few shapes (resizing has work to do)."""
    img = Image.new("RGB", (width, height))
    px = img.load()
    for y in range(height):
        for x in range(width):
            px[x, y] = ((x * 7 + seed * 31) % 256, (y * 5 + x * 3 + seed * 17) % 256, ((x ^ y) * 11 + seed) % 256)
    draw = ImageDraw.Draw(img)
    draw.rectangle([width // 5, height // 4, width // 2, height // 2], fill=(250, 250, 250))
    draw.ellipse([width // 2, height // 3, width - 4, height - 4], fill=(10, 10, 10), outline=(200, 30, 30))
    draw.line([0, height - 1, width - 1, 0], fill=(0, 180, 40), width=3)
    return img


def png_data_url(img: Image.Image) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG", optimize=False, compress_level=6)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def jpeg_data_url(img: Image.Image, exif_orientation: int | None = None) -> str:
    buf = io.BytesIO()
    kwargs = {"quality": 90, "subsampling": 2}
    if exif_orientation is not None:
        exif = Image.Exif()
        exif[0x0112] = exif_orientation
        kwargs["exif"] = exif.tobytes()
    img.save(buf, format="JPEG", **kwargs)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def images() -> dict[str, str]:
    """Data URLs: sizes chosen so each goes through smart_resize differently."""
    rgba = _pattern(150, 90, 4).convert("RGBA")
    rgba.putalpha(Image.linear_gradient("L").resize((150, 90)))
    return {
        # 100x70 = 7000 px < min_pixels (65536): upscaled, and not a multiple of 32.
        "small_png": png_data_url(_pattern(100, 70, 1)),
        # 333x251: above min_pixels, each side rounded to a multiple of 32.
        "odd_jpeg": jpeg_data_url(_pattern(333, 251, 2)),
        # stored landscape, EXIF orientation 6 (rotate 90): the processor must transpose first.
        "exif_jpeg": jpeg_data_url(_pattern(120, 80, 3), exif_orientation=6),
        # RGBA PNG: alpha is dropped (not composited) by both pipelines.
        "rgba_png": png_data_url(rgba),
        # exactly a multiple of 32 and at min_pixels: no resize.
        "exact_png": png_data_url(_pattern(256, 256, 5)),
    }


def _req(state, questions: dict) -> dict:
    return {"model": MODEL, "state": state, "questions": questions}


def text_case() -> list[tuple[str, dict]]:
    return [
        (
            "refund",
            _req(
                "The card was charged twice for one order.",
                {"action": {"type": "choice", "instructions": "Should we refund the customer?", "criteria": {"refund": "Refund now", "wait": "Wait for the bank"}}},
            ),
        ),
        (
            "unicode",
            _req(
                "白色棋子在棋盘上。Ünïcödé café — नमस्ते दुनिया, e\u0301 (combining acute), emoji 👍🏽 👨‍👩‍👧 ✅",
                {
                    "colour": {
                        "type": "choice",
                        "instructions": "哪个玩家移动？ Which player moves?",
                        "criteria": {"白色": "白色玩家 (white) ♙", "黑色": "黑色玩家 (black) ♟", "🤷": "नहीं पता — unknown 🤔"},
                    },
                    "single": {"type": "choice", "instructions": "Only one option.", "criteria": {"only": None}},
                },
            ),
        ),
        (
            "json_state",
            _req(
                {"board": [[1, 0], [0, 1]], "player": "white", "note": "très bien ✓"},
                {"winner": {"type": "choice", "instructions": "Who is ahead?", "criteria": {"white": "White is ahead", "black": "Black is ahead", "even": "Nobody"}}},
            ),
        ),
        (
            "messages",
            _req(
                {
                    "messages": [
                        {"role": "system", "content": "You judge customer support cases."},
                        {"role": "user", "content": [{"type": "text", "text": "  The order arrived broken.  "}]},
                        {"role": "assistant", "content": "Sorry to hear that. Do you have a photo?"},
                        {"role": "user", "content": "No photo, but the box was crushed.\n\tPlease help!"},
                    ]
                },
                {"next": {"type": "choice", "instructions": "What next?", "criteria": {"replace": "Send a replacement", "refund": "Refund", "ask": "Ask for a photo"}}},
            ),
        ),
    ]


def image_case() -> list[tuple[str, dict]]:
    im = images()
    q = {"colour": {"type": "choice", "instructions": "Which colour dominates the picture?", "criteria": {"white": "White", "black": "Black"}}}
    return [
        ("small_png", _req({"image": im["small_png"]}, q)),
        ("odd_jpeg", _req({"image": im["odd_jpeg"]}, q)),
        ("exif_jpeg", _req({"image": im["exif_jpeg"]}, q)),
        ("rgba_png", _req({"image": im["rgba_png"]}, q)),
        (
            "messages_two_images",
            _req(
                {
                    "messages": [
                        {
                            "role": "user",
                            "content": [
                                {"type": "text", "text": "Before:"},
                                {"type": "image_url", "image_url": {"url": im["exact_png"]}},
                                {"type": "text", "text": "After 之后:"},
                                {"type": "image_url", "image_url": im["small_png"]},
                            ],
                        }
                    ]
                },
                {"changed": {"type": "choice", "instructions": "Did the scene change?", "criteria": {"yes": "It changed", "no": "Same scene"}}},
            ),
        ),
    ]


def noul_case() -> list[tuple[str, dict]]:
    im = images()
    return [
        ("text", _req("The light is on and the door is open.", {"light": {"type": "noul", "instructions": "Is the light on?"}})),
        ("cjk", _req("灯是开着的。", {"灯": {"type": "noul", "instructions": "灯开着吗？满足条件吗？"}})),
        ("image", _req({"image": im["odd_jpeg"]}, {"line": {"type": "noul", "instructions": "Is there a green line?"}})),
    ]


def score_case() -> list[tuple[str, dict]]:
    im = images()
    return [
        ("two", _req("The package is slightly late.", {"severity": {"type": "score", "instructions": "How severe is it?", "criteria": ["Not severe", "Very severe"]}})),
        (
            "five_unicode",
            _req(
                "Le client est très mécontent 😡 — 非常生气。",
                {"anger": {"type": "score", "instructions": "How angry is the customer? 生气程度", "criteria": ["Calm 平静", "Slightly annoyed", "Annoyed 😒", "Angry", "Furious 🤬"]}},
            ),
        ),
        (
            "ten_image",
            _req({"image": im["small_png"]}, {"brightness": {"type": "score", "instructions": "How bright is it?", "criteria": [f"Level {i} of 9" for i in range(10)]}}),
        ),
    ]


def mixed_case() -> list[tuple[str, dict]]:
    im = images()
    return [
        (
            "image_three_types",
            _req(
                {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": im["odd_jpeg"]}}, {"type": "text", "text": "A game board. 棋盘。"}]}]},
                {
                    "move": {"type": "choice", "instructions": "Which move is best?", "criteria": {"up": "Move up ↑", "down": "Move down ↓", "left": "Move left ←", "right": "Move right →"}},
                    "stuck": {"type": "noul", "instructions": "Is the player stuck?"},
                    "progress": {"type": "score", "instructions": "How close is the goal?", "criteria": ["Far", "Halfway", "Close"]},
                },
            ),
        ),
        (
            "text_many",
            _req(
                "Order #4521: refund requested twice; customer writes in 中文 and English, 👍.",
                {
                    "dup": {"type": "noul", "instructions": "Is this a duplicate request?"},
                    "lang": {"type": "choice", "instructions": "Main language?", "criteria": {"en": "English", "zh": "中文", "mix": "Both"}},
                    "urgency": {"type": "score", "instructions": "Urgency", "criteria": ["Low", "Medium", "High", "Critical"]},
                    "team": {"type": "choice", "instructions": "Route to which team?", "criteria": {"billing": "Billing", "support": "Support"}},
                },
            ),
        ),
    ]


# name: (MIME subtype = PyAV muxer, encoder, frame rate, frames, width, height, noise seed). Small
# frames (64 x 48: 4 x 4 patches, 4 tokens per frame pair) keep the CPU gate fast; what varies is
# what the sampling, the stamps and the decoders do with them (2 sampled frames per second).
CLIPS = {
    # 3 s at 10 fps: 6 of 30 frames sampled (0, 6, 12, 17, 23, 29), video_grid_thw [3, 4, 4].
    "mp4_short": ("mp4", "libx264", 10, 30, 64, 48, 1),
    # 2.93 s at 7.5 fps: 5 frames sampled, an odd count (the processor repeats the last), [3, 4, 4].
    "webm_vp9_odd": ("webm", "libvpx-vp9", Fraction(15, 2), 22, 64, 48, 2),
    # 12 s at 5 fps: 24 of 60 frames sampled (frames skipped), 12 pairs whose stamps pass 10 s.
    "mp4_long": ("mp4", "libx264", 5, 60, 64, 48, 3),
}


@functools.lru_cache(maxsize=None)
def video_data_url(name: str) -> str:
    mime, codec, rate, count, width, height, seed = CLIPS[name]
    from valen_export.clips import encode_clip

    data = encode_clip(mime, codec, rate, count, width, height, seed=seed)
    return f"data:video/{mime};base64," + base64.b64encode(data).decode("ascii")


def video_case() -> list[tuple[str, dict]]:
    """One video per request (the wire contract): a `{"video": ...}` state and message lists (a
    system turn, text before and after the clip; a video_url item as a string and as
    `{"url": ...}`). Few branches (one per choice or noul question, two score grades): the CPU gate
    runs them in every configuration."""
    return [
        ("mp4_short", _req({"video": video_data_url("mp4_short")},
                           {"motion": {"type": "choice", "instructions": "Which way does the pattern move?", "criteria": {"left": "To the left", "right": "To the right"}}})),
        (
            "webm_vp9_odd_messages",
            _req(
                {"messages": [
                    {"role": "system", "content": "You judge screen recordings."},
                    {"role": "user", "content": [
                        {"type": "video_url", "video_url": video_data_url("webm_vp9_odd")},
                        {"type": "text", "text": "Short clip. 短片。"},
                    ]},
                ]},
                {"noise": {"type": "noul", "instructions": "Is the clip noisy? 有噪点吗？"}},
            ),
        ),
        (
            "mp4_long_text_around",
            _req(
                {"messages": [{"role": "user", "content": [
                    {"type": "text", "text": "A screen recording, 12 seconds:"},
                    {"type": "video_url", "video_url": {"url": video_data_url("mp4_long")}},
                    {"type": "text", "text": "Did the screen change after 10 s? 之后呢？"},
                ]}]},
                {"change": {"type": "score", "instructions": "How much does the screen change?", "criteria": ["Not at all", "A lot 很多"]}},
            ),
        ),
    ]


_BUILDERS = {"text": text_case, "image": image_case, "noul": noul_case, "score": score_case, "mixed": mixed_case, "video": video_case}


def cases(name: str) -> list[tuple[str, str, dict]]:
    """[(case, request name, request)] for one case name or "all"."""
    names = CASE_NAMES if name == "all" else (name,)
    out = []
    for n in names:
        if n not in _BUILDERS:
            raise KeyError(f"unknown case {n!r}; expected one of {', '.join(CASE_NAMES)}, all")
        out += [(n, rname, req) for rname, req in _BUILDERS[n]()]
    return out
