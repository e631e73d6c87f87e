"""Structured outputs' cost: output tokens/s with no constraint vs half the requests
constrained, on the bundled demo model, asynchronous scheduling on and off.

Every request writes exactly `--max_tokens` tokens (temperature 1.0): the free ones
ignore EOS, the constrained ones follow a regex that cannot end sooner
(`[a-z ]{K,}`, K = 20 x max_tokens characters), so both runs generate the same tokens
and only the constraint differs. Each run is repeated (`--repeats`, the best kept)
after a warm-up pass. Reports tokens/s, the ratio half/free (the target is >= 0.8),
the host's mask time per constrained step and the mean step time; then the sampler
alone (`--sampler`): no mask vs an all-ones mask (the unconstrained path's added device
work) vs a real one, at the demo's vocab and at 128k. `--runs=free --nosampler` runs
only the unconstrained workload, e.g. against the commit before structured outputs:

    python benchmarks/bench_structured.py
    BENCH=benchmarks/bench_structured.py benchmarks/compare_commits.sh BASE --runs=free \
        --nosampler

Prints one JSON object.
"""

from __future__ import annotations

import json
import sys
import time

from absl import app, flags

from jaxinfer import LLM, SamplingParams
from jaxinfer.config import DEFAULT_MODEL

flags.DEFINE_integer("num_requests", 16, "requests per run")
flags.DEFINE_integer("max_tokens", 64, "output tokens of every request")
flags.DEFINE_integer("max_num_seqs", 8, "requests in flight")
flags.DEFINE_integer("repeats", 3, "timed repeats of each run (the fastest is kept)")
flags.DEFINE_list("runs", ["free", "half"], "free: no constraint; half: every other "
                  "request constrained")
flags.DEFINE_list("modes", ["async", "sync"], "scheduling loops to measure")
flags.DEFINE_bool("sampler", True, "also time the sampler alone with and without a mask")
FLAGS = flags.FLAGS
PROMPTS = ["import os\n", "The answer is", "def main():\n", "# A list of", "class A:\n",
           "x = ", "for i in range(", "Note: "]
COUNTERS = ("steps", "step_seconds", "generated_tokens", "constrained_steps",
            "grammar_mask_seconds", "host_to_device_bytes")


def _params(constrained: bool) -> SamplingParams:
    n = FLAGS.max_tokens
    if not constrained:
        return SamplingParams(max_tokens=n, temperature=1.0, ignore_eos=True)
    from jaxinfer import StructuredOutputsParams  # absent before structured outputs
    return SamplingParams(max_tokens=n, temperature=1.0, ignore_eos=True,
                          structured_outputs=StructuredOutputsParams(
                              regex=f"[a-z ]{{{20 * n},}}"))


def _run(llm: LLM, constrained_share: int) -> dict:
    """One pass; `constrained_share`: every k-th request constrained (0: none)."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(FLAGS.num_requests)]
    params = [_params(bool(constrained_share) and i % constrained_share == 0)
              for i in range(FLAGS.num_requests)]
    before = llm.metrics()
    began = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - began
    after = llm.metrics()
    if any(len(o.token_ids) != FLAGS.max_tokens for o in outputs):
        raise RuntimeError("a request ended before max_tokens: the outputs are not equal")
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in COUNTERS}
    steps = max(delta["steps"], 1)
    return {"seconds": round(seconds, 3),
            "tokens_per_s": round(delta["generated_tokens"] / seconds, 1),
            "steps": delta["steps"],
            "step_ms": round(1e3 * delta["step_seconds"] / steps, 3),
            "constrained_steps": delta["constrained_steps"],
            "grammar_mask_ms_per_step": round(1e3 * delta["grammar_mask_seconds"] / steps, 3),
            "grammar_mask_ms_per_constrained_step": round(
                1e3 * delta["grammar_mask_seconds"] / max(delta["constrained_steps"], 1), 3),
            "host_to_device_bytes_per_step": round(delta["host_to_device_bytes"] / steps, 1)}


def _mode(asynchronous: bool) -> dict:
    llm = LLM(str(DEFAULT_MODEL), max_num_seqs=FLAGS.max_num_seqs,
              max_num_batched_tokens=256, max_model_len=256, seed=0,
              async_scheduling=asynchronous)
    shares = {"free": 0, "half": 2}
    for name in FLAGS.runs:
        _run(llm, shares[name])  # warm-up pass: first grammar compile, caches
    out = {}
    for _ in range(FLAGS.repeats):  # interleaved, so load on the host hits both alike
        for name in FLAGS.runs:
            result = _run(llm, shares[name])
            if name not in out or result["seconds"] < out[name]["seconds"]:
                out[name] = result
    if "free" in out and "half" in out:
        out["half_over_free"] = round(out["half"]["tokens_per_s"]
                                      / out["free"]["tokens_per_s"], 3)
    return out


def _sampler(vocab: int, rows: int = 8, calls: int = 100) -> dict:
    """The sampler alone, jitted, temperature 1.0 over f32[rows, vocab] logits: no mask
    argument (the step before structured outputs), an all-ones mask (what every
    unconstrained step now runs) and a real one; the fastest of `calls`, in ms."""
    import dataclasses

    import jax
    import numpy as np

    from jaxinfer.engine.runner import sampling_inputs
    from jaxinfer.model import sampler

    inputs = sampling_inputs([], num_rows=rows, history_width=16,
                             eos_token_ids=frozenset())
    inputs = dataclasses.replace(inputs, temperature=np.ones(rows, np.float32))
    logits = jax.device_put(
        np.random.default_rng(0).normal(size=(rows, vocab)).astype(np.float32))
    words = -(-vocab // 32)
    some = np.full((rows, words), -1, np.int32)
    some[::2] = np.random.default_rng(1).integers(-2**31, 2**31, (rows // 2, words))
    masks = {"no_mask": None, "all_ones": np.full((rows, words), -1, np.int32),
             "half_rows_masked": some}
    masks = {k: None if m is None else jax.device_put(m) for k, m in masks.items()}
    sample = jax.jit(sampler.sample, static_argnames="num_logprobs")
    times = {name: [] for name in masks}
    for mask in masks.values():  # compile first
        jax.block_until_ready(sample(logits, inputs, num_logprobs=0, token_mask=mask))
    for _ in range(calls):  # interleaved, so host load hits every variant alike
        for name, mask in masks.items():
            began = time.perf_counter()
            jax.block_until_ready(sample(logits, inputs, num_logprobs=0, token_mask=mask))
            times[name].append(time.perf_counter() - began)
    return {name: round(1e3 * min(t), 4) for name, t in times.items()}


def main(argv: list[str]) -> None:
    del argv
    result = {"model": "demo", "num_requests": FLAGS.num_requests,
              "max_tokens": FLAGS.max_tokens, "max_num_seqs": FLAGS.max_num_seqs}
    for mode in FLAGS.modes:
        result[mode] = _mode(mode == "async")
    if FLAGS.sampler:
        result["sampler_ms"] = {f"V={v}": _sampler(v) for v in (4096, 128256)}
    json.dump(result, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    app.run(main)
