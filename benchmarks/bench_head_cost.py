"""The cost side of speculative heads at a real model's shape (random weights: no
acceptance to show, so only times): per decode slot rung S,

- `decode_ms`: a plain decode step of the target without kept features;
- `decode_features_ms`: the same step keeping EAGLE-3's three feature layers (the
  feature store write), and its ratio to `decode_ms`;
- `verify_ms`: the verify step at k = `--k` (k + 1 positions a request, the heads' q as
  input), and its ratio to `decode_ms`;
- `draft_ms_per_token`: the EAGLE-3 drafter's proposal call of k drafts over S slots,
  divided by k; `draft_1_ms`, `draft_k_ms` the calls of 1 and k drafts;
- `medusa_ms`: Medusa's one call of k heads (`--medusa`).

Steps run with nothing in their slots (`Runner.time_bucket`: what the speculation policy
seeds its cost model with), so they read the weights and no context. Also prints the
weight-read bound of one decode step at the device's measured bandwidth. Runs anywhere;
on CPU use a small preset (`--preset=smollm-135m`).

    python benchmarks/bench_head_cost.py --preset=llama3.1-8b --slots=1,8,32 --k=4
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
import types

import jax
import jax.numpy as jnp
from absl import app, flags

from jaxinfer.checkpoint import heads as heads_checkpoint
from jaxinfer.config import ModelOptions, load_preset
from jaxinfer.engine.core.buckets import BucketSet
from jaxinfer.engine.runner import Runner, memory_bandwidth, tree_bytes
from jaxinfer.engine.runner.heads import HeadRunner
from jaxinfer.model import transformer

flags.DEFINE_string("preset", "llama3.1-8b", "target shape (random weights)")
flags.DEFINE_integer("num_layers", 0, "override the preset's layer count (0: keep)")
flags.DEFINE_list("slots", ["1", "8", "32"], "decode slot rungs to time")
flags.DEFINE_integer("k", 4, "drafts a request verifies")
flags.DEFINE_integer("max_model_len", 2048, "context length the page tables allow")
flags.DEFINE_integer("draft_vocab_size", 32000, "EAGLE-3's reduced vocabulary")
flags.DEFINE_enum("dtype", "bfloat16", ["float32", "bfloat16"], "weights and KV dtype")
flags.DEFINE_bool("medusa", True, "also time Medusa heads")
FLAGS = flags.FLAGS
PAGE_SIZE = 16


def _target(cfg, feature_layers, buckets, num_pages):
    params = jax.jit(functools.partial(transformer.init_params, cfg,
                                       dtype=jnp.dtype(FLAGS.dtype)))(jax.random.key(0))
    return Runner(cfg, params, num_pages=num_pages, page_size=PAGE_SIZE,
                  max_model_len=FLAGS.max_model_len, buckets=buckets, kv_dtype=FLAGS.dtype,
                  uses_draft_probs=True, options=ModelOptions(feature_layers=feature_layers))


def _heads(method, cfg, runner, buckets, num_pages, **shape):
    head, params = heads_checkpoint.random_head(method, cfg, jax.random.key(1), **shape)
    params = jax.tree.map(lambda x: jnp.asarray(x, FLAGS.dtype)
                          if jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating) else x, params)
    return head, HeadRunner(head, params, runner, mesh=runner.mesh, num_pages=num_pages,
                            page_size=PAGE_SIZE, max_model_len=FLAGS.max_model_len,
                            buckets=buckets, num_positions=FLAGS.k + 1,
                            vocab_size=cfg.vocab_size, kv_dtype=FLAGS.dtype)


def main(argv: list[str]) -> None:
    del argv
    cfg = load_preset(FLAGS.preset)
    if FLAGS.num_layers:
        cfg = dataclasses.replace(cfg, num_layers=FLAGS.num_layers)
    slots = [int(s) for s in FLAGS.slots]
    buckets = BucketSet(max_num_batched_tokens=max(256, max(slots) * (FLAGS.k + 1)),
                        max_num_seqs=max(slots), verify_positions=FLAGS.k + 1,
                        min_tokens=1)
    num_pages = max(slots) * -(-FLAGS.max_model_len // PAGE_SIZE) + 1
    plain = _target(cfg, (), buckets, num_pages)
    rows = {s: {"decode_ms": plain.time_bucket(buckets.pick(s, s, decode=True)) * 1e3}
            for s in slots}
    weights = tree_bytes(plain.params)
    del plain
    head_probe, _ = heads_checkpoint.random_head(
        "eagle3", cfg, jax.random.key(1), draft_vocab_size=FLAGS.draft_vocab_size)
    runner = _target(cfg, head_probe.feature_layers, buckets, num_pages)
    _, eagle3 = _heads("eagle3", cfg, runner, buckets, num_pages,
                       draft_vocab_size=FLAGS.draft_vocab_size)
    # Medusa reads the final normed hidden state: a store of that width beside the target
    store = jnp.zeros((num_pages * PAGE_SIZE, cfg.hidden_size), runner.kv_cache[-1].dtype)
    medusa = FLAGS.medusa and _heads("medusa", cfg, types.SimpleNamespace(
        params=runner.params, kv_cache=[store], mesh=runner.mesh), buckets, num_pages,
        num_heads=FLAGS.k)[1]
    for s, row in rows.items():
        decode, verify = buckets.pick(s, s, decode=True), buckets.pick(
            s * (FLAGS.k + 1), s, verify=True)
        row["decode_features_ms"] = runner.time_bucket(decode) * 1e3
        row["verify_ms"] = runner.time_bucket(verify) * 1e3
        row["draft_1_ms"] = eagle3.time_propose(s, 2) * 1e3
        row["draft_k_ms"] = eagle3.time_propose(s, FLAGS.k + 1) * 1e3
        if medusa:
            row["medusa_ms"] = medusa.time_propose(s, FLAGS.k + 1) * 1e3
        row |= {"features_over_decode": row["decode_features_ms"] / row["decode_ms"],
                "verify_over_decode": row["verify_ms"] / row["decode_ms"],
                "draft_ms_per_token": row["draft_k_ms"] / FLAGS.k}
        row = {k: round(v, 3) for k, v in row.items()}
        rows[s] = row
        print(s, row, file=sys.stderr, flush=True)
    bandwidth = memory_bandwidth()
    print(json.dumps({
        "preset": FLAGS.preset, "num_layers": cfg.num_layers, "dtype": FLAGS.dtype,
        "k": FLAGS.k, "device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
        "feature_layers": list(head_probe.feature_layers),
        "weight_bytes": weights, "bandwidth_gb_per_s": round(bandwidth, 1),
        "weight_read_bound_ms": round(weights / (bandwidth * 1e9) * 1e3, 3),
        "eagle3_weight_bytes": eagle3.weight_bytes, "by_slots": rows}, indent=1))


if __name__ == "__main__":
    app.run(main)
