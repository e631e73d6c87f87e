"""What stays on the device across steps (`BatchState`: each slot's page-table rows per
page group, token history, last sample, sampling settings) and the small `StepDelta` a
step sends; `expand` makes the step's inputs, `admit` writes newly placed requests' rows,
`record_samples` keeps each slot's last token. See docs/architecture.md#the-host-loop and
docs/kv_cache.md#page-groups-the-hybrid-kv-cache.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.model.attention import AttentionMetadata, KVCache
from jaxinfer.model.sampler import SamplingInputs
from jaxinfer.model.step import StepInputs
from jaxinfer.pallas import DEFAULT_SETTINGS, AttentionSettings


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SlotRows:
    """Sampling settings per slot (vLLM's SamplingParams, greedy as temperature 0)."""

    temperature: jax.Array  # f32[n]
    top_k: jax.Array  # i32[n]
    top_p: jax.Array  # f32[n]
    min_p: jax.Array  # f32[n]
    repetition_penalty: jax.Array  # f32[n]
    presence_penalty: jax.Array  # f32[n]
    frequency_penalty: jax.Array  # f32[n]
    seeds: jax.Array  # u32[n]
    prompt_lens: jax.Array  # i32[n]
    min_tokens: jax.Array  # i32[n]
    logprobs: jax.Array  # i32[n]
    stop_ids: jax.Array  # i32[n, E]: banned while min_tokens is not reached; -1 padding
    adapter: jax.Array  # i32[n]: the LoRA adapter slot, -1 for the base model


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BatchState:
    """Per-slot rows on the device, N + 1 of each (the last one padding)."""

    page_table: jax.Array  # i32[G, N + 1, pages_per_seq]: per KV page group
    history: jax.Array  # i32[N + 1, max_model_len]: token ids by position
    last_token: jax.Array  # i32[N + 1]: the token the slot sampled last
    rows: SlotRows  # [N + 1]
    expert_tokens: jax.Array  # i32[L_moe, E]: tokens each MoE layer routed to each expert
    # over the engine's life (a dense model: [0, 0])
    # logit_bias: each slot's biased token ids (-1 padding) and their biases, written at
    # admission (sparse: B pairs, the most a request may send)
    bias_ids: jax.Array  # i32[N + 1, B]
    bias_values: jax.Array  # f32[N + 1, B]
    # the window of each page group's layers (AttentionMetadata.group_windows)
    group_windows: tuple[int | None, ...] = dataclasses.field(
        default=(None,), metadata={"static": True})


# A step delta's fields, in the order the host packs them, and their sizes given
# T tokens, S requests, Q sampled positions each and U page-id writes per page group.
_DELTA_FIELDS = (
    ("token_ids", "T"),  # -1 = the token the slot sampled last
    ("positions", "T"),
    ("token_slots", "T"),  # each token's slot; N for padding
    ("seq_slots", "S"),  # each request's slot; N for padding
    ("kv_lens", "S"),
    ("cu_q_lens", "S+1"),
    ("num_seqs", "1"),
    ("logits_indices", "SQ"),  # token row of each sampled position
    ("sample_slots", "SQ"),  # slot whose settings sample it; N: not sampled
    ("proposed_ids", "SQ"),  # [S, Q]: token to verify; -1 = none
    ("page_writes", "3GU"),  # [G, U, 3]: (slot, page index, page id); slot N + 1 = none
)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["flat"],
                   meta_fields=["num_tokens", "num_slots", "num_positions",
                                "num_page_writes", "num_groups"])
