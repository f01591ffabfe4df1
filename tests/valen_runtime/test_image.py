"""valen_runtime.image: bitwise against transformers 5.4.0's torchvision-backed Qwen2-VL processor."""

import base64
import dataclasses
import importlib.util
import io
import json
import os
import struct
import time
import warnings
import zlib

import numpy as np
import pytest
import torch
from PIL import Image

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from valen_runtime.errors import ConfigError, RequestError  # noqa: E402
from valen_runtime.image import (  # noqa: E402
    ImageConfig,
    ImageLimits,
    decode_image,
    fast_png_pixels,
    image_to_tensor,
    open_image,
    plain_png,
    preprocess,
    smart_resize,
    stack_images,
)


@pytest.fixture(scope="module")
def folder(text_assets):
    return text_assets[0]


@pytest.fixture(scope="module")
def processor(folder):
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(str(folder))
    assert proc.image_processor.backend == "torchvision"
    return proc


@pytest.fixture(scope="module")
def config(folder):
    return ImageConfig.from_file(folder / "preprocessor_config.json")


def encode(image: Image.Image, fmt: str, **save) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **save)
    return buffer.getvalue()


def noise(width, height, mode="RGB", seed=0) -> Image.Image:
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "LA": 2, "L": 1}[mode]
    array = rng.integers(0, 256, (height, width, channels), dtype=np.uint8)
    # Smooth structure plus noise, so resizing has something to blend.
    ramp = (np.linspace(0, 255, width)[None, :, None] + np.linspace(0, 128, height)[:, None, None]) % 256
    array = ((array.astype(np.float64) * 0.5 + ramp * 0.5) % 256).astype(np.uint8)
    return Image.fromarray(array[..., 0] if channels == 1 else array, mode)


def jpeg_with_orientation(width, height, orientation) -> bytes:
    image = noise(width, height)
    exif = image.getexif()
    exif[0x0112] = orientation
    return encode(image, "JPEG", exif=exif, quality=92)


def reference(processor, data: bytes, fmt: str, processor_kwargs=None):
    url = f"data:image/{fmt};base64," + base64.b64encode(data).decode("ascii")
    messages = [{"role": "user", "content": [{"type": "image", "url": url}, {"type": "text", "text": "x"}]}]
    return processor.apply_chat_template(
        messages,
        tokenize=True,
        add_generation_prompt=False,
        return_dict=True,
        return_tensors="pt",
        processor_kwargs=processor_kwargs or {},
    )


