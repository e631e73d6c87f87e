"""Ragged paged attention on decode batches: an implementation against a baseline.

For each (requests, context) it times one decode step (one query token per
request over its paged KV) with `--impl` (default: the default backend's kernel,
i.e. the reference on CPU, the Triton kernel on a GPU) and with `--baseline_impl`
(default: the jnp reference), computes the bytes the step must read (K and V of
every attended token, plus queries and outputs) and the achieved GB/s, and puts
it next to the device's memory read bandwidth measured in the same run (a jitted
sum over a 1 GiB array). Prints one JSON object. Shapes default to a
Llama-3.1-8B layer (32 query heads, 8 KV heads, head_dim 128).

    python benchmarks/bench_attention.py [--requests=1,4,16,64] [--contexts=512,1024,2048,4096]
    python benchmarks/bench_attention.py --dtype=bfloat16 --requests=1,8,32,64 \
        --contexts=1024,4096,8192        # on a GPU: Triton kernel vs XLA reference
"""

from __future__ import annotations

import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from jaxinfer.pallas import AttentionSettings, kv_layout, reference
from jaxinfer.pallas.dispatch import ragged_paged_attention, resolve_impl

flags.DEFINE_list("requests", ["1", "4", "16", "64"], "decode batch sizes")
flags.DEFINE_list("contexts", ["512", "1024", "2048", "4096"], "KV length of every request")
flags.DEFINE_integer("num_heads", 32, "query heads (Llama-3-8B layer)")
flags.DEFINE_integer("num_kv_heads", 8, "KV heads")
flags.DEFINE_integer("head_dim", 128, "head dim")
flags.DEFINE_integer("page_size", 16, "tokens per page")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"],
                  "KV dtype (bfloat16 pages are stored as uint16 bits on CPU, as the engine "
                  "does; queries are then float32)")
flags.DEFINE_integer("repeats", 5, "timed calls per point (median reported)")
flags.DEFINE_enum("impl", "auto", ["auto", "reference", "gpu", "tpu"], "implementation timed")
flags.DEFINE_enum("baseline_impl", "reference", ["none", "reference", "gpu", "tpu"],
                  "implementation timed next to it on the same inputs")
FLAGS = flags.FLAGS


def median_seconds(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def memory_bandwidth(repeats: int) -> float:
    """GB/s of a jitted float32 sum over 1 GiB: the host's read bandwidth."""
    data = jnp.ones((256 * 1024 * 1024,), jnp.float32)
    seconds = median_seconds(jax.jit(jnp.sum), data, repeats=repeats)
    return data.nbytes / seconds / 1e9


def decode_case(num_requests: int, context: int, dtype: jnp.dtype) -> tuple:
    rng = np.random.default_rng(0)
    pages_per_seq = context // FLAGS.page_size
    num_pages = num_requests * pages_per_seq + 1
    shape = kv_layout.kv_cache_shape(num_pages, FLAGS.page_size, FLAGS.num_kv_heads,
                                     FLAGS.head_dim, dtype)
    kv_pages = jax.random.normal(jax.random.key(0), shape, dtype)
    if dtype == jnp.bfloat16 and jax.default_backend() == "cpu":
        kv_pages = jax.lax.bitcast_convert_type(kv_pages, reference.BF16_STORAGE)
        dtype = jnp.dtype(jnp.float32)  # the queries
    pages = rng.permutation(np.arange(1, num_pages)).reshape(num_requests, pages_per_seq)
    queries = jnp.ones((num_requests, FLAGS.num_heads, FLAGS.head_dim), dtype)
    kv_lens = jnp.full((num_requests,), context, jnp.int32)
    cu_q_lens = jnp.arange(num_requests + 1, dtype=jnp.int32)
    return (queries, kv_pages, kv_lens, jnp.asarray(pages, jnp.int32), cu_q_lens,
            jnp.array([num_requests], jnp.int32))


def bytes_read(num_requests: int, context: int, itemsize: int) -> int:
    kv = num_requests * context * 2 * FLAGS.num_kv_heads * FLAGS.head_dim * itemsize
    q_and_out = 2 * num_requests * FLAGS.num_heads * FLAGS.head_dim * itemsize
    return kv + q_and_out


def time_rows(impl: str, dtype: jnp.dtype, bandwidth: float) -> list[dict]:
    settings = AttentionSettings(sm_scale=FLAGS.head_dim ** -0.5, impl=impl)
    attend = jax.jit(lambda *a: ragged_paged_attention(*a, settings))
    rows = []
    for num_requests in map(int, FLAGS.requests):
        for context in map(int, FLAGS.contexts):
            args = decode_case(num_requests, context, dtype)
            seconds = median_seconds(attend, *args, repeats=FLAGS.repeats)
            moved = bytes_read(num_requests, context, args[1].dtype.itemsize)
            rows.append({"requests": num_requests, "context": context,
                         "ms": round(seconds * 1e3, 3), "mb_read": round(moved / 1e6, 1),
                         "gb_per_s": round(moved / seconds / 1e9, 2),
                         "fraction_of_bandwidth": round(moved / seconds / 1e9 / bandwidth, 3)})
            del args
    return rows


def main(argv: list[str]) -> None:
    del argv
    dtype = jnp.dtype(FLAGS.dtype)
    bandwidth = memory_bandwidth(FLAGS.repeats)
    impl = resolve_impl(FLAGS.impl)
    result = {
        "benchmark": "ragged_paged_attention decode, jit", "impl": impl,
        "backend": jax.default_backend(), "device": jax.devices()[0].device_kind,
        "dtype": dtype.name,
        "shape": {"num_heads": FLAGS.num_heads, "num_kv_heads": FLAGS.num_kv_heads,
                  "head_dim": FLAGS.head_dim, "page_size": FLAGS.page_size},
        "memory_read_gb_per_s": round(bandwidth, 2),
        "bandwidth_measured_by": "median time of a jitted float32 sum over 1 GiB",
        "repeats": FLAGS.repeats, "rows": time_rows(impl, dtype, bandwidth)}
    if FLAGS.baseline_impl not in ("none", impl):
        result["baseline_impl"] = FLAGS.baseline_impl
        base = time_rows(FLAGS.baseline_impl, dtype, bandwidth)
        for row, other in zip(result["rows"], base, strict=True):
            row["baseline_ms"] = other["ms"]
            row["speedup_over_baseline"] = round(other["ms"] / row["ms"], 2)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    app.run(main)
