"""Tokenizer and chat template of a Qwen3.5 folder, without transformers.

Loads tokenizer.json with the `tokenizers` library exactly as written (transformers 5.4.0 loads a
Qwen3.5 folder as a plain TokenizersBackend, which keeps the file's pre-tokenizer regex), works
out the special-token set the way 5.4.0 fills `all_special_tokens` from tokenizer_config.json,
and renders chat_template.jinja in the same sandboxed Jinja environment 5.4.0 uses
(`transformers/utils/chat_template_utils.py`). Prompt segment rules live in request.py.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _BackendTokenizer

from .config import read_config_json
from .errors import ConfigError

# transformers' PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES, in its order.
NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Control tokens the /v1/systemone worker always refuses in user text (docs/wire-contract.md).
CONTROL_TOKENS = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")


def _token_text(value) -> str | None:
    """A special-token value as tokenizer_config.json may hold it: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def special_tokens_from_config(config: dict, special_tokens_map: dict | None = None) -> tuple[dict[str, str], list[str]]:
    """Named and extra special tokens, following transformers 5.4.0's tokenizer loading.

    Returns (special_tokens_map, extra_special_tokens): the map holds the standard names that are
    set plus model-specific `*_token` keys (what `tokenizer.special_tokens_map` returns and the
    chat template receives); `all_special_tokens` is the map's values, then the extras, without
    repeats.
    """
    config = dict(config)
    # Legacy special_tokens_map.json is read only when tokenizer_config.json has no added_tokens_decoder.
    if special_tokens_map and "added_tokens_decoder" not in config:
        for key, value in special_tokens_map.items():
            if key in ("extra_special_tokens", "additional_special_tokens") and isinstance(value, list):
                existing = list(config.get(key) or [])
                existing += [v for v in value if v not in existing]
                config[key] = existing
            else:
                config[key] = value
    if "additional_special_tokens" in config:
        config.setdefault("extra_special_tokens", config.pop("additional_special_tokens"))

    names = list(NAMED_SPECIAL_TOKENS)
    model_specific = {
        key: value
        for key, value in config.items()
        if key not in NAMED_SPECIAL_TOKENS and key.endswith("_token") and isinstance(value, str)
    }
    extras = config.get("extra_special_tokens")
    if isinstance(extras, dict):
        model_specific.update(extras)
        extras = []
    names += [key for key in model_specific if key not in names]
    mapping = {}
    for key in names:
        text = _token_text(model_specific.get(key, config.get(key)))
        if text is not None:
            mapping[key] = text
    extra_list = [t for t in (_token_text(v) for v in (extras or [])) if t is not None]
    return mapping, extra_list


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}…{% endgeneration %}` renders its body unchanged (5.4.0 only records indices)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Like 5.4.0's override: plain json.dumps, no HTML escaping, non-ASCII kept.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in the environment transformers 5.4.0 uses for chat templates."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


class Tokenizer:
    """tokenizer.json + tokenizer_config.json + chat template of one folder."""

    def __init__(self, backend: _BackendTokenizer, config: dict, chat_template: str, special_tokens_map: dict | None = None):
        self.backend = backend
        self.config = config
        self.chat_template = chat_template
        self._template = compile_chat_template(chat_template)
        self.special_tokens_map, extras = special_tokens_from_config(config, special_tokens_map)
        seen: dict[str, None] = {}
        for token in list(self.special_tokens_map.values()) + extras:
            seen.setdefault(token, None)
        # What transformers' `tokenizer.all_special_tokens` holds for this folder (Valen's reject list).
        self.all_special_tokens: tuple[str, ...] = tuple(seen)
        added_tokens = backend.get_added_tokens_decoder().values()
        backend_specials = [t.content for t in added_tokens if t.special]
        # Special added tokens matched exactly as written (no lstrip, rstrip, single_word or
        # normalisation): split out before anything else, so N copies in a text are N ids and the
        # text between them tokenizes alone (video.encode_prompt repeats such pad ids).
        self.standalone_specials: frozenset[str] = frozenset(
            t.content for t in added_tokens if t.special and not (t.lstrip or t.rstrip or t.single_word or t.normalized)
        )
        reserved: dict[str, None] = dict.fromkeys(self.all_special_tokens)
        reserved.update(dict.fromkeys(CONTROL_TOKENS))
        reserved.update(dict.fromkeys(backend_specials))
        # Strings refused in user text: Valen's list, the worker's control tokens, and every
        # special added token of tokenizer.json (a superset; identical on a Qwen folder).
        self.reserved_strings: tuple[str, ...] = tuple(reserved)
        self._prompt_add_special_tokens = self._processor_adds_special_tokens()

    @classmethod
    def from_dir(cls, directory: Path) -> "Tokenizer":
        directory = Path(directory)
        try:
            backend = _BackendTokenizer.from_file(str(directory / "tokenizer.json"))
        except Exception as exc:
            raise ConfigError(f"{directory / 'tokenizer.json'}: cannot load ({exc})") from exc
        config = read_config_json(directory / "tokenizer_config.json")
        special_map_path = directory / "special_tokens_map.json"
        special_map = read_config_json(special_map_path) if special_map_path.exists() else None
        template_path = directory / "chat_template.jinja"
        if template_path.exists():
            template = template_path.read_text(encoding="utf-8")
        elif (directory / "chat_template.json").exists():
            template = read_config_json(directory / "chat_template.json").get("chat_template")
        else:
            template = config.get("chat_template")
        if not isinstance(template, str):
            raise ConfigError(f"{directory}: no chat template (chat_template.jinja) found")
        return cls(backend, config, template, special_map)

    def _processor_adds_special_tokens(self) -> bool:
        # TokenizersBackend rebuilds the post-processor when add_bos_token / add_eos_token are
        # given (or none exists); otherwise tokenizer.json's post-processor applies.
        explicit = "add_bos_token" in self.config or "add_eos_token" in self.config
        if explicit or self.backend.post_processor is None:
            if self.config.get("add_bos_token") and self.special_tokens_map.get("bos_token"):
                raise ConfigError("tokenizer_config.json: add_bos_token=true is not supported")
            if self.config.get("add_eos_token") and self.special_tokens_map.get("eos_token"):
                raise ConfigError("tokenizer_config.json: add_eos_token=true is not supported")
            return False
        return True

    @property
    def vocab_size(self) -> int:
        """Number of ids incl. added tokens (transformers' `len(tokenizer)`)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """`tokenizer.encode(text, add_special_tokens=False)`."""
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_prompt(self, text: str) -> list[int]:
        """Tokenize a rendered chat the way the 5.4.0 processor does inside apply_chat_template."""
        add = self._prompt_add_special_tokens
        bos = self.special_tokens_map.get("bos_token")
        if bos is not None and text.startswith(bos):
            add = False
        return self.backend.encode(text, add_special_tokens=add).ids

    def token_id(self, token: str) -> int:
        value = self.backend.token_to_id(token)
        if value is None:
            raise ConfigError(f"tokenizer.json: token {token!r} is not in the vocabulary")
        return value

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """Render like `apply_chat_template` in 5.4.0 (no tools, no documents).

        The template receives `messages`, `tools=None`, `documents=None`,
        `add_generation_prompt` and the special-tokens map (`eos_token`, …), as there.
        """
        return self._template.render(
            messages=messages,
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **self.special_tokens_map,
        )
