"""The encoder's bridge to the device (`EncoderRunner`): params on the device, the packed
step compiled per bucket at warm-up (pooling/packing.py), batches dispatched ahead of
reading so the host packs while the device runs. See docs/pooling.md#encoder-models.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config.encoder import EncoderConfig
from jaxinfer.model import pooling
from jaxinfer.pooling.packing import Bucket, PackedBatch

log = logging.getLogger(__name__)


def step_function(cfg: EncoderConfig, all_tokens: bool) -> Callable:
    """The jittable packed step: (params, EncoderInputs) -> (pools or tokens, scores)."""
    return functools.partial(pooling.encoder_step, cfg=cfg, all_tokens=all_tokens)


def input_spec(bucket: Bucket) -> pooling.EncoderInputs:
    """ShapeDtypeStructs of a bucket's EncoderInputs."""
    grid = jax.ShapeDtypeStruct((bucket.rows, bucket.row_len), jnp.int32)
    flat = jax.ShapeDtypeStruct((bucket.max_inputs,), jnp.int32)
    return pooling.EncoderInputs(token_ids=grid, type_ids=grid, positions=grid,
                                 segments=grid, owners=grid, starts=flat, lengths=flat)


def device_inputs(batch: PackedBatch) -> pooling.EncoderInputs:
    return pooling.EncoderInputs(
        token_ids=batch.token_ids, type_ids=batch.type_ids, positions=batch.positions,
        segments=batch.segments, owners=batch.owners, starts=batch.starts,
        lengths=batch.lengths)


class EncoderRunner:
    """Device params and the packed step compiled per bucket of `ladder`."""

    def __init__(self, cfg: EncoderConfig, params: dict, ladder: list[Bucket], *,
                 all_tokens: bool = False) -> None:
        self.cfg, self.ladder, self.all_tokens = cfg, list(ladder), all_tokens
        self.params = jax.device_put(params)
        self._jitted = jax.jit(step_function(cfg, all_tokens))
        self._compiled: dict[Bucket, jax.stages.Compiled] = {}
        self.compiles_after_warmup = 0
        self._warm = False

    def warm_up(self) -> dict[str, float]:
        """Compile every bucket now, so that serving never compiles."""
        began = time.perf_counter()
        for bucket in self.ladder:
            self._compile(bucket)
        self._warm = True
        seconds = time.perf_counter() - began
        log.info("encoder warm-up: %d buckets in %.1fs", len(self.ladder), seconds)
        return {"buckets": len(self.ladder), "seconds": seconds}

    def _compile(self, bucket: Bucket) -> jax.stages.Compiled:
        if bucket not in self._compiled:
            if self._warm:
                self.compiles_after_warmup += 1
            params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                  self.params)
            self._compiled[bucket] = self._jitted.lower(params, input_spec(bucket)).compile()
        return self._compiled[bucket]

    def run(self, batches: Iterable[PackedBatch]
            ) -> Iterator[tuple[PackedBatch, np.ndarray, np.ndarray]]:
        """(batch, pools f32[B, 3, D] or tokens f32[R * L, D], scores f32[B, labels]) per
        batch, each dispatched before the previous one is read."""
        previous = None
        for batch in batches:
            out = self._compile(batch.bucket)(self.params, device_inputs(batch))
            if previous is not None:
                yield _read(*previous)
            previous = (batch, out)
        if previous is not None:
            yield _read(*previous)


def _read(batch: PackedBatch, out: tuple[jax.Array, jax.Array]
          ) -> tuple[PackedBatch, np.ndarray, np.ndarray]:
    pooled, scores = out
    return batch, np.asarray(pooled), np.asarray(scores)
