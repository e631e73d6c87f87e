"""Does a float32 matmul row round the same whatever rows share its dot? On the demo
model's shapes, for XLA:CPU's plain dot and for a dot by fixed blocks of 16 rows
(lax.map over [16, K] blocks): row equality against the row computed alone, across row
counts M and positions in the block, and the time of 256 rows against the plain dot in
the same run. See docs/rl.md#logprobs-that-match-the-trainers. Prints JSON.

    python benchmarks/bench_row_invariance.py
"""

from __future__ import annotations

import datetime
import json
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

SHAPES = ((320, 448), (320, 1728), (864, 320), (320, 4096))  # qkv, gate/up, down, head
ROW_COUNTS = (2, 3, 8, 64, 100, 256)
BLOCK = 16


def plain(x: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.matmul(x, w, preferred_element_type=jnp.float32)


def by_blocks(x: jax.Array, w: jax.Array) -> jax.Array:
    rows = x.shape[0]
    padded = -(-rows // BLOCK) * BLOCK
    blocks = jnp.pad(x, ((0, padded - rows), (0, 0))).reshape(-1, BLOCK, x.shape[1])
    return jax.lax.map(lambda b: plain(b, w), blocks).reshape(padded, -1)[:rows]


def seconds(fn: object, *args: jax.Array) -> float:
    fn(*args).block_until_ready()
    start = time.perf_counter()
    for _ in range(10):
        fn(*args).block_until_ready()
    return (time.perf_counter() - start) / 10


def measure(fn: object, x: jax.Array, w: jax.Array) -> dict:
    jitted = jax.jit(fn)
    alone = np.asarray(jitted(x[5:6], w))[0]
    counts = [m for m in ROW_COUNTS if (np.asarray(jitted(x[:m], w))[0] ==
                                        np.asarray(jitted(x[:1], w))[0]).all()]
    positions = [p for p in range(BLOCK + 3)
                 if (np.asarray(jitted(jnp.concatenate([x[100:100 + p], x[5:6], x[:7]]),
                                       w))[p] == alone).all()]
    return {"row_counts_equal_to_alone": counts, "of_row_counts": list(ROW_COUNTS),
            "positions_equal_to_alone": len(positions), "of_positions": BLOCK + 3,
            "ms_256_rows": round(seconds(jitted, x, w) * 1e3, 3)}


def main() -> None:
    rng = np.random.default_rng(0)
    rows = []
    for k, n in SHAPES:
        w = jnp.asarray(rng.standard_normal((k, n)), jnp.float32)
        x = jnp.asarray(rng.standard_normal((256, k)), jnp.float32)
        base, blocked = measure(plain, x, w), measure(by_blocks, x, w)
        rows.append({"shape": [k, n], "plain": base, "blocks_of_16": blocked,
                     "time_ratio": round(blocked["ms_256_rows"] / base["ms_256_rows"], 2)})
    print(json.dumps({"date": datetime.date.today().isoformat(),
                      "backend": jax.default_backend(), "machine": platform.machine(),
                      "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
