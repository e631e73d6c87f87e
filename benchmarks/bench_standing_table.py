"""The standing table: what a session measures first on a lent GPU (docs/benchmarks.md).

One random-weight model of a preset's shape (default Llama-3.1-8B, bfloat16) runs three
parts, each in a process of its own under its own time limit, so that an overrun or a
crash costs that part alone and each part starts with the device's memory free:

- vllm_random: vLLM's offline throughput benchmark on random data (`vllm bench throughput
  --dataset-name random`, `benchmark_throughput.py`): `--num_prompts` prompts of
  `--input_len` random token ids, `--output_len` tokens out each with `ignore_eos`, all
  given to one `LLM.generate`. Requests/s, output and total (in + out) tok/s, and the
  total's ratio to vLLM's published 12,450 tok/s on one H100 (published, not measured).
- batch1: bench_throughput's batch-1 decode against the weight-read bound of
  benchmarks/bounds.py (measured in the same run) and, where the device's spec is known,
  against its published memory bandwidth.
- mixed128: bench_throughput's 128-request mixed workload under continuous batching.

vllm_random and mixed128 run the same engine settings and share one compilation cache,
so mixed128 loads the programs vllm_random compiled (vllm_random's warm-up is cold).
Prints one JSON object: date, commit, device, JAX version, preset, dtype, settings, parts.

    python benchmarks/bench_standing_table.py          # on a GPU: tools/gpu_session.sh standing
    python benchmarks/bench_standing_table.py --preset=tiny.toml --num_prompts=16 \\
        --input_len=16 --output_len=8 --num_requests=8 --max_num_seqs=8 \\
        --max_num_batched_tokens=64
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import bench_throughput
import jax
import numpy as np
from absl import app, flags

from jaxinfer import testing
from jaxinfer.config import load_preset
from jaxinfer.sizing import planner

PARTS = ("vllm_random", "batch1", "mixed128")
# vLLM's published offline throughput on this workload (Llama-3.1-8B, 1,000 random
# prompts, 256 in / 256 out, one H100), in + out tokens/s: a published figure.
VLLM_H100_TOTAL_TOKENS_PER_S = 12_450.0
# Published HBM bandwidth (GB/s) by device kind, most specific name first.
PUBLISHED_BANDWIDTH_GB_PER_S = (("H100 PCIe", 2_000.0), ("H100 NVL", 3_900.0),
                                ("H100", 3_350.0), ("H200", 4_800.0))

flags.DEFINE_list("parts", list(PARTS), "parts to run, of " + ", ".join(PARTS))
flags.DEFINE_enum("dtype", "bfloat16", ["float32", "bfloat16"], "engine dtype")
flags.DEFINE_integer("num_prompts", 1000, "vllm_random: prompts")
flags.DEFINE_integer("input_len", 256, "vllm_random: random token ids a prompt")
flags.DEFINE_integer("output_len", 256, "vllm_random: tokens out a prompt (ignore_eos)")
flags.DEFINE_integer("model_limit_s", 120, "seconds to build and save the random model")
flags.DEFINE_integer("vllm_random_limit_s", 240, "seconds for vllm_random, warm-up included")
flags.DEFINE_integer("batch1_limit_s", 75, "seconds for batch1, warm-up included")
flags.DEFINE_integer("mixed128_limit_s", 100, "seconds for mixed128, warm-up included")
flags.DEFINE_string("commit", "", "the commit measured; default: git's HEAD, if any")
flags.DEFINE_enum("part", None, ["model", *PARTS], "internal: run one part in this process")
flags.DEFINE_string("model_dir", None, "internal: the saved random model")
flags.DEFINE_string("cache_dir", None, "internal: the compilation cache the parts share")
FLAGS = flags.FLAGS
# bench_throughput's flags this script uses, with the standing table's defaults; its
# other flags (dtypes, skip, static_batch) do nothing here.
FLAGS.set_default("preset", "llama3.1-8b")
FLAGS.set_default("save_dtype", "bfloat16")
FLAGS.set_default("max_num_seqs", 256)
FLAGS.set_default("max_num_batched_tokens", 8192)
FORWARDED = ("preset", "save_dtype", "dtype", "seed", "num_requests", "max_num_seqs",
             "max_num_batched_tokens", "compile_threads", "num_prompts", "input_len",
             "output_len")


def max_model_len() -> int:
    """Room for vllm_random's and the mixed workload's requests (one page-table width,
    so the two parts compile the same programs)."""
    return max(bench_throughput.MAX_MODEL_LEN, FLAGS.input_len + FLAGS.output_len)


def engine_settings() -> dict:
    return {"dtype": FLAGS.dtype, "max_num_seqs": FLAGS.max_num_seqs,
            "max_num_batched_tokens": FLAGS.max_num_batched_tokens,
            "max_model_len": max_model_len(), "compile_threads": FLAGS.compile_threads}


def random_prompts() -> list[list[int]]:
    """vLLM's random dataset at range ratio 0: every prompt exactly input_len ids."""
    rng = np.random.default_rng(FLAGS.seed)
    vocab = load_preset(FLAGS.preset).vocab_size
    return rng.integers(1, vocab, size=(FLAGS.num_prompts, FLAGS.input_len)).tolist()


