"""Image preprocessing for Qwen3.5's vision tower, torch only (no torchvision, no transformers).

Reproduces, bit for bit, what transformers 5.4.0's torchvision-backed `Qwen2VLImageProcessor`
returns for an image file: EXIF transpose, `convert("RGB")` (alpha dropped, not composited),
uint8 CHW tensor, `smart_resize` to multiples of patch * merge, uint8 bicubic antialiased resize
(what torchvision's tensor `resize` runs on CPU), fused rescale + normalise in FP32, and the
Qwen2-VL patch layout with the temporal duplicate.

Also decodes untrusted PNG / JPEG bytes with limits checked on the header before any pixel is
decoded; a plain 8-bit RGB or RGBA PNG decodes through libspng (pyspng, optional) where it is
installed, everything else through Pillow. Token expansion and prompt building live in request.py.
"""

from __future__ import annotations

import io
import math
import re
import struct
import zlib
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageOps

from .config import read_config_json
from .errors import ConfigError, RequestError

try:  # optional: about a third faster than Pillow on PNGs (docs/benchmarks.md, "Host-side request compile")
    import pyspng
except ImportError:
    pyspng = None

from .limits import MAX_ASPECT_RATIO, MAX_IMAGE_BYTES, MAX_PIXELS, MAX_SIDE  # noqa: F401  (the wire's, re-exported)

_PIL_FORMATS = {"png": "PNG", "jpeg": "JPEG"}
_BICUBIC = 3  # PIL.Image.Resampling.BICUBIC, as preprocessor_config.json writes it

# Processor call kwargs (Valen's media_kwargs) that do not concern still images.
_VIDEO_ONLY_KWARGS = frozenset(
    {"fps", "num_frames", "min_frames", "max_frames", "do_sample_frames", "return_metadata", "video_metadata"}
)


