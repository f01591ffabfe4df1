"""valen_runtime.tokenizer against transformers 5.4.0 on the synthetic Qwen3.5 folder."""

import json
import os
import shutil

import jinja2
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from valen_export.fixture_files import SPECIAL_TOKENS  # noqa: E402
from valen_runtime.errors import ConfigError  # noqa: E402
from valen_runtime.tokenizer import Tokenizer  # noqa: E402

STRINGS = [
    "The card was charged twice for one order.",
    "Task: choice\nQuestion: Refund?\nCandidates:\n",
    "refund: Refund now",
    "Decision:",
    "<|im_start|>user\n",
    "白色 黑色 棋盘。你好，世界！",
    "True / 是：满足问题中的条件。",
    "False / 否：不满足问题中的条件。",
    "हिन्दी में पाठ। नमस्ते दुनिया। मैंने किताब पढ़ी।",
    "ภาษาไทย น้ำ ที่นี่",
    "e\u0301 combining vs \u00e9 precomposed; Å vs A\u030a",
    "emoji 😀 👍🏽 👨‍👩‍👧 ❤️",
    "\ttabs\t\tand  spaces   \n\n\r\n trailing  ",
    "It's we're I'm you'll he'd THEY'VE",
    "1234567890 3.14 -7e-6",
    '{"a": [1, 2, {"b": null}], "ü": "ß"}',
    "<think>\n\n</think>\n\n<tool_call>x</tool_call>",
    "<|vision_start|><|image_pad|><|vision_end|>",
    "",
    " ",
    "\x00nul and \u2028 line separator",
]


@pytest.fixture(scope="module")
def folder(text_assets):
    return text_assets[0]


@pytest.fixture(scope="module")
def hf_tokenizer(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


@pytest.fixture(scope="module")
def tokenizer(folder):
    return Tokenizer.from_dir(folder)


def test_encode_matches_autotokenizer(tokenizer, hf_tokenizer):
    for text in STRINGS:
        assert tokenizer.encode(text) == hf_tokenizer.encode(text, add_special_tokens=False), repr(text)


def test_encode_prompt_matches_processor_call_tokenization(tokenizer, hf_tokenizer):
    # The processor calls tokenizer(text) with the default add_special_tokens=True.
    for text in STRINGS:
        assert tokenizer.encode_prompt(text) == hf_tokenizer(text)["input_ids"], repr(text)


def test_specials_are_single_ids(tokenizer):
    for index, token in enumerate(SPECIAL_TOKENS):
        assert tokenizer.token_id(token) == index
        assert tokenizer.encode(token) == [index]
    with pytest.raises(ConfigError, match="not in the vocabulary"):
        tokenizer.token_id("<|no_such_token|>")


def test_vocab_size_is_len_of_transformers_tokenizer(tokenizer, hf_tokenizer):
    assert tokenizer.vocab_size == len(hf_tokenizer)


def test_all_special_tokens_match_transformers(tokenizer, hf_tokenizer):
    assert list(tokenizer.all_special_tokens) == list(hf_tokenizer.all_special_tokens)
    assert tokenizer.special_tokens_map == hf_tokenizer.special_tokens_map
    assert set(SPECIAL_TOKENS) <= set(tokenizer.reserved_strings)
    assert "<think>" not in tokenizer.reserved_strings  # an ordinary added token


def _variant(folder, tmp_path, change_config, extra_files=None):
    directory = tmp_path / "variant"
    shutil.copytree(folder, directory)
    config = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
    change_config(config)
    (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    for name, content in (extra_files or {}).items():
        (directory / name).write_text(json.dumps(content), encoding="utf-8")
    return directory


ADDED_EOS = {"content": "<|im_end|>", "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True, "__type": "AddedToken"}


@pytest.mark.parametrize(
    "change, extra_files",
    [
        (lambda c: c.pop("additional_special_tokens"), None),
        (lambda c: (c.pop("additional_special_tokens"), c.update(extra_special_tokens=["<|vision_pad|>"])), None),
        (lambda c: c.update(image_token="<|image_pad|>", video_token="<|video_pad|>"), None),
        (lambda c: c.update(extra_special_tokens={"image_token": "<|image_pad|>"}), None),
        (lambda c: c.update(eos_token=ADDED_EOS), None),
        (lambda c: c.update(bos_token="<|im_start|>", unk_token="<|endoftext|>"), None),
        (
            lambda c: (c.pop("added_tokens_decoder"), c.pop("additional_special_tokens")),
            {"special_tokens_map.json": {"additional_special_tokens": ["<|box_start|>"], "eos_token": "<|im_end|>"}},
        ),
    ],
    ids=["no-additional", "extra-list", "model-specific-keys", "extra-dict", "added-token-dict", "bos-unk", "legacy-map"],
)
def test_special_token_rules_match_transformers_on_variants(folder, tmp_path, change, extra_files):
    from transformers import AutoTokenizer

    directory = _variant(folder, tmp_path, change, extra_files)
    hf = AutoTokenizer.from_pretrained(str(directory))
    ours = Tokenizer.from_dir(directory)
    assert list(ours.all_special_tokens) == list(hf.all_special_tokens)
    assert ours.special_tokens_map == hf.special_tokens_map
    for token in hf.all_special_tokens:
        assert token in ours.reserved_strings


MESSAGES = [
    [{"role": "user", "content": [{"type": "text", "text": "  The card was charged twice.  "}]}],
    [
        {"role": "system", "content": [{"type": "text", "text": "Be brief. "}]},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "\nwhat?\n"}, {"type": "image"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "white"}]},
        {"role": "user", "content": "plain string content ü"},
    ],
    [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "हिन्दी 😀"}]}],
]


