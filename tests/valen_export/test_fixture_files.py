"""valen_export.fixture_files: the synthetic Qwen3.5 tokenizer / processor folder.

Checked against transformers 5.4.0: which classes AutoTokenizer / AutoProcessor build from the
folder, and that they tokenize exactly like the raw `tokenizers` file.
"""

import hashlib
import json
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from tokenizers import Tokenizer  # noqa: E402

from valen_export.fixture_files import (  # noqa: E402
    ORDINARY_ADDED_TOKENS,
    QWEN35_SPLIT_REGEX,
    SPECIAL_TOKENS,
    write_text_assets,
)

FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "preprocessor_config.json",
    "video_preprocessor_config.json",
)
HINDI = "हिन्दी में पाठ। नमस्ते दुनिया।"


@pytest.fixture(scope="module")
def folder(text_assets):
    return text_assets


def test_writes_every_file(folder):
    directory, _ = folder
    for name in FILES:
        assert (directory / name).is_file(), name


def test_output_is_deterministic(tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    assert write_text_assets(first) == write_text_assets(second)
    for name in FILES:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name


def test_returned_ids_match_tokenizer_json(folder):
    directory, ids = folder
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    assert ids["image_token_id"] == tok.token_to_id("<|image_pad|>")
    assert ids["video_token_id"] == tok.token_to_id("<|video_pad|>")
    assert ids["vision_start_token_id"] == tok.token_to_id("<|vision_start|>")
    assert ids["vision_end_token_id"] == tok.token_to_id("<|vision_end|>")
    assert ids["im_start_token_id"] == tok.token_to_id("<|im_start|>")
    assert ids["im_end_token_id"] == ids["eos_token_id"] == tok.token_to_id("<|im_end|>")
    assert ids["pad_token_id"] == tok.token_to_id("<|endoftext|>")
    assert ids["bos_token_id"] is None
    assert ids["vocab_size"] == tok.get_vocab_size(with_added_tokens=True)


def test_tokenizer_json_layout(folder):
    directory, _ = folder
    data = json.loads((directory / "tokenizer.json").read_text(encoding="utf-8"))
    assert data["normalizer"]["type"] == "NFC"
    split, byte_level = data["pre_tokenizer"]["pretokenizers"]
    assert split["type"] == "Split" and split["behavior"] == "Isolated"
    assert split["pattern"]["Regex"] == QWEN35_SPLIT_REGEX
    assert "[\\p{L}\\p{M}]+" in QWEN35_SPLIT_REGEX
    assert byte_level == {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    assert data["decoder"]["type"] == "ByteLevel"
    assert data["model"]["type"] == "BPE" and data["model"]["byte_fallback"] is False
    added = data["added_tokens"]
    specials = [t for t in added if t["special"]]
    assert [t["content"] for t in specials] == list(SPECIAL_TOKENS)
    assert [t["id"] for t in specials] == list(range(14))
    ordinary = [t for t in added if not t["special"]]
    assert [t["content"] for t in ordinary] == list(ORDINARY_ADDED_TOKENS)


def test_tokenizer_config_fields(folder):
    directory, _ = folder
    config = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["tokenizer_class"] == "Qwen2Tokenizer"
    assert config["eos_token"] == "<|im_end|>" and config["pad_token"] == "<|endoftext|>"
    assert config["bos_token"] is None and config["add_bos_token"] is False
    assert config["model_max_length"] == 262144


def test_processor_configs(folder):
    directory, _ = folder
    image = json.loads((directory / "preprocessor_config.json").read_text(encoding="utf-8"))
    video = json.loads((directory / "video_preprocessor_config.json").read_text(encoding="utf-8"))
    assert image["size"] == {"shortest_edge": 65536, "longest_edge": 16777216}
    for config in (image, video):
        assert (config["patch_size"], config["temporal_patch_size"], config["merge_size"]) == (16, 2, 2)
        assert config["image_mean"] == [0.5] * 3 and config["image_std"] == [0.5] * 3
        assert config["rescale_factor"] == 1 / 255 and config["resample"] == 3
        assert config["processor_class"] == "Qwen3VLProcessor"
    assert video["video_processor_type"] == "Qwen3VLVideoProcessor"


def test_chat_template_renders_qwen_shape(folder):
    from transformers.utils.chat_template_utils import render_jinja_template

    directory, _ = folder
    template = (directory / "chat_template.jinja").read_text(encoding="utf-8")
    messages = [
        {"role": "system", "content": "sys "},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "  look: "},
                {"type": "image", "path": "x.png"},
                {"type": "image_url", "image_url": {"url": "y.png"}},
                {"type": "video", "path": "v.mp4"},
                {"type": "text", "text": " done \n"},
            ],
        },
        {"role": "assistant", "content": [{"type": "text", "text": "ok"}]},
    ]
    rendered, _ = render_jinja_template([messages], chat_template=template, add_generation_prompt=True)
    image = "<|vision_start|><|image_pad|><|vision_end|>"
    video = "<|vision_start|><|video_pad|><|vision_end|>"
    assert rendered[0] == (
        "<|im_start|>system\nsys <|im_end|>\n"
        f"<|im_start|>user\nlook: {image}{image}{video} done<|im_end|>\n"
        "<|im_start|>assistant\nok<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    plain, _ = render_jinja_template(
        [[{"role": "user", "content": [{"type": "text", "text": " S "}]}]], chat_template=template
    )
    assert plain[0] == "<|im_start|>user\nS<|im_end|>\n"


