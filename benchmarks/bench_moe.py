"""A mixture of experts against dense models of its active and of its total size.

Three random models of one shape, scaled from Qwen3-30B-A3B to this machine (hidden
512, 8 query and 2 KV heads of 64, 12 layers, a vocabulary of 8,192):
- `moe`: Qwen3-MoE, 16 experts of intermediate 192, top-4;
- `dense_active`: Qwen3 with an MLP of 4 x 192 = 768, the MoE's active parameters;
- `dense_total`: Qwen3 with an MLP of 16 x 192 = 3,072, the MoE's total parameters.
For each dtype (`--dtypes`), each model: batch-1 decode (one request, the median wall
time of its decode steps; the engine's host time is in every model's figure alike)
and a mixed workload's throughput (prompts of 16-128 tokens, 16-64 output tokens,
greedy and sampled), with zero compilations after warm-up checked. Prints JSON with
the MoE's decode step over the active-size dense model's (a decode step that read
every expert would cost about the total-size model's) and its throughput over both.

    python benchmarks/bench_moe.py [--dtypes=float32,bfloat16]
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time

import jax
import numpy as np
from absl import app, flags

from jaxinfer import SamplingParams, testing
from jaxinfer.config import EngineConfig, ModelConfig, MoEConfig
from jaxinfer.engine.engine import Engine

flags.DEFINE_list("dtypes", ["float32", "bfloat16"], "weight dtypes to run")
flags.DEFINE_integer("decode_steps", 48, "batch-1 decode steps timed")
flags.DEFINE_integer("num_requests", 32, "requests in the mixed workload")
flags.DEFINE_integer("max_num_seqs", 16, "requests in flight")
FLAGS = flags.FLAGS

SHAPE = dict(vocab_size=8192, hidden_size=512, num_layers=12, num_heads=8, num_kv_heads=2,
             head_dim=64, qk_norm=True, rope_theta=1e6, max_position_embeddings=1024)
EXPERTS, TOP_K, EXPERT_SIZE = 16, 4, 192


def models() -> dict[str, ModelConfig]:
    moe = MoEConfig(num_experts=EXPERTS, num_experts_per_tok=TOP_K,
                    intermediate_size=EXPERT_SIZE, norm_topk_prob=True)
    return {"moe": ModelConfig(architecture="qwen3_moe", intermediate_size=EXPERT_SIZE,
                               moe=moe, **SHAPE),
            "dense_active": ModelConfig(architecture="qwen3",
                                        intermediate_size=TOP_K * EXPERT_SIZE, **SHAPE),
            "dense_total": ModelConfig(architecture="qwen3",
                                       intermediate_size=EXPERTS * EXPERT_SIZE, **SHAPE)}


def _engine(path: str, dtype: str) -> Engine:
    return Engine(path, EngineConfig(dtype=dtype, max_num_seqs=FLAGS.max_num_seqs,
                                     max_num_batched_tokens=256, max_model_len=512,
                                     compilation_cache_dir="", async_scheduling=False))


def _batch1_decode_ms(engine: Engine) -> float:
    engine.add_request("one", list(range(1, 17)), SamplingParams(
        max_tokens=FLAGS.decode_steps + 2, temperature=0.0, ignore_eos=True))
    times = []
    while engine.has_unfinished():
        began = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - began)
    engine.release("one")
    return 1e3 * statistics.median(times[2:])  # past the prefill


def _mixed_tokens_per_s(engine: Engine, vocab: int) -> float:
    rng = np.random.default_rng(0)
    before = engine.metrics.generated_tokens
    for i in range(FLAGS.num_requests):
        prompt = rng.integers(1, vocab, int(rng.integers(16, 129))).tolist()
        engine.add_request(f"mixed-{i}", prompt, SamplingParams(
            max_tokens=int(rng.integers(16, 65)), temperature=0.0 if i % 2 else 0.8, seed=i,
            ignore_eos=True))
    began = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                engine.release(out.request_id)
    return (engine.metrics.generated_tokens - before) / (time.perf_counter() - began)


def run_dtype(dtype: str, tmp: str) -> dict:
    out = {}
    for name, cfg in models().items():
        path = testing.make_random_model(f"{tmp}/{name}-{dtype}", cfg, dtype=dtype)
        engine = _engine(str(path), dtype)
        decode_ms = _batch1_decode_ms(engine)
        throughput = _mixed_tokens_per_s(engine, cfg.vocab_size)
        out[name] = {"batch1_decode_ms": round(decode_ms, 3),
                     "mixed_tokens_per_s": round(throughput, 1),
                     "weight_bytes": engine.memory_plan.weight_bytes,
                     "compiles_after_warmup": engine.metrics.compiles_after_warmup}
        del engine
    moe, active, total = out["moe"], out["dense_active"], out["dense_total"]
    out["ratios"] = {
        "moe_decode_over_dense_active": round(moe["batch1_decode_ms"]
                                              / active["batch1_decode_ms"], 3),
        "moe_decode_over_dense_total": round(moe["batch1_decode_ms"]
                                             / total["batch1_decode_ms"], 3),
        "moe_throughput_over_dense_active": round(moe["mixed_tokens_per_s"]
                                                  / active["mixed_tokens_per_s"], 3),
        "moe_throughput_over_dense_total": round(moe["mixed_tokens_per_s"]
                                                 / total["mixed_tokens_per_s"], 3)}
    return out


def main(_: list[str]) -> None:
    result = {"jax": jax.__version__, "backend": jax.default_backend(),
              "shape": SHAPE | {"experts": EXPERTS, "top_k": TOP_K,
                                "expert_intermediate_size": EXPERT_SIZE}}
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in FLAGS.dtypes:
            result[dtype] = run_dtype(dtype, tmp)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    app.run(main)