@pytest.mark.parametrize("messages", MESSAGES)
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_render_matches_transformers(tokenizer, hf_tokenizer, messages, add_generation_prompt):
    expected = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert tokenizer.render_chat(messages, add_generation_prompt=add_generation_prompt) == expected


def test_render_environment_features_match_transformers(folder, tmp_path):
    # tojson without HTML escaping, loop controls, {% generation %}, special-token variables,
    # trim_blocks / lstrip_blocks and raise_exception behave as in 5.4.0's environment.
    from transformers.utils.chat_template_utils import render_jinja_template

    template = (
        "{% for m in messages %}\n"
        "  {% if loop.index > 2 %}{% break %}{% endif %}\n"
        "  {{ m | tojson }}|{{ m.content | tojson(indent=2) }}\n"
        "  {% generation %}[{{ eos_token }}]{% endgeneration %}\n"
        "{% endfor %}\n"
        "{% if add_generation_prompt %}GEN{% endif %}{{ tools is none }}{{ documents is none }}"
    )
    directory = tmp_path / "tpl"
    shutil.copytree(folder, directory)
    (directory / "chat_template.jinja").write_text(template, encoding="utf-8")
    ours = Tokenizer.from_dir(directory)
    messages = [{"role": "user", "content": "<b>ü & 'x'</b>"}, {"role": "assistant", "content": "a"}, {"role": "user", "content": "c"}]
    rendered, _ = render_jinja_template(
        [messages], chat_template=template, add_generation_prompt=True, **ours.special_tokens_map
    )
    assert ours.render_chat(messages, add_generation_prompt=True) == rendered[0]

    (directory / "chat_template.jinja").write_text("{{ raise_exception('nope') }}", encoding="utf-8")
    with pytest.raises(jinja2.TemplateError, match="nope"):
        Tokenizer.from_dir(directory).render_chat(messages)


def test_sandbox_blocks_unsafe_attribute_access(folder, tmp_path):
    directory = tmp_path / "unsafe"
    shutil.copytree(folder, directory)
    (directory / "chat_template.jinja").write_text("{{ messages.__class__.__mro__ }}", encoding="utf-8")
    with pytest.raises(jinja2.exceptions.SecurityError):
        Tokenizer.from_dir(directory).render_chat([{"role": "user", "content": "x"}])


def test_missing_files_are_config_errors(folder, tmp_path):
    directory = tmp_path / "broken"
    shutil.copytree(folder, directory)
    (directory / "chat_template.jinja").unlink()
    with pytest.raises(ConfigError, match="chat template"):
        Tokenizer.from_dir(directory)
    (directory / "tokenizer.json").unlink()
    with pytest.raises(ConfigError, match="tokenizer.json"):
        Tokenizer.from_dir(directory)


def test_add_bos_token_is_refused(folder, tmp_path):
    directory = _variant(folder, tmp_path, lambda c: c.update(add_bos_token=True, bos_token="<|im_start|>"))
    with pytest.raises(ConfigError, match="add_bos_token"):
        Tokenizer.from_dir(directory)