def test_autotokenizer_is_tokenizers_backend_with_file_regex(folder):
    from transformers import AutoTokenizer

    directory, _ = folder
    hf = AutoTokenizer.from_pretrained(str(directory))
    assert type(hf).__name__ == "TokenizersBackend"
    raw = Tokenizer.from_file(str(directory / "tokenizer.json"))
    for text in (HINDI, "True / 是：满足问题中的条件。", "emoji 👍🏽 done", "a\tb\n\nc  "):
        assert hf.encode(text, add_special_tokens=False) == raw.encode(text, add_special_tokens=False).ids
        assert hf(text)["input_ids"] == raw.encode(text, add_special_tokens=False).ids
    assert "[\\p{L}\\p{M}]+" in str(hf.backend_tokenizer.pre_tokenizer)


def test_without_config_json_transformers_forces_the_qwen2_regex(folder, tmp_path):
    # Why the caller must write config.json: without model_type qwen3_5, 5.4.0 builds
    # Qwen2Tokenizer from tokenizer_class and replaces the \p{M} regex.
    from transformers import AutoTokenizer

    directory, _ = folder
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in FILES:
        (bare / name).write_bytes((directory / name).read_bytes())
    hf = AutoTokenizer.from_pretrained(str(bare))
    raw = Tokenizer.from_file(str(bare / "tokenizer.json"))
    assert type(hf).__name__ == "Qwen2Tokenizer"
    assert hf.encode(HINDI, add_special_tokens=False) != raw.encode(HINDI, add_special_tokens=False).ids


def test_autoprocessor_builds_qwen3vl_with_torchvision_backend(folder):
    from transformers import AutoProcessor

    directory, ids = folder
    processor = AutoProcessor.from_pretrained(str(directory))
    assert type(processor).__name__ == "Qwen3VLProcessor"
    assert type(processor.image_processor).__name__ == "Qwen2VLImageProcessor"
    assert processor.image_processor.backend == "torchvision"
    assert type(processor.video_processor).__name__ == "Qwen3VLVideoProcessor"
    assert type(processor.tokenizer).__name__ == "TokenizersBackend"
    assert processor.image_token_id == ids["image_token_id"]
    assert processor.video_token_id == ids["video_token_id"]
    assert processor.chat_template == (directory / "chat_template.jinja").read_text(encoding="utf-8")


def test_noul_descriptions_tokenize_and_round_trip(folder):
    directory, _ = folder
    raw = Tokenizer.from_file(str(directory / "tokenizer.json"))
    for text, digest in (
        ("True / 是：满足问题中的条件。", "6013d06fe04f22ce6913bd38a63e0b8f0a8e5f4b67b9bbe788633b5ebdad32dc"),
        ("False / 否：不满足问题中的条件。", "8682831f01e2c5676edeff84b87f29faee29b26872a9fc034082cdb9b8c9912c"),
    ):
        assert hashlib.sha256(text.encode("utf-8")).hexdigest() == digest
        ids = raw.encode(text, add_special_tokens=False).ids
        assert raw.decode(ids) == text
        assert len(ids) < len(text.encode("utf-8"))  # the corpus taught merges for these characters
