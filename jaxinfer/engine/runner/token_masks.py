"""Each step's allowed-token bitmask, i32[S, ceil(V / 32)] in llguidance's layout,
filled on the host in numpy from the constrained requests' matchers (structured
outputs), then ANDed with their token filters (bad_words, allowed_token_ids:
engine/structured/token_filter.py); a step with none sends no mask.
See docs/structured_outputs.md (#how-it-works, #costs).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import jax
import llguidance
import llguidance.numpy as llg_numpy
import numpy as np

from jaxinfer.engine.structured.token_filter import MaskRow, TokenFilter

# Rows from which masks are filled on llguidance's thread pool: handing a few cheap
# masks (~0.03 ms each, a regex on the demo model) to the pool cost ~0.8 ms a step
# on a busy 2-core host, more than filling them in turn.
PARALLEL_ROWS = 8


def mask_words(vocab_size: int) -> int:
    """W: 32-bit words of one row's mask."""
    return -(-vocab_size // 32)


class TokenMasks:
    """The step's mask input: the device's all-ones array, or one filled here."""

    def __init__(self, vocab_size: int, sharding: jax.sharding.Sharding) -> None:
        self.words = mask_words(vocab_size)
        # u32[W]: the bits of real tokens (a row's padding bits say nothing)
        self._vocab_bits = np.packbits(np.arange(self.words * 32) < vocab_size,
                                       bitorder="little").view(np.uint32)
        self.sharding = sharding
        self._ones: dict[int, jax.Array] = {}  # S -> i32[S, W] of -1, on the device
        self._executor: llguidance.LLExecutor | None = None
        self.seconds = 0.0  # host time filling masks, over the runner's life
        self.steps = 0  # steps that sent a mask

    def counts(self) -> tuple[float, int]:
        """(seconds filling masks, steps that sent one) so far (the engine's metrics)."""
        return self.seconds, self.steps

    def spec(self, num_slots: int) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((num_slots, self.words), np.int32)

    def ones(self, num_slots: int) -> jax.Array:
        """i32[S, W] all ones, placed once per S (no transfer in later steps)."""
        if num_slots not in self._ones:
            self._ones[num_slots] = jax.device_put(
                np.full((num_slots, self.words), -1, np.int32), self.sharding)
        return self._ones[num_slots]

    def drop_ones(self) -> list[jax.Array]:
        """Forget the all-ones masks kept on the device (a sleeping runner frees them;
        `ones` makes them again on demand); returns them."""
        ones, self._ones = list(self._ones.values()), {}
        return ones

    def build(self, rows: Sequence[tuple[int, MaskRow]], num_slots: int
              ) -> tuple[jax.Array | np.ndarray, int]:
        """(the mask, host-to-device bytes): request row i of each (i, MaskRow) allowed
        what its matcher allows next and its filter lets through, every other row all
        ones."""
        if not rows:
            return self.ones(num_slots), 0
        began = time.perf_counter()
        mask = np.full((num_slots, self.words), -1, np.int32)
        matchers = [(index, row.matcher) for index, row in rows if row.matcher is not None]
        if len(matchers) < PARALLEL_ROWS:
            for index, matcher in matchers:
                llg_numpy.fill_next_token_bitmask(matcher, mask, index)
        else:
            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            llg_numpy.fill_next_token_bitmask_par(
                self._executor, [(matcher, index) for index, matcher in matchers], mask)
        words = mask.view(np.uint32)
        for index, row in rows:
            if row.token_filter is not None:
                self._filter(words[index], row.token_filter, row.output_token_ids)
        self.seconds += time.perf_counter() - began
        self.steps += 1
        return mask, mask.nbytes

    def _filter(self, words: np.ndarray, token_filter: TokenFilter,
                output_token_ids: Sequence[int]) -> None:
        """AND a filter into one row (u32[W], in place): allowed_token_ids, then the bad
        words' bans. Each yields where it would leave no token allowed (the grammar's
        row stands, then allowed_token_ids), for the device would sample from nothing."""
        if token_filter.allowed is not None:
            allowed = words & np.frombuffer(token_filter.allowed, np.uint32)
            if (allowed & self._vocab_bits).any():
                words[:] = allowed
        banned = token_filter.banned(output_token_ids)
        if banned:
            ids = np.asarray(banned, np.uint32)
            kept = words.copy()
            np.bitwise_and.at(kept, ids >> 5, ~(np.uint32(1) << (ids & 31)))
            if (kept & self._vocab_bits).any():
                words[:] = kept
