"""What a structured-output request asks for: `StructuredOutputsParams` (vLLM's class and
field names, exactly one constraint: json, regex, choice, grammar, json_object) and
OpenAI's `response_format` mapped onto it; `spec()` is the canonical (kind, text) key
compiled grammars are cached by. Checks the request's shape only. Plain Python, no jax.
See docs/structured_outputs.md (#using-it, #errors).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclasses.dataclass(frozen=True, kw_only=True)
class StructuredOutputsParams:
    """One output constraint (vLLM's `StructuredOutputsParams`)."""

    json: str | dict | bool | None = None  # kept as a dict
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [k for k in KINDS if is_given(k, getattr(self, k))]
        if len(given) != 1:
            raise ValueError(f"structured_outputs must give exactly one of {', '.join(KINDS)}"
                             f"; got {', '.join(given) or 'none'}")
        if self.json is not None:
            object.__setattr__(self, "json", _schema(self.json))
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(
                    isinstance(c, str) and c for c in self.choice) or not self.choice:
                raise ValueError("structured_outputs.choice must be a non-empty list of "
                                 "non-empty strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.json_object not in (None, True, False):
            raise ValueError("structured_outputs.json_object must be a bool")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if is_given(k, getattr(self, k)))

    def spec(self) -> tuple[str, str]:
        """(kind, canonical text): equal constraints give equal specs."""
        value = getattr(self, self.kind)
        if self.kind == "json":  # key order kept: the output writes properties in it
            return "json", json.dumps(value, separators=(",", ":"))
        if self.kind == "choice":
            return "choice", json.dumps(list(value))
        if self.kind == "json_object":
            return "json_object", ""
        return self.kind, value

    @classmethod
    def parse(cls, value: object) -> StructuredOutputsParams | None:
        """None, an instance, or its fields as a dict (a JSON round trip)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, Mapping):
            unknown = set(value) - {f.name for f in dataclasses.fields(cls)}
            if unknown:
                raise ValueError(f"structured_outputs has unknown field(s) "
                                 f"{', '.join(sorted(unknown))}; known: {', '.join(KINDS)}")
            return cls(**{k: v for k, v in value.items() if v is not None})
        raise ValueError(f"structured_outputs must be an object, not {type(value).__name__}")


def is_given(kind: str, value: object) -> bool:
    """Whether a constraint field was given: anything but None, and for `json_object`
    anything but False (`json_object: false` asks for nothing; `json: false` is a schema)."""
    return value is not None and not (kind == "json_object" and value is False)


def _schema(value: object) -> dict:
    """`structured_outputs.json` as a schema dict; ValueError naming the field."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"structured_outputs.json is not JSON: {e}") from None
        except RecursionError:  # the C decoder's depth limit: text nested ~1,000 deep
            raise ValueError("structured_outputs.json is nested too deeply") from None
    if value is True:  # JSON Schema's `true`: any value, the same constraint as `{}`
        return {}
    if value is False:
        raise ValueError("structured_outputs.json is the schema false: no value is valid "
                         "under it")
    if not isinstance(value, dict):
        raise ValueError("structured_outputs.json must be a JSON schema (an object), "
                         f"not {type(value).__name__}")
    return value


def from_response_format(response_format: Mapping) -> StructuredOutputsParams | None:
    """OpenAI's `response_format` as a constraint: `text` (none), `json_object`, or
    `json_schema` with `{"json_schema": {"name", "schema", "strict"}}`. ValueError
    naming the field for anything else."""
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, Mapping) or "schema" not in spec:
            raise ValueError("response_format.json_schema must be an object with a "
                             "'schema' (and 'name', optional 'strict')")
        try:
            return StructuredOutputsParams(json=spec["schema"])
        except ValueError as e:  # named as the client sent it
            raise ValueError(str(e).replace("structured_outputs.json",
                                            "response_format.json_schema", 1)) from None
    raise ValueError(f"response_format.type={kind!r} must be one of 'text', 'json_object', "
                     "'json_schema'")
