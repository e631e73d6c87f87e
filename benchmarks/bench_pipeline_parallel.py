"""Pipeline parallelism against its bubble model, on virtual CPU devices, in one run.

A random-weight model of a preset's shape (default SmolLM-135M, float32) prefills a
fixed workload (prompts of `prompt_tokens`, one output token each, so nearly every step
is a full mixed step of `max_num_batched_tokens`) on one device (the baseline, t1), then
as `pipeline_parallel_size` stages for each microbatch count M. A step of M microbatches
runs M + PP - 1 ticks, each a microbatch through one stage's layers, so the bubble model
(model/pipeline.py; docs/parallelism.md#pipeline-parallelism) predicts

    stages at once (separate chips):  t(M) / t1 = (M + PP - 1) / (M * PP)
    stages one after another:         t(M) / t1 = (M + PP - 1) / M

Virtual CPU devices share this machine's cores, and a bubble tick still computes (its
K/V writes go to the padding page), so the second model is the one to expect here; the
figure is the measured ratio over it. Prints one JSON object.

    python benchmarks/bench_pipeline_parallel.py [--preset=smollm-135m] [--stages=2]
        [--microbatches=1,2,4] [--num_prompts=16] [--prompt_tokens=128]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import gc  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from jaxinfer import LLM, SamplingParams, testing  # noqa: E402
from jaxinfer.config import load_preset  # noqa: E402

flags.DEFINE_string("preset", "smollm-135m", "model shape (a preset name), random weights")
flags.DEFINE_string("dtype", "float32", "weight dtype")
flags.DEFINE_integer("stages", 2, "pipeline_parallel_size")
flags.DEFINE_list("microbatches", ["1", "2", "4"], "microbatch counts to run")
flags.DEFINE_integer("num_prompts", 16, "prompts in the workload")
flags.DEFINE_integer("prompt_tokens", 128, "tokens per prompt")
flags.DEFINE_integer("max_num_batched_tokens", 256, "tokens per step")
flags.DEFINE_integer("repeats", 3, "timed runs of the workload per setting (best kept)")
FLAGS = flags.FLAGS


def workload_seconds(model_dir: pathlib.Path, **layout: object) -> tuple[float, dict]:
    """Best wall time of the workload over FLAGS.repeats runs (after warm-up), and the
    engine's metrics."""
    llm = LLM(str(model_dir), dtype=FLAGS.dtype, max_num_seqs=FLAGS.num_prompts,
              max_num_batched_tokens=FLAGS.max_num_batched_tokens,
              max_model_len=FLAGS.prompt_tokens + 8, enable_prefix_caching=False,
              compilation_cache_dir="", **layout)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 250, FLAGS.prompt_tokens).tolist()
               for _ in range(FLAGS.num_prompts)]
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:2], params, use_tqdm=False)  # first steps off the clock
    best = float("inf")
    for _ in range(FLAGS.repeats):
        began = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        best = min(best, time.perf_counter() - began)
    metrics = llm.metrics()
    del llm
    gc.collect()
    return best, metrics


def main(argv: list[str]) -> None:
    del argv
    cfg = load_preset(FLAGS.preset)
    stages = FLAGS.stages
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = pathlib.Path(tmp) / "model"
        testing.make_random_model(model_dir, cfg)
        t1, _ = workload_seconds(model_dir)
        runs = []
        for micro in (int(m) for m in FLAGS.microbatches):
            seconds, metrics = workload_seconds(model_dir, pipeline_parallel_size=stages,
                                                pipeline_microbatches=micro)
            serial = (micro + stages - 1) / micro
            runs.append({"microbatches": micro, "seconds": round(seconds, 3),
                         "ratio_to_one_device": round(seconds / t1, 3),
                         "model_stages_one_after_another": round(serial, 3),
                         "model_stages_at_once": round(serial / stages, 3),
                         "measured_over_model": round(seconds / t1 / serial, 3),
                         "bubble_fraction": round((stages - 1) / (micro + stages - 1), 3),
                         "compiles_after_warmup": metrics["compiles_after_warmup"]})
    json.dump({"preset": FLAGS.preset, "dtype": FLAGS.dtype, "stages": stages,
               "num_prompts": FLAGS.num_prompts, "prompt_tokens": FLAGS.prompt_tokens,
               "max_num_batched_tokens": FLAGS.max_num_batched_tokens,
               "one_device_seconds": round(t1, 3), "runs": runs}, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    app.run(main)
