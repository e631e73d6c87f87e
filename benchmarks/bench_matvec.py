"""How fast XLA:CPU reads a model's weights in a few-row matmul, float32 vs bfloat16.

One jitted pass of `rows` x weights dots over every 2-D weight of a decoder layer
stack of a preset's shape (q/k/v fused, o, gate/up fused, down; random values), for
float32 weights and for bfloat16 weights with `preferred_element_type=float32` (the
engine's dot), at several row counts. Prints one JSON object: median ms per pass and
the GB/s of weight bytes read, and per row count the ratio of the bfloat16 pass to
the bfloat16 weight-read bound: half the float32 pass at one row (1.0
would mean bf16 weights are read as fast as f32 ones, byte for byte).

With --layouts it also times bfloat16 and int8 weights (int8 activations, int32
accumulation, the w8a8 dot) stored [in, out] against the same weights stored
[out, in], the layout jaxinfer/model/quantization.py keeps: `out_in_speedup` is the [in, out]
pass time over the [out, in] one.

    python benchmarks/bench_matvec.py [--rows=1,2,4,16] [--preset=smollm-135m] [--layouts]
"""

from __future__ import annotations

import json
import statistics
import time

import jax
import jax.numpy as jnp
from absl import app, flags

from jaxinfer.config import load_preset

flags.DEFINE_list("rows", ["1", "2", "4", "16"], "row counts (tokens in the step)")
flags.DEFINE_string("preset", "smollm-135m", "model shape")
flags.DEFINE_integer("repeats", 20, "timed passes per case (median)")
flags.DEFINE_bool("layouts", False, "also compare [in, out] with [out, in] weights")
FLAGS = flags.FLAGS


def weights(dtype: jnp.dtype) -> list[jax.Array]:
    cfg = load_preset(FLAGS.preset)
    d, f, h = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    shapes = [(d, (cfg.num_heads + 2 * cfg.num_kv_heads) * h), (cfg.num_heads * h, d),
              (d, 2 * f), (f, d)] * cfg.num_layers
    keys = jax.random.split(jax.random.key(0), len(shapes))
    return [(0.02 * jax.random.normal(k, s)).astype(dtype) for k, s in zip(keys, shapes,
                                                                            strict=True)]


def pass_ms(ws: list[jax.Array], rows: int, out_in: bool = False) -> float:
    """Median ms of one pass; `out_in`: the weights are stored [out, in]."""
    contracted = 1 if out_in else 0
    width = max(w.shape[contracted] for w in ws)
    accumulate = jnp.int32 if ws[0].dtype == jnp.int8 else jnp.float32
    spec = "ri,oi->ro" if out_in else "ri,io->ro"

    @jax.jit
    def run(ws: list[jax.Array], x: jax.Array) -> jax.Array:
        acc = jnp.zeros((rows,), jnp.float32)
        for w in ws:
            y = jnp.einsum(spec, x[:, :w.shape[contracted]].astype(w.dtype), w,
                           preferred_element_type=accumulate)
            acc = acc + y[:, :8].sum(-1).astype(jnp.float32)  # keep every dot live
        return acc

    x = jnp.ones((rows, width), jnp.float32)
    run(ws, x).block_until_ready()
    times = []
    for _ in range(FLAGS.repeats):
        started = time.perf_counter()
        run(ws, x).block_until_ready()
        times.append(time.perf_counter() - started)
    return 1e3 * statistics.median(times)


def layouts(bf16: list[jax.Array]) -> list[dict]:
    """Per row count and dtype: ms with [in, out] and [out, in] weights."""
    int8 = [jnp.clip(jnp.round(w.astype(jnp.float32) * 2000), -127, 127).astype(jnp.int8)
            for w in bf16]
    cases = []
    for rows in map(int, FLAGS.rows):
        for name, ws in (("bfloat16", bf16), ("int8", int8)):
            in_out = pass_ms(ws, rows)
            out_in = pass_ms([w.T.copy() for w in ws], rows, out_in=True)
            cases.append({"rows": rows, "dtype": name, "in_out_ms": round(in_out, 2),
                          "out_in_ms": round(out_in, 2),
                          "out_in_speedup": round(in_out / out_in, 2)})
    return cases


def main(argv: list[str]) -> None:
    del argv
    by_dtype = {name: weights(jnp.dtype(name)) for name in ("float32", "bfloat16")}
    result = {"preset": FLAGS.preset, "backend": jax.default_backend(), "cases": []}
    for rows in map(int, FLAGS.rows):
        case = {"rows": rows}
        for name, ws in by_dtype.items():
            ms = pass_ms(ws, rows)
            nbytes = sum(w.nbytes for w in ws)
            case[name] = {"ms": round(ms, 2), "gb_per_s": round(nbytes / ms / 1e6, 1)}
        result["cases"].append(case)
    bound = pass_ms(by_dtype["float32"], 1) / 2
    result["bf16_bound_ms"] = round(bound, 2)
    for case in result["cases"]:
        case["bf16_over_bound"] = round(case["bfloat16"]["ms"] / bound, 2)
    if FLAGS.layouts:
        result["layouts"] = layouts(by_dtype["bfloat16"])
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    app.run(main)
