"""Weight quantization: batch-1 decode and a mixed workload, bf16 vs int8,
w8a8, fp8 and int4, against weight-read bounds measured in the same run.

A random-weight model of a preset's shape (default SmolLM-135M, as
benchmarks/bench_throughput.py makes it, saved in bfloat16) is loaded once per mode,
each a fresh `LLM(dtype="bfloat16", quantization=...)` (the previous one freed first):
"bf16" (no quantization, the baseline), "int8", "w8a8", "fp8", "int4"
(jaxinfer/model/quantization.py; int4's load includes its AWQ calibration,
jaxinfer/checkpoint/awq.py, on the default corpus windows: its warmup_seconds).
Per mode, after warm-up: batch-1 greedy decode tokens/s (median of `--repeats`
requests; the decode steps after the first token, timed from the stream), its weight
bytes as planned (`memory_plan.weight_bytes`) and as loaded (`tree_bytes(params)`), its
roofline (weight bytes over the engine's bandwidth probe) and its fraction of it, its
speed-up over bf16, and compilations after warm-up. Bounds measured in the same run
(benchmarks/bounds.py): the bf16 weight-read bound (the f32 batch-1 pass times 1/2, as
bench_throughput reports it, and a bf16 batch-2 pass, the rows a bf16 step runs), the
int8 weight-read bound (a jitted batch-2 int8 x int8 -> int32 pass over exactly the
int8 values a w8a8 step reads, the layers' and the LM head's, stored [O, I] and
contracted on their minor axis as the step does; timed right after the w8a8 decode, or
the int8 one when w8a8 is not run). Then bench_throughput's
continuous-batching workload (smaller by default) per `--mixed_modes` (a weight mode,
or MODE_kv8: that mode with an int8 KV cache). The targets are reported as
booleans (the mixed one for the fastest quantized mode). XLA:CPU's dots differ by ISA
(AMX and AVX512-BF16 make bf16 dots fast; without them bf16 is emulated), so the JSON
names the CPU features they depend on. Prints one JSON object.

    python benchmarks/bench_quant.py [--modes=bf16,int8,w8a8,fp8,int4]
        [--mixed_modes=bf16,w8a8,w8a8_kv8]
        [--num_requests=24] [--output_tokens=128] [--repeats=5]
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import tempfile
import time

import bench_throughput
import bounds
import jax
import jax.numpy as jnp
from absl import app, flags

from jaxinfer import LLM, SamplingParams, testing
from jaxinfer.engine import runner as engine_runner

MODES = {"bf16": None, "int8": "int8", "w8a8": "w8a8", "fp8": "fp8", "int4": "int4"}
# mixed-workload modes: engine settings each (a weight mode, or one with an int8 KV cache)
MIXED_MODES = {mode: {"quantization": q} for mode, q in MODES.items()} | {
    f"{mode}_kv8": {"quantization": q, "kv_cache_dtype": "int8"} for mode, q in MODES.items()}
CPU_FEATURES = ("avx2", "avx_vnni", "avx512f", "avx512_vnni", "avx512_bf16", "amx_int8",
                "amx_bf16")  # the ones XLA:CPU's int8 and bf16 dots depend on
DTYPE = "bfloat16"
TARGET_SPEEDUP = 1.5
TARGET_BOUND_FRACTION = 0.8

flags.DEFINE_list("modes", list(MODES), "batch-1 modes to run (bf16 is the baseline)")
flags.DEFINE_list("mixed_modes", ["bf16", "w8a8", "w8a8_kv8"],
                  "modes of the mixed workload ([] skips); MODE_kv8 adds an int8 KV cache")
flags.DEFINE_integer("output_tokens", 128, "batch-1: tokens generated per request")
flags.DEFINE_integer("prompt_tokens", 32, "batch-1: prompt length")
flags.DEFINE_integer("repeats", 5, "batch-1: timed requests per mode (median)")
flags.DEFINE_integer("bound_repeats", 20, "timed passes per weight-read bound (median)")
FLAGS = flags.FLAGS
# bench_throughput's workload flags, smaller here: < 3 min a mode on 2 CPU cores
SMALLER = {"num_requests": 24, "max_num_seqs": 16, "max_num_batched_tokens": 256,
           "save_dtype": "bfloat16"}


def batch1_llm(model_dir: str, quantization: str | None) -> tuple[LLM, float]:
    started = time.perf_counter()
    llm = LLM(model_dir, dtype=DTYPE, quantization=quantization, max_num_seqs=1,
              max_num_batched_tokens=64, max_model_len=bench_throughput.MAX_MODEL_LEN,
              compilation_cache_dir="")
    return llm, time.perf_counter() - started


def decode_rate(llm: LLM) -> tuple[float, float]:
    """One greedy request: (decode tokens/s after its first token, end-to-end tokens/s)."""
    params = SamplingParams(max_tokens=FLAGS.output_tokens, temperature=0.0,
                            ignore_eos=True)
    prompt = list(range(1, FLAGS.prompt_tokens + 1))
    started = time.perf_counter()
    stamps = []
    for out in llm.generate_stream([prompt], params):
        stamps.append((time.perf_counter(), len(out.token_ids)))
    (first, first_n), (last, last_n) = stamps[0], stamps[-1]
    return (last_n - first_n) / (last - first), last_n / (last - started)


def run_batch1(llm: LLM, warmup_s: float) -> dict:
    llm.generate([[1] * 8], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    rates = [decode_rate(llm) for _ in range(FLAGS.repeats)]
    rate = statistics.median(r for r, _ in rates)
    planned = llm.engine.memory_plan.weight_bytes
    bandwidth = llm.engine.memory_plan.bandwidth_gb_per_s
    roofline = bandwidth * 1e9 / planned
    return {"decode_tokens_per_s": round(rate, 1), "decode_step_ms": round(1e3 / rate, 2),
            "decode_tokens_per_s_each": [round(r, 1) for r, _ in rates],
            "end_to_end_tokens_per_s": round(statistics.median(e for _, e in rates), 1),
            "weight_bytes_planned": planned,
            "weight_bytes_loaded": engine_runner.tree_bytes(llm.engine.runner.params),
            "roofline_tokens_per_s": round(roofline, 1),
            "fraction_of_roofline": round(rate / roofline, 3),
            "warmup_seconds": round(warmup_s, 1),
            "compiles_after_warmup": llm.metrics()["compiles_after_warmup"]}


def pass_bound(seconds: float, what: str) -> dict:
    return {"what": what, "pass_ms": round(1e3 * seconds, 2),
            "tokens_per_s": round(1 / seconds, 1)}


def measured_bounds(mode: str, params: object) -> dict:
    """The weight-read bounds this mode's params give (benchmarks/bounds.py)."""
    matrices = bounds.weight_matrices(params)
    repeats = FLAGS.bound_repeats
    found = {}
    if mode == "bf16":
        f32_s, _ = bounds.weight_pass_seconds(params, repeats)
        found["bf16_weight_read"] = pass_bound(
            f32_s / 2, "f32 batch-1 pass over every 2-D weight x bf16/f32 bytes")
        found["bf16_batch2_pass"] = pass_bound(
            bounds.matmul_pass_seconds(matrices, rows=2, repeats=repeats),
            "jitted batch-2 bf16 pass over every 2-D weight")
    return found


