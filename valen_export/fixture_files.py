"""Tokenizer and processor files of a synthetic Qwen3.5 base folder, written offline.

`write_text_assets(out_dir)` writes tokenizer.json (a byte-level BPE trained in-process on a
small inline corpus), tokenizer_config.json, chat_template.jinja, preprocessor_config.json and
video_preprocessor_config.json, shaped like the real Qwen3.5-2B files so that transformers
5.4.0's AutoTokenizer / AutoProcessor and valen_runtime both load them. It returns the special
token ids and the vocabulary size; writing config.json (with those ids) and any weights is the
caller's job. No model code lives here.

Loading note (transformers 5.4.0): `tokenizer_class` is "Qwen2Tokenizer", as in the real Qwen
folders. With a config.json whose model_type is "qwen3_5", 5.4.0 sees that the class differs
from the model type's own tokenizer ("Qwen3_5Tokenizer") and loads a plain TokenizersBackend
from tokenizer.json as written (the \\p{M} regex is kept). Without a qwen3_5 config.json it
would build Qwen2Tokenizer and force the Qwen2 regex, so the caller must write config.json.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

# Qwen's special tokens in Qwen's order (the real ids start at 248044 in this order).
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
# Ordinary (non-special) added tokens used by the real template.
ORDINARY_ADDED_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>")

EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
MODEL_MAX_LENGTH = 262144
VOCAB_SIZE = 800  # BPE vocabulary incl. the 14 specials; the 4 ordinary added tokens come after

# The Qwen3.5 pre-tokenizer split pattern, combining marks counted as letters ([\p{L}\p{M}]+).
QWEN35_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
    r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+"
    r"|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+"
    r"|\s+(?!\S)"
    r"|\s+"
)

# A small corpus covering what the tests and the Valen prompt use. Fixed text: training is
# deterministic for a fixed corpus and vocabulary size.
_CORPUS = (
    "The card was charged twice for one order. The customer asked for a refund.",
    "Task: choice\nQuestion: Should we refund the customer?\nCandidates:\nrefund: Refund now\nwait: Wait for the bank\nDecision:",
    "Task: noul\nQuestion: Is the light on?\nCandidates:\ntrue: yes\nfalse: no\nDecision:",
    "Task: score\nQuestion: How severe is it?\nCandidates:\nNot severe\nVery severe\nDecision:",
    "True / 是：满足问题中的条件。\nFalse / 否：不满足问题中的条件。",
    "user\nassistant\nsystem\n<think>\n\n</think>\n\n",
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs!",
    "It's, we're, they've, I'm, you'll, he'd; don't stop. What's the score? 42% of 100 is 42.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 2024 3.14159 -7 +8 1e-6 1,000,000 (12) [34] {56}",
    "Punctuation: ! \" # $ % & ' ( ) * + , - . / : ; < = > ? @ [ \\ ] ^ _ ` { | } ~",
    '{"state": {"board": [[1, 0], [0, 1]], "player": "white", "ok": true, "none": null}}',
    "\tindented with a tab\n\t\ttwo tabs\n    four spaces\n\n\nblank lines\r\nwindows line",
    "白色 黑色 棋盘 玩家 移动 选择 问题 条件 满足 不满足 是 否 中文 文本 测试。你好，世界！",
    "日本語のテキストです。こんにちは、世界。한국어 문장입니다.",
    "हिन्दी में पाठ। नमस्ते दुनिया। क्या यह सही है? मैंने किताब पढ़ी।",
    "ภาษาไทย สวัสดีชาวโลก ข้อความทดสอบ น้ำ ที่นี่",
    "Emoji: 😀 😂 👍🏽 ❤️ 🎉 🚀 👨‍👩‍👧 ✅ ❌ ⭐",
    "Ünïcödé café naïve résumé Straße Ångström coöperate façade",
    "Русский текст. Ελληνικά. العربية مَرْحَبًا. עברית.",
)


def _train_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(
        models.BPE(
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN35_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=1,
        show_progress=False,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(list(_CORPUS) * 4, trainer=trainer)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in ORDINARY_ADDED_TOKENS])
    return tokenizer


def _chat_template() -> str:
    # Newlines are emitted as Jinja string literals: `{%- -%}` trimming would eat literal ones.
    lines = [
        "{%- macro render_content(content) -%}",
        "{%- if content is string -%}",
        "{{- content -}}",
        "{%- elif content is iterable and content is not mapping -%}",
        "{%- for item in content -%}",
        "{%- if item.type == 'image' or item.type == 'image_url' or 'image' in item -%}",
        "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}",
        "{%- elif item.type == 'video' or item.type == 'video_url' or 'video' in item -%}",
        "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}",
        "{%- elif 'text' in item -%}",
        "{{- item.text -}}",
        "{%- else -%}",
        "{{- raise_exception('Unexpected item type in content.') -}}",
        "{%- endif -%}",
        "{%- endfor -%}",
        "{%- elif content is none or content is undefined -%}",
        "{{- '' -}}",
        "{%- else -%}",
        "{{- raise_exception('Unexpected content type.') -}}",
        "{%- endif -%}",
        "{%- endmacro -%}",
        "{%- for message in messages -%}",
        "{%- if message.role == 'user' -%}",
        "{%- set content = render_content(message.content) | trim -%}",
        "{%- else -%}",
        "{%- set content = render_content(message.content) -%}",
        "{%- endif -%}",
        "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' -}}",
        "{%- endfor -%}",
        "{%- if add_generation_prompt -%}",
        "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' -}}",
        "{%- endif -%}",
    ]
    return "\n".join(lines) + "\n"


def _tokenizer_config(tokenizer: Tokenizer) -> dict:
    added = {}
    for token_id, token in sorted(tokenizer.get_added_tokens_decoder().items()):
        added[str(token_id)] = {
            "content": token.content,
            "lstrip": token.lstrip,
            "normalized": token.normalized,
            "rstrip": token.rstrip,
            "single_word": token.single_word,
            "special": token.special,
        }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [t for t in SPECIAL_TOKENS if t not in (EOS_TOKEN, PAD_TOKEN)],
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "errors": "replace",
        "model_max_length": MODEL_MAX_LENGTH,
        "pad_token": PAD_TOKEN,
        "processor_class": "Qwen3VLProcessor",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


_VISION_COMMON = {
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "do_convert_rgb": True,
    "do_normalize": True,
    "do_rescale": True,
    "do_resize": True,
    "rescale_factor": 1 / 255,
    "resample": 3,
    "processor_class": "Qwen3VLProcessor",
}


def _preprocessor_config() -> dict:
    return {
        **_VISION_COMMON,
        "image_processor_type": "Qwen2VLImageProcessorFast",
        "size": {"shortest_edge": 65536, "longest_edge": 16777216},
    }


def _video_preprocessor_config() -> dict:
    return {
        **_VISION_COMMON,
        "video_processor_type": "Qwen3VLVideoProcessor",
        "size": {"shortest_edge": 4096, "longest_edge": 25165824},
        "fps": 2,
        "min_frames": 4,
        "max_frames": 768,
        "do_sample_frames": True,
    }


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_text_assets(out_dir: Path) -> dict:
    """Write the tokenizer / template / processor files of a synthetic Qwen3.5 base.

    Args:
        out_dir: directory to write into (created if missing; existing files are replaced).

    Returns:
        dict with `image_token_id`, `video_token_id`, `vision_start_token_id`,
        `vision_end_token_id`, `eos_token_id`, `pad_token_id`, `im_start_token_id`,
        `im_end_token_id`, `bos_token_id` (None) and `vocab_size` (number of ids incl. added
        tokens; config.json's `vocab_size` must be at least this).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer()
    tokenizer.save(str(out_dir / "tokenizer.json"), pretty=True)
    _write_json(out_dir / "tokenizer_config.json", _tokenizer_config(tokenizer))
    (out_dir / "chat_template.jinja").write_text(_chat_template(), encoding="utf-8")
    _write_json(out_dir / "preprocessor_config.json", _preprocessor_config())
    _write_json(out_dir / "video_preprocessor_config.json", _video_preprocessor_config())

    def token_id(token: str) -> int:
        value = tokenizer.token_to_id(token)
        if value is None:  # internal invariant: every special is registered above
            raise RuntimeError(f"token {token!r} missing from the trained tokenizer")
        return value

    return {
        "image_token_id": token_id("<|image_pad|>"),
        "video_token_id": token_id("<|video_pad|>"),
        "vision_start_token_id": token_id("<|vision_start|>"),
        "vision_end_token_id": token_id("<|vision_end|>"),
        "eos_token_id": token_id(EOS_TOKEN),
        "pad_token_id": token_id(PAD_TOKEN),
        "im_start_token_id": token_id("<|im_start|>"),
        "im_end_token_id": token_id("<|im_end|>"),
        "bos_token_id": None,
        "vocab_size": tokenizer.get_vocab_size(with_added_tokens=True),
    }
