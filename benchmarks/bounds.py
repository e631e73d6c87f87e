"""Bounds the benchmarks compare against, measured in the same run.

`weight_pass_seconds`: a jitted batch-1 matmul pass over a model's own weights in
float32, the weight-read bound of a decode step on this machine. (XLA:CPU turns a
bf16 weight into f32 for a dot of fewer than 16 rows, so a bf16 pass at batch 1 is
no bound; the bf16 bound is the f32 time times bf16 bytes over f32 bytes.)
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np


def weight_matrices(params: object) -> list[jax.Array]:
    """Every 2-D weight of a params pytree (norms and biases are too small to count)."""
    return [w for w in jax.tree.leaves(params) if getattr(w, "ndim", 0) == 2]


def weight_pass_seconds(params: object, repeats: int = 20) -> tuple[float, int]:
    """Median seconds of one jitted f32 row-times-matrix pass over every 2-D weight of
    `params` (each weight contracted on its larger axis's partner, so all of it is read),
    and the f32 bytes read."""
    weights = [jnp.asarray(w, jnp.float32) for w in weight_matrices(params)]
    rows = [jnp.ones((1, w.shape[0]), jnp.float32) for w in weights]

    @jax.jit
    def one_pass(weights: list[jax.Array], rows: list[jax.Array]) -> jax.Array:
        return sum(jnp.sum(x @ w) for x, w in zip(rows, weights, strict=True))

    one_pass(weights, rows).block_until_ready()
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        one_pass(weights, rows).block_until_ready()
        times.append(time.perf_counter() - began)
    del weights
    return float(np.median(times)), sum(int(np.prod(w.shape)) * 4
                                        for w in weight_matrices(params))