def _is_quantized(leaf: object) -> bool:
    """A quantized weight (values and scales), told by its fields rather than its class:
    compare_commits.sh runs this script against commits where the class lives elsewhere."""
    return hasattr(leaf, "value") and hasattr(leaf, "scale")


def int8_bound(params: object) -> dict:
    """The int8 weight-read bound: a batch-2 int8 x int8 -> int32 pass over exactly the
    int8 values a w8a8 step reads (every layer's linear weights and the LM head, stored
    [O, I], contracted on their minor axis as the step's dots are); the bf16 embedding
    is gathered, a few rows a step, so it is left out."""
    values = [leaf.value for leaf in jax.tree.leaves(params, is_leaf=_is_quantized)
              if _is_quantized(leaf)]
    matrices = [jnp.ones(v.shape, jnp.int8) for v in values]
    seconds = bounds.matmul_pass_seconds(matrices, rows=2, repeats=FLAGS.bound_repeats,
                                         contract_last=True)
    return pass_bound(seconds, "jitted batch-2 int8 x int8 -> int32 pass over the int8 "
                      "values a w8a8 step reads (layers and LM head, [O, I], minor axis "
                      "contracted)")


def batch1_all(model_dir: str) -> tuple[dict, dict]:
    runs, found = {}, {}
    for mode in FLAGS.modes:
        llm, warmup_s = batch1_llm(model_dir, MODES[mode])
        runs[mode] = run_batch1(llm, warmup_s)
        found |= measured_bounds(mode, llm.engine.runner.params)
        if mode in ("w8a8", "int8") and "int8_weight_read" not in found:
            found["int8_weight_read"] = int8_bound(llm.engine.runner.params)  # beside w8a8
        del llm
        gc.collect()  # the engine's device memory before the next one loads
        print(json.dumps({mode: runs[mode]}), file=sys.stderr, flush=True)
    for run in runs.values():
        if "bf16" in runs:
            run["speedup_vs_bf16"] = round(run["decode_tokens_per_s"]
                                           / runs["bf16"]["decode_tokens_per_s"], 2)
        for name, bound in found.items():
            run[f"fraction_of_{name}"] = round(run["decode_tokens_per_s"]
                                               / bound["tokens_per_s"], 3)
    return runs, found