def run_continuous(prompts: list[list[int]], outputs: list[int]) -> dict:
    """bench_throughput's continuous run, and the totals vLLM's benchmark reports."""
    run = bench_throughput.run_jaxinfer(
        FLAGS.model_dir, FLAGS.dtype, "continuous", prompts, outputs,
        max_model_len=max_model_len(), compilation_cache_dir=FLAGS.cache_dir)
    prompt_tokens = sum(map(len, prompts))
    seconds = run["seconds"]
    return {"requests": len(prompts), "prompt_tokens": prompt_tokens,
            "requested_output_tokens": sum(outputs),
            "requests_per_s": round(len(prompts) / seconds, 3),
            "total_tokens_per_s": round((prompt_tokens + run["generated_tokens"]) / seconds, 1),
            **run}


def vllm_random() -> dict:
    prompts = random_prompts()
    run = run_continuous(prompts, [FLAGS.output_len] * len(prompts))
    return {"input_len": FLAGS.input_len, "output_len": FLAGS.output_len, **run,
            "vllm_reference": {"total_tokens_per_s": VLLM_H100_TOTAL_TOKENS_PER_S,
                               "device": "one NVIDIA H100", "measured_here": False,
                               "note": "vLLM's published figure for 1,000 prompts of 256 "
                               "random tokens, 256 out, Llama-3.1-8B; not measured in this "
                               "run, so the ratio means most on an H100"},
            "ratio_to_vllm_published": round(
                run["total_tokens_per_s"] / VLLM_H100_TOTAL_TOKENS_PER_S, 4)}


def published_bandwidth(device_kind: str) -> float | None:
    return next((gb for name, gb in PUBLISHED_BANDWIDTH_GB_PER_S if name in device_kind), None)


