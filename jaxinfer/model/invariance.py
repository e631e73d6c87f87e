"""Batch-invariant arithmetic (`ModelOptions.batch_invariant`): matmuls, and the
projection with RoPE, run over fixed blocks of `ROW_BLOCK` rows in a loop, so a row
rounds the same whatever rows share its step. Switched on while a forward is traced
(`rows_in_blocks`), so one option reaches every linear without a parameter on each.
See docs/rl.md#batch-invariant-mode.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp

from jaxinfer.pallas.row_sum import row_sum

# XLA:CPU rounds a row of a float32 dot by the dot's row count and the row's place in
# it; a dot of a fixed [ROW_BLOCK, K] block does not (benchmarks/bench_row_invariance.py).
ROW_BLOCK = 16
# A loop of one iteration is inlined and fused with its neighbours, which rounds RoPE by
# its reader again: at least two blocks keep every step's blocks inside the loop.
MIN_BLOCKS = 2

_ACTIVE: contextvars.ContextVar[bool] = contextvars.ContextVar("batch_invariant",
                                                               default=False)


@contextlib.contextmanager
def rows_in_blocks(enabled: bool) -> Iterator[None]:
    """While tracing inside, `active()` is `enabled`."""
    token = _ACTIVE.set(enabled)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active() -> bool:
    return _ACTIVE.get()


def map_rows(fn: Callable[..., object], *arrays: jax.Array) -> object:
    """fn over row blocks of `arrays` (each [..., rest] with the same leading axes, rows
    flattened), results un-blocked to those leading axes; rows padded with zeros."""
    lead = arrays[0].shape[:-1]
    rows = math.prod(lead)
    blocks = max(MIN_BLOCKS, -(-rows // ROW_BLOCK))
    padded = blocks * ROW_BLOCK

    def block(x: jax.Array) -> jax.Array:
        flat = x.reshape(rows, *x.shape[len(lead):])
        flat = jnp.pad(flat, ((0, padded - rows),) + ((0, 0),) * (flat.ndim - 1))
        return flat.reshape(blocks, ROW_BLOCK, *flat.shape[1:])

    out = jax.lax.map(lambda xs: fn(*xs), tuple(block(x) for x in arrays))
    return jax.tree.map(lambda y: y.reshape(padded, *y.shape[2:])[:rows].reshape(
        *lead, *y.shape[2:]), out)


def logsumexp(x: jax.Array) -> jax.Array:
    """log(sum(exp(x))) over the last axis with the sum in `row_sum`'s one order:
    XLA:CPU's reduction of a row rounds by how many rows it reduces with."""
    top = jnp.max(x, axis=-1)
    top = jnp.where(jnp.isfinite(top), top, 0.0)  # rows of -inf: log(0) = -inf
    return top + jnp.log(row_sum(jnp.exp(x - top[..., None])))
