"""Tensor-parallel overhead on virtual CPU devices: prefill and decode tokens/s at TP=1
and TP=3, and the collective bytes per step the shardings imply.

On one CPU the "devices" share the same two cores and memory, so TP cannot speed
anything up here: the ratio TP=3 / TP=1 measures what splitting costs (collectives,
per-device launches, smaller matmuls), not a speed-up. The model is a random
SmolLM-135M shape (9 query heads, 3 KV heads: TP=3 gives each device 3 query heads and
1 KV head; vocabulary 49152 splits 3 ways). Workloads: prefill (`--batch` prompts of
`--prompt_len` tokens, one output token each) and decode (`--batch` 8-token prompts,
`--output_len` greedy tokens); median of `--repeats` runs after warm-up. Collective
bytes per step are computed from the shardings (not measured): per layer two
all-reduces of f32[T, D] (after o and after down), one of f32[T, D] for the
vocab-split embedding lookup, and the all-gather of f32[S, V] logits before sampling;
a ring all-reduce moves 2 (n - 1) / n of its payload per device, an all-gather
(n - 1) / n. Prints one JSON object.

    python benchmarks/bench_tp.py [--sizes=1,3] [--batch=8] [--dtype=float32]
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time

import jax
from absl import app, flags

flags.DEFINE_list("sizes", ["1", "3"], "tensor_parallel_size values to run")
flags.DEFINE_integer("batch", 8, "requests per workload")
flags.DEFINE_integer("prompt_len", 256, "prefill workload: tokens per prompt")
flags.DEFINE_integer("output_len", 64, "decode workload: tokens per request")
flags.DEFINE_integer("repeats", 3, "runs per workload (median)")
flags.DEFINE_string("dtype", "float32", "weights dtype")
flags.DEFINE_string("preset", "smollm-135m", "model shape (random weights)")
FLAGS = flags.FLAGS
MAX_MODEL_LEN = 512


def collective_bytes(cfg: object, tp: int, *, tokens: int, slots: int) -> dict:
    """Bytes of the step's collectives from its shardings: payloads and per-device ring
    traffic."""
    if tp == 1:
        return {"all_reduce_payload_bytes": 0, "all_gather_payload_bytes": 0,
                "per_device_traffic_bytes": 0}
    vocab_split = cfg.vocab_size % tp == 0
    all_reduce = (2 * cfg.num_layers + vocab_split) * tokens * cfg.hidden_size * 4
    all_gather = slots * cfg.vocab_size * 4 if vocab_split else 0
    traffic = 2 * (tp - 1) / tp * all_reduce + (tp - 1) / tp * all_gather
    return {"all_reduce_payload_bytes": all_reduce, "all_gather_payload_bytes": all_gather,
            "per_device_traffic_bytes": round(traffic)}


def timed(llm: object, prompts: list, params: object) -> tuple[float, int]:
    started = time.perf_counter()
    outs = llm.generate(prompts, params)
    return time.perf_counter() - started, sum(len(o.token_ids) for o in outs)


def run_size(model_dir: str, tp: int) -> dict:
    from jaxinfer import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(model_dir, dtype=FLAGS.dtype, tensor_parallel_size=tp,
              max_num_seqs=FLAGS.batch, max_num_batched_tokens=FLAGS.prompt_len,
              max_model_len=MAX_MODEL_LEN, compilation_cache_dir="", strict_compile=True,
              enable_prefix_caching=False)
    warm = time.perf_counter() - started
    prefill_prompts = [[1 + (i * 7 + j) % 1000 for j in range(FLAGS.prompt_len)]
                       for i in range(FLAGS.batch)]
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    decode = SamplingParams(max_tokens=FLAGS.output_len, temperature=0.0, ignore_eos=True)
    prefill_s, decode_s = [], []
    for _ in range(FLAGS.repeats):
        prefill_s.append(timed(llm, prefill_prompts, one)[0])
        seconds, generated = timed(llm, [[i + 1] * 8 for i in range(FLAGS.batch)], decode)
        decode_s.append(seconds)
    cfg = llm.engine.runner.cfg
    return {
        "tensor_parallel_size": tp, "warmup_seconds": round(warm, 1),
        "prefill_tokens_per_s": round(FLAGS.batch * FLAGS.prompt_len
                                      / statistics.median(prefill_s), 1),
        "decode_tokens_per_s": round(generated / statistics.median(decode_s), 1),
        "compiles_after_warmup": llm.metrics()["compiles_after_warmup"],
        "decode_step_collectives": collective_bytes(cfg, tp, tokens=FLAGS.batch,
                                                    slots=FLAGS.batch),
        "prefill_step_collectives": collective_bytes(cfg, tp, tokens=FLAGS.prompt_len,
                                                     slots=FLAGS.batch)}


def main(argv: list[str]) -> None:
    del argv
    sizes = [int(s) for s in FLAGS.sizes]
    jax.config.update("jax_num_cpu_devices", max(sizes))
    from jaxinfer import testing

    result = {"model": f"random {FLAGS.preset} shape", "dtype": FLAGS.dtype,
              "batch": FLAGS.batch, "prompt_len": FLAGS.prompt_len,
              "output_len": FLAGS.output_len, "repeats": FLAGS.repeats,
              "note": "virtual CPU devices share 2 cores: TP>1 measures overhead, "
                      "not speed-up", "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        testing.make_random_model(tmp, FLAGS.preset, dtype=FLAGS.dtype,
                                  max_position_embeddings=MAX_MODEL_LEN)
        for tp in sizes:
            result["runs"].append(run_size(tmp, tp))
            print(json.dumps(result["runs"][-1]), file=sys.stderr)
    base = result["runs"][0]
    for run in result["runs"][1:]:
        run["prefill_ratio_to_first"] = round(
            run["prefill_tokens_per_s"] / base["prefill_tokens_per_s"], 3)
        run["decode_ratio_to_first"] = round(
            run["decode_tokens_per_s"] / base["decode_tokens_per_s"], 3)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    app.run(main)
