"""Tool-call parsers (vLLM's `--tool-call-parser` names: `hermes`, `llama3_json`,
`mistral`, `openai`): a model's output split into content and `ToolCall`s, whole or
streamed; `ConstrainedCalls` reads what a `tool_choice` constraint made the model write.
Formats and rules: docs/serving.md#tool-calling.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator
from typing import Protocol

from jaxinfer.text.reasoning import (
    CALL,
    CHANNEL,
    END,
    HARMONY_MARKERS,
    MESSAGE,
    RETURN,
    START,
    MarkerScanner,
)


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text


@dataclasses.dataclass
class ToolSplit:
    """What some text added to the content, and the calls it completed."""

    content: str = ""
    calls: list[ToolCall] = dataclasses.field(default_factory=list)

    def __iadd__(self, other: ToolSplit) -> ToolSplit:
        self.content += other.content
        self.calls += other.calls
        return self


def call_of(value: object) -> ToolCall | None:
    """A call from parsed JSON `{"name": str, "arguments" or "parameters": ...}`; None for
    anything else. Arguments given as an object become JSON text; as text, stay as sent."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return ToolCall(value["name"], arguments)


def _loads(text: str) -> object:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # a model may nest past the decoder's limit
        return None


class JsonObjects:
    """The `{...}` objects of a text arriving in pieces, each once it closes: objects at
    the outermost brace level, whatever lies between them (`[`, `,`, `;`, spaces)."""

    def __init__(self) -> None:
        self.buffer = ""  # the text of the object open now
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def feed(self, text: str) -> Iterator[str]:
        for char in text:
            if self._depth == 0 and char != "{":
                continue
            self.buffer += char
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{}":
                self._depth += 1 if char == "{" else -1
                if self._depth == 0:
                    yield self.buffer
                    self.buffer = ""


