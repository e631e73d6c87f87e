"""`row_sum`: a sum over the last axis whose rounding does not depend on the other axes
(RMSNorm, the reference attention's softmax), so a request's tokens do not depend on
the batch it ran in. See docs/kernels.md#the-entry-point.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def row_sum(x: jax.Array) -> jax.Array:
    """x[..., n] summed over its last axis, in one fixed order of additions."""
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        odd = x[..., 2 * half:]  # one column when the width is odd
        x = x[..., :half] + x[..., half:2 * half]
        if odd.shape[-1]:
            x = jnp.concatenate([x[..., :1] + odd, x[..., 1:]], axis=-1)
    return x[..., 0]
