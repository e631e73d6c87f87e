"""The prefix cache's host tier (`kv_offloading_size`) off vs on: prompt tokens computed,
hits from the device and from host memory, throughput, and what the copies cost, when
the device KV pool is too small for the prompts' shared preambles.

Workload: `--num_preambles` distinct preambles of `--preamble_tokens` random token ids,
`--questions` questions each (`--question_min`..`--question_max` random tokens after
the preamble, `--output_min`..`--output_max` greedy tokens out, ignore_eos), given to
one `LLM.generate` call in round-robin order (question 0 of preambles 0..P-1, then
question 1 of each, ...). The device pool (`kv_cache_memory_bytes`, computed from the
page size and the model's KV bytes per token) holds `--device_preambles` preambles'
pages plus `--max_num_seqs` requests at full length (those in flight): a preamble comes
back after P - 1 others, so with P above what the pool keeps, every repeat misses on
the device. The `on` arm adds a host tier large enough for every preamble's pages
(twice their bytes, in GiB); its repeats hit there and their pages are copied back.

Model: random weights of the demo checkpoint's shape (checkpoints/demo/config.json:
Llama, 6 layers, hidden 320, 5 heads, 1 KV head of 64, vocabulary 4,096) with
max_position_embeddings raised to fit a preamble: the demo checkpoint itself stops at
512 positions, below a 2,048-token preamble (`--preset` takes a preset name or TOML
path instead; `--small` a 2-layer, hidden-64 one). Both arms run one after another with
the same engine settings (page size 16, `--max_num_batched_tokens`, asynchronous
scheduling, prefix caching on); warm-up (at construction) is excluded from the
timings, and the second arm's warm-up loads the first's programs from the persistent
compilation cache (the engine's default directory). Throughput is over the `generate`
call: output tokens/s and (prompt + output) tokens/s, every prompt token counted as
vLLM does. Greedy outputs of the two arms are compared (`outputs_equal`). Prints one
JSON object.

    python benchmarks/bench_kv_offload.py [--num_preambles=16] [--preamble_tokens=2048]
    python benchmarks/bench_kv_offload.py --small  # a few seconds' workload, for tests
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import pathlib
import sys
import tempfile
import time

import numpy as np
from absl import app, flags

from jaxinfer import LLM, SamplingParams, testing
from jaxinfer.config import ModelConfig, load_preset
from jaxinfer.sizing import planner

REPO = pathlib.Path(__file__).resolve().parents[1]
DEMO_CONFIG = REPO / "checkpoints" / "demo" / "config.json"

flags.DEFINE_string("preset", "demo", "model shape: demo (the demo checkpoint's "
                    "config.json, random weights), or a preset name or TOML path")
flags.DEFINE_string("dtype", "bfloat16", "weights and KV dtype")
flags.DEFINE_integer("num_preambles", 16, "distinct preambles")
flags.DEFINE_integer("preamble_tokens", 2048, "tokens of each preamble")
flags.DEFINE_integer("questions", 8, "questions per preamble")
flags.DEFINE_integer("question_min", 16, "fewest tokens of a question")
flags.DEFINE_integer("question_max", 64, "most tokens of a question")
flags.DEFINE_integer("output_min", 8, "fewest tokens generated per request")
flags.DEFINE_integer("output_max", 16, "most tokens generated per request")
flags.DEFINE_integer("device_preambles", 4, "preambles the device pool holds, beside "
                     "the requests in flight")
flags.DEFINE_integer("max_num_seqs", 4, "requests in flight")
flags.DEFINE_integer("max_num_batched_tokens", 512, "tokens per step")
flags.DEFINE_integer("page_size", 16, "tokens per KV page")
flags.DEFINE_float("offload_factor", 2.0, "the host tier's size over the bytes of all "
                   "preambles' pages")
flags.DEFINE_bool("small", False, "a tiny workload (4 preambles of 64 tokens, 3 "
                  "questions, a 1-preamble pool, 1 request in flight, 64-token steps) "
                  "on a tiny model, for tests; flags given explicitly still win")
FLAGS = flags.FLAGS

SMALL = dict(num_preambles=4, preamble_tokens=64, questions=3, question_min=4,
             question_max=12, output_min=2, output_max=4, device_preambles=1,
             max_num_seqs=1, max_num_batched_tokens=64, dtype="float32")
TINY_MODEL = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16)


def apply_small() -> None:
    """--small: the tiny sizes, for flags not given on the command line."""
    if not FLAGS.small:
        return
    for name, value in SMALL.items():
        if not FLAGS[name].present:
            FLAGS[name].value = value


def model_config(max_len: int) -> tuple[ModelConfig, str]:
    """The model's shape, with max_position_embeddings at least `max_len`; and its name."""
    if FLAGS.preset != "demo":
        cfg, name = load_preset(FLAGS.preset), FLAGS.preset
    elif FLAGS.small:
        cfg = ModelConfig(architecture="llama", **TINY_MODEL)
        name = "random tiny Llama (2 layers, hidden 64)"
    else:
        cfg = ModelConfig.from_hf(json.loads(DEMO_CONFIG.read_text()))
        name = "random weights, demo checkpoint's shape"
    return dataclasses.replace(
        cfg, max_position_embeddings=max(cfg.max_position_embeddings, max_len)), name