class HermesParser:
    """`<tool_call>{json}</tool_call>` blocks (Hermes 2 Pro, Qwen2.5, Qwen3). Text after the
    first block is dropped, as vLLM's parser drops it; a block whose JSON is no call is
    content."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    markers = (OPEN, CLOSE)

    def __init__(self) -> None:
        self._scanner = MarkerScanner(self.markers)
        self._block: str | None = None  # the open block's text
        self._called = False

    def add(self, text: str) -> ToolSplit:
        return self._feed(self._scanner.scan(text))

    def finish(self) -> ToolSplit:
        out = self._feed(self._scanner.scan("", final=True))
        if self._block is not None:  # a block the output ended inside: a call if whole
            out += self._close()
        return out

    def _feed(self, runs: list[tuple[bool, str]]) -> ToolSplit:
        out = ToolSplit()
        for is_marker, run in runs:
            if is_marker and run == self.OPEN and self._block is None:
                self._block = ""
            elif is_marker and run == self.CLOSE and self._block is not None:
                out += self._close()
            elif self._block is not None:
                self._block += run
            elif not self._called:
                out.content += run
        return out

    def _close(self) -> ToolSplit:
        block, self._block = self._block, None
        call = call_of(_loads(block.strip()))
        if call is None:
            return ToolSplit(content="" if self._called else self.OPEN + block + self.CLOSE)
        self._called = True
        return ToolSplit(calls=[call])


class Llama3JsonParser:
    """Llama 3's JSON calls: `{"name", "parameters"}` objects (`;` between), maybe after
    `<|python_tag|>`. The first text that is not a space decides: `{` or the tag, calls;
    anything else, all content."""

    TAG = "<|python_tag|>"
    markers = (TAG,)

    def __init__(self) -> None:
        self._scanner = MarkerScanner(self.markers)
        self._mode: str | None = None  # "calls" or "content", once known
        self._lead = ""  # spaces before the mode is known
        self._objects = JsonObjects()

    def add(self, text: str) -> ToolSplit:
        return self._feed(self._scanner.scan(text))

    def finish(self) -> ToolSplit:
        out = self._feed(self._scanner.scan("", final=True))
        rest = self._objects.buffer if self._mode == "calls" else self._lead
        self._objects.buffer, self._lead = "", ""
        if rest.strip():
            out.content += rest
        return out

    def _feed(self, runs: list[tuple[bool, str]]) -> ToolSplit:
        out = ToolSplit()
        for is_marker, run in runs:
            if self._mode is None:
                if is_marker:
                    self._mode = "calls"
                    continue
                self._lead += run
                stripped = self._lead.lstrip()
                if not stripped:
                    continue
                self._mode = "calls" if stripped[0] == "{" else "content"
                run, self._lead = (stripped if self._mode == "calls" else self._lead), ""
            if self._mode == "content":
                out.content += run
            elif not is_marker:
                for text in self._objects.feed(run):
                    call = call_of(_loads(text))
                    out += ToolSplit(calls=[call]) if call else ToolSplit(content=text)
        return out


class MistralParser:
    """`[TOOL_CALLS]` then a JSON list of calls, or `NAME[ARGS]{json}` per call (newer
    tokenizers, `[CALL_ID]ID` optional before `[ARGS]`). Text before is content."""

    CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
    markers = (CALLS, ARGS, CALL_ID)

    def __init__(self) -> None:
        self._scanner = MarkerScanner(self.markers)
        self._calling = False
        self._name: str | None = None  # NAME[ARGS] form: the name, then its arguments
        self._head = ""  # text after [TOOL_CALLS] before [ARGS] or a JSON list
        self._objects = JsonObjects()

    def add(self, text: str) -> ToolSplit:
        return self._feed(self._scanner.scan(text))

    def finish(self) -> ToolSplit:
        return self._feed(self._scanner.scan("", final=True))

    def _feed(self, runs: list[tuple[bool, str]]) -> ToolSplit:
        out = ToolSplit()
        for is_marker, run in runs:
            if is_marker and run == self.CALLS:
                self._calling, self._name, self._head = True, None, ""
            elif not self._calling:
                out.content += run
            elif is_marker and run == self.ARGS:
                self._name, self._head = self._head.strip(), ""
            elif is_marker and run == self.CALL_ID:
                self._name = self._head.strip()  # the id that follows is ours to choose
            elif self._name is None:
                self._head += run  # a JSON list, or a name
                if self._head.lstrip().startswith("["):
                    out += self._objects_of(self._head)
                    self._head, self._name = "", ""
            else:
                out += self._objects_of(run)
        return out

    def _objects_of(self, text: str) -> ToolSplit:
        out = ToolSplit()
        for obj in self._objects.feed(text):
            value = _loads(obj)
            if self._name:  # NAME[ARGS]{...}: the object is the arguments
                value = {"name": self._name, "arguments": value}
            call = call_of(value)
            if call is not None:
                out.calls.append(call)
        return out


class HarmonyCallParser:
    """gpt-oss's calls: a harmony message whose header has `to=functions.NAME`. Its header
    waits for `<|message|>` (only then is its recipient known); a call's message is taken
    out whole, every other message passes on as it came, markers included, for the
    reasoning parser (`content` here is that text)."""

    reads_harmony = True
    markers = HARMONY_MARKERS
    RECIPIENT = re.compile(r"\bto=functions\.([^\s<]+)")

    def __init__(self) -> None:
        self._scanner = MarkerScanner(HARMONY_MARKERS)
        self._header: list[str] | None = None  # the open header's runs
        self._call: str | None = None  # the open call's name
        self._arguments = ""

    def add(self, text: str) -> ToolSplit:
        return self._feed(self._scanner.scan(text))

    def finish(self) -> ToolSplit:
        out = self._feed(self._scanner.scan("", final=True))
        if self._call is not None and _loads(self._arguments) is not None:
            out.calls.append(ToolCall(self._call, self._arguments))  # cut off, yet whole
        if self._header is not None:
            out.content += "".join(self._header)
        self._call, self._header = None, None
        return out

    def _feed(self, runs: list[tuple[bool, str]]) -> ToolSplit:
        out = ToolSplit()
        for is_marker, run in runs:
            if self._call is not None:
                if run in (END, CALL, RETURN, START):
                    out.calls.append(ToolCall(self._call, self._arguments))
                    self._call, self._arguments = None, ""
                    self._header = [run] if run == START else None
                elif not is_marker:
                    self._arguments += run
            elif self._header is not None:
                if run == MESSAGE:
                    out.content += self._message_opens()
                else:
                    self._header.append(run)
            elif is_marker and run in (START, CHANNEL):
                self._header = [run]
            else:
                out.content += run
        return out

    def _message_opens(self) -> str:
        """What passes on when a header ends: nothing for a call (it opens), else the
        header and the `<|message|>` marker."""
        header, self._header = "".join(self._header), None
        match = self.RECIPIENT.search(header)
        if match is None:
            return header + MESSAGE
        self._call, self._arguments = match.group(1), ""
        return ""


class ConstrainedCalls:
    """What `tool_choice="required"`'s constraint made the model write: a JSON list of
    `{"name", "parameters"}`, each call once whole. (A named function's constraint is its
    arguments alone: the server streams that text as they are.)"""

    markers: tuple[str, ...] = ()

    def __init__(self) -> None:
        self._objects = JsonObjects()

    def add(self, text: str) -> ToolSplit:
        calls = (call_of(_loads(obj)) for obj in self._objects.feed(text))
        return ToolSplit(calls=[c for c in calls if c is not None])

    def finish(self) -> ToolSplit:
        return ToolSplit()


# name (vLLM's `--tool-call-parser` value) -> parser; config.serving.TOOL_CALL_PARSERS lists
# the same names for the flag's choices
PARSERS: dict[str, type] = {"hermes": HermesParser, "llama3_json": Llama3JsonParser,
                            "mistral": MistralParser, "openai": HarmonyCallParser}


class ToolParser(Protocol):
    markers: tuple[str, ...]  # the special tokens it reads: decode them as text

    def add(self, text: str) -> ToolSplit: ...

    def finish(self) -> ToolSplit: ...


def parser(name: str) -> ToolParser:
    """A new parser of that name; an unknown name is refused with the known ones."""
    if name not in PARSERS:
        raise ValueError(f"tool_call_parser={name!r} is not a known tool-call parser; the "
                         f"known ones are {', '.join(PARSERS)}")
    return PARSERS[name]()


def split(name: str, text: str) -> ToolSplit:
    """The whole `text` split by the parser `name`."""
    p = parser(name)
    out = p.add(text)
    out += p.finish()
    return out
