"""A prompt's RequestOutput brought up to date from its completions (`copy_into`), and
the logprob entries it carries, vLLM's dicts of Logprob (`output_logprobs`,
`record_prompt_scores`) with each token's text (`TokenTexts`). Plain Python.
See docs/sampling.md#the-python-api.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from jaxinfer.engine.detokenize import TextState
from jaxinfer.engine.request import Logprob, Request, RequestOutput
from jaxinfer.text.tokenizer import Tokenizer


class TokenTexts:
    """Each token's own text (special tokens kept), as vLLM's `decoded_token`, decoded
    once; None without a tokenizer."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token: int) -> str | None:
        if self._tokenizer is None:
            return None
        if token not in self._texts:
            self._texts[token] = self._tokenizer.decode([token], skip_special_tokens=False)
        return self._texts[token]


def output_logprobs(sample: Any, k: int, greedy: bool,
                    token_text: Callable[[int], str | None]) -> dict[int, Logprob]:
    """vLLM's entry for a generated token (a runner Sample): it, then the top k, as
    Logprobs. Its rank: 1 when greedy, else 1 + the top k above it; None if all k are
    (its place is unknown)."""
    top = sample.top_logprobs[:k].tolist()
    entry = {token: Logprob(logprob, rank, token_text(token)) for rank, (token, logprob)
             in enumerate(zip(sample.top_ids[:k].tolist(), top, strict=True), start=1)}
    above = sum(logprob > sample.logprob for logprob in top)
    rank = 1 if greedy else above + 1 if above < k else None
    chosen = entry.get(sample.token_id) or Logprob(sample.logprob, rank,
                                                    token_text(sample.token_id))
    return {sample.token_id: chosen} | entry


def record_prompt_scores(chunks: Sequence, prompt_scores: Sequence,
                         token_text: Callable[[int], str | None]) -> None:
    """Append each chunk's scored prompt positions (runner PromptScores, or None) to its
    request's prompt_logprobs: {prompt token: Logprob} plus the top k, vLLM's dict."""
    for chunk, scores in zip(chunks, prompt_scores, strict=True):
        request = chunk.request
        if scores is None or request.prompt_logprobs is None or request.finished:
            continue
        if scores.first != len(request.prompt_logprobs):
            raise RuntimeError(f"{request.request_id}: prompt position {scores.first} "
                               f"scored after {len(request.prompt_logprobs)}")
        k = request.params.prompt_logprobs or 0
        prompt = request.prompt_token_ids
        for i in range(len(scores.logprobs)):
            token = prompt[scores.first + i + 1]
            entry = {token: Logprob(float(scores.logprobs[i]), int(scores.ranks[i]),
                                    token_text(token))}
            for rank, (top, logprob) in enumerate(zip(
                    scores.top_ids[i, :k].tolist(), scores.top_logprobs[i, :k].tolist(),
                    strict=True), start=1):
                entry.setdefault(top, Logprob(logprob, rank, token_text(top)))
            request.prompt_logprobs.append(entry)


def copy_into(out: RequestOutput, requests: Sequence[Request], texts: dict[str, TextState],
              finished: Callable[[Request], None]) -> RequestOutput:
    """Copy a prompt's completions (`requests`) into its RequestOutput, with this step's
    deltas; `finished` is called once for each completion that ended since."""
    first = requests[0]
    if out.prompt_logprobs is None and first.prompt_logprobs is not None and not (
            first.scoring_prompt):
        out.prompt_logprobs = [None, *first.prompt_logprobs]
    for request, completion in zip(requests, out.outputs, strict=True):
        text = texts[request.request_id]
        if request.finished and completion.finish_reason is None:
            text.finish()
            finished(request)
        done = len(completion.token_ids)  # only what this step added is copied
        completion.delta_token_ids = request.output_token_ids[done:]
        completion.token_ids.extend(completion.delta_token_ids)
        completion.delta_text = text.delta(request.finished)
        completion.text += completion.delta_text
        completion.finish_reason = request.finish_reason
        out.num_cached_tokens = max(out.num_cached_tokens, request.num_cached_tokens or 0)
        completion.stop_reason = request.stop_reason
        if completion.logprobs is not None:
            new = request.output_logprobs[done:]
            completion.logprobs.extend(new)
            completion.cumulative_logprob = (completion.cumulative_logprob or 0.0) + sum(
                entry[token].logprob for entry, token in zip(
                    new, completion.delta_token_ids, strict=True))
    return out
