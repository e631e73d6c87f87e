"""Unrolled layers vs `lax.scan` over stacked layers: compile time and step time.

The decision behind model/transformer.py's unrolled loop. A preset's layer matmuls
(fused q/k/v, o, fused gate/up, down: attention left out, it is the same either way)
run for L layers, once as a Python loop over per-layer weights and once as a
`lax.scan` over weights stacked [L, ...], at a few row counts and dtypes. Prints
one JSON object with compile seconds and median run ms for each, and the ratios.

    python benchmarks/bench_layer_loop.py [--preset=smollm-135m] [--rows=1,2,16,64]
"""

from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from jaxinfer.config import load_preset
from jaxinfer.model import layers, transformer

flags.DEFINE_string("preset", "smollm-135m", "model shape (jaxinfer/config/presets/*.toml)")
flags.DEFINE_list("rows", ["1", "2", "16", "64"], "token rows per step")
flags.DEFINE_list("dtypes", ["float32", "bfloat16"], "weight dtypes")
flags.DEFINE_integer("repeats", 20, "timed runs per case")
FLAGS = flags.FLAGS
MATRICES = ("wqkv", "wo", "w_gate_up", "w_down")


def layer(x: jax.Array, w: dict, q_width: int) -> jax.Array:
    qkv = layers.linear(x, w["wqkv"])
    x = x + layers.linear(qkv[:, :q_width], w["wo"])
    return x + layers.mlp(w, x)


def unrolled(weights: list[dict], x: jax.Array, q_width: int) -> jax.Array:
    for w in weights:
        x = layer(x, w, q_width)
    return x


def scanned(stacked: dict, x: jax.Array, q_width: int) -> jax.Array:
    return jax.lax.scan(lambda x, w: (layer(x, w, q_width), None), x, stacked)[0]


def measure(fn: object, *args: object) -> tuple[float, float]:
    began = time.perf_counter()
    compiled = jax.jit(fn, static_argnums=2).lower(*args).compile()
    compile_s = time.perf_counter() - began
    compiled(*args[:2]).block_until_ready()
    times = []
    for _ in range(FLAGS.repeats):
        began = time.perf_counter()
        compiled(*args[:2]).block_until_ready()
        times.append(time.perf_counter() - began)
    return round(compile_s, 2), round(1e3 * float(np.median(times)), 2)


def main(argv: list[str]) -> None:
    del argv
    cfg = load_preset(FLAGS.preset)
    q_width = cfg.num_heads * cfg.head_dim
    jax.jit(jnp.sin).lower(jnp.ones(3)).compile()  # one-time compiler start-up, not timed
    results = []
    for dtype in FLAGS.dtypes:
        params = transformer.init_params(cfg, jax.random.key(0), dtype=dtype)
        weights = [{k: lay[k] for k in MATRICES} for lay in params["layers"]]
        del params
        stacked = jax.tree.map(lambda *w: jnp.stack(w), *weights)
        for rows in map(int, FLAGS.rows):
            x = jnp.ones((rows, cfg.hidden_size), jnp.float32)
            loop_c, loop_ms = measure(unrolled, weights, x, q_width)
            scan_c, scan_ms = measure(scanned, stacked, x, q_width)
            results.append({"dtype": dtype, "rows": rows, "unrolled_compile_s": loop_c,
                            "scan_compile_s": scan_c, "unrolled_ms": loop_ms,
                            "scan_ms": scan_ms, "scan_over_unrolled_ms":
                            round(scan_ms / loop_ms, 2)})
            print(json.dumps(results[-1]), flush=True)
        del weights, stacked
    print(json.dumps({"preset": FLAGS.preset, "layers": cfg.num_layers, "cases": results},
                     indent=1))


if __name__ == "__main__":
    app.run(main)
