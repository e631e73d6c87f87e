"""The Ray path's overhead: `run_ray` over N replicas vs the single-process batch
runner, on the same JSONL file, in the same run.

Workload: `--num_prompts` short code prompts (the first short `def` line of held-out
corpus files, jaxinfer/text/corpus.py), greedy, `--max_tokens` each, on the demo model.
The single-process runner loads and warms up one LLM in this process, then runs the
file; the Ray path starts a local Ray cluster (`--num_cpus`), then `run_ray` starts
`--num_replicas` actors, each loading and warming up its own engine, and runs the file.
Both warm-ups read the same persistent compilation cache (a first, untimed
single-process warm-up fills it). Wall times include the warm-ups (what a user waits
for); `generated_tokens_per_s` counts the generated tokens over the whole wall time.
Also checks that both wrote the same token ids. Prints one JSON object.

    python benchmarks/bench_ray_batch.py [--num_prompts=96] [--num_replicas=2]
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import tempfile
import time

from absl import app, flags

from jaxinfer import LLM, batch
from jaxinfer.config import DEFAULT_MODEL
from jaxinfer.text.corpus import corpus_files

flags.DEFINE_integer("num_prompts", 96, "requests in the file")
flags.DEFINE_integer("max_tokens", 32, "tokens generated per request")
flags.DEFINE_integer("num_replicas", 2, "Ray replicas (actors), one CPU each")
flags.DEFINE_integer("num_cpus", 2, "CPUs of the local Ray cluster")
flags.DEFINE_integer("max_num_seqs", 16, "requests in flight per engine")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "weights dtype")
FLAGS = flags.FLAGS


def prompts(count: int) -> list[str]:
    """Up to 4 short `def` lines per held-out file, repeated if the files have too few."""
    found = []
    for path in corpus_files()[1]:
        lines = [s.strip() for s in path.read_text(errors="ignore").splitlines()]
        found += [s.split("(")[0] + "(" for s in lines if s.startswith("def ") and len(s) < 60][:4]
    return (found * (count // len(found) + 1))[:count]


def token_ids(path: pathlib.Path) -> dict[str, list[int]]:
    return {r["id"]: r["token_ids"] for r in map(json.loads, path.read_text().splitlines())}


def main(argv: list[str]) -> None:
    del argv
    engine = {"dtype": FLAGS.dtype, "max_num_seqs": FLAGS.max_num_seqs, "max_model_len": 256,
              "max_num_batched_tokens": 256}
    work = pathlib.Path(tempfile.mkdtemp(prefix="bench_ray_batch-"))
    inp = work / "in.jsonl"
    inp.write_text("".join(json.dumps({"id": f"q{i}", "prompt": p, "max_tokens":
                                       FLAGS.max_tokens, "temperature": 0.0}) + "\n"
                           for i, p in enumerate(prompts(FLAGS.num_prompts))))
    LLM(DEFAULT_MODEL, **engine)  # fills the persistent compilation cache, untimed

    single_started = time.perf_counter()
    llm = LLM(DEFAULT_MODEL, **engine)
    loaded = time.perf_counter()
    single = batch.run(llm, inp, work / "single.jsonl", progress=False)
    single_wall = time.perf_counter() - single_started
    del llm

    import ray

    from jaxinfer.ray import run_ray

    ray_started = time.perf_counter()
    ray.init(num_cpus=FLAGS.num_cpus, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS",
                                                                       "cpu")}})
    joined = time.perf_counter()
    on_ray = run_ray(inp, work / "ray.jsonl", num_replicas=FLAGS.num_replicas,
                     model=DEFAULT_MODEL, progress=False, **engine)
    ray_wall = time.perf_counter() - ray_started
    ray.shutdown()

    tokens = single["completion_tokens"]
    report = {
        "num_prompts": FLAGS.num_prompts, "max_tokens": FLAGS.max_tokens,
        "completion_tokens": tokens, "cpus": os.cpu_count(),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "single": {"wall_s": round(single_wall, 2),
                   "load_and_warm_up_s": round(loaded - single_started, 2),
                   "run_s": single["seconds"],
                   "generated_tokens_per_s": round(tokens / single_wall, 1),
                   "run_generated_tokens_per_s": single["generated_tokens_per_s"]},
        "ray": {"replicas": FLAGS.num_replicas, "wall_s": round(ray_wall, 2),
                "ray_init_s": round(joined - ray_started, 2), "run_ray_s": on_ray["seconds"],
                "batch_size": on_ray["batch_size"], "first_result_s": on_ray["first_result_s"],
                "replica_warmup": [{k: m[k] for k in ("warmup_seconds", "warmup_loaded",
                                                       "warmup_compiled")}
                                   for m in on_ray["engine"].values()],
                "generated_tokens_per_s": round(on_ray["completion_tokens"] / ray_wall, 1)},
        "same_token_ids": token_ids(work / "single.jsonl") == token_ids(work / "ray.jsonl"),
    }
    report["ray_over_single_wall"] = round(ray_wall / single_wall, 2)
    report["ray_over_single_tokens_per_s"] = round(
        report["ray"]["generated_tokens_per_s"] / report["single"]["generated_tokens_per_s"],
        2)
    sys.stdout.write(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    app.run(main)