def batch1_kv_bytes(page_size: int = 16) -> int:
    """One request of full length, plus the spare page: the pool the engine gives one
    slot on a CPU. On an accelerator the default pool would fill the memory that
    bounds.py's float32 copy of the weights needs (32 GB for the 8B shape)."""
    pages = -(-bench_throughput.MAX_MODEL_LEN // page_size) + 1
    return pages * page_size * planner.kv_bytes_per_token(load_preset(FLAGS.preset),
                                                          FLAGS.dtype)


def batch1() -> dict:
    run = bench_throughput.run_batch1(FLAGS.model_dir, FLAGS.dtype,
                                      kv_cache_memory_bytes=batch1_kv_bytes(),
                                      compilation_cache_dir=FLAGS.cache_dir)
    rate, weight_bytes = run["decode_tokens_per_s"], run["weight_bytes"]
    spec = published_bandwidth(jax.devices()[0].device_kind)
    return {**run, "fraction_of_weight_read_bound": _significant(
                1 / run["step_over_weight_pass"]),
            "published_bandwidth_gb_per_s": spec,
            "fraction_of_published_bandwidth_bound": None if spec is None else
            _significant(rate * weight_bytes / (spec * 1e9))}


def mixed128() -> dict:
    return run_continuous(*bench_throughput.workload())


def make_model() -> dict:
    testing.make_random_model(FLAGS.model_dir, FLAGS.preset, dtype=FLAGS.save_dtype,
                              max_position_embeddings=max(2048, max_model_len()))
    return {"device": str(jax.devices()[0].device_kind), "backend": jax.default_backend(),
            "device_count": jax.device_count(), "jax_version": jax.__version__}


def _significant(x: float) -> float:
    return float(f"{x:.4g}")


def run_part(part: str, model_dir: str, cache_dir: str, limit_s: int) -> dict:
    """One part in a child process (this script, `--part`), killed past `limit_s`."""
    argv = [sys.executable, __file__, *(FLAGS[name].serialize() for name in FORWARDED),
            f"--part={part}", f"--model_dir={model_dir}", f"--cache_dir={cache_dir}"]
    # JAX takes its cache directory from the environment too: name the same one there.
    env = os.environ | {"JAX_COMPILATION_CACHE_DIR": cache_dir}
    started = time.perf_counter()
    try:
        done = subprocess.run(argv, stdout=subprocess.PIPE, text=True, timeout=limit_s,
                              env=env, check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"stopped at its {limit_s} s limit"}
    wall = round(time.perf_counter() - started, 1)
    lines = done.stdout.strip().splitlines()
    if done.returncode or not lines:
        return {"error": f"exit status {done.returncode}", "wall_seconds": wall}
    return {**json.loads(lines[-1]), "wall_seconds": wall}


def commit() -> dict:
    """`--commit`, else git's HEAD and whether tracked files differ from it (a device
    machine's copy of the checkout may carry no .git: "unknown")."""
    if FLAGS.commit:
        return {"commit": FLAGS.commit}
    try:
        return {"commit": _git("rev-parse", "--short", "HEAD"), "uncommitted_changes":
                bool(_git("status", "--porcelain", "--untracked-files=no"))}
    except (OSError, subprocess.CalledProcessError):
        return {"commit": "unknown"}


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, check=True,
                          cwd=pathlib.Path(__file__).parent).stdout.strip()


def main(argv: list[str]) -> None:
    del argv
    bench_throughput.runner.COMPILE_THREADS = FLAGS.compile_threads
    if FLAGS.part:  # a child: one part, one JSON line
        runs = {"model": make_model, "vllm_random": vllm_random, "batch1": batch1,
                "mixed128": mixed128}
        print(json.dumps(runs[FLAGS.part]()))
        return
    unknown = set(FLAGS.parts) - set(PARTS)
    if unknown:
        raise app.UsageError(f"unknown parts {sorted(unknown)}; known: {PARTS}")
    result = {"benchmark": "standing table", "date": time.strftime("%Y-%m-%d"), **commit(),
              "preset": FLAGS.preset, "model": f"random {FLAGS.preset} shape",
              "dtype": FLAGS.dtype, "save_dtype": FLAGS.save_dtype,
              "engine": engine_settings(), "seed": FLAGS.seed, "jax_version": jax.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, cache_dir = f"{tmp}/model", f"{tmp}/xla"
        made = run_part("model", model_dir, cache_dir, FLAGS.model_limit_s)
        result |= {k: made.pop(k) for k in ("device", "backend", "jax_version") if k in made}
        result["model_build"] = made
        for part in PARTS:
            if part in FLAGS.parts and "error" not in made:
                result[part] = run_part(part, model_dir, cache_dir,
                                        FLAGS[f"{part}_limit_s"].value)
                print(json.dumps({part: result[part]}), file=sys.stderr, flush=True)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    app.run(main)
