"""Output tokens/s: continuous batching vs our static mode vs transformers' generate.

A random-weight model of a preset's shape (default SmolLM-135M: hidden 576, 30
layers, 9 heads, 3 KV heads, MLP 1536, vocab 49152; `--preset=llama3.1-8b` on a
GPU) is saved as an HF directory (in `--save_dtype`); the same
weights run in jaxinfer (continuous, and `scheduler="static"` in batches of
16) and in transformers' `generate` in static batches of 16 (torch, left
padding). Workload: 128 requests, prompts uniform in 32..512 tokens, outputs
uniform in 16..256, fixed seed, `ignore_eos`. Also batch-1 decode: the step time
next to the time of a jitted batch-1 matmul pass over the model's own weights in
float32, measured in the same run (the weight-read bound; the bfloat16 bound is that
time times bf16 bytes over f32 bytes, see benchmarks/bounds.py), and the roofline
from the engine's bandwidth probe. Warm-up (cold: the persistent compilation cache is
off) is timed apart and excluded from the rates. Prints one JSON object.
`benchmarks/compare_commits.sh BASE` runs it against another commit's package.

    python benchmarks/bench_throughput.py [--dtypes=float32,bfloat16] [--num_requests=128]
    python benchmarks/bench_throughput.py --preset=llama3.1-8b --dtypes=bfloat16 \
        --save_dtype=bfloat16 --skip=transformers --max_num_seqs=32 --compile_threads=8
"""

from __future__ import annotations

import gc
import json
import sys
import tempfile
import time

import bounds
import jax
import numpy as np
from absl import app, flags

from jaxinfer import LLM, SamplingParams, testing
from jaxinfer.config import load_preset
from jaxinfer.engine import runner

runner = getattr(runner, "runner", runner)  # the runner module, in or as engine.runner

flags.DEFINE_list("dtypes", ["float32", "bfloat16"], "weight dtypes to run")
flags.DEFINE_integer("num_requests", 128, "requests in the workload")
flags.DEFINE_integer("static_batch", 16, "batch size of the static baselines")
flags.DEFINE_integer("max_num_seqs", 64, "continuous batching: requests in flight")
flags.DEFINE_integer("max_num_batched_tokens", 512, "tokens per step")
flags.DEFINE_list("skip", [], "runs to skip: continuous, static, transformers, batch1")
flags.DEFINE_integer("seed", 0, "workload seed")
flags.DEFINE_string("preset", "smollm-135m", "model shape (a preset name), random weights")
flags.DEFINE_enum("save_dtype", "float32", ["float32", "bfloat16"], "dtype of the saved model")
flags.DEFINE_integer("compile_threads", runner.COMPILE_THREADS, "warm-up compile threads")
FLAGS = flags.FLAGS
MAX_MODEL_LEN = 1024


def workload() -> tuple[list[list[int]], list[int]]:
    rng = np.random.default_rng(FLAGS.seed)
    vocab = load_preset(FLAGS.preset).vocab_size
    prompts = [rng.integers(1, vocab, size=int(rng.integers(32, 513))).tolist()
               for _ in range(FLAGS.num_requests)]
    outputs = [int(rng.integers(16, 257)) for _ in range(FLAGS.num_requests)]
    return prompts, outputs


def run_jaxinfer(model_dir: str, dtype: str, scheduler: str, prompts: list, outputs: list,
                 **settings: object) -> dict:
    """`settings`: engine settings over the flags' (e.g. max_model_len)."""
    seqs = FLAGS.max_num_seqs if scheduler == "continuous" else FLAGS.static_batch
    started = time.perf_counter()
    llm = LLM(model_dir, **dict(dtype=dtype, scheduler=scheduler, max_num_seqs=seqs,
                                max_num_batched_tokens=FLAGS.max_num_batched_tokens,
                                max_model_len=MAX_MODEL_LEN, compilation_cache_dir="")
              | settings)
    warm = time.perf_counter() - started
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in outputs]
    started = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - started
    generated = sum(len(o.token_ids) for o in outs)
    metrics = llm.metrics()
    return {"output_tokens_per_s": round(generated / seconds, 1), "seconds": round(seconds, 3),
            "generated_tokens": generated, "finished_requests": sum(o.finished for o in outs),
            "warmup_seconds": round(warm, 1),
            "compile_seconds": round(metrics.get("warmup_seconds", 0.0), 1),
            "buckets": metrics["buckets"], "compiles_after_warmup":
            metrics["compiles_after_warmup"], "mean_requests_per_step":
            metrics["mean_requests_per_step"], "padding_waste": metrics["padding_waste"],
            "preemptions": metrics["preemptions"],
            "roofline_fraction": metrics["roofline_fraction"]}


