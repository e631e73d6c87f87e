"""Prefix caching on vs off: prefill tokens computed, end-to-end time, audit vs measured.

Workload: 64 requests sharing one 1,024-token prefix, each with a distinct
256-token suffix, 64 output tokens (greedy, ignore_eos), on a random-weight
model of SmolLM-135M's shape. The same prompts run through `LLM(...,
enable_prefix_caching=True)` and `=False`; warm-up is excluded (the second
engine's warm-up reads the first's persistent compilation cache). The
prompt-overlap audit (`jaxinfer.cli.audit.overlap`, which does not run the model)
projects the prefill saving; it is printed next to the measured one. Prints one
JSON object.

    python benchmarks/bench_prefix_cache.py [--dtype=bfloat16] [--num_requests=64]
"""

from __future__ import annotations

import json
import sys
import tempfile
import time

import numpy as np
from absl import app, flags

from jaxinfer import LLM, SamplingParams, testing
from jaxinfer.cli import audit

flags.DEFINE_integer("num_requests", 64, "requests in the workload")
flags.DEFINE_integer("prefix_tokens", 1024, "tokens every prompt shares")
flags.DEFINE_integer("suffix_tokens", 256, "distinct tokens after the prefix")
flags.DEFINE_integer("output_tokens", 64, "tokens generated per request")
FLAGS = flags.FLAGS
# --dtype, --max_num_seqs, --max_num_batched_tokens and --page_size are the CLI's engine
# flags (importing jaxinfer.cli defines them), with this workload's defaults
for _name, _default in (("dtype", "bfloat16"), ("max_num_seqs", 64),
                        ("max_num_batched_tokens", 512), ("page_size", 16)):
    FLAGS.set_default(_name, _default)


def workload() -> list[list[int]]:
    rng = np.random.default_rng(0)
    prefix = rng.integers(1, 49152, size=FLAGS.prefix_tokens).tolist()
    return [prefix + rng.integers(1, 49152, size=FLAGS.suffix_tokens).tolist()
            for _ in range(FLAGS.num_requests)]


def run(model_dir: str, prompts: list[list[int]], caching: bool) -> dict:
    started = time.perf_counter()
    llm = LLM(model_dir, dtype=FLAGS.dtype, enable_prefix_caching=caching,
              max_num_seqs=FLAGS.max_num_seqs, page_size=FLAGS.page_size,
              max_num_batched_tokens=FLAGS.max_num_batched_tokens,
              max_model_len=FLAGS.prefix_tokens + FLAGS.suffix_tokens + FLAGS.output_tokens)
    warm = time.perf_counter() - started
    params = SamplingParams(max_tokens=FLAGS.output_tokens, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - started
    metrics = llm.metrics()
    result = {"seconds": round(seconds, 2), "warmup_seconds": round(warm, 1),
              "prompt_tokens_computed": metrics["prompt_tokens"],
              "generated_tokens": sum(len(o.token_ids) for o in outs),
              "cached_tokens_reported": sum(o.num_cached_tokens for o in outs),
              "steps": metrics["steps"], "token_ids": [o.token_ids for o in outs]}
    result |= {k: v for k, v in metrics.items() if k.startswith("prefix_cache")}
    return result


def main(argv: list[str]) -> None:
    del argv
    prompts = workload()
    total = sum(map(len, prompts))
    projected = audit.overlap(prompts, FLAGS.page_size)["projected_prefill_saving"]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(testing.make_random_model(tmp, "smollm-135m",
                                                  max_position_embeddings=2048))
        runs = {}
        for name, caching in (("caching", True), ("no_caching", False)):
            runs[name] = run(model_dir, prompts, caching)
            print(json.dumps({name: {k: v for k, v in runs[name].items() if k != "token_ids"}}),
                  file=sys.stderr, flush=True)
    on, off = runs["caching"], runs["no_caching"]
    same = on.pop("token_ids") == off.pop("token_ids")
    measured = 1 - on["prompt_tokens_computed"] / off["prompt_tokens_computed"]
    print(json.dumps({
        "model": "random SmolLM-135M shape", "dtype": FLAGS.dtype,
        "num_requests": len(prompts), "prompt_tokens": total,
        "prefix_tokens": FLAGS.prefix_tokens, "suffix_tokens": FLAGS.suffix_tokens,
        "output_tokens": FLAGS.output_tokens, "runs": runs,
        "computed_prefill_ratio": round(on["prompt_tokens_computed"]
                                        / off["prompt_tokens_computed"], 4),
        "end_to_end_speedup": round(off["seconds"] / on["seconds"], 2),
        "measured_prefill_saving": round(measured, 4),
        "audit_projected_saving": projected,
        "audit_minus_measured_points": round(100 * (projected - measured), 2),
        "greedy_tokens_identical": same}, indent=1))


if __name__ == "__main__":
    app.run(main)
