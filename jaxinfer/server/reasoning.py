"""Chat under `--reasoning_parser`: each choice's reasoning apart from its content.

The engine's text skips special tokens, and the markers a parser reads (harmony's
`<|channel|>`...) are special tokens of their model's tokenizer; so each choice's
generated ids are decoded again here with the parser's markers kept
(`MarkedDetokenizer`), cut at the request's stop strings as the engine cuts its own text
(`TextState`), and split by the parser (jaxinfer/text/reasoning.py). A piece goes in, the
same piece comes out with `text` the content it added and `reasoning` the reasoning;
app.py renders the reasoning under `names`.
"""

from __future__ import annotations

import dataclasses

from jaxinfer.config import ServerConfig
from jaxinfer.engine.output import TextState
from jaxinfer.engine.request import SamplingParams
from jaxinfer.server.streams import Piece, Stream
from jaxinfer.text import reasoning
from jaxinfer.text.tokenizer import Tokenizer


class _Choice:
    """One completion's decoder, stop-string cut and parser."""

    def __init__(self, name: str, tokenizer: Tokenizer, prompt_token_ids: list[int],
                 stop: tuple[str, ...]) -> None:
        self._parser = reasoning.parser(name)
        detokenizer = reasoning.MarkedDetokenizer(tokenizer, prompt_token_ids,
                                                  self._parser.markers)
        self._text = TextState(detokenizer, stop)

    def split(self, piece: Piece) -> reasoning.Split:
        finished = piece.finish_reason is not None
        self._text.add(piece.token_ids)
        if finished:
            self._text.finish()
        out = self._parser.add(self._text.delta(finished))
        if finished:
            out += self._parser.finish()
        return out


class ReasoningSplitter:
    """The choices of one chat request, each parsed as its pieces arrive."""

    def __init__(self, name: str, tokenizer: Tokenizer, stop: tuple[str, ...], *,
                 include_reasoning_content: bool) -> None:
        self.names = ("reasoning", "reasoning_content") if include_reasoning_content else (
            "reasoning",)
        self._name = name
        self._tokenizer = tokenizer
        self._stop = stop
        self._choices: dict[tuple[str, int], _Choice] = {}

    def split(self, stream: Stream, pieces: list[Piece]) -> list[Piece]:
        """`pieces` of `stream` with their text split into content and reasoning."""
        out = []
        for piece in pieces:
            key = (stream.request_id, piece.index)
            if key not in self._choices:
                self._choices[key] = _Choice(self._name, self._tokenizer,
                                             stream.prompt_token_ids, self._stop)
            split = self._choices[key].split(piece)
            out.append(dataclasses.replace(piece, text=split.content,
                                           reasoning=split.reasoning))
        return out


def splitter(config: ServerConfig, tokenizer: Tokenizer | None,
             params: SamplingParams) -> ReasoningSplitter | None:
    """The splitter of a chat request, or None when the server runs no reasoning parser."""
    if config.reasoning_parser is None:
        return None
    if tokenizer is None:  # `serve` refuses this pairing at start; a library caller may not
        raise ValueError("a reasoning parser needs the model's tokenizer")
    return ReasoningSplitter(config.reasoning_parser, tokenizer, params.stop,
                             include_reasoning_content=config.include_reasoning_content)
