"""Data parallelism: one lockstep program over every replica vs one engine per replica.

DP replicas of a model (each with its own scheduler and KV pool) can run as
(A) one compiled step over the ("data", "model") mesh: every replica steps together,
    each step padded to the one bucket that holds the largest replica's work (a
    replica with nothing to do still runs the padded step), or
(B) one engine per replica: each picks its own bucket each step and runs its own
    program on its own chips.

No TPU is used. Device time per bucket comes from libtpu's ahead-of-time compiler
(`jaxinfer/aot.py`): every bucket of the BucketSet is compiled for one chip (TP 1)
and its `cost_analysis()` gives FLOPs and bytes accessed; a bucket's time is the
roofline max(bytes / HBM bandwidth, FLOPs / peak bf16) at the chip's published figures
(`jaxinfer/sizing/accelerators.py`): an estimate, not a measurement. The step is
compiled at `--layers` and `--layers / 2` layers (a full 8B takes minutes a bucket
here) and each cost extrapolated linearly to `--target_layers` (the layers are
unrolled, so each adds the same cost).

Two cost models:
- "compiled": the compiled cost as is. The attention kernel tells XLA a bound: every
  request of the bucket at max_model_len, so a bucket's attention cost does not depend
  on the contexts it actually holds.
- "actual_context": the kernel's bound taken out (the same formula as
  `rpa_tpu._cost_estimate`) and put back with each scheduled chunk's own context. In
  lockstep a replica's step then costs its padded bucket's non-attention work plus its
  own attention, and the step lasts as long as the slowest replica's.

The workload runs through DP host-only Schedulers (no model; each step's plan is fed
back with a fake token per sample), requests dealt round-robin, arrivals counted in
steps (so A and B see the same plans; B's time is the slowest replica's sum):
"poisson" (`--rate` requests a step) and "burst" (all at step 0).

    .venv-tpu/bin/python benchmarks/bench_dp_lockstep.py [--dp=4] [--num_requests=400]
    .venv-tpu/bin/python benchmarks/bench_dp_lockstep.py --costs_in=costs.json  # no compile
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

from jaxinfer.engine.core.buckets import Bucket, BucketSet
from jaxinfer.engine.core.page_pool import PagePool
from jaxinfer.engine.core.scheduler import Scheduler
from jaxinfer.engine.request import Request, SamplingParams


@dataclasses.dataclass(frozen=True)
class Step:
    """One replica's step: what its bucket must hold, and its attention at the contexts
    it actually has (bytes, FLOPs; all layers)."""

    num_tokens: int
    num_requests: int
    decode: bool
    attention_bytes: float = 0.0
    attention_flops: float = 0.0


# ---- the comparison (pure; tests/test_bench_dp_lockstep.py) -----------------------------


def lockstep_bucket(buckets: BucketSet, steps: Sequence[Step | None]) -> Bucket | None:
    """The one bucket that holds every replica's step (None: no replica has work). A
    decode bucket only when every working replica decodes."""
    working = [s for s in steps if s is not None]
    if not working:
        return None
    return buckets.pick(max(s.num_tokens for s in working),
                        max(s.num_requests for s in working),
                        decode=all(s.decode for s in working))


def dp_totals(buckets: BucketSet, replicas: Sequence[Sequence[Step | None]],
              cost: Callable[[Bucket, Step | None], float]) -> dict[str, float]:
    """(B) per-replica engines: the slowest replica's sum of its own steps' costs;
    (A) lockstep: per step, the slowest replica running the shared bucket (a replica
    without work runs it too, `cost(bucket, None)`). `replicas[r][i]` is replica r's
    step i (None: nothing to do). Padding: the share of A's chip time (DP chips for
    the whole run) that B would not spend."""
    length = max((len(steps) for steps in replicas), default=0)
    padded = [list(steps) + [None] * (length - len(steps)) for steps in replicas]
    own = [sum(cost(own_bucket(buckets, s), s) for s in steps if s is not None)
           for steps in padded]
    lockstep = 0.0
    for i in range(length):
        column = [steps[i] for steps in padded]
        shared = lockstep_bucket(buckets, column)
        if shared is not None:
            lockstep += max(cost(shared, s) for s in column)
    per_replica = max(own, default=0.0)
    chip_time = lockstep * len(replicas)
    return {"per_replica_s": per_replica, "lockstep_s": lockstep,
            "lockstep_over_per_replica": lockstep / per_replica if per_replica else 1.0,
            "padding_fraction": 1 - sum(own) / chip_time if chip_time else 0.0}


def own_bucket(buckets: BucketSet, step: Step) -> Bucket:
    return buckets.pick(step.num_tokens, step.num_requests, decode=step.decode)


# ---- the workload through host-only schedulers ------------------------------------------


@dataclasses.dataclass(frozen=True)
class Shape:
    """What the attention estimate needs of the model (per layer, bf16 pages)."""

    layers: int
    num_heads: int
    head_dim: int
    kv_bytes_per_token: int  # one layer's K and V of one token
    q_block: int  # prefill pass: tokens per query block


def attention_cost(shape: Shape, start: int, num_tokens: int) -> tuple[float, float]:
    """(bytes, FLOPs) of one chunk over all layers: the kernel's estimate with the
    chunk's own context (start + num_tokens) in place of max_model_len."""
    context = start + num_tokens
    blocks = 1 if num_tokens == 1 else -(-num_tokens // shape.q_block)
    row = shape.num_heads * shape.head_dim
    moved = blocks * context * shape.kv_bytes_per_token + 4 * num_tokens * row
    return shape.layers * moved, shape.layers * 4.0 * num_tokens * row * context


def make_workload(num_requests: int, arrival: str, rate: float, prompt: tuple[int, int],
                  output: tuple[int, int], seed: int) -> list[tuple[int, int, int]]:
    """(arrival step, prompt length, output length) per request, in arrival order."""
    rng = random.Random(seed)
    step, requests = 0.0, []
    for _ in range(num_requests):
        if arrival == "poisson":
            step += rng.expovariate(rate)
        requests.append((int(step), rng.randint(*prompt), rng.randint(*output)))
    return requests


def simulate(workload: Sequence[tuple[int, int, int]], dp: int, *, max_num_seqs: int,
             max_num_batched_tokens: int, max_model_len: int, num_pages: int,
             page_size: int, shape: Shape) -> list[list[Step | None]]:
    """Each replica's steps (None where it had nothing to do) over the whole run."""
    schedulers = [Scheduler(PagePool(num_pages), page_size=page_size,
                            max_num_seqs=max_num_seqs,
                            max_num_batched_tokens=max_num_batched_tokens,
                            max_model_len=max_model_len) for _ in range(dp)]
    replicas: list[list[Step | None]] = [[] for _ in range(dp)]
    pending, index, step = list(enumerate(workload)), 0, 0
    while index < len(pending) or any(s.has_unfinished() for s in schedulers):
        while index < len(pending) and pending[index][1][0] <= step:
            number, (_, prompt, output) = pending[index]
            schedulers[number % dp].add(_request(number, prompt, output))
            index += 1
        for scheduler, steps in zip(schedulers, replicas, strict=True):
            steps.append(_one_step(scheduler, shape))
        step += 1
    return replicas


def _request(number: int, prompt: int, output: int) -> Request:
    params = SamplingParams(max_tokens=output, ignore_eos=True, temperature=0.0)
    return Request(request_id=str(number), prompt_token_ids=[1] * prompt, params=params,
                   arrival=number, seed=0)


def _one_step(scheduler: Scheduler, shape: Shape) -> Step | None:
    """Schedule, then feed the plan back with token 1 for every sample (no EOS)."""
    if not scheduler.has_unfinished():
        return None
    plan = scheduler.schedule()
    if not plan.chunks:
        return None
    moved = flops = 0.0
    for chunk in plan.chunks:
        chunk_bytes, chunk_flops = attention_cost(shape, chunk.start, chunk.num_tokens)
        moved, flops = moved + chunk_bytes, flops + chunk_flops
    scheduler.update(plan, [[1] * c.num_samples for c in plan.chunks])
    return Step(plan.num_tokens, len(plan.chunks),
                all(c.num_tokens == 1 for c in plan.chunks), moved, flops)


# ---- per-bucket device time from libtpu's compiler --------------------------------------


def kernel_bound(shape: Shape, bucket: Bucket, context: int) -> tuple[float, float]:
    """(bytes, FLOPs) the attention kernel's CostEstimate adds to a bucket's compiled
    cost over all layers: its decode pass (min(S, T) requests of one token) and its
    prefill pass (T tokens in ceil(T / q_block) blocks), each at `context` (the page
    table's width), as `rpa_tpu._cost_estimate` writes it."""
    row = shape.num_heads * shape.head_dim
    moved = flops = 0.0
    for queries, blocks in ((min(bucket.num_slots, bucket.num_tokens),) * 2,
                            (bucket.num_tokens, -(-bucket.num_tokens // shape.q_block))):
        moved += blocks * context * shape.kv_bytes_per_token + 4 * queries * row
        flops += 4.0 * queries * row * context
    return shape.layers * moved, shape.layers * flops


def compile_rows(cfg: Any, device: str, settings: Any, chosen: list[Bucket]
                 ) -> list[dict[str, Any]]:
    """aot_rows.bucket_row (per-chip memory, FLOPs, bytes accessed) of each bucket's step
    compiled for one chip of `device`."""
    from jaxinfer import aot, aot_rows
    from jaxinfer.model import sharding
    from jaxinfer.sizing import accelerators

    acc = accelerators.get(device)
    plan = aot.plan_for(cfg, acc, settings, 1)
    mesh = sharding.make_mesh(1, aot.target_devices(acc)[:1])
    params, kv = aot.step_specs(sharding.served_config(cfg, 1), plan, settings, 1)
    compiled = aot.compile_buckets(sharding.served_config(cfg, 1), params, kv, chosen,
                                   settings, mesh)
    rows = []
    for bucket, result in zip(chosen, compiled, strict=True):
        if isinstance(result, Exception):
            raise RuntimeError(f"{bucket} does not compile: {str(result)[:500]}")
        rows.append(aot_rows.bucket_row(result, acc) | {"num_pages": plan.num_pages})
    return rows


def extrapolate(low: dict[str, Any], high: dict[str, Any], layers: tuple[int, int],
                target: int) -> dict[str, float]:
    """Each numeric figure at `target` layers, on the line through its values at
    `layers` (the layers are unrolled copies: each adds the same)."""
    slope = {k: (high[k] - low[k]) / (layers[1] - layers[0]) for k in FIGURES}
    return {k: high[k] + slope[k] * (target - layers[1]) for k in FIGURES}


FIGURES = ("flops", "bytes_accessed", "argument_bytes", "temp_bytes", "total_bytes")


def interpolate(known: dict[Bucket, dict[str, float]], every: list[Bucket]
                ) -> dict[Bucket, dict[str, float]]:
    """Figures of buckets not compiled, linear in tokens between the compiled rungs of
    the same kind (decode or mixed)."""
    out = {}
    for bucket in every:
        if bucket in known:
            out[bucket] = known[bucket]
            continue
        same = sorted((b for b in known if b.decode == bucket.decode),
                      key=lambda b: b.num_tokens)
        below = max((b for b in same if b.num_tokens < bucket.num_tokens),
                    key=lambda b: b.num_tokens)
        above = min((b for b in same if b.num_tokens > bucket.num_tokens),
                    key=lambda b: b.num_tokens)
        share = ((bucket.num_tokens - below.num_tokens)
                 / (above.num_tokens - below.num_tokens))
        out[bucket] = {k: known[below][k] + share * (known[above][k] - known[below][k])
                       for k in FIGURES}
    return out


def sparse_buckets(buckets: BucketSet) -> list[Bucket]:
    """The smallest, a middle and the largest rung of each kind."""
    chosen = set()
    for kind in (buckets.decode(), [b for b in buckets.all() if not b.decode]):
        chosen |= {kind[0], kind[len(kind) // 2], kind[-1]}
    return sorted(chosen)


def compiled_figures(cfg: Any, settings: Any, device: str, chosen: list[Bucket],
                     layers: int, target: int) -> dict[str, Any]:
    """Per-bucket figures at `target` layers from compiles at layers // 2 and `layers`,
    each with the KV pool of the `target`-layer model's plan scaled to its layers (the
    same number of pages), and the largest bucket's compiled memory at both."""
    from jaxinfer import aot
    from jaxinfer.sizing import accelerators

    full = aot.plan_for(dataclasses.replace(cfg, num_layers=target),
                        accelerators.get(device), settings, 1)
    counts = (layers // 2, layers)
    began, rows = time.perf_counter(), {}
    for count in counts:
        scaled = dataclasses.replace(settings,
                                     kv_cache_memory_bytes=full.kv_cache_bytes * count // target)
        rows[count] = compile_rows(dataclasses.replace(cfg, num_layers=count), device,
                                   scaled, chosen)
    figures = {bucket: extrapolate(low, high, counts, target) for bucket, low, high
               in zip(chosen, rows[counts[0]], rows[counts[1]], strict=True)}
    largest = max(range(len(chosen)), key=lambda i: chosen[i])
    memory = {f"{count}_layers_compiled": {k: rows[count][largest][k] for k in FIGURES[2:]}
              for count in counts}
    memory[f"{target}_layers_extrapolated"] = {k: figures[chosen[largest]][k]
                                               for k in FIGURES[2:]}
    return {"compile_s": round(time.perf_counter() - began, 1),
            "num_pages": full.num_pages, "kv_cache_bytes": full.kv_cache_bytes,
            "weight_bytes": full.weight_bytes, "compiled_layers": list(counts),
            "target_layers": target,
            "memory_bucket": {"tokens": chosen[largest].num_tokens,
                              "slots": chosen[largest].num_slots} | memory,
            "buckets": [_bucket_key(b) | figures[b] for b in chosen]}


def _bucket_key(bucket: Bucket) -> dict[str, Any]:
    return {"tokens": bucket.num_tokens, "slots": bucket.num_slots, "decode": bucket.decode}


def roofline(moved: float, flops: float, chip: Any) -> float:
    return max(moved / chip.hbm_bytes_per_s, flops / chip.bf16_flops)


def cost_models(table: dict[Bucket, dict[str, float]], shape: Shape, context: int,
                chip: Any) -> dict[str, Callable[[Bucket, Step | None], float]]:
    """Seconds of a replica's step run in a bucket: "compiled" (the bucket's compiled
    cost whatever it holds) and "actual_context" (the kernel's max_model_len bound
    replaced by the step's own attention)."""
    def compiled(bucket: Bucket, step: Step | None) -> float:
        return roofline(table[bucket]["bytes_accessed"], table[bucket]["flops"], chip)

    def actual(bucket: Bucket, step: Step | None) -> float:
        bound_bytes, bound_flops = kernel_bound(shape, bucket, context)
        moved = table[bucket]["bytes_accessed"] - bound_bytes
        flops = table[bucket]["flops"] - bound_flops
        if step is not None:
            moved, flops = moved + step.attention_bytes, flops + step.attention_flops
        return roofline(moved, flops, chip)

    return {"compiled": compiled, "actual_context": actual}


# ---- the run ------------------------------------------------------------------------------


def parse_flags(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """argparse, not absl: importing jaxinfer.cli defines absl flags of the same names."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="llama3.1-8b", help="model shape (config presets)")
    p.add_argument("--layers", type=int, default=4,
                   help="compile at this many layers and half as many")
    p.add_argument("--target_layers", type=int, default=0,
                   help="extrapolate costs to this many layers (0: the preset's)")
    p.add_argument("--quantization", default="w8a8", help="linear weights' mode ('' for "
                   "bf16): the 8B's bf16 weights do not fit one 16 GiB v5e chip")
    p.add_argument("--chip", default="v5e-1", help="one chip of this TPU generation")
    p.add_argument("--max_num_seqs", type=int, default=64, help="per replica")
    p.add_argument("--max_num_batched_tokens", type=int, default=512, help="per replica")
    p.add_argument("--max_model_len", type=int, default=2560,
                   help="context limit (prompt + output <= 2500)")
    p.add_argument("--dp", type=int, default=4, help="data-parallel replicas")
    p.add_argument("--num_requests", type=int, default=400, help="in each workload")
    p.add_argument("--rate", type=float, default=0.25,
                   help="poisson workload: requests per step, all replicas together")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--compile_buckets", choices=("all", "sparse"), default="all",
                   help="compile every bucket, or the smallest, a middle and the largest "
                   "of each kind and interpolate")
    p.add_argument("--costs_in", default="", help="read the per-bucket figures from this "
                   "JSON (a --costs_out of the same settings) instead of compiling")
    p.add_argument("--costs_out", default="", help="write the per-bucket figures here")
    return p.parse_args(argv)


FLAGS = argparse.Namespace()  # set by main

PROMPT_TOKENS = (100, 2000)
OUTPUT_TOKENS = (50, 500)


def bucket_figures(cfg: Any, buckets: BucketSet) -> dict[str, Any]:
    if FLAGS.costs_in:
        with open(FLAGS.costs_in) as f:
            return json.load(f)
    from jaxinfer import aot

    aot.tpu_compile_environment()
    settings = aot.Settings(max_num_seqs=FLAGS.max_num_seqs,
                            max_num_batched_tokens=FLAGS.max_num_batched_tokens,
                            max_model_len=FLAGS.max_model_len,
                            quantization=FLAGS.quantization or None)
    chosen = buckets.all() if FLAGS.compile_buckets == "all" else sparse_buckets(buckets)
    figures = compiled_figures(cfg, settings, FLAGS.chip, chosen, FLAGS.layers,
                               FLAGS.target_layers or cfg.num_layers)
    figures["interpolated"] = FLAGS.compile_buckets == "sparse"
    if FLAGS.costs_out:
        with open(FLAGS.costs_out, "w") as f:
            json.dump(figures, f, indent=1)
    return figures


def model_shape(cfg: Any, layers: int, page_size: int) -> Shape:
    from jaxinfer.pallas import rpa_tpu

    q_block, _ = rpa_tpu.block_sizes(cfg.num_heads // cfg.num_kv_heads, page_size,
                                     -(-FLAGS.max_model_len // page_size))
    return Shape(layers=layers, num_heads=cfg.num_heads, head_dim=cfg.head_dim,
                 kv_bytes_per_token=2 * cfg.num_kv_heads * cfg.head_dim * 2, q_block=q_block)


def compare(workload: str, buckets: BucketSet, models: dict[str, Any], shape: Shape,
            num_pages: int, page_size: int) -> dict[str, Any]:
    requests = make_workload(FLAGS.num_requests, workload, FLAGS.rate, PROMPT_TOKENS,
                             OUTPUT_TOKENS, FLAGS.seed)
    replicas = simulate(requests, FLAGS.dp, max_num_seqs=FLAGS.max_num_seqs,
                        max_num_batched_tokens=FLAGS.max_num_batched_tokens,
                        max_model_len=FLAGS.max_model_len, num_pages=num_pages,
                        page_size=page_size, shape=shape)
    steps = len(replicas[0])
    columns = [[r[i] for r in replicas] for i in range(steps)]
    busy = [c for c in columns if any(s is not None for s in c)]
    mixed = sum(any(s is not None and not s.decode for s in c) for c in busy)
    differ = sum(len({None if s is None else own_bucket(buckets, s) for s in c}) > 1
                 for c in busy)
    out = {"steps": steps, "steps_with_work": len(busy),
           "steps_some_replica_prefills": mixed,
           "steps_replicas_pick_different_buckets": differ}
    for name, cost in models.items():
        totals = dp_totals(buckets, replicas, cost)
        out[name] = {k: round(v, 4) for k, v in totals.items()}
    return out


def main(argv: Sequence[str] | None = None) -> None:
    global FLAGS
    FLAGS = parse_flags(argv)
    from jaxinfer.config import load_preset
    from jaxinfer.sizing import accelerators

    page_size = 16  # aot.Settings' default, the engine's
    cfg = load_preset(FLAGS.preset)
    buckets = BucketSet(max_num_batched_tokens=FLAGS.max_num_batched_tokens,
                        max_num_seqs=FLAGS.max_num_seqs)
    figures = bucket_figures(cfg, buckets)
    known = {Bucket(b["tokens"], b["slots"], b["decode"]): b for b in figures["buckets"]}
    table = interpolate(known, buckets.all())
    shape = model_shape(cfg, figures["target_layers"], page_size)
    chip = accelerators.get(FLAGS.chip).chip
    context = -(-FLAGS.max_model_len // page_size) * page_size
    models = cost_models(table, shape, context, chip)
    report = {"settings": {k: getattr(FLAGS, k) for k in (
        "preset", "layers", "quantization", "chip", "max_num_seqs",
        "max_num_batched_tokens", "max_model_len", "dp", "num_requests", "rate", "seed",
        "compile_buckets")} | {"prompt_tokens": PROMPT_TOKENS, "output_tokens": OUTPUT_TOKENS},
              "compiled": {k: v for k, v in figures.items() if k != "buckets"},
              "bucket_ms": [_bucket_key(b) | {
                  name: round(1e3 * cost(b, None), 3) for name, cost in models.items()}
                  for b in buckets.all()]}
    for workload in ("poisson", "burst"):
        report[workload] = compare(workload, buckets, models, shape, figures["num_pages"],
                                   page_size)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
