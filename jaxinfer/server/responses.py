"""OpenAI response bodies: completions and chat, whole or as stream chunks; logprobs in
each endpoint's own shape; usage. Pure functions over plain data (no engine, no I/O).
See docs/serving.md (#routes, #prompt-logprobs).
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Callable
from typing import Any

from jaxinfer.engine.request import PromptLogprobs
from jaxinfer.server.protocol import finite

TokenText = Callable[[int], str]  # a token id as text (special tokens kept)
Entry = dict[int, float] | None  # a token's logprob and the top k; None: not scored


@dataclasses.dataclass
class Choice:
    """One completion as it accumulates (non-streaming) or one chunk's worth (streaming)."""

    index: int
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[Entry] | None = None
    finish_reason: str | None = None
    reasoning: str = ""  # chat under a reasoning parser (`text` is then the content)
    tool_calls: list[dict] = dataclasses.field(default_factory=list)  # deltas, in order
    stop_reason: int | str | None = None  # vLLM's: the stop string or token id that ended it

    def add(self, text: str, token_ids: list[int], logprobs: list[Entry] | None,
            finish_reason: str | None, reasoning: str = "", tool_calls: tuple = (),
            stop_reason: int | str | None = None) -> None:
        self.stop_reason = stop_reason if stop_reason is not None else self.stop_reason
        self.text += text
        self.reasoning += reasoning
        self.tool_calls += tool_calls
        self.token_ids += token_ids
        if logprobs is not None:
            self.logprobs = (self.logprobs or []) + logprobs
        self.finish_reason = finish_reason or self.finish_reason


@dataclasses.dataclass(frozen=True)
class Echo:
    """A prompt as `echo` shows it: its text, token ids and logprobs (None: not scored)."""

    text: str
    token_ids: list[int]
    logprobs: PromptLogprobs | None = None


def echoed(choice: Choice, echo: Echo, *, top: int | None, generated: bool) -> Choice:
    """`choice` with the prompt in front; with `top` (the request's `logprobs`) the
    prompt's entries lead its logprobs, each cut to its first top + 1 items as vLLM cuts
    them (the prompt token, then the best). `generated=False` (`max_tokens=0`): the prompt
    alone."""
    rest = choice if generated else Choice(choice.index)
    logprobs = None
    if top is not None:
        prompt = [None] * len(echo.token_ids) if echo.logprobs is None else [
            None if e is None else {t: lp.logprob for t, lp in list(e.items())[:top + 1]}
            for e in echo.logprobs]
        logprobs = prompt + (rest.logprobs or [])
    return Choice(choice.index, echo.text + rest.text, echo.token_ids + rest.token_ids,
                  logprobs, choice.finish_reason, stop_reason=choice.stop_reason)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def header(kind: str, response_id: str, model: str) -> dict[str, Any]:
    return {"id": response_id, "object": kind, "created": int(time.time()), "model": model}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def completion_choice(choice: Choice, token_text: TokenText | None,
                      text_offset: int = 0) -> dict[str, Any]:
    logprobs = None
    if choice.logprobs is not None and token_text is not None:
        logprobs = completion_logprobs(choice.token_ids, choice.logprobs, token_text,
                                       text_offset)
    return {"index": choice.index, "text": choice.text, "logprobs": logprobs,
            "finish_reason": choice.finish_reason, "stop_reason": choice.stop_reason}


def completion_logprobs(token_ids: list[int], entries: list[Entry],
                        token_text: TokenText, text_offset: int) -> dict[str, Any]:
    """/v1/completions' shape: parallel lists of tokens, their logprobs, the top
    alternatives as {token text: logprob} (both null for an unscored prompt token), and
    each token's offset in the text."""
    tokens, offsets = [], []
    for token_id in token_ids:
        tokens.append(token_text(token_id))
        offsets.append(text_offset)
        text_offset += len(tokens[-1])
    return {"tokens": tokens,
            "token_logprobs": [None if e is None else finite(e[t])
                               for t, e in zip(token_ids, entries, strict=True)],
            "top_logprobs": [None if e is None else {token_text(k): finite(v)
                                                     for k, v in _ranked(e)}
                             for e in entries],
            "text_offset": offsets}


def chat_choice(choice: Choice, token_text: TokenText | None, top: int,
                delta: bool, reasoning_names: tuple[str, ...] = ()) -> dict[str, Any]:
    """A chat choice: `message` whole, or `delta` in a stream chunk. With a reasoning
    parser, `reasoning_names` are the fields that carry `choice.reasoning`: a message
    has them all (null: no reasoning) and null content when it has only reasoning (as
    vLLM's), a delta those with text."""
    logprobs = None
    if choice.logprobs is not None and token_text is not None:
        logprobs = {"content": chat_logprobs(choice.token_ids, choice.logprobs, token_text,
                                             top)}
    if delta:
        reasoning = dict.fromkeys(reasoning_names, choice.reasoning) if choice.reasoning else {}
        body = {"delta": reasoning | ({"content": choice.text} if choice.text else {})
                | ({"tool_calls": choice.tool_calls} if choice.tool_calls else {})}
    else:
        content = choice.text or (None if reasoning_names else "")
        calls = {"tool_calls": merged_calls(choice.tool_calls)} if choice.tool_calls else {}
        if calls and not choice.text.strip():
            content = None  # vLLM's: only calls, no text
        body = {"message": {"role": "assistant", "content": content} | calls
                | dict.fromkeys(reasoning_names, choice.reasoning or None)}
    return {"index": choice.index, **body, "logprobs": logprobs,
            "finish_reason": choice.finish_reason, "stop_reason": choice.stop_reason}


def merged_calls(deltas: list[dict]) -> list[dict]:
    """A message's `tool_calls` from its stream deltas: each call's id, type and name from
    its first delta, its arguments joined."""
    calls: dict[int, dict] = {}
    for delta in deltas:
        if "id" in delta:
            calls[delta["index"]] = {"id": delta["id"], "type": delta["type"],
                                     "function": dict(delta["function"])}
        else:
            calls[delta["index"]]["function"]["arguments"] += delta["function"]["arguments"]
    return list(calls.values())


def chat_logprobs(token_ids: list[int], entries: list[dict[int, float]],
                  token_text: TokenText, top: int) -> list[dict[str, Any]]:
    """/v1/chat/completions' shape: per token its text, logprob, UTF-8 bytes and the
    `top` best alternatives."""
    out = []
    for token_id, entry in zip(token_ids, entries, strict=True):
        alternatives = [_token_logprob(token_text(k), v) for k, v in _ranked(entry)[:top]]
        out.append(_token_logprob(token_text(token_id), entry[token_id])
                   | {"top_logprobs": alternatives})
    return out


def _token_logprob(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": finite(logprob), "bytes": list(text.encode("utf-8"))}


def _ranked(entry: dict[int, float]) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda kv: -kv[1])