@dataclass(frozen=True)
class ImageConfig:
    """The image-processor settings that change pixels or the grid (preprocessor_config.json names)."""

    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 65536  # size.shortest_edge
    max_pixels: int = 16777216  # size.longest_edge
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    do_convert_rgb: bool = True
    resample: int = _BICUBIC

    def __post_init__(self):
        for name in ("patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"preprocessor_config.json: {name} must be a positive integer, got {value!r}")
        if self.resample != _BICUBIC:
            raise ConfigError(f"preprocessor_config.json: resample={self.resample!r} unsupported (only 3, bicubic)")
        if not self.do_convert_rgb:
            raise ConfigError("preprocessor_config.json: do_convert_rgb=false is unsupported")
        if len(self.image_mean) != 3 or len(self.image_std) != 3:
            raise ConfigError("preprocessor_config.json: image_mean and image_std need 3 values")
        if any(s == 0 for s in self.image_std):
            raise ConfigError("preprocessor_config.json: image_std must not contain 0")

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @classmethod
    def from_dict(cls, config: dict, media_kwargs: dict | None = None) -> "ImageConfig":
        """Build from a parsed preprocessor_config.json, then apply Valen's `media_kwargs`.

        Mirrors 5.4.0: a `min_pixels` or `max_pixels` in the file overrides the matching `size`
        edge, each on its own; in `media_kwargs` (call kwargs) they apply only as a pair, and a
        lone one is ignored (`with_media_kwargs`).
        """
        size = config.get("size") or {}
        min_pixels = size.get("shortest_edge")
        max_pixels = size.get("longest_edge")
        if config.get("min_pixels") is not None:
            min_pixels = config["min_pixels"]
        if config.get("max_pixels") is not None:
            max_pixels = config["max_pixels"]
        if min_pixels is None or max_pixels is None:
            raise ConfigError("preprocessor_config.json: size needs shortest_edge and longest_edge")
        values = dict(pixel_fields(config, cls), min_pixels=min_pixels, max_pixels=max_pixels,
                      do_convert_rgb=bool(config.get("do_convert_rgb", True)))
        return cls(**values).with_media_kwargs(media_kwargs or {})

    @classmethod
    def from_file(cls, path: Path, media_kwargs: dict | None = None) -> "ImageConfig":
        return cls.from_dict(read_config_json(path), media_kwargs)

    def with_media_kwargs(self, media_kwargs: dict) -> "ImageConfig":
        """Apply processor call kwargs the way 5.4.0's image processor would; refuse unknown ones."""
        changes = {}
        unknown = sorted(set(media_kwargs) - _VIDEO_ONLY_KWARGS - {"min_pixels", "max_pixels", "size"})
        if unknown:
            raise ConfigError(f"media_kwargs: unsupported keys {unknown}")
        size = media_kwargs.get("size")
        if size is not None:
            if not isinstance(size, dict) or not size.get("shortest_edge") or not size.get("longest_edge"):
                raise ConfigError("media_kwargs: size must contain 'shortest_edge' and 'longest_edge' keys")
            changes.update(min_pixels=size["shortest_edge"], max_pixels=size["longest_edge"])
        if media_kwargs.get("min_pixels") is not None and media_kwargs.get("max_pixels") is not None:
            changes.update(min_pixels=media_kwargs["min_pixels"], max_pixels=media_kwargs["max_pixels"])
        return replace(self, **changes) if changes else self


def pixel_fields(config: dict, defaults) -> dict:
    """The patch and pixel fields the image and the video processor configs share, read from a
    parsed config file with `defaults`' class values where the file has none."""
    return dict(
        patch_size=config.get("patch_size", defaults.patch_size),
        temporal_patch_size=config.get("temporal_patch_size", defaults.temporal_patch_size),
        merge_size=config.get("merge_size", defaults.merge_size),
        image_mean=_triple(config.get("image_mean", defaults.image_mean), "image_mean"),
        image_std=_triple(config.get("image_std", defaults.image_std), "image_std"),
        rescale_factor=float(config.get("rescale_factor", defaults.rescale_factor)),
        do_resize=bool(config.get("do_resize", True)),
        do_rescale=bool(config.get("do_rescale", True)),
        do_normalize=bool(config.get("do_normalize", True)),
        resample=config.get("resample", _BICUBIC),
    )


def _triple(value, name: str) -> tuple[float, ...]:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return (float(value),) * 3
    if isinstance(value, (list, tuple)):
        return tuple(float(v) for v in value)
    raise ConfigError(f"preprocessor_config.json: {name} must be a number or a list, got {value!r}")


@dataclass(frozen=True)
class ImageLimits:
    """Input limits checked on the encoded header, before decoding."""

    max_bytes: int = MAX_IMAGE_BYTES
    max_pixels: int = MAX_PIXELS
    max_side: int = MAX_SIDE
    max_aspect_ratio: float = MAX_ASPECT_RATIO


@dataclass
class ProcessedImage:
    pixel_values: torch.Tensor  # [grid_t * grid_h * grid_w, C * tp * p * p] fp32
    grid_thw: tuple[int, int, int] = field(default=(1, 1, 1))


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Target (height, width): multiples of `factor`, pixel count within bounds, aspect kept.

    Same arithmetic as transformers' Qwen2-VL `smart_resize` (Python `round` is half-to-even).
    """
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"absolute aspect ratio must be smaller than 200, got {max(height, width) / min(height, width)}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def open_image(data: bytes, mime_format: str | None, field_name: str, limits: ImageLimits = ImageLimits()) -> Image.Image:
    """Read the header of untrusted PNG / JPEG bytes and check every limit; no pixel is decoded.

    Args:
        data: the encoded file.
        mime_format: "png" or "jpeg" (the data URL's type; the decoded format must match), or
            None to accept either.
        field_name: JSON path used in every RequestError.
        limits: size limits, checked here on the header.
    """
    if len(data) > limits.max_bytes:
        raise RequestError(field_name, f"image is {len(data)} bytes; the limit is {limits.max_bytes}")
    allowed = [_PIL_FORMATS[mime_format]] if mime_format else list(_PIL_FORMATS.values())
    try:
        # Image.open reads only the header; formats= stops PIL from guessing other decoders.
        image = Image.open(io.BytesIO(data), formats=allowed)
    except Image.DecompressionBombError as exc:
        # Pillow's own guard, far above ours: refused in the contract's words, not Pillow's.
        claimed = re.search(r"\((\d+) pixels\)", str(exc))
        pixels = claimed.group(1) if claimed else f"more than {limits.max_pixels}"
        raise RequestError(field_name, f"image has {pixels} pixels; the limit is {limits.max_pixels}") from exc
    except Exception as exc:  # PIL raises many types for garbage input
        expected = " or ".join(f.lower() for f in allowed)
        raise RequestError(field_name, f"not a decodable {expected} image") from exc
    width, height = image.size
    if width <= 0 or height <= 0:
        raise RequestError(field_name, f"image has an empty size {width}x{height}")
    if width > limits.max_side or height > limits.max_side:
        raise RequestError(field_name, f"image is {width}x{height}; each side must be at most {limits.max_side}")
    if width * height > limits.max_pixels:
        raise RequestError(field_name, f"image has {width * height} pixels; the limit is {limits.max_pixels}")
    if max(width, height) / min(width, height) > limits.max_aspect_ratio:
        raise RequestError(field_name, f"image aspect ratio {width}x{height} exceeds {limits.max_aspect_ratio}")
    if getattr(image, "n_frames", 1) != 1 or getattr(image, "is_animated", False):
        raise RequestError(field_name, "animated images are not supported; send a single frame")
    return image


def load_image(image: Image.Image, field_name: str) -> Image.Image:
    """Decode the pixels of an opened image: RGB, EXIF orientation applied.

    The orientation is only known after the load (a PNG may carry its eXIf chunk after the pixel
    data), so the decoded size can differ from the header's `image.size`.
    """
    try:
        image.load()
        ImageOps.exif_transpose(image, in_place=True)  # no full copy when there is nothing to turn
        if image.mode != "RGB":
            if isinstance(image.info.get("transparency"), bytes):
                # A palette's per-entry alpha: convert("RGB") drops it anyway, but with a UserWarning
                # on stderr; dropping it first gives the same pixels without one.
                del image.info["transparency"]
            image = image.convert("RGB")
    except Exception as exc:
        raise RequestError(field_name, f"image data is corrupt or truncated ({type(exc).__name__})") from exc
    return image


def decode_image(data: bytes, mime_format: str | None, field_name: str, limits: ImageLimits = ImageLimits()) -> Image.Image:
    """Decode untrusted PNG / JPEG bytes to an RGB PIL image, EXIF orientation applied.

    `open_image` (header and limits) then `load_image` (pixels); see those for the arguments.
    """
    return load_image(open_image(data, mime_format, field_name, limits), field_name)


_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_PLAIN_COLOR_TYPES = (2, 6)  # truecolour RGB, RGBA: both decode to the same RGB bytes in either decoder
# Ancillary chunks that change no decoded pixel in either decoder, allowed before the pixel data,
# where Pillow's open has already parsed (and so validated) them. Everything else, text chunks
# aside, leaves the file to Pillow: eXIf and APNG's acTL/fcTL/fdAT change what Pillow returns.
_NEUTRAL_CHUNKS = frozenset({b"PLTE", b"gAMA", b"cHRM", b"sRGB", b"iCCP", b"cICP", b"sBIT", b"pHYs", b"bKGD", b"tIME", b"tRNS"})
_TEXT_CHUNKS = frozenset({b"tEXt", b"zTXt", b"iTXt"})


def _orientation_text(body: bytes) -> bool:
    """A text chunk Pillow may read an EXIF orientation from (its keyword names XMP or EXIF:
    "XML:com.adobe.xmp", "xmp", "Raw profile type exif", ...)."""
    keyword = body.split(b"\0", 1)[0].lower()
    return b"xmp" in keyword or b"exif" in keyword


def plain_png(data: bytes) -> bool:
    """True for a PNG whose pixels libspng and Pillow decode to the same RGB bytes: the signature,
    an IHDR of an 8-bit RGB or RGBA image, not interlaced; then only ancillary chunks that change
    no pixel (text without XMP or EXIF); then the IDAT chunks, back to back; then IEND, ending the
    file; every CRC right. Anything else (palette, grey, 16-bit, an orientation, an animation,
    a chunk after the pixels that Pillow would parse, damage, trailing bytes) is left to Pillow,
    so what it accepts, refuses and returns stays as before. One difference remains: libspng
    does not check the zlib stream's adler32 (pyspng turns its CRC checks off; this walk checks
    the CRCs), so an IDAT stream that inflates completely but carries a wrong adler32 decodes
    here and is refused by Pillow."""
    if not data.startswith(_PNG_SIGNATURE):
        return False
    view, offset, stage = memoryview(data), len(_PNG_SIGNATURE), "header"  # header -> ancillary -> pixels
    while offset + 12 <= len(data):
        length, kind = struct.unpack_from(">I4s", data, offset)
        end = offset + 12 + length
        if end > len(data):
            return False
        (crc,) = struct.unpack_from(">I", data, end - 4)
        if zlib.crc32(view[offset + 4 : end - 4]) != crc:
            return False
        if stage == "header":
            if kind != b"IHDR" or length != 13:
                return False
            bit_depth, color_type, compression, filtering, interlace = data[offset + 16 : offset + 21]
            if bit_depth != 8 or color_type not in _PLAIN_COLOR_TYPES or compression or filtering or interlace:
                return False
            stage = "ancillary"
        elif kind == b"IDAT":
            stage = "pixels"
        elif kind == b"IEND":
            return stage == "pixels" and end == len(data)
        elif stage == "pixels":  # Pillow's load parses chunks after the pixels; libspng never reads them
            return False
        elif kind in _TEXT_CHUNKS:
            if _orientation_text(data[offset + 8 : min(end - 4, offset + 8 + 80)]):
                return False
        elif kind not in _NEUTRAL_CHUNKS:
            return False
        offset = end
    return False


def fast_png_pixels(data: bytes, size: tuple[int, int]) -> torch.Tensor | None:
    """uint8 [3, H, W] of a `plain_png` through libspng, or None (pyspng absent, not a plain PNG,
    or libspng refused it: the caller then decodes with Pillow). `size`: (width, height) from the
    header Pillow read; the pixels must have it."""
    if pyspng is None or not plain_png(data):
        return None
    try:
        array = pyspng.load(data, "RGB")  # [H, W, 3] uint8, alpha dropped as convert("RGB") drops it
    except Exception:
        return None
    if array.shape != (size[1], size[0], 3):
        return None
    return torch.from_numpy(array).permute(2, 0, 1)


def image_to_tensor(image: Image.Image) -> torch.Tensor:
    """RGB PIL image -> uint8 [3, H, W], laid out channels-last like torchvision's pil_to_tensor."""
    if image.mode != "RGB":
        image = image.convert("RGB")
    array = np.array(image, dtype=np.uint8, copy=True)  # [H, W, 3]
    return torch.from_numpy(array).permute(2, 0, 1)


def preprocess(image: Image.Image | torch.Tensor, config: ImageConfig) -> ProcessedImage:
    """One RGB image -> Qwen2-VL patches in merge order and its (t, h, w) grid in patches."""
    return patchify(resize_for_patches(image, config), config)


def resize_for_patches(image: Image.Image | torch.Tensor, config: ImageConfig) -> torch.Tensor:
    """RGB image -> uint8 [1, C, H, W] resized to multiples of patch * merge (the CPU half).

    The uint8 bicubic antialiased resize stays on the CPU: it is the kernel torchvision runs there,
    and its integer arithmetic is what the reference's pixels are made of.
    """
    pixels = image if isinstance(image, torch.Tensor) else image_to_tensor(image)
    if pixels.dtype != torch.uint8 or pixels.ndim != 3 or pixels.shape[0] != 3:
        raise ValueError(f"expected a uint8 [3, H, W] tensor, got {pixels.dtype} {tuple(pixels.shape)}")
    height, width = pixels.shape[-2:]
    batch = pixels.unsqueeze(0)  # [1, C, H, W], as the processor's per-shape stacking gives
    new_height, new_width = resized_size(height, width, config)
    if (new_height, new_width) != (height, width):
        batch = F.interpolate(batch, size=[new_height, new_width], mode="bicubic", align_corners=False, antialias=True)
    return batch


def resized_size(height: int, width: int, config: ImageConfig) -> tuple[int, int]:
    """(height, width) that `resize_for_patches` gives an image of this size; ValueError as it."""
    if config.do_resize:
        height, width = smart_resize(height, width, config.factor, config.min_pixels, config.max_pixels)
    if height % config.factor or width % config.factor:
        raise ValueError(f"image size {height}x{width} is not a multiple of {config.factor}; enable do_resize")
    return height, width


def grid_for_size(height: int, width: int, config: ImageConfig) -> tuple[int, int, int]:
    """(t, h, w) in patches of a still image of this decoded size, before any pixel exists."""
    new_height, new_width = resized_size(height, width, config)
    return -(-1 // config.temporal_patch_size), new_height // config.patch_size, new_width // config.patch_size


def patch_grid(batch: torch.Tensor, config: ImageConfig) -> tuple[int, int, int]:
    """(t, h, w) in patches of a still image [1, C, H, W]: one frame padded to the temporal patch."""
    return -(-batch.shape[0] // config.temporal_patch_size), batch.shape[-2] // config.patch_size, batch.shape[-1] // config.patch_size


def patchify(batch: torch.Tensor, config: ImageConfig) -> ProcessedImage:
    """uint8 [1, C, H, W] -> fp32 patches [t * h * w, C * tp * p * p] on the batch's device.

    Only IEEE-exact operations (cast, subtract, divide) and a permutation, so the result is the
    same bit for bit on any device; the engine runs it next to the vision tower.
    """
    p, tp, m = config.patch_size, config.temporal_patch_size, config.merge_size
    frames = batch.unsqueeze(1)  # [1, T=1, C, H, W] uint8
    if frames.shape[1] % tp:
        frames = torch.cat([frames, frames[:, -1:].repeat(1, tp - 1, 1, 1, 1)], dim=1)
    channels = frames.shape[2]
    grid_t, grid_h, grid_w = patch_grid(batch, config)
    patches = frames.reshape(1, grid_t, tp, channels, grid_h // m, m, p, grid_w // m, m, p)
    # -> [1, t, h/m, w/m, m, m, C, tp, p, p]: merge-window order, then channel, time, row, column.
    # Rearranged while still uint8 (a quarter of the bytes to move); the arithmetic is per
    # element, so normalising afterwards gives the same bits.
    patches = patches.permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9).reshape(grid_t * grid_h * grid_w, channels, tp, p * p)
    values = _rescale_and_normalize(patches, config)  # [N, C, tp, p * p] fp32, C third from last
    flat = values.reshape(grid_t * grid_h * grid_w, channels * tp * p * p)
    return ProcessedImage(pixel_values=flat, grid_thw=(grid_t, grid_h, grid_w))


def _rescale_and_normalize(batch: torch.Tensor, config: ImageConfig) -> torch.Tensor:
    # uint8 [..., C, X, Y] -> fp32. 5.4.0 fuses rescale into normalise: mean and std are scaled
    # by 1 / rescale_factor in FP32, then (x - mean) / std on the FP32 image; (x - 127.5) / 127.5
    # for the Qwen values.
    if config.do_normalize:
        mean = torch.tensor(config.image_mean, dtype=torch.float32)
        std = torch.tensor(config.image_std, dtype=torch.float32)
        if config.do_rescale:
            mean = mean * (1.0 / config.rescale_factor)
            std = std * (1.0 / config.rescale_factor)
        mean, std = mean.to(batch.device), std.to(batch.device)  # scaled on the CPU on every device
        values = batch.to(dtype=torch.float32)
        return values.sub(mean.view(-1, 1, 1)).div_(std.view(-1, 1, 1))
    if config.do_rescale:
        return batch * config.rescale_factor
    return batch.to(dtype=torch.float32)


def stack_images(processed: list[ProcessedImage]) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate per-image patches ([N, D] fp32) and grids ([n, 3] int64) in prompt order."""
    pixel_values = torch.cat([item.pixel_values for item in processed], dim=0)
    grids = torch.tensor([list(item.grid_thw) for item in processed], dtype=torch.int64)
    return pixel_values, grids