@dataclasses.dataclass(frozen=True)
class StepDelta:
    """One step's host inputs, packed in one int32 array (one transfer, not eleven);
    the shapes are static, so each field is a fixed slice of it."""

    flat: jax.Array  # i32[n]: the _DELTA_FIELDS, concatenated
    num_tokens: int  # T
    num_slots: int  # S
    num_positions: int  # Q
    num_page_writes: int  # U
    num_groups: int = 1  # G: KV page groups

    @classmethod
    def from_list(cls, values: list[int], *, num_tokens: int, num_slots: int,
                  num_positions: int, num_page_writes: int, num_groups: int = 1
                  ) -> StepDelta:
        """The delta of the _DELTA_FIELDS already concatenated in one list (the host's
        fast path: one conversion)."""
        delta = cls(np.array(values, np.int32), num_tokens, num_slots, num_positions,
                    num_page_writes, num_groups)
        expected = sum(delta._size(size) for _, size in _DELTA_FIELDS)
        if len(values) != expected:
            raise ValueError(f"{len(values)} values for a delta of {expected}")
        return delta

    def __getattr__(self, name: str) -> jax.Array:
        offset = 0
        for field, size in _DELTA_FIELDS:
            count = self._size(size)
            if field == name:
                part = self.flat[offset:offset + count]
                if name == "proposed_ids":
                    return part.reshape(self.num_slots, self.num_positions)
                if name == "page_writes":
                    return part.reshape(self.num_groups, self.num_page_writes, 3)
                return part
            offset += count
        raise AttributeError(name)

    def _size(self, size: str) -> int:
        return {"T": self.num_tokens, "S": self.num_slots, "S+1": self.num_slots + 1,
                "1": 1, "SQ": self.num_slots * self.num_positions,
                "3GU": 3 * self.num_groups * self.num_page_writes}[size]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Admission:
    """Rows of newly placed requests, and writes too many for a step's delta."""

    slots: jax.Array  # i32[A]: slot of each row; N + 1 = none
    rows: SlotRows  # [A]
    page_writes: jax.Array  # i32[G, W, 3]: (slot, page index, page id) per page group
    history_writes: jax.Array  # i32[W, 3]: (slot, position, token id)
    bias_writes: jax.Array  # i32[Wb, 3]: (slot, index, token id or -1) of logit_bias pairs
    bias_values: jax.Array  # f32[Wb]: the bias of each pair


def init(num_slots: int, *, pages_per_seq: int, max_model_len: int,
         num_stop_ids: int, experts: tuple[int, int] = (0, 0),
         group_windows: tuple[int | None, ...] = (None,), bias_width: int = 0
         ) -> BatchState:
    """N = `num_slots` empty slots and the padding one, all neutral; `experts`: (MoE
    layers, experts) of the routing counts; `group_windows`: the window of each KV page
    group's layers (a page table each); `bias_width`: logit_bias pairs a slot holds."""
    n = num_slots + 1
    return BatchState(
        page_table=jnp.zeros((len(group_windows), n, pages_per_seq), jnp.int32),
        history=jnp.full((n, max_model_len), -1, jnp.int32),
        last_token=jnp.zeros((n,), jnp.int32),
        rows=neutral_rows(n, num_stop_ids),
        expert_tokens=jnp.zeros(experts, jnp.int32),
        bias_ids=jnp.full((n, bias_width), -1, jnp.int32),
        bias_values=jnp.zeros((n, bias_width), jnp.float32),
        group_windows=tuple(group_windows))


def neutral_rows(n: int, num_stop_ids: int) -> SlotRows:
    """Greedy rows without penalties, logprobs or stop ids."""
    f32, i32 = jnp.zeros((n,), jnp.float32), jnp.zeros((n,), jnp.int32)
    return SlotRows(temperature=f32, top_k=i32, top_p=f32 + 1, min_p=f32,
                    repetition_penalty=f32 + 1, presence_penalty=f32, frequency_penalty=f32,
                    seeds=jnp.zeros((n,), jnp.uint32), prompt_lens=i32, min_tokens=i32,
                    logprobs=i32, stop_ids=jnp.full((n, num_stop_ids), -1, jnp.int32),
                    adapter=i32 - 1)


def admit(state: BatchState, admission: Admission) -> BatchState:
    """`state` with the admitted rows, pages and history written (out-of-range slots:
    padding, dropped)."""
    slots = admission.slots
    rows = jax.tree.map(lambda table, new: table.at[slots].set(new, mode="drop"),
                        state.rows, admission.rows)
    return dataclasses.replace(
        state, rows=rows, page_table=_write_pages(state.page_table, admission.page_writes),
        history=_write(state.history, admission.history_writes),
        **_admit_bias(state, admission))


def _admit_bias(state: BatchState, admission: Admission) -> dict[str, jax.Array]:
    """The bias table with the admission's pairs written (the host also writes -1 over the
    pairs a slot's last request left, runner/slots.py)."""
    writes = admission.bias_writes
    ids = _write(state.bias_ids, writes)
    values = state.bias_values.at[writes[:, 0], writes[:, 1]].set(admission.bias_values,
                                                                  mode="drop")
    return {"bias_ids": ids, "bias_values": values}


def _write(table: jax.Array, writes: jax.Array) -> jax.Array:
    """`table` with (row, column, value) triples set; rows out of range dropped."""
    return table.at[writes[:, 0], writes[:, 1]].set(writes[:, 2], mode="drop")


def _write_pages(page_table: jax.Array, writes: jax.Array) -> jax.Array:
    """The page table i32[G, N + 1, P] with each group's (slot, index, page id) triples
    `writes` i32[G, W, 3] set; slots out of range dropped."""
    group = jnp.arange(writes.shape[0])[:, None]
    return page_table.at[group, writes[..., 0], writes[..., 1]].set(writes[..., 2],
                                                                     mode="drop")


