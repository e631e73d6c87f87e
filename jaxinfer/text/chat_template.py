"""Chat templates rendered as transformers renders them, in a jinja2 sandbox; messages
rebuilt from plain data. See docs/sampling.md#tokenizer-and-chat-template.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
from collections.abc import Callable, Mapping
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils

# An assistant turn's reasoning, by the names clients send (vLLM's `reasoning`, DeepSeek's
# `reasoning_content`) and templates read (gpt-oss's harmony reads `thinking`, Qwen3's
# `reasoning_content`): a message giving one gets them all.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def render(template: str, messages: list[dict], *, add_generation_prompt: bool,
           **variables: Any) -> str:
    """The template's text for `messages`; raises jinja2.TemplateError on failure."""
    return _compile_template(template).render(
        messages=_prepare_messages(messages), add_generation_prompt=add_generation_prompt,
        **_plain_data(variables))



def continue_final(text: str, messages: list[dict]) -> str:
    """`text`, the rendering of `messages` without a generation prompt, cut right after the
    last message's content, so the model goes on writing that message (transformers'
    `continue_final_message`). ValueError when the template did not write the content."""
    content = messages[-1].get("content") if messages else None
    if isinstance(content, list):  # text parts: the last one holding text
        content = next((part["text"] for part in reversed(content)
                        if isinstance(part, Mapping) and isinstance(part.get("text"), str)),
                       None)
    if not isinstance(content, str):
        raise ValueError("continue_final_message: the last message has no text to continue")
    start = text.rfind(content.strip())
    if start < 0:
        raise ValueError("continue_final_message: the chat template does not write the last "
                         "message's content as given, so there is no place to continue it")
    kept = content.lstrip()  # templates that strip the content drop its trailing space too
    end = start + (len(kept) if text.startswith(kept, start) else len(content.strip()))
    return text[:end]

def _prepare_messages(messages: list[dict]) -> list[dict]:
    """Plain copies of the messages without None values, reasoning under all its names."""
    prepared = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise TypeError(f"chat messages must be dicts, got {message!r}")
        message = _plain_data({k: v for k, v in message.items() if v is not None})
        reasoning = next((message[k] for k in _REASONING_FIELDS if k in message), None)
        if reasoning is not None:
            message = {**dict.fromkeys(_REASONING_FIELDS, reasoning), **message}
        prepared.append(message)
    return prepared


def _plain_data(value: Any) -> Any:
    """`value` rebuilt from plain JSON types, so templates never reach a rich object's methods."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for base in (str, int, float):
        if isinstance(value, base):
            return base(value)
    if isinstance(value, Mapping):
        return {_plain_data(k): _plain_data(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain_data(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain_data(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain_data(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):  # pydantic models
        return _plain_data(value.model_dump())
    return f"<{type(value).__name__}>"


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """transformers' `tojson`: no HTML escaping, non-ASCII kept, optional indent."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.datetime.now().strftime(format)


def _check_namespace_name(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(
            f"chat templates cannot set underscore-prefixed namespace attributes, got {name!r}"
        )


class _TemplateDict:
    """The `dict` global without the type itself, so templates cannot reach its attributes."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """jinja's `namespace` refusing underscore attributes (as transformers' sandbox does)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # jinja's signature trick: `self` may be a key
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _check_namespace_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_namespace_name(name)
        super().__setitem__(name, value)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask tag): its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render(self, caller: Callable[[], str]) -> str:
        return caller()


@functools.lru_cache(maxsize=8)
def _compile_template(source: str) -> jinja2.Template:
    """Compiles a chat template in the environment transformers uses."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _Namespace
    return env.from_string(source)