CASES = {
    "png-rgb-64": lambda: (encode(noise(64, 64), "PNG"), "png"),
    "png-rgba-odd": lambda: (encode(noise(97, 33, "RGBA"), "PNG"), "png"),
    "png-la": lambda: (encode(noise(40, 50, "LA"), "PNG"), "png"),
    "png-gray": lambda: (encode(noise(45, 61, "L"), "PNG"), "png"),
    "png-palette": lambda: (encode(noise(70, 30).convert("P"), "PNG"), "png"),
    "png-tiny-upscaled": lambda: (encode(noise(3, 5), "PNG"), "png"),
    "png-1x1": lambda: (encode(noise(1, 1), "PNG"), "png"),
    "png-odd-301x257": lambda: (encode(noise(301, 257), "PNG"), "png"),
    "png-1024x768": lambda: (encode(noise(1024, 768), "PNG"), "png"),
    "png-2048x512-limit": lambda: (encode(noise(2048, 512), "PNG"), "png"),
    "png-thin-200x1": lambda: (encode(noise(200, 1), "PNG"), "png"),
    "png-16-bit-gray": lambda: (encode(Image.fromarray(np.arange(40 * 50, dtype=np.uint16).reshape(40, 50) * 31), "PNG"), "png"),
    "jpeg-plain": lambda: (encode(noise(123, 77), "JPEG", quality=85), "jpeg"),
    "jpeg-cmyk": lambda: (encode(noise(40, 30, "RGBA").convert("CMYK"), "JPEG"), "jpeg"),
    "jpeg-exif-rot90": lambda: (jpeg_with_orientation(120, 70, 6), "jpeg"),
    "jpeg-exif-rot180": lambda: (jpeg_with_orientation(90, 64, 3), "jpeg"),
    "jpeg-exif-mirror-rot270": lambda: (jpeg_with_orientation(64, 150, 7), "jpeg"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_pixels_bitwise_equal_to_transformers(processor, config, case):
    data, fmt = CASES[case]()
    expected = reference(processor, data, fmt)
    processed = preprocess(decode_image(data, fmt, "state.image"), config)
    pixel_values, grid = stack_images([processed])
    assert grid.dtype == torch.int64 and pixel_values.dtype == torch.float32
    assert torch.equal(grid, expected["image_grid_thw"])
    assert pixel_values.shape == expected["pixel_values"].shape
    assert torch.equal(pixel_values, expected["pixel_values"]), (pixel_values - expected["pixel_values"]).abs().max()


def test_exif_rotation_is_applied(config):
    processed = preprocess(decode_image(jpeg_with_orientation(120, 70, 6), "jpeg", "f"), config)
    grid_t, grid_h, grid_w = processed.grid_thw
    assert grid_t == 1 and grid_h > grid_w  # 120 wide, 70 high, rotated by 90 degrees


def test_rgba_alpha_is_dropped_not_composited(config):
    image = Image.new("RGBA", (64, 64), (200, 10, 30, 0))  # fully transparent
    processed = preprocess(decode_image(encode(image, "PNG"), "png", "f"), config)
    red = processed.pixel_values.view(-1, 3, 2, 16, 16)[:, 0]
    assert torch.all(red == (200 - 127.5) / 127.5)


@pytest.mark.parametrize(
    "height, width",
    [(1, 1), (3, 5), (16, 16), (31, 33), (64, 64), (100, 20000 // 100), (767, 1023), (2048, 512), (1, 200), (4000, 3000), (47, 1)],
)
def test_smart_resize_matches_transformers(config, height, width):
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize as hf_smart_resize

    expected = hf_smart_resize(height, width, factor=32, min_pixels=config.min_pixels, max_pixels=config.max_pixels)
    assert smart_resize(height, width, 32, config.min_pixels, config.max_pixels) == expected


# Sides of 32k + 16: side / 32 ends in exactly .5, where round-half-to-even (Python's round, as
# transformers) and round-half-up part ways whenever k is even (272 -> 256, not 288).
HALF_SIDES = [16 * (2 * k + 1) for k in range(4, 15)]  # 144 ... 464, k = 4..14 (odd and even k)


@pytest.mark.parametrize("height", HALF_SIDES)
def test_smart_resize_at_exact_halves_matches_transformers(config, height):
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize as hf_smart_resize

    for width in (*HALF_SIDES, 512):
        expected = hf_smart_resize(height, width, factor=32, min_pixels=config.min_pixels, max_pixels=config.max_pixels)
        assert smart_resize(height, width, 32, config.min_pixels, config.max_pixels) == expected, (height, width)


def test_half_sizes_round_to_even_grids():
    # Independent of transformers: 272 = 8.5 x 32 rounds to 8 x 32 and 304 = 9.5 x 32 to 10 x 32.
    assert smart_resize(272, 304, 32, 4096, 16777216) == (256, 320)
    assert smart_resize(336, 400, 32, 4096, 16777216) == (320, 384)


def test_pixel_bounds_come_from_preprocessor_config(folder, processor, tmp_path):
    from transformers import AutoProcessor

    changed = tmp_path / "changed"
    changed.mkdir()
    for path in folder.iterdir():
        (changed / path.name).write_bytes(path.read_bytes())
    pre = json.loads((folder / "preprocessor_config.json").read_text())
    pre["size"] = {"shortest_edge": 32 * 32, "longest_edge": 128 * 128}
    (changed / "preprocessor_config.json").write_text(json.dumps(pre))
    ours = ImageConfig.from_file(changed / "preprocessor_config.json")
    assert (ours.min_pixels, ours.max_pixels) == (1024, 16384)
    data = encode(noise(300, 200), "PNG")
    expected = reference(AutoProcessor.from_pretrained(str(changed)), data, "png")
    pixel_values, grid = stack_images([preprocess(decode_image(data, "png", "f"), ours)])
    assert torch.equal(grid, expected["image_grid_thw"]) and torch.equal(pixel_values, expected["pixel_values"])


@pytest.mark.parametrize(
    "media_kwargs",
    [
        {"min_pixels": 32 * 32, "max_pixels": 64 * 64 * 4},
        {"max_pixels": 64 * 64},  # alone: ignored by 5.4.0
        {"min_pixels": 512 * 512},  # alone: ignored by 5.4.0
        {"size": {"shortest_edge": 1024, "longest_edge": 128 * 128}},
        {"fps": 1, "return_metadata": True},
    ],
)
def test_media_kwargs_follow_transformers(processor, folder, media_kwargs):
    data = encode(noise(300, 200), "PNG")
    expected = reference(processor, data, "png", processor_kwargs=dict(media_kwargs))
    ours = ImageConfig.from_file(folder / "preprocessor_config.json", media_kwargs=media_kwargs)
    pixel_values, grid = stack_images([preprocess(decode_image(data, "png", "f"), ours)])
    assert torch.equal(grid, expected["image_grid_thw"])
    assert torch.equal(pixel_values, expected["pixel_values"])


def test_unknown_media_kwargs_are_refused(folder):
    with pytest.raises(ConfigError, match="patch_size"):
        ImageConfig.from_file(folder / "preprocessor_config.json", media_kwargs={"patch_size": 14})


def test_unsupported_preprocessor_settings_are_refused(folder, tmp_path):
    pre = json.loads((folder / "preprocessor_config.json").read_text())
    for change, phrase in (({"resample": 2}, "resample"), ({"size": {"shortest_edge": 10}}, "longest_edge"), ({"patch_size": 0}, "patch_size")):
        path = tmp_path / "pre.json"
        path.write_text(json.dumps({**pre, **change}))
        with pytest.raises(ConfigError, match=phrase):
            ImageConfig.from_file(path)


def test_patch_layout_is_merge_order(config):
    # A 64x64 image has 4x4 patches of 16 px; merge windows are 2x2 patches, row-major.
    array = np.zeros((64, 64, 3), dtype=np.uint8)
    for row in range(4):
        for col in range(4):
            array[row * 16 : (row + 1) * 16, col * 16 : (col + 1) * 16] = row * 4 + col
    processed = preprocess(Image.fromarray(array), dataclasses.replace(config, min_pixels=32 * 32))
    first_pixel = processed.pixel_values[:, 0] * 127.5 + 127.5
    expected_patch_ids = [0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15]
    assert first_pixel.round().int().tolist() == expected_patch_ids
    assert processed.pixel_values.shape == (16, 3 * 2 * 16 * 16)
    # Temporal duplicate: both frames identical.
    frames = processed.pixel_values.view(16, 3, 2, 16 * 16)
    assert torch.equal(frames[:, :, 0], frames[:, :, 1])


def float_first_patches(batch: torch.Tensor, config: ImageConfig) -> torch.Tensor:
    """Patches the way the processor orders the work: normalise the whole fp32 image, then cut it."""
    values = batch.to(torch.float32)  # [1, C, H, W]
    if config.do_normalize:
        scale = 1.0 / config.rescale_factor if config.do_rescale else 1.0
        mean = torch.tensor(config.image_mean, dtype=torch.float32) * scale
        std = torch.tensor(config.image_std, dtype=torch.float32) * scale
        values = (values - mean.view(1, -1, 1, 1)) / std.view(1, -1, 1, 1)
    elif config.do_rescale:
        values = batch * config.rescale_factor
    p, tp, m = config.patch_size, config.temporal_patch_size, config.merge_size
    frames = values.unsqueeze(1).repeat(1, tp, 1, 1, 1)  # one frame, repeated to the temporal patch
    _, _, channels, height, width = frames.shape
    gh, gw = height // p, width // p
    patches = frames.reshape(1, 1, tp, channels, gh // m, m, p, gw // m, m, p).permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)
    return patches.reshape(gh * gw, channels * tp * p * p)


@pytest.mark.parametrize(
    "changes",
    [{}, {"do_normalize": False}, {"do_normalize": False, "do_rescale": False}, {"do_rescale": False},
     {"image_mean": (0.48145466, 0.4578275, 0.40821073), "image_std": (0.26862954, 0.26130258, 0.27577711)}],
    ids=["qwen", "rescale-only", "neither", "normalise-only", "clip-values"],
)
def test_patchify_equals_normalising_before_cutting(changes):
    # patchify rearranges the uint8 pixels first and normalises afterwards; per-element arithmetic
    # makes that the same bits as the processor's order, for every rescale / normalise setting.
    from valen_runtime.image import patchify

    config = dataclasses.replace(ImageConfig(), **changes)
    gen = torch.Generator().manual_seed(7)
    for height, width in ((32, 32), (64, 96), (160, 32)):
        channels_last = torch.randint(0, 256, (height, width, 3), generator=gen, dtype=torch.uint8)
        for batch in (channels_last.permute(2, 0, 1)[None], channels_last.permute(2, 0, 1).contiguous()[None]):
            got = patchify(batch, config)
            expected = float_first_patches(batch, config)
            assert got.pixel_values.dtype == torch.float32 and got.pixel_values.is_contiguous()
            assert got.grid_thw == (1, height // 16, width // 16)
            assert torch.equal(got.pixel_values.view(torch.int32), expected.view(torch.int32))


# ------------------------------------------------------------------ decoding limits


def with_ihdr(data: bytes, index: int, fields: bytes) -> bytes:
    """PNG `data` with its IHDR body overwritten from byte `index` by `fields`, CRC recomputed."""
    out = bytearray(data)
    ihdr = 8 + 8  # signature, then length + type of the IHDR chunk
    out[ihdr + index : ihdr + index + len(fields)] = fields
    out[ihdr + 13 : ihdr + 17] = struct.pack(">I", zlib.crc32(bytes(out[ihdr - 4 : ihdr + 13])))
    return bytes(out)


def png_with_header_size(width: int, height: int) -> bytes:
    """A valid tiny PNG whose IHDR claims another size (a decompression-bomb header)."""
    return with_ihdr(encode(Image.new("RGB", (8, 8)), "PNG"), 0, struct.pack(">II", width, height))


def apng() -> bytes:
    frames = [noise(16, 16, seed=s) for s in range(2)]
    return encode(frames[0], "PNG", save_all=True, append_images=frames[1:])


@pytest.mark.parametrize(
    "data, fmt, phrase",
    [
        (lambda: png_with_header_size(100_000, 100_000), "png", "image has 10000000000 pixels; the limit is 1048576"),
        (lambda: png_with_header_size(2049, 16), "png", "each side"),
        (lambda: png_with_header_size(2048, 513), "png", "pixels"),
        (lambda: png_with_header_size(201, 1), "png", "aspect"),
        (lambda: encode(noise(2, 2), "PNG"), "jpeg", "not a decodable jpeg"),
        (lambda: encode(noise(8, 8), "JPEG"), "png", "not a decodable png"),
        (lambda: encode(noise(8, 8), "GIF"), "png", "not a decodable png"),
        (lambda: b"not an image at all", "png", "not a decodable"),
        (lambda: encode(noise(64, 64), "PNG")[:-40], "png", "corrupt or truncated"),
        (lambda: apng(), "png", "animated"),
        (lambda: b"\x89PNG\r\n\x1a\n" + b"\x00" * (4 * 1024 * 1024), "png", "bytes"),
    ],
    ids=["bomb-header", "side", "pixels", "aspect", "png-as-jpeg", "jpeg-as-png", "gif", "garbage", "truncated", "apng", "too-many-bytes"],
)
def test_decode_refusals(data, fmt, phrase):
    payload = data()
    started = time.perf_counter()
    with pytest.raises(RequestError) as info:
        decode_image(payload, fmt, "state.image")
    assert info.value.field == "state.image"
    assert phrase in str(info.value)
    assert time.perf_counter() - started < 2.0  # refused from the header, never decoded


def test_a_decompression_bomb_is_refused_in_the_contracts_words():
    """Pillow refuses such a header itself, before our checks run: the refusal must still state our
    limit, not Pillow's internal one."""
    with pytest.raises(RequestError) as info:
        open_image(png_with_header_size(20_000, 20_000), "png", "state.image")
    assert str(info.value) == "state.image: image has 400000000 pixels; the limit is 1048576"


def palette_png_with_alpha_entries() -> bytes:
    image = Image.new("P", (6, 4))
    image.putpalette([v for i in range(4) for v in (60 * i, 255 - 60 * i, 30 * i)])
    image.putdata([(x + y) % 4 for y in range(4) for x in range(6)])
    return encode(image, "PNG", transparency=bytes([0, 128, 255, 64]))  # tRNS with an alpha per entry


def test_a_palette_png_with_alpha_entries_decodes_without_a_warning():
    """convert("RGB") warns about such a palette's transparency (the reference's processor ignores
    the warning); a worker must not print it, and the pixels stay Pillow's."""
    data = palette_png_with_alpha_entries()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        decoded = decode_image(data, "png", "state.image")
    assert [str(w.message) for w in caught] == []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = Image.open(io.BytesIO(data)).convert("RGB")
    assert decoded.mode == "RGB" and decoded.tobytes() == expected.tobytes()


def test_limits_are_configurable():
    with pytest.raises(RequestError, match="each side"):
        decode_image(encode(noise(40, 10), "PNG"), "png", "f", ImageLimits(max_side=32))


@pytest.mark.gpu
def test_patchify_on_cuda_is_bitwise_equal_to_cpu():
    # The engine uploads uint8 images and makes the fp32 patches on the device (cast, subtract,
    # divide, a permutation): the same IEEE operations as on the CPU, so the same bits.
    from valen_runtime.image import patchify

    gen = torch.Generator().manual_seed(3)
    batch = torch.randint(0, 256, (1, 3, 64, 96), generator=gen, dtype=torch.uint8)
    config = ImageConfig()
    assert torch.equal(patchify(batch.cuda(), config).pixel_values.cpu(), patchify(batch, config).pixel_values)


# ------------------------------------------------------------------ the libspng path for plain PNGs


def png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def filtered_rows(pixels: np.ndarray, filters: list[int]) -> bytes:
    """The PNG scanlines of pixels [H, W, C] uint8, row y filtered with filters[y] (0 none, 1 sub,
    2 up, 3 average, 4 Paeth; PNG spec section 9), written out independently of any encoder."""
    height, _, channels = pixels.shape
    out, above = bytearray(), np.zeros(pixels.shape[1] * channels, np.int32)
    for y in range(height):
        row = pixels[y].reshape(-1).astype(np.int32)
        left = np.concatenate([np.zeros(channels, np.int32), row[:-channels]])
        upper_left = np.concatenate([np.zeros(channels, np.int32), above[:-channels]])
        if filters[y] == 4:
            p = left + above - upper_left
            pa, pb, pc = np.abs(p - left), np.abs(p - above), np.abs(p - upper_left)
            predicted = np.where((pa <= pb) & (pa <= pc), left, np.where(pb <= pc, above, upper_left))
        else:
            predicted = [np.zeros_like(row), left, above, (left + above) // 2][filters[y]]
        out.append(filters[y])
        out += ((row - predicted) % 256).astype(np.uint8).tobytes()
        above = row
    return bytes(out)


def handmade_png(pixels: np.ndarray, filters: list[int], idat_parts: int = 1, ancillary: bytes = b"", after_idat: bytes = b"") -> bytes:
    """A PNG of pixels [H, W, 3 or 4] built chunk by chunk (several IDATs, extra chunks)."""
    height, width, channels = pixels.shape
    stream = zlib.compress(filtered_rows(pixels, filters), 6)
    cuts = np.linspace(0, len(stream), idat_parts + 1).astype(int)
    ihdr = struct.pack(">IIBBBBB", width, height, 8, {3: 2, 4: 6}[channels], 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + ancillary
            + b"".join(png_chunk(b"IDAT", stream[a:b]) for a, b in zip(cuts[:-1], cuts[1:]))
            + after_idat + png_chunk(b"IEND", b""))


def pillow_pixels(data: bytes) -> torch.Tensor:
    return image_to_tensor(decode_image(data, "png", "f"))


needs_pyspng = pytest.mark.skipif(importlib.util.find_spec("pyspng") is None, reason="pyspng (the fast-png extra) is not installed")


@needs_pyspng
@pytest.mark.parametrize("channels", [3, 4])
@pytest.mark.parametrize("width,height", [(1, 1), (5, 3), (37, 23), (64, 17)])
def test_plain_pngs_decode_to_pillows_pixels(channels, width, height):
    """Every filter type in every row position, odd sizes, one or several IDAT chunks, ancillary
    chunks libspng could act on (gAMA, sBIT, tRNS, a text chunk): the same bytes as Pillow's
    decode + convert("RGB") (alpha dropped)."""
    rng = np.random.default_rng(width * 100 + height + channels)
    pixels = rng.integers(0, 256, (height, width, channels), dtype=np.uint8)
    filters = [int(f) for f in rng.integers(0, 5, height)]
    filters[: min(5, height)] = list(range(5))[: min(5, height)]
    ancillary = (png_chunk(b"gAMA", struct.pack(">I", 45455)) + png_chunk(b"sBIT", bytes([5] * channels))
                 + png_chunk(b"tEXt", b"Software\x00test") + (png_chunk(b"tRNS", bytes(6)) if channels == 3 else b""))
    for parts in (1, 3):
        data = handmade_png(pixels, filters, idat_parts=parts, ancillary=ancillary)
        assert plain_png(data)
        fast = fast_png_pixels(data, (width, height))
        assert fast is not None and fast.dtype == torch.uint8 and fast.shape == (3, height, width)
        assert torch.equal(fast, pillow_pixels(data))
        assert torch.equal(fast, torch.from_numpy(pixels[..., :3]).permute(2, 0, 1))  # and the pixels encoded


XMP_ROT90 = (b'<x:xmpmeta xmlns:x="adobe:ns:meta/"><rdf:RDF xmlns:rdf="http://www.w3.org/1999/02/22-rdf-syntax-ns#">'
             b'<rdf:Description xmlns:tiff="http://ns.adobe.com/tiff/1.0/" tiff:Orientation="6"/></rdf:RDF></x:xmpmeta>')


def test_only_plain_pngs_take_the_fast_decoder():
    """Pillow turns an image by an orientation from eXIf, from XMP or from a "Raw profile type
    exif" text, draws APNG's first frame in its fcTL rectangle and parses every chunk after the
    pixels (refusing malformed ones): each of those stays with Pillow."""
    rgb = encode(noise(20, 10), "PNG")
    exif = noise(20, 10).getexif()
    exif[0x0112] = 6
    pixels = np.zeros((4, 5, 3), np.uint8)
    made = lambda **parts: handmade_png(pixels, [0] * 4, **parts)  # noqa: E731
    raw_exif = exif.tobytes()
    cases = {
        "handmade": (made(), True),
        "text-before-pixels": (made(ancillary=png_chunk(b"tEXt", b"Comment\x00hello")), True),
        "text-after-pixels": (made(after_idat=png_chunk(b"tEXt", b"Comment\x00hello")), False),
        "short-gama-after-pixels": (made(after_idat=png_chunk(b"gAMA", b"\x00")), False),
        "xmp-orientation": (made(ancillary=png_chunk(b"iTXt", b"XML:com.adobe.xmp\x00\x00\x00\x00\x00" + XMP_ROT90)), False),
        "raw-profile-exif": (made(ancillary=png_chunk(b"tEXt", b"Raw profile type exif\x00\nexif\n"
                                                      + f"{len(raw_exif):8d}\n{raw_exif.hex()}\n".encode())), False),
        "apng-frame": (made(ancillary=png_chunk(b"acTL", struct.pack(">II", 1, 0))
                            + png_chunk(b"fcTL", struct.pack(">IIIIIHHBB", 0, 3, 2, 0, 0, 1, 1, 0, 0))), False),
        "unknown-ancillary": (made(ancillary=png_chunk(b"vpAg", bytes(9))), False),
        "rgb": (rgb, True),
        "rgba": (encode(noise(20, 10, "RGBA"), "PNG"), True),
        "grey": (encode(noise(20, 10, "L"), "PNG"), False),
        "grey+alpha": (encode(noise(20, 10, "LA"), "PNG"), False),
        "palette": (encode(noise(20, 10).convert("P"), "PNG"), False),
        "16-bit": (with_ihdr(rgb, 8, bytes([16])), False),
        "interlaced": (with_ihdr(rgb, 12, bytes([1])), False),
        "exif-orientation": (encode(noise(20, 10), "PNG", exif=exif), False),
        "bad-crc": (rgb[:-20] + bytes([rgb[-20] ^ 1]) + rgb[-19:], False),
        "trailing-bytes": (rgb + b"\x00", False),
        "truncated": (rgb[:-12], False),
        "jpeg": (encode(noise(20, 10), "JPEG"), False),
    }
    assert {name: plain_png(data) for name, (data, _) in cases.items()} == {name: want for name, (_, want) in cases.items()}
    assert b"eXIf" in cases["exif-orientation"][0]  # Pillow wrote the chunk the check looks for


@needs_pyspng
def test_a_plain_png_libspng_refuses_falls_back_to_pillows_error():
    """Well-formed chunks with correct CRCs around a broken deflate stream: libspng fails, Pillow
    decodes (and refuses) it as before, with the field named."""
    good = handmade_png(np.zeros((8, 8, 3), np.uint8), [0] * 8)
    broken = handmade_png(np.zeros((8, 8, 3), np.uint8), [0] * 8)
    start = broken.index(b"IDAT") - 4
    (length,) = struct.unpack(">I", broken[start : start + 4])
    body = b"\xff" * length  # not a deflate stream
    broken = broken[:start] + png_chunk(b"IDAT", body) + broken[start + 12 + length :]
    assert plain_png(good) and plain_png(broken)
    assert fast_png_pixels(broken, (8, 8)) is None
    with pytest.raises(RequestError, match="corrupt or truncated") as info:
        decode_image(broken, "png", "state.image")
    assert info.value.field == "state.image"


def test_without_pyspng_every_png_decodes_with_pillow(monkeypatch):
    import valen_runtime.image as image_module

    monkeypatch.setattr(image_module, "pyspng", None)
    assert fast_png_pixels(encode(noise(20, 10), "PNG"), (20, 10)) is None