def expand(state: BatchState, delta: StepDelta, *, page_size: int,
           attention: AttentionSettings = DEFAULT_SETTINGS
           ) -> tuple[BatchState, StepInputs]:
    """The step's full inputs from the state and the delta (`attention`: the engine's
    attention settings, AttentionMetadata.attention); the state with the delta's pages
    and fed tokens written."""
    page_table = _write_pages(state.page_table, delta.page_writes)
    slots, positions = delta.token_slots, delta.positions
    token_ids = jnp.where(delta.token_ids >= 0, delta.token_ids, state.last_token[slots])
    history = state.history.at[slots, positions].set(token_ids, mode="drop")
    slot_mapping = page_table[:, slots, positions // page_size] * page_size \
        + positions % page_size  # [G, T]
    page_indices = page_table[:, delta.seq_slots]  # [G, S, P]
    several = len(state.group_windows) > 1
    md = AttentionMetadata(
        positions=positions, slot_mapping=slot_mapping[0], page_indices=page_indices[0],
        kv_lens=delta.kv_lens, cu_q_lens=delta.cu_q_lens, num_seqs=delta.num_seqs,
        logits_indices=delta.logits_indices,
        group_slot_mapping=slot_mapping if several else None,
        group_page_indices=page_indices if several else None,
        group_windows=state.group_windows, attention=attention,
        adapters=state.rows.adapter[slots])
    state = dataclasses.replace(state, page_table=page_table, history=history)
    sampling = _sampling(state, delta, positions[delta.logits_indices])
    return state, StepInputs(token_ids=token_ids, md=md, sampling=sampling,
                             proposed_ids=delta.proposed_ids)


def _sampling(state: BatchState, delta: StepDelta, sampled_at: jax.Array) -> SamplingInputs:
    """Each sampled position's settings: its slot's rows, and what its position implies
    (the tokens before it, and how many of them the request generated)."""
    slots = delta.sample_slots
    row = jax.tree.map(lambda table: table[slots], state.rows)
    history_lens = sampled_at + 1
    generated = jnp.maximum(history_lens - row.prompt_lens, 0)
    return SamplingInputs(
        temperature=row.temperature, top_k=row.top_k, top_p=row.top_p, min_p=row.min_p,
        repetition_penalty=row.repetition_penalty, presence_penalty=row.presence_penalty,
        frequency_penalty=row.frequency_penalty, seeds=row.seeds, counters=generated,
        history=state.history, history_rows=slots, prompt_lens=row.prompt_lens,
        history_lens=history_lens, ban_stop=generated < row.min_tokens,
        stop_ids=row.stop_ids, logprobs=row.logprobs, bias_ids=state.bias_ids[slots],
        bias_values=state.bias_values[slots])


def record_samples(state: BatchState, delta: StepDelta, packed: jax.Array) -> BatchState:
    """`state` with each slot's token sampled at its one position (a step of Q = 1; a
    verify step's tokens reach the host before the next step)."""
    if packed.shape[1] != 1:
        return state
    tokens = packed[:, 0, 0]  # i32[S]: sampler.pack puts the token id first
    return dataclasses.replace(
        state, last_token=state.last_token.at[delta.sample_slots].set(tokens, mode="drop"))


def stateful(step_fn: Callable[..., tuple], *, page_size: int, routing: bool = False,
             attention: AttentionSettings = DEFAULT_SETTINGS) -> Callable[..., tuple]:
    """A model step `(params, kv_cache, inputs, *extra, token_mask) -> (kv_cache, packed,
    *more)` as the runner compiles it: `(params, kv_cache, state, delta, token_mask,
    *extra) -> (kv_cache, state, packed, *more)`; `token_mask` i32[S, W] is each
    request row's allowed-token bits (structured outputs; all ones where unconstrained).
    `routing`: the step returns a MoE model's routing counts last, which are added to
    `state.expert_tokens` (never sent to the host per step). `attention`: the engine's
    attention settings (impl, interpret), which the step's metadata carries."""

    def run(params: dict, kv_cache: KVCache, state: BatchState, delta: StepDelta,
            token_mask: jax.Array, *extra: jax.Array) -> tuple:
        state, inputs = expand(state, delta, page_size=page_size, attention=attention)
        kv_cache, packed, *more = step_fn(params, kv_cache, inputs, *extra,
                                          token_mask=token_mask)
        if routing:
            *more, routed = more
            state = dataclasses.replace(state, expert_tokens=state.expert_tokens + routed)
        return (kv_cache, record_samples(state, delta, packed), packed, *more)

    return run
