"""Bounds the benchmarks compare against, measured in the same run.

`weight_pass_seconds`: a jitted batch-1 matmul pass over a model's own weights in
float32, the weight-read bound of a decode step on the host. (XLA:CPU turns a
bf16 weight into f32 for a dot of fewer than 16 rows, so a bf16 pass at batch 1 is
no bound; the bf16 bound is the f32 time times bf16 bytes over f32 bytes.)
`matmul_pass_seconds`: the same pass over given matrices with `rows` rows in each
matrix's own dtype (int8 accumulates in int32), e.g. the int8 bound of w8a8;
`contract_last=True` contracts each matrix's last (minor) axis, as the quantized
weights' [O, I] values are read (jaxinfer/model/quantization.py).
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
    seconds = matmul_pass_seconds(weights, rows=1, repeats=repeats)
    del weights
    return seconds, sum(int(np.prod(w.shape)) * 4 for w in weight_matrices(params))


def matmul_pass_seconds(weights: list[jax.Array], rows: int = 1, repeats: int = 20,
                        contract_last: bool = False) -> float:
    """Median seconds of one jitted pass of `rows` rows (in each weight's dtype) times
    every matrix of `weights`, contracted on its first axis (`contract_last`: its last);
    int8 x int8 accumulates in int32, anything else in float32."""
    axis = 1 if contract_last else 0
    spec = "ri,oi->ro" if contract_last else "ri,io->ro"
    inputs = [jnp.ones((rows, w.shape[axis]), w.dtype) for w in weights]

    @jax.jit
    def one_pass(weights: list[jax.Array], inputs: list[jax.Array]) -> jax.Array:
        return sum(jnp.sum(jnp.einsum(spec, x, w, preferred_element_type=_accumulator(
            w.dtype))).astype(jnp.float32) for x, w in zip(inputs, weights, strict=True))

    one_pass(weights, inputs).block_until_ready()
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        one_pass(weights, inputs).block_until_ready()
        times.append(time.perf_counter() - began)
    return float(np.median(times))


def _accumulator(dtype: jnp.dtype) -> jnp.dtype:
    return jnp.dtype(jnp.int32) if jnp.dtype(dtype) == jnp.int8 else jnp.dtype(jnp.float32)