def mixed_all(model_dir: str) -> dict:
    prompts, outputs = bench_throughput.workload()
    runs = {"num_requests": len(prompts), "prompt_tokens": sum(map(len, prompts)),
            "requested_output_tokens": sum(outputs), "max_num_seqs": FLAGS.max_num_seqs,
            "max_num_batched_tokens": FLAGS.max_num_batched_tokens}
    for mode in FLAGS.mixed_modes:
        runs[mode] = bench_throughput.run_jaxinfer(model_dir, DTYPE, "continuous", prompts,
                                                   outputs, **MIXED_MODES[mode])
        gc.collect()
        print(json.dumps({f"mixed {mode}": runs[mode]}), file=sys.stderr, flush=True)
    for mode in FLAGS.mixed_modes:
        if mode != "bf16" and "bf16" in runs:
            runs[f"{mode}_over_bf16"] = round(runs[mode]["output_tokens_per_s"]
                                              / runs["bf16"]["output_tokens_per_s"], 2)
    return runs


def cpu_features() -> list[str]:
    """Which of CPU_FEATURES the host's CPU has (Linux /proc/cpuinfo; [] elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags_line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return []
    present = set(flags_line.split())
    return [name for name in CPU_FEATURES if name in present]


def targets(batch1: dict, found: dict, mixed: dict) -> dict:
    """The targets as booleans (None: not measured in this run)."""
    speedups = [batch1[m]["speedup_vs_bf16"] for m in ("w8a8", "int8")
                if "speedup_vs_bf16" in batch1.get(m, {})]
    w8a8 = batch1.get("w8a8", {}).get("fraction_of_int8_weight_read")
    ratios = [v for k, v in mixed.items() if k.endswith("_over_bf16")]
    ratio = max(ratios) if ratios else None
    return {"batch1_w8a8_or_int8_ge_1.5x_bf16": max(speedups) >= TARGET_SPEEDUP
            if speedups else None,
            "batch1_w8a8_ge_80pct_int8_weight_read": w8a8 >= TARGET_BOUND_FRACTION
            if w8a8 is not None else None,
            "mixed_best_quantized_ge_1.5x_bf16": ratio >= TARGET_SPEEDUP
            if ratio is not None else None,
            "zero_compiles_after_warmup": all(
                r["compiles_after_warmup"] == 0 for r in batch1.values())
            and all(mixed[m]["compiles_after_warmup"] == 0 for m in FLAGS.mixed_modes)}


def main(argv: list[str]) -> None:
    del argv
    unknown = (set(FLAGS.modes) - set(MODES)) | (set(FLAGS.mixed_modes) - set(MIXED_MODES))
    if unknown:
        raise app.UsageError(f"unknown modes {sorted(unknown)}: choose from {list(MODES)} "
                             f"(mixed: {list(MIXED_MODES)})")
    bench_throughput.runner.COMPILE_THREADS = FLAGS.compile_threads
    result = {"model": f"random {FLAGS.preset} shape", "dtype": DTYPE,
              "backend": jax.default_backend(), "device": str(jax.devices()[0].device_kind),
              "cpu_cores": len(os.sched_getaffinity(0)), "cpu_features": cpu_features(),
              "memory_bandwidth_gb_per_s": round(engine_runner.memory_bandwidth(), 2),
              "batch1": {"prompt_tokens": FLAGS.prompt_tokens,
                         "output_tokens": FLAGS.output_tokens, "repeats": FLAGS.repeats}}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(testing.make_random_model(tmp, FLAGS.preset,
                                                  max_position_embeddings=2048,
                                                  dtype=FLAGS.save_dtype))
        runs, found = batch1_all(model_dir)
        result["batch1"] |= runs
        result["bounds"] = found
        result["mixed"] = mixed_all(model_dir) if FLAGS.mixed_modes else {}
    result["targets"] = targets(runs, found, result["mixed"])
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    for name, value in SMALLER.items():
        FLAGS.set_default(name, value)
    app.run(main)
