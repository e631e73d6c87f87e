"""Data-parallel routing: the prefix-cache hit rate and the prompt tokens computed when
requests sharing preambles are spread over replicas by `cache_aware` routing, against
`round_robin` (and `shortest_queue`), in the same run.

Workload: `--num_preambles` preambles (held-out corpus text, `--preamble_tokens` each)
x `--per_preamble` requests, each preamble followed by a request's own `--own_tokens`
tokens, in a shuffled order, all added at once through `LLM.generate` (greedy,
`--max_tokens` each), on the demo model with `--data_parallel_size` replicas of one
virtual CPU device each. One LLM per method; their warm-ups share the persistent
compilation cache (the same devices), so only the first compiles. Reports per method:
the hit rate, prompt tokens computed, requests per replica, the run's seconds (the
replicas share this machine's cores: seconds compare methods, not replica counts), and
whether every method produced the same token ids. Prints one JSON object.

    python benchmarks/bench_dp_routing.py [--data_parallel_size=4] [--per_preamble=64]
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
import time

from absl import app, flags

flags.DEFINE_integer("data_parallel_size", 4, "replicas, one virtual CPU device each")
flags.DEFINE_integer("num_preambles", 4, "distinct preambles")
flags.DEFINE_integer("per_preamble", 64, "requests per preamble")
flags.DEFINE_integer("preamble_tokens", 128, "tokens of each preamble")
flags.DEFINE_integer("own_tokens", 16, "tokens of each request after its preamble")
flags.DEFINE_integer("max_tokens", 8, "tokens generated per request")
flags.DEFINE_integer("max_num_seqs", 16, "requests in flight per replica")
flags.DEFINE_list("methods", ["cache_aware", "round_robin", "shortest_queue"],
                  "load_balance_method values to compare")
FLAGS = flags.FLAGS


def workload(tokenizer, seed: int = 0) -> list[list[int]]:
    """Token-id prompts: each preamble's tokens, then a request's own."""
    from jaxinfer.text.corpus import corpus_files

    rng = random.Random(seed)
    heldout = corpus_files()[1]
    texts = [path.read_text() for path in heldout[:FLAGS.num_preambles + 8]]
    pool = tokenizer.encode("\n".join(texts), add_special_tokens=False)
    step = FLAGS.preamble_tokens
    preambles = [pool[i * step:(i + 1) * step] for i in range(FLAGS.num_preambles)]
    tail = pool[FLAGS.num_preambles * step:]
    order = [p for p in range(FLAGS.num_preambles) for _ in range(FLAGS.per_preamble)]
    rng.shuffle(order)
    prompts = []
    for p in order:
        start = rng.randrange(len(tail) - FLAGS.own_tokens)
        prompts.append(preambles[p] + tail[start:start + FLAGS.own_tokens])
    return prompts


def run_method(method: str, cache_dir: str) -> tuple[dict, list[list[int]]]:
    from jaxinfer import LLM, SamplingParams

    llm = LLM(data_parallel_size=FLAGS.data_parallel_size, load_balance_method=method,
              max_num_seqs=FLAGS.max_num_seqs, max_num_batched_tokens=256,
              max_model_len=512, compilation_cache_dir=cache_dir)
    prompts = workload(llm.tokenizer)
    began = time.perf_counter()
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=FLAGS.max_tokens),
                           use_tqdm=False)
    seconds = time.perf_counter() - began
    m = llm.metrics()
    looked_up = m["prompt_tokens"] + m["prompt_tokens_cached"]
    return {"prefix_cache_hit_rate": m["prefix_cache_hit_rate"],
            "prompt_tokens_computed": m["prompt_tokens"],
            "prompt_tokens": looked_up,
            "requests_per_replica": [r["requests_finished"] for r in m["replicas"]],
            "seconds": round(seconds, 2),
            "compiles_after_warmup": m["compiles_after_warmup"]}, [
        o.outputs[0].token_ids for o in outputs]


def main(argv: list[str]) -> None:
    del argv
    import jax

    jax.config.update("jax_num_cpu_devices", FLAGS.data_parallel_size)
    results, tokens = {}, {}
    with tempfile.TemporaryDirectory() as cache_dir:
        for method in FLAGS.methods:
            results[method], tokens[method] = run_method(method, cache_dir)
            print(method, results[method], file=sys.stderr)
    base = results.get("round_robin")
    report = {"workload": {k: FLAGS[k].value for k in (
                  "data_parallel_size", "num_preambles", "per_preamble", "preamble_tokens",
                  "own_tokens", "max_tokens", "max_num_seqs")},
              "methods": results,
              "same_tokens": all(t == next(iter(tokens.values())) for t in tokens.values())}
    if base and "cache_aware" in results:
        report["computed_prompt_tokens_round_robin_over_cache_aware"] = round(
            base["prompt_tokens_computed"] / results["cache_aware"]["prompt_tokens_computed"],
            2)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    app.run(main)
