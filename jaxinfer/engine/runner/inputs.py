"""The numpy half of the runner: a bucket's padded inputs (token ids, attention
metadata, sampling rows, proposed ids) built from chunks on the host, for the draft
model's steps and parity checks; `score_spans` / `score_targets` name the prompt
positions a step scores (docs/sampling.md#sampling-parameters, prompt logprobs).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxinfer.engine.request import MAX_LOGIT_BIAS, Request, SamplingParams
from jaxinfer.model.attention import AttentionMetadata
from jaxinfer.model.sampler import SamplingInputs
from jaxinfer.pallas import DEFAULT_SETTINGS, AttentionSettings

STOP_WIDTH = 16  # stop ids per request row, masked while min_tokens is not reached
BIAS_WIDTH = MAX_LOGIT_BIAS  # logit_bias pairs a slot's row holds on the device
NUM_SAMPLE_POSITIONS = 1  # Q: positions sampled per request in the compiled step


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One request's new tokens in one step."""

    token_ids: Sequence[int]
    start: int  # tokens of this request already in the KV cache
    page_ids: Sequence[int]  # the request's pages, enough for start + len(token_ids)
    num_samples: int = 1  # the last tokens whose logits are sampled


@dataclasses.dataclass(frozen=True)
class SampleRow:
    """One sampled position: its request, and every token up to it (the last one fed)."""

    request: Request
    token_ids: Sequence[int]  # prompt, outputs, then what the step fed up to the position


def build_metadata(chunks: Sequence[Chunk], *, page_size: int, pages_per_seq: int,
                   num_tokens: int, num_slots: int, all_logits: bool = False,
                   num_positions: int = 1, attention: AttentionSettings = DEFAULT_SETTINGS
                   ) -> tuple[np.ndarray, AttentionMetadata]:
    """Token ids and attention metadata (numpy) for chunks padded to a bucket, attended
    with the engine's `attention` settings (impl, interpret).

    Logits rows: every token with `all_logits`, else `num_positions` per slot, position
    q of slot i at row i * num_positions + q: the chunk's q-th sampled token, token 0
    where it samples fewer."""
    total = sum(len(c.token_ids) for c in chunks)
    if total > num_tokens or len(chunks) > num_slots:
        raise ValueError(f"{total} tokens / {len(chunks)} requests exceed the bucket "
                         f"({num_tokens}, {num_slots})")
    token_ids = np.zeros(num_tokens, np.int32)
    positions = np.zeros(num_tokens, np.int32)
    slot_mapping = np.arange(num_tokens, dtype=np.int32) % page_size  # trash page 0
    page_indices = np.zeros((num_slots, pages_per_seq), np.int32)
    kv_lens = np.zeros(num_slots, np.int32)
    cu_q_lens = np.zeros(num_slots + 1, np.int32)
    offset = 0
    for i, chunk in enumerate(chunks):
        n, end = len(chunk.token_ids), chunk.start + len(chunk.token_ids)
        if len(chunk.page_ids) * page_size < end or len(chunk.page_ids) > pages_per_seq:
            raise ValueError(f"request {i}: {len(chunk.page_ids)} pages cannot hold {end} "
                             f"tokens (page_size {page_size}, at most {pages_per_seq} pages)")
        pos = np.arange(chunk.start, end, dtype=np.int32)
        pages = np.asarray(chunk.page_ids, np.int32)
        token_ids[offset:offset + n] = chunk.token_ids
        positions[offset:offset + n] = pos
        slot_mapping[offset:offset + n] = pages[pos // page_size] * page_size + pos % page_size
        page_indices[i, :len(pages)] = pages
        kv_lens[i] = end
        offset += n
        cu_q_lens[i + 1:] = offset
    rows = (np.arange(num_tokens, dtype=np.int32) if all_logits
            else _sampled_rows(chunks, cu_q_lens, num_slots, num_positions))
    md = AttentionMetadata(positions=positions, slot_mapping=slot_mapping,
                           page_indices=page_indices, kv_lens=kv_lens, cu_q_lens=cu_q_lens,
                           num_seqs=np.array([len(chunks)], np.int32), logits_indices=rows,
                           attention=attention)
    return token_ids, md


def _sampled_rows(chunks: Sequence[Chunk], cu_q_lens: np.ndarray, num_slots: int,
                  num_positions: int) -> np.ndarray:
    """i32[S * Q]: row s * Q + q is the token of slot s's q-th sample; 0 where none."""
    rows = np.zeros((num_slots, num_positions), np.int32)
    for i, chunk in enumerate(chunks):
        m, n = chunk.num_samples, len(chunk.token_ids)
        if not 0 <= m <= min(n, num_positions):
            raise ValueError(f"request {i}: {m} samples of {n} tokens, at most "
                             f"{num_positions} per request")
        rows[i, :m] = np.arange(cu_q_lens[i + 1] - m, cu_q_lens[i + 1])
    return rows.reshape(-1)


def proposed_ids(chunks: Sequence[Chunk], *, num_slots: int, num_positions: int
                 ) -> np.ndarray:
    """i32[S, Q]: at each sampled position the token the chunk feeds next (a draft it
    verifies); -1 at the chunk's last position and at unused ones."""
    out = np.full((num_slots, num_positions), -1, np.int32)
    for i, chunk in enumerate(chunks):
        first = len(chunk.token_ids) - chunk.num_samples
        out[i, :max(chunk.num_samples - 1, 0)] = chunk.token_ids[first + 1:]
    return out


def next_power_of_two(n: int, floor: int = 1) -> int:
    return max(floor, 1 << max(n - 1, 0).bit_length())


# The SamplingParams fields the device reads as they are (floats, then ints), and what a
# greedy padding row holds: SamplingParams' own neutral defaults.
PARAM_FLOATS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                "frequency_penalty")
PADDING_PARAMS = SamplingParams(temperature=0.0)