def workload(vocab_size: int) -> tuple[list[list[int]], list[int], list[int]]:
    """(prompts, their preamble index, their output lengths), round-robin over the
    preambles. Ids in 1..vocab_size - 1 (0 is the random model's EOS)."""
    rng = np.random.default_rng(0)
    preambles = rng.integers(1, vocab_size, (FLAGS.num_preambles, FLAGS.preamble_tokens))
    prompts, owners, outputs = [], [], []
    for _ in range(FLAGS.questions):
        for p in range(FLAGS.num_preambles):
            length = int(rng.integers(FLAGS.question_min, FLAGS.question_max + 1))
            question = rng.integers(1, vocab_size, length)
            prompts.append([*map(int, preambles[p]), *map(int, question)])
            owners.append(p)
            outputs.append(int(rng.integers(FLAGS.output_min, FLAGS.output_max + 1)))
    return prompts, owners, outputs


def pool_sizes(cfg: ModelConfig, max_len: int) -> dict[str, int | float]:
    """The device pool's bytes (`device_preambles` preambles' pages, `max_num_seqs`
    requests at max_len, the trash page) and the host tier's GiB."""
    per_token = planner.kv_bytes_per_token(cfg, FLAGS.dtype)
    page_bytes = FLAGS.page_size * per_token
    preamble_pages = -(-FLAGS.preamble_tokens // FLAGS.page_size)
    request_pages = -(-max_len // FLAGS.page_size)
    pages = FLAGS.device_preambles * preamble_pages + FLAGS.max_num_seqs * request_pages + 1
    every_preamble = FLAGS.num_preambles * preamble_pages * page_bytes
    gib = math.ceil(FLAGS.offload_factor * every_preamble / 2**30 * 1e4) / 1e4
    return {"kv_bytes_per_token": per_token, "page_bytes": page_bytes,
            "device_pages": pages, "kv_cache_memory_bytes": pages * page_bytes,
            "preamble_pages": preamble_pages, "request_pages": request_pages,
            "all_preambles_bytes": every_preamble, "kv_offloading_size_gib": gib}


def run_arm(model_dir: str, prompts: list[list[int]],
            params: list[SamplingParams], max_len: int, sizes: dict,
            offload: bool) -> tuple[dict, list[list[int]]]:
    began = time.perf_counter()
    llm = LLM(model_dir, dtype=FLAGS.dtype, enable_prefix_caching=True,
              max_num_seqs=FLAGS.max_num_seqs, page_size=FLAGS.page_size,
              max_num_batched_tokens=FLAGS.max_num_batched_tokens, max_model_len=max_len,
              kv_cache_memory_bytes=sizes["kv_cache_memory_bytes"],
              kv_offloading_size=sizes["kv_offloading_size_gib"] if offload else None)
    warm = time.perf_counter() - began
    began = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - began
    m = llm.metrics()
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    generated = sum(map(len, tokens))
    prompt_total = sum(map(len, prompts))
    hits = m.get("prefix_cache_hit_tokens", 0)
    host_hits = m.get("prefix_cache_host_hit_tokens", 0)
    result = {
        "warmup_seconds": round(warm, 1), "seconds": round(seconds, 2),
        "prompt_tokens_computed": m["prompt_tokens"],
        "prompt_tokens_cached": m["prompt_tokens_cached"],
        "hit_tokens_device": hits - host_hits, "hit_tokens_host": host_hits,
        "generated_tokens": generated,
        "output_tokens_per_s": round(generated / seconds, 1),
        "prompt_plus_output_tokens_per_s": round((prompt_total + generated) / seconds, 1),
        "steps": m["steps"], "preemptions": m["preemptions"],
        "peak_pages_in_use": m["peak_pages_in_use"],
        "prefix_cache_evictions": m.get("prefix_cache_evictions", 0),
        "compiles_after_warmup": m["compiles_after_warmup"],
        "kv_offload_copy_ms_per_step": m.get("kv_offload_copy_ms_per_step", 0.0),
        "kv_offload_copy_seconds": m.get("kv_offload_copy_seconds", 0.0),
        "kv_offload_bytes_to_host": m.get("kv_offload_bytes_to_host", 0),
        "kv_offload_bytes_to_device": m.get("kv_offload_bytes_to_device", 0),
    }
    result |= {k: v for k, v in m.items() if k.startswith("kv_offload_") and k not in result}
    del llm, outs
    gc.collect()
    return result, tokens


def ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def main(argv: list[str]) -> None:
    del argv
    apply_small()
    max_len = FLAGS.preamble_tokens + FLAGS.question_max + FLAGS.output_max
    cfg, model_name = model_config(max_len)
    prompts, _, output_lengths = workload(cfg.vocab_size)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
              for n in output_lengths]
    sizes = pool_sizes(cfg, max_len)
    arms, tokens = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(testing.make_random_model(pathlib.Path(tmp) / "model", cfg))
        for name, offload in (("off", False), ("on", True)):
            arms[name], tokens[name] = run_arm(model_dir, prompts, params,
                                               max_len, sizes, offload)
            print(json.dumps({name: arms[name]}), file=sys.stderr, flush=True)
    off, on = arms["off"], arms["on"]
    print(json.dumps({
        "model": model_name, "dtype": FLAGS.dtype,
        "model_shape": {k: getattr(cfg, k) for k in (
            "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
            "num_kv_heads", "head_dim")},
        "workload": {k: FLAGS[k].value for k in (
            "num_preambles", "preamble_tokens", "questions", "question_min", "question_max",
            "output_min", "output_max", "device_preambles", "max_num_seqs",
            "max_num_batched_tokens", "page_size")} | {
            "requests": len(prompts), "prompt_tokens": sum(map(len, prompts)),
            "max_model_len": max_len},
        "pool": sizes,
        "arms": arms,
        "ratio_on_off_prompt_tokens_computed": ratio(on["prompt_tokens_computed"],
                                                     off["prompt_tokens_computed"]),
        "prompt_tokens_computed_off_over_on": ratio(off["prompt_tokens_computed"],
                                                    on["prompt_tokens_computed"]),
        "ratio_on_off_output_tokens_per_s": ratio(on["output_tokens_per_s"],
                                                  off["output_tokens_per_s"]),
        "ratio_on_off_prompt_plus_output_tokens_per_s": ratio(
            on["prompt_plus_output_tokens_per_s"], off["prompt_plus_output_tokens_per_s"]),
        "outputs_equal": tokens["on"] == tokens["off"],
        "requests_with_equal_outputs": sum(a == b for a, b in zip(tokens["on"], tokens["off"],
                                                                 strict=True)),
    }, indent=1))


if __name__ == "__main__":
    app.run(main)
