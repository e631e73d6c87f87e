"""What a request handler reads: the `Stream` of each submitted prompt, the `Update`s the
engine thread posts to it (one `Piece` per completion that moved), and `updates`, which
yields them in order until every prompt of the HTTP request has finished.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from jaxinfer.engine.request import PromptLogprobs
from jaxinfer.server.protocol import APIError


@dataclasses.dataclass(frozen=True)
class Piece:
    """What one step added to one of a prompt's completions."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    reasoning: str = ""  # under a reasoning parser (server/reasoning.py): `text` is content
    tool_calls: tuple[dict, ...] = ()  # OpenAI's tool_calls deltas (server/reasoning.py)
    stop_reason: int | str | None = None  # the stop string or token id that ended it


@dataclasses.dataclass(frozen=True)
class Update:
    pieces: list[Piece]
    finished: bool
    error: APIError | None = None
    prompt_logprobs: PromptLogprobs | None = None  # the prompt's, once all are scored


Inbox = asyncio.Queue  # of (Stream, Update), or None: the client went away


class Disconnected(Exception):
    """The client closed its connection."""


class Stream:
    """A submitted prompt as the handler sees it: its token ids, then its updates, which
    arrive in the inbox it shares with the other prompts of the same HTTP request."""

    def __init__(self, inbox: Inbox, request_id: str, n: int, prompt_text: str = "") -> None:
        self.request_id = request_id
        self.n = n
        self.inbox = inbox
        self._loop = asyncio.get_running_loop()
        self.prompt_token_ids: list[int] = []
        self.prompt_text = prompt_text  # with `Submission.echo`: the prompt, or its ids decoded
        self.prompt_logprobs: PromptLogprobs | None = None  # from the first update with them
        self.num_cached_tokens = 0
        self.finished = False
        self.constraint_field: str | None = None  # the field an output constraint came in

    def post(self, update: Update) -> None:
        """From the engine thread: hand an update to the handler's event loop."""
        with contextlib.suppress(RuntimeError):  # a closed event loop: nobody listens
            self._loop.call_soon_threadsafe(self.inbox.put_nowait, (self, update))


async def updates(streams: list[Stream]) -> AsyncIterator[tuple[int, Update]]:
    """(prompt index, update) of `streams` (one inbox) until all finish; an error update
    raises its APIError, a None in the inbox raises Disconnected."""
    index = {id(stream): i for i, stream in enumerate(streams)}
    inbox = streams[0].inbox
    while not all(stream.finished for stream in streams):
        item = await inbox.get()
        if item is None:
            raise Disconnected
        stream, update = item
        stream.finished = update.finished
        if update.prompt_logprobs is not None:
            stream.prompt_logprobs = update.prompt_logprobs
        if update.error is not None:
            raise update.error
        yield index[id(stream)], update


def piece_of(completion: Any) -> Piece:
    """What the last step added to a CompletionOutput; logprobs as floats (the JSON's)."""
    logprobs = completion.logprobs
    count = len(completion.delta_token_ids)
    new = None if logprobs is None else [{token: lp.logprob for token, lp in entry.items()}
                                         for entry in logprobs[len(logprobs) - count:]]
    return Piece(completion.index, completion.delta_text, list(completion.delta_token_ids),
                 new, completion.finish_reason, stop_reason=completion.stop_reason)


def moved(piece: Piece, done: list[bool]) -> bool:
    """Whether the piece is news: text or tokens, or a finish not reported yet."""
    if done[piece.index]:
        return False
    return bool(piece.text or piece.token_ids or piece.finish_reason)
