"""A chat choice's output read apart: its reasoning (`--reasoning_parser`), content and
tool calls, from its ids decoded again with the parsers' markers kept. See
docs/serving.md (#reasoning-models, #tool-calling).
"""

from __future__ import annotations

import dataclasses

from jaxinfer.config import ServerConfig
from jaxinfer.engine.detokenize import TextState
from jaxinfer.engine.request import SamplingParams
from jaxinfer.server import responses
from jaxinfer.server.streams import Piece, Stream
from jaxinfer.server.tools import ToolPlan
from jaxinfer.text import reasoning, tool_parsers
from jaxinfer.text.tokenizer import Tokenizer


class _Choice:
    """One completion's decoder, stop-string cut and parsers."""

    def __init__(self, name: str | None, tools: ToolPlan, tokenizer: Tokenizer,
                 prompt_token_ids: list[int], stop: tuple[str, ...]) -> None:
        self._tools = _tool_parser(tools)
        self._named = tools.named
        self._keep_reasoning = name is not None
        if getattr(self._tools, "reads_harmony", False) and name is None:
            name = "openai_gptoss"  # its passed-on text is harmony: only `final` is content
        self._reasoning = None if name is None else reasoning.parser(
            name, _prompt_tail(tokenizer, prompt_token_ids))
        markers = (getattr(self._reasoning, "markers", ())
                   + getattr(self._tools, "markers", ()))
        detokenizer = reasoning.MarkedDetokenizer(tokenizer, prompt_token_ids, markers)
        self._text = TextState(detokenizer, stop)
        self._calls = 0

    def split(self, piece: Piece) -> list[Piece]:
        finished = piece.finish_reason is not None
        self._text.add(piece.token_ids)
        if finished:
            self._text.finish()
        text = self._text.delta(finished)
        calls: list[tool_parsers.ToolCall] = []
        if getattr(self._tools, "reads_harmony", False):
            text, calls = self._read_calls(text, finished, calls)
        split = reasoning.Split(content=text)
        if self._reasoning is not None:
            split = self._reasoning.add(text)
            if finished:
                split += self._reasoning.finish()
        content = split.content
        if self._tools is not None and not getattr(self._tools, "reads_harmony", False):
            content, calls = self._read_calls(content, finished, calls)
        deltas = self._deltas(calls, content)
        if self._named is not None:
            content = ""
        return self._pieces(piece, content, split.reasoning, deltas)

    def _read_calls(self, text: str, finished: bool,
                    calls: list) -> tuple[str, list[tool_parsers.ToolCall]]:
        out = self._tools.add(text)
        if finished:
            out += self._tools.finish()
        return out.content, calls + out.calls

    def _deltas(self, calls: list[tool_parsers.ToolCall], content: str) -> list[dict]:
        """OpenAI's tool_calls deltas: a call's id, type, name and "", then its arguments."""
        deltas = []
        if self._named is not None:  # the whole text is the named function's arguments
            calls = [tool_parsers.ToolCall(self._named, "")] if self._calls == 0 else []
        for call in calls:
            deltas.append({"index": self._calls, "id": responses.new_id("chatcmpl-tool"),
                           "type": "function",
                           "function": {"name": call.name, "arguments": ""}})
            if call.arguments:
                deltas.append({"index": self._calls, "function": {"arguments": call.arguments}})
            self._calls += 1
        if self._named is not None and content:
            deltas.append({"index": 0, "function": {"arguments": content}})
        return deltas

    def _pieces(self, piece: Piece, content: str, reasoning_text: str,
                deltas: list[dict]) -> list[Piece]:
        finish = piece.finish_reason
        if finish == "stop" and self._calls:
            finish = "tool_calls"
        first = dataclasses.replace(piece, text=content,
                                    reasoning=reasoning_text if self._keep_reasoning else "",
                                    finish_reason=None if deltas else finish)
        rest = [Piece(piece.index, "", [], None, None, tool_calls=(delta,)) for delta in deltas]
        if rest:
            rest[-1] = dataclasses.replace(rest[-1], finish_reason=finish,
                                           stop_reason=piece.stop_reason)
        if rest and not (first.text or first.reasoning or first.token_ids):
            return rest
        return [first, *rest]


def _tool_parser(tools: ToolPlan) -> tool_parsers.ToolParser | None:
    if tools.parser is not None:
        return tool_parsers.parser(tools.parser)
    return tool_parsers.ConstrainedCalls() if tools.required else None


def _prompt_tail(tokenizer: Tokenizer, prompt_token_ids: list[int]) -> str:
    """The prompt's end as text, its markers kept (where a reasoning block may open)."""
    tail = prompt_token_ids[-reasoning.PROMPT_TAIL_TOKENS:]
    return tokenizer.decode(tail, skip_special_tokens=False)


class ReasoningSplitter:
    """The choices of one chat request, each parsed as its pieces arrive."""

    def __init__(self, name: str | None, tokenizer: Tokenizer, stop: tuple[str, ...], *,
                 include_reasoning_content: bool, tools: ToolPlan | None = None) -> None:
        self.names = () if name is None else ("reasoning", "reasoning_content") if (
            include_reasoning_content) else ("reasoning",)
        self._name = name
        self._tools = tools or ToolPlan()
        self._tokenizer = tokenizer
        self._stop = stop
        self._choices: dict[tuple[str, int], _Choice] = {}

    def split(self, stream: Stream, pieces: list[Piece]) -> list[Piece]:
        """`pieces` of `stream` with their text split into content, reasoning and calls."""
        out = []
        for piece in pieces:
            key = (stream.request_id, piece.index)
            if key not in self._choices:
                self._choices[key] = _Choice(self._name, self._tools, self._tokenizer,
                                             stream.prompt_token_ids, self._stop)
            out += self._choices[key].split(piece)
        return out


def splitter(config: ServerConfig, tokenizer: Tokenizer | None, params: SamplingParams,
             tools: ToolPlan | None = None) -> ReasoningSplitter | None:
    """The splitter of a chat request, or None when it has nothing to read apart (no
    reasoning parser, no calls to read)."""
    reads_calls = tools is not None and tools.reads_calls
    if config.reasoning_parser is None and not reads_calls:
        return None
    if tokenizer is None:  # `serve` refuses this pairing at start; a library caller may not
        raise ValueError("a reasoning or tool-call parser needs the model's tokenizer")
    return ReasoningSplitter(config.reasoning_parser, tokenizer, params.stop,
                             include_reasoning_content=config.include_reasoning_content,
                             tools=tools)