def run_transformers(model_dir: str, dtype: str, prompts: list, outputs: list) -> dict:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype)).eval()
    batch = FLAGS.static_batch
    started, generated = time.perf_counter(), 0
    for lo in range(0, len(prompts), batch):
        chunk, wanted = prompts[lo:lo + batch], outputs[lo:lo + batch]
        width = max(map(len, chunk))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=max(wanted),
                           min_new_tokens=max(wanted), do_sample=False, pad_token_id=0)
        generated += sum(wanted)  # tokens the requests asked for; the rest is batch waste
    seconds = time.perf_counter() - started
    return {"output_tokens_per_s": round(generated / seconds, 1), "seconds": round(seconds, 1),
            "generated_tokens": generated, "torch_threads": torch.get_num_threads()}


def run_batch1(model_dir: str, dtype: str, **settings: object) -> dict:
    """`settings`: engine settings over these (e.g. compilation_cache_dir)."""
    llm = LLM(model_dir, **dict(dtype=dtype, max_num_seqs=1, max_num_batched_tokens=64,
                                max_model_len=MAX_MODEL_LEN, compilation_cache_dir="")
              | settings)
    params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    llm.generate([[1] * 8], SamplingParams(max_tokens=4, ignore_eos=True))
    started = time.perf_counter()
    (out,) = llm.generate([list(range(1, 33))], params)
    seconds = time.perf_counter() - started
    weight_bytes = llm.engine.runner.weight_bytes
    bandwidth = llm.engine.metrics.bandwidth_gb_per_s
    bound = bandwidth * 1e9 / weight_bytes
    rate = len(out.token_ids) / seconds
    pass_s, _ = bounds.weight_pass_seconds(llm.engine.runner.params)
    if dtype == "bfloat16":
        pass_s /= 2  # bf16 bytes over f32 bytes (benchmarks/bounds.py)
    return {"decode_tokens_per_s": round(rate, 1), "decode_step_ms": round(1e3 / rate, 2),
            "weight_pass_ms": round(1e3 * pass_s, 2),
            "step_over_weight_pass": round(1 / rate / pass_s, 2), "weight_bytes": weight_bytes,
            "memory_bandwidth_gb_per_s": round(bandwidth, 1),
            "roofline_tokens_per_s": round(bound, 1), "fraction_of_roofline":
            round(rate / bound, 3)}


def main(argv: list[str]) -> None:
    del argv
    runner.COMPILE_THREADS = FLAGS.compile_threads
    prompts, outputs = workload()
    result = {"model": f"random {FLAGS.preset} shape", "num_requests": len(prompts),
              "prompt_tokens": sum(map(len, prompts)), "requested_output_tokens": sum(outputs),
              "static_batch": FLAGS.static_batch, "max_num_seqs": FLAGS.max_num_seqs,
              "backend": jax.default_backend(),
              "device": str(jax.devices()[0].device_kind), "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(testing.make_random_model(tmp, FLAGS.preset,
                                                  max_position_embeddings=2048,
                                                  dtype=FLAGS.save_dtype))
        for dtype in FLAGS.dtypes:
            runs = {}
            for name in ("continuous", "static"):
                if name not in FLAGS.skip:
                    runs[name] = run_jaxinfer(model_dir, dtype, name, prompts, outputs)
                    gc.collect()  # the engine's device memory before the next one loads
                    print(json.dumps({dtype: {name: runs[name]}}), file=sys.stderr, flush=True)
            if "transformers" not in FLAGS.skip:
                runs["transformers"] = run_transformers(model_dir, dtype, prompts, outputs)
            if "batch1" not in FLAGS.skip:
                gc.collect()
                runs["batch1"] = run_batch1(model_dir, dtype)
            rate = {k: v.get("output_tokens_per_s") for k, v in runs.items()}
            if rate.get("continuous"):
                for base in ("static", "transformers"):
                    if rate.get(base):
                        runs[f"continuous_over_{base}"] = round(rate["continuous"] / rate[base],
                                                                2)
            result["runs"][dtype] = runs
            print(json.dumps({dtype: runs}), file=sys.stderr, flush=True)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    app.run(main)
