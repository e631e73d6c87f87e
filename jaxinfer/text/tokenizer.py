"""Text <-> token ids for a checkpoint directory: `Tokenizer.from_dir` (HF fast tokenizer,
configs, chat template); streamed text deltas are text/detokenizer.py's.
See docs/sampling.md#tokenizer-and-chat-template.
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import os
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import tokenizers

from jaxinfer.text import chat_template
from jaxinfer.text.detokenizer import IncrementalDetokenizer

logger = logging.getLogger(__name__)

# Named special tokens that transformers passes to chat templates (its `special_tokens_map`).
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                      "cls_token", "mask_token")
# How many characters a normalizer may fold into one (NFC composes up to three Hangul
# jamo into a syllable; a margin over that).
NORMALIZER_SHRINK = 4


class TooLong(ValueError):
    """A prompt text with surely too many tokens, found from its length alone."""

    def __init__(self, num_chars: int, min_tokens: int, max_chars_per_token: int) -> None:
        super().__init__(f"the prompt has {num_chars} characters, so at least {min_tokens} "
                         f"tokens (one token of this tokenizer spans at most "
                         f"{max_chars_per_token})")
        self.min_tokens = min_tokens


class Tokenizer:
    """An HF fast tokenizer plus the special tokens, stop ids and chat template of a checkpoint."""

    def __init__(self, backend: tokenizers.Tokenizer, *, special_tokens: Mapping[str, str],
                 eos_token_ids: frozenset[int], bos_token_id: int | None,
                 chat_template: str | None, name: str = "tokenizer") -> None:
        self._backend = backend
        self._special_tokens = dict(special_tokens)
        self._name = name
        self.eos_token_ids = eos_token_ids
        self.bos_token_id = bos_token_id
        self.bos_token: str | None = self._special_tokens.get("bos_token")
        self.eos_token: str | None = self._special_tokens.get("eos_token")
        self.chat_template = chat_template

    @classmethod
    def from_dir(cls, model_dir: str | os.PathLike) -> Tokenizer:
        """Loads `tokenizer.json` and the optional config files of an HF checkpoint directory."""
        root = pathlib.Path(model_dir)
        if not root.is_dir():
            raise FileNotFoundError(f"tokenizer directory {str(root)!r} does not exist")
        path = root / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(
                f"{str(root)!r} has no tokenizer.json (only HF fast tokenizers are supported)"
            )
        try:
            backend = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises a bare Exception
            raise ValueError(f"{path} is not a valid tokenizer.json: {e}") from e
        tokenizer_config = read_json(root / "tokenizer_config.json")
        special_tokens_map = read_json(root / "special_tokens_map.json")
        special_tokens = _special_tokens(tokenizer_config, special_tokens_map)
        _add_missing_special_tokens(backend, special_tokens)
        generation_config = read_json(root / "generation_config.json")
        model_config = read_json(root / "config.json")
        template_path = root / "chat_template.jinja"
        template_file = template_path.read_text("utf-8") if template_path.is_file() else None
        tokenizer = cls(
            backend,
            special_tokens=special_tokens,
            eos_token_ids=_eos_token_ids(backend, special_tokens, generation_config, model_config),
            bos_token_id=_bos_token_id(backend, special_tokens, generation_config, model_config),
            chat_template=_select_chat_template(root, tokenizer_config, template_file),
            name=str(root),
        )
        logger.info("tokenizer %s: vocab_size=%d bos_token_id=%s eos_token_ids=%s", root,
                    tokenizer.vocab_size, tokenizer.bos_token_id, sorted(tokenizer.eos_token_ids))
        return tokenizer

    def with_chat_template(self, template: str) -> Tokenizer:
        """This tokenizer (its vocabulary shared) rendering chats with `template`."""
        other = copy.copy(self)
        other.chat_template = template
        other._name = f"{self._name} (the chat_template given)"
        return other

    @property
    def vocab_size(self) -> int:
        """Vocabulary size including added tokens."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def vocab(self) -> dict[str, int]:
        """Token string -> id, added tokens included."""
        return self._backend.get_vocab(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; the tokenizer.json post-processor adds BOS/EOS as configured.

        Other threads run meanwhile: `encode_batch` lets go of the GIL, `encode` holds it
        (a long prompt tokenized on one thread stalled the server's engine thread)."""
        _check_unicode(text)
        return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def encode_for_pooling(self, text: str, pair: str | None = None, *,
                           max_length: int | None = None) -> tuple[list[int], list[int]]:
        """(ids, token type ids) of `text`, or of the pair (text, pair) as a cross-encoder
        reads it, with special tokens; `max_length`: cut to that many tokens as
        transformers' `truncation=True` cuts (special tokens kept)."""
        _check_unicode(text)
        _check_unicode(pair or "")
        backend = self._backend if max_length is None else self._truncating(max_length)
        encoding = backend.encode_batch([(text, pair) if pair is not None else text])[0]
        return encoding.ids, encoding.type_ids

    @functools.lru_cache(maxsize=8)  # noqa: B019 (a few lengths, for the tokenizer's life)
    def _truncating(self, max_length: int) -> tokenizers.Tokenizer:
        backend = tokenizers.Tokenizer.from_str(self._backend.to_str())
        backend.enable_truncation(max_length=max_length)
        return backend

    @functools.cached_property
    def max_chars_per_token(self) -> int:
        """The most characters of text one token can stand for: the longest vocabulary
        entry (a byte-level entry has a character per byte, so this bounds characters too),
        times NORMALIZER_SHRINK when a normalizer may compose characters first."""
        longest = max(map(len, self.vocab()), default=1)
        return longest * (NORMALIZER_SHRINK if self._backend.normalizer is not None else 1)

    def min_tokens(self, text: str) -> int:
        """A lower bound on the tokens of `text`, without tokenizing it."""
        return -(-len(text) // self.max_chars_per_token)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `token_ids`."""
        ids = [int(t) for t in token_ids]
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    @property
    def eos_token_id(self) -> int | None:
        """The id of `eos_token` (transformers' name; `eos_token_ids` holds every stop id)."""
        return None if self.eos_token is None else self._backend.token_to_id(self.eos_token)

    def convert_ids_to_tokens(self, token_ids: Sequence[int]) -> list[str]:
        """The vocabulary entries of `token_ids` (byte-level BPE: `Ġ` for a space)."""
        return [self._backend.id_to_token(int(t)) for t in token_ids]

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool | None = None, *,
        tokenize: bool = False, continue_final_message: bool = False, **kwargs: Any
    ) -> str | list[int]:
        """Renders `messages` with the checkpoint's chat template, as transformers does.

        The template sees `messages`, `add_generation_prompt` (default: True, unless
        `continue_final_message`), `tools=None`, `documents=None`, the named special tokens
        (`bos_token`, `eos_token`, ...) and `kwargs`, which win. Returns the text, or with
        `tokenize=True` its ids, encoded without special tokens, as transformers encodes
        it (transformers returns ids unless told `tokenize=False`). Encode the text with
        `add_special_tokens=False`. `continue_final_message`: the text ends right after the
        last message's content, for the model to go on writing it.
        """
        if self.chat_template is None:
            raise ValueError(
                f"{self._name} has no chat template (no 'chat_template' in tokenizer_config.json "
                "and no chat_template.jinja); send a plain prompt instead of chat messages"
            )
        if not messages:
            raise ValueError("cannot apply the chat template to an empty list of messages")
        if add_generation_prompt is None:
            add_generation_prompt = not continue_final_message
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message continues the last message; it cannot "
                             "be given with add_generation_prompt, which starts a new one")
        defaults = {**self._special_tokens, "tools": None, "documents": None}
        try:
            text = chat_template.render(self.chat_template, messages,
                                        add_generation_prompt=add_generation_prompt,
                                        **{**defaults, **kwargs})
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template of {self._name} failed: {e}") from e
        if continue_final_message:
            text = chat_template.continue_final(text, messages)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def prompt_ids(self, prompt: str | Sequence[int] | None = None,
                   messages: list[dict] | None = None, *, add_generation_prompt: bool = True,
                   max_tokens: int | None = None, tools: list[dict] | None = None,
                   continue_final_message: bool = False,
                   template_kwargs: dict | None = None) -> list[int]:
        """Token ids of a text prompt, a token-id prompt, or chat messages (templated, with
        `tools`, `continue_final_message` and the template variables `template_kwargs`,
        vLLM's chat_template_kwargs). A text of surely more than `max_tokens` tokens
        (`min_tokens`) raises TooLong before it is tokenized: time and memory stay bounded
        whatever its size."""
        if (prompt is None) == (messages is None):
            raise ValueError("give exactly one of a prompt or chat messages")
        if messages is not None:
            text = self.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tools=tools,
                continue_final_message=continue_final_message, **(template_kwargs or {}))
        elif isinstance(prompt, str):
            text = prompt
        else:
            return list(prompt)
        if max_tokens is not None and self.min_tokens(text) > max_tokens:
            raise TooLong(len(text), self.min_tokens(text), self.max_chars_per_token)
        return self.encode(text, add_special_tokens=messages is None)

    def detokenizer(
        self, prompt_token_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> IncrementalDetokenizer:
        """A streaming detokenizer for the ids generated after `prompt_token_ids`."""
        return IncrementalDetokenizer(self, prompt_token_ids, skip_special_tokens)


def _check_unicode(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # a lone surrogate, e.g. from JSON's "\ud800"
        raise ValueError(f"the text is not valid Unicode ({e.reason} at character "
                         f"{e.start})") from None


def read_json(path: pathlib.Path) -> dict[str, Any]:
    """The JSON object in `path`, or {} if the file is absent."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _token_content(value: Any) -> str | None:
    """A special token given as a string or as an AddedToken dict {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _special_tokens(tokenizer_config: Mapping[str, Any],
                    special_tokens_map: Mapping[str, Any]) -> dict[str, str]:
    """Named special token strings; special_tokens_map.json wins when the tokenizer config has
    no `added_tokens_decoder` (transformers' legacy rule)."""
    merged = dict(tokenizer_config)
    if "added_tokens_decoder" not in tokenizer_config:
        merged.update(special_tokens_map)
    tokens = {key: _token_content(merged.get(key)) for key in SPECIAL_TOKEN_KEYS}
    return {key: token for key, token in tokens.items() if token is not None}


def _add_missing_special_tokens(backend: tokenizers.Tokenizer,
                                special_tokens: Mapping[str, str]) -> None:
    """Adds named special tokens that are not in the vocab, as transformers does on load."""
    missing = [t for t in dict.fromkeys(special_tokens.values()) if backend.token_to_id(t) is None]
    if missing:
        logger.warning("special tokens %s are not in tokenizer.json; adding them", missing)
        backend.add_special_tokens([tokenizers.AddedToken(t, special=True) for t in missing])


def _config_ids(config: Mapping[str, Any], key: str, file: str) -> list[int]:
    value = config.get(key)
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ValueError(f"{file} {key}={value!r} must be an int or a list of ints")
    return values


def _eos_token_ids(backend: tokenizers.Tokenizer, special_tokens: Mapping[str, str],
        generation_config: Mapping[str, Any], model_config: Mapping[str, Any]) -> frozenset[int]:
    ids = _config_ids(generation_config, "eos_token_id", "generation_config.json")
    ids += _config_ids(model_config, "eos_token_id", "config.json")
    if "eos_token" in special_tokens:
        ids.append(backend.token_to_id(special_tokens["eos_token"]))
    if not ids:
        logger.warning("no eos token in the tokenizer or model configs; generation stops on length")
    return frozenset(ids)


def eos_token_ids_from_configs(model_dir: str | os.PathLike) -> frozenset[int]:
    """EOS ids from generation_config.json and config.json alone: the stop ids of a
    checkpoint served without a tokenizer (`skip_tokenizer_init`)."""
    root = pathlib.Path(model_dir)
    ids = _config_ids(read_json(root / "generation_config.json"), "eos_token_id",
                      "generation_config.json")
    ids += _config_ids(read_json(root / "config.json"), "eos_token_id", "config.json")
    return frozenset(ids)


def _bos_token_id(backend: tokenizers.Tokenizer, special_tokens: Mapping[str, str],
        generation_config: Mapping[str, Any], model_config: Mapping[str, Any]) -> int | None:
    if "bos_token" in special_tokens:
        return backend.token_to_id(special_tokens["bos_token"])
    ids = _config_ids(model_config, "bos_token_id", "config.json")
    ids += _config_ids(generation_config, "bos_token_id", "generation_config.json")
    return ids[0] if ids else None


def _select_chat_template(root: pathlib.Path, tokenizer_config: Mapping[str, Any],
                          template_file: str | None) -> str | None:
    """chat_template.jinja, else tokenizer_config's `chat_template` (a string, or a list of
    {"name", "template"} from which "default" is taken). The file wins, as in transformers."""
    if template_file is not None:
        return template_file
    template = tokenizer_config.get("chat_template")
    if template is None or isinstance(template, str):
        return template
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        if isinstance(named.get("default"), str):
            return named["default"]
        logger.warning("%s: chat templates %s have no 'default'; ignoring them", root, list(named))
        return None
    raise ValueError(f"{root / 'tokenizer_config.json'} chat_template must be a string or a list")