def device_temperature(params: SamplingParams) -> float:
    """The temperature the device samples with: 0 (greedy) below GREEDY_TEMPERATURE."""
    return 0.0 if params.greedy else params.temperature


def stop_ids(params: SamplingParams, eos_token_ids: frozenset[int]) -> list[int]:
    """The ids banned while a request has fewer than `min_tokens` outputs (at most
    STOP_WIDTH): its stop token ids, then the EOS ids unless it ignores EOS."""
    stops = list(params.stop_token_ids)
    stops += [] if params.ignore_eos else sorted(eos_token_ids)
    return stops[:STOP_WIDTH]


def sampling_inputs(rows: Sequence[SampleRow | None], *, num_rows: int,
                    history_width: int, eos_token_ids: frozenset[int]) -> SamplingInputs:
    """Per-row sampling arrays; None rows and rows past the given ones are greedy padding."""
    rows = list(rows) + [None] * (num_rows - len(rows))
    history = np.full((num_rows, history_width), -1, np.int32)
    banned = np.full((num_rows, STOP_WIDTH), -1, np.int32)
    values = [_row(row) for row in rows]
    for i, row in enumerate(rows):
        if row is None:
            continue
        request, tokens = row.request, row.token_ids
        history[i, :len(tokens)] = tokens
        if values[i]["ban_stop"]:
            stops = stop_ids(request.params, eos_token_ids)
            banned[i, :len(stops)] = stops
    arrays = {k: np.asarray([v[k] for v in values], np.float32 if k in PARAM_FLOATS
                            else np.int32) for k in values[0]}
    arrays["seeds"] = arrays["seeds"].astype(np.uint32)
    arrays["ban_stop"] = arrays["ban_stop"].astype(bool)
    return SamplingInputs(history=history, history_rows=np.arange(num_rows, dtype=np.int32),
                          stop_ids=banned, **arrays)


def _row(row: SampleRow | None) -> dict[str, float | int | bool]:
    """One row's SamplingInputs values (history and stop ids apart)."""
    p = PADDING_PARAMS if row is None else row.request.params
    values = {name: getattr(p, name) for name in (*PARAM_FLOATS, "top_k")}
    values["temperature"] = device_temperature(p)
    if row is None:
        return values | {"seeds": 0, "counters": 0, "prompt_lens": 0, "history_lens": 0,
                         "ban_stop": False, "logprobs": 0}
    request = row.request
    # Outputs before this row's token (0 at a position inside the prompt).
    generated = max(0, len(row.token_ids) - len(request.prompt_token_ids))
    return values | {"seeds": request.seed, "counters": generated,
                     "prompt_lens": len(request.prompt_token_ids),
                     "history_lens": len(row.token_ids), "ban_stop": generated < p.min_tokens,
                     "logprobs": p.logprobs or 0}


@dataclasses.dataclass(frozen=True)
class ScoreSpan:
    """The prompt positions one chunk scores: request positions `first` .. `first + count
    - 1`, at token rows `row` .. `row + count - 1` of the step. Position p scores prompt
    token p + 1, the request's `prompt_logprobs[p]` entry."""

    first: int
    count: int
    row: int


def score_spans(requests: Sequence[Request], chunks: Sequence[tuple[int, int]]
                ) -> list[ScoreSpan | None]:
    """Per chunk, given as (start, number of tokens), the prompt positions it scores, or
    None: those of a request collecting
    prompt logprobs that are in the chunk, not scored yet (a recompute after preemption
    scores nothing twice) and followed by a prompt token (a chunk's last position scores
    the first token of the next chunk, known from the prompt)."""
    spans: list[ScoreSpan | None] = []
    row = 0
    for request, (start, count) in zip(requests, chunks, strict=True):
        span = None
        if request.prompt_logprobs is not None:
            first = max(start, len(request.prompt_logprobs))
            last = min(start + count, len(request.prompt_token_ids) - 1)  # one past the last
            if first < last:
                span = ScoreSpan(first=first, count=last - first, row=row + first - start)
        spans.append(span)
        row += count
    return spans


def score_targets(requests: Sequence[Request], spans: Sequence[ScoreSpan | None], *,
                  num_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """(i32[T] target ids, -1 where a row is not scored; i32[1] most top logprobs wanted)."""
    targets = np.full(num_tokens, -1, np.int32)
    num_top = 0
    for request, span in zip(requests, spans, strict=True):
        if span is None:
            continue
        prompt = request.prompt_token_ids
        targets[span.row:span.row + span.count] = prompt[span.first + 1:
                                                         span.first + 1 + span.count]
        num_top = max(num_top, request.params.prompt_logprobs or 0)
    return targets, np.array([num_top], np.int32)
