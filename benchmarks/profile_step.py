"""Where a step's time goes: per-op times of a batch-1 decode step and a mixed step.

Runs a random-weight model of a preset's shape through the engine (no warm-up: each
scenario's bucket compiles on its first step, timed), times `--repeats` steps of
each scenario, then traces `--trace_steps` more with `jax.profiler` and sums XLA:CPU's
per-op events by name. Prints one JSON object: per scenario the bucket, compile
seconds, median step ms, ops per step (kernel events in the trace, and top-level
instructions of the compiled program) and the top ops by time; and the weight-read
bound (benchmarks/bounds.py) with the decode step's ratio to it.

--quantization and --kv_cache_dtype profile a quantized step (no weight-read bound is
printed then); --decode_prompt_tokens sets the KV length the decoding requests start at.

    python benchmarks/profile_step.py [--dtype=float32] [--preset=smollm-135m]
        [--quantization=w8a8] [--kv_cache_dtype=int8] [--decode_batch=15]
"""

from __future__ import annotations

import collections
import glob
import json
import re
import tempfile
import time

import bounds
import jax
import numpy as np
from absl import app, flags
from jax.profiler import ProfileData

from jaxinfer import LLM, SamplingParams, testing

flags.DEFINE_string("preset", "smollm-135m", "model shape (a preset name), random weights")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "weight dtype")
flags.DEFINE_integer("repeats", 20, "timed steps per scenario")
flags.DEFINE_integer("trace_steps", 5, "traced steps per scenario")
flags.DEFINE_integer("top", 15, "ops listed per scenario")
flags.DEFINE_integer("decode_batch", 8, "requests decoding beside the prompt, mixed step")
flags.DEFINE_integer("prompt_tokens", 256, "prompt tokens prefilled in a mixed step")
flags.DEFINE_integer("decode_prompt_tokens", 32, "prompt length of each decoding request")
flags.DEFINE_enum("quantization", None, ["int8", "w8a8", "fp8", "int4"], "weight quantization")
flags.DEFINE_enum("kv_cache_dtype", "auto", ["auto", "int8", "fp8"], "KV cache dtype")
FLAGS = flags.FLAGS
IDLE_EVENTS = ("ThreadpoolListener", "SlinkyThreadPool", "ThunkExecutor", "end: ", "$")


def op_times(trace_dir: str) -> collections.Counter:
    """Seconds per XLA op name over every op event of the trace (Python frames and
    thread-pool bookkeeping left out)."""
    (path,) = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
    totals: collections.Counter = collections.Counter()
    counts: collections.Counter = collections.Counter()
    for plane in ProfileData.from_file(path).planes:
        if plane.name != "/host:CPU":
            continue
        for line in plane.lines:
            if line.name == "python":
                continue
            for event in line.events:
                if not event.name.startswith(IDLE_EVENTS) and "Pjit" not in event.name:
                    totals[event.name] += event.duration_ns / 1e9
                    counts[event.name] += 1
    return totals, counts


def entry_ops(compiled: object) -> int:
    """Top-level instructions of a compiled program's entry computation."""
    text = compiled.as_text()
    entry = text[text.index("\nENTRY "):]
    body = entry[entry.index("{") + 1:entry.index("\n}")]
    return sum(1 for line in body.splitlines() if " = " in line)


def profile(llm: LLM, step_once: callable, name: str) -> dict:
    """Compile (first step), time and trace one scenario's steps."""
    began = time.perf_counter()
    bucket = step_once()
    first = time.perf_counter() - began
    times = []
    for _ in range(FLAGS.repeats):
        began = time.perf_counter()
        step_once()
        times.append(time.perf_counter() - began)
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            for _ in range(FLAGS.trace_steps):
                step_once()
        totals, counts = op_times(trace_dir)
    step_s = float(np.median(times))
    compiled = llm.engine.runner._compile(bucket)
    kinds: collections.Counter = collections.Counter()
    for op, seconds in totals.items():
        kinds[re.sub(r"\.\d+$", "", op)] += seconds
    per_step = 1e3 / FLAGS.trace_steps
    top = [{"op": op, "ms_per_step": round(per_step * s, 3),
            "calls_per_step": counts[op] / FLAGS.trace_steps}
           for op, s in totals.most_common(FLAGS.top)]
    top_kinds = {kind: round(per_step * s, 2) for kind, s in kinds.most_common(FLAGS.top)}
    return {"scenario": name, "bucket": [bucket.num_tokens, bucket.num_slots],
            "compile_seconds": round(first - step_s, 2), "step_ms": round(1e3 * step_s, 2),
            "op_events_per_step": sum(counts.values()) / FLAGS.trace_steps,
            "entry_ops": entry_ops(compiled),
            "op_ms_per_step": round(per_step * sum(totals.values()), 2),
            "ms_by_op_kind": top_kinds, "top_ops": top}


def main(argv: list[str]) -> None:
    del argv
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = testing.make_random_model(tmp, FLAGS.preset, max_position_embeddings=2048)
        llm = LLM(model_dir, dtype=FLAGS.dtype, warm_up=False, compilation_cache_dir="",
                  max_num_seqs=16, max_num_batched_tokens=512, max_model_len=1024,
                  enable_prefix_caching=False, quantization=FLAGS.quantization,
                  kv_cache_dtype=FLAGS.kv_cache_dtype)
    engine = llm.engine
    endless = SamplingParams(max_tokens=900, temperature=0.0, ignore_eos=True)
    decode_prompt = list(range(1, FLAGS.decode_prompt_tokens + 1))
    engine.add_request("decode-0", decode_prompt, endless)
    engine.step()  # prefill
    buckets = []
    real_step = engine.runner.execute

    def execute(plan: object, *args: object) -> object:
        result = real_step(plan, *args)
        buckets.append(result.bucket)
        return result

    engine.runner.execute = execute

    def step_once() -> object:
        engine.step()
        return buckets[-1]

    decode = profile(llm, step_once, "decode batch 1")
    for i in range(1, FLAGS.decode_batch):
        engine.add_request(f"decode-{i}", decode_prompt, endless)
    for _ in range(2 + FLAGS.decode_batch * FLAGS.decode_prompt_tokens // 512):
        engine.step()  # the prompts' prefill chunks
    counter = iter(range(10**6))

    def mixed_once() -> object:
        prompt = np.random.default_rng(next(counter)).integers(1, 1000, FLAGS.prompt_tokens)
        engine.add_request(f"prompt-{next(counter)}", prompt.tolist(),
                           SamplingParams(max_tokens=1, ignore_eos=True))
        return step_once()

    mixed = profile(llm, mixed_once, f"{FLAGS.decode_batch} decoding + "
                    f"{FLAGS.prompt_tokens}-token prompt")
    if FLAGS.quantization:
        print(json.dumps({"quantization": FLAGS.quantization, "scenarios": [decode, mixed]},
                         indent=1))
        return
    bound_s, bound_bytes = bounds.weight_pass_seconds(engine.runner.params)
    if FLAGS.dtype == "bfloat16":
        bound_s /= 2  # bf16 bytes over f32 bytes (see bounds.py)
    print(json.dumps({"preset": FLAGS.preset, "dtype": FLAGS.dtype,
                      "weight_pass_ms": round(1e3 * bound_s, 2),
                      "weight_pass_f32_bytes": bound_bytes,
                      "decode_step_over_weight_pass": round(decode["step_ms"] / 1e3 / bound_s,
                                                            2),
                      "scenarios": [decode, mixed]}, indent=1))


if __name__ == "__main__":
    app.run(main)
