"""Sleep and wake of the demo model (docs/rl.md#sleeping-and-waking): the engine's live
device bytes (JAX's own count, and the allocator's where the backend reports it) before
sleep, asleep and after wake, the seconds of sleep and of wake_up, for level 1 (weights
to host memory) and level 2 (weights dropped, then given back from a host copy), and
whether the greedy tokens after wake are those before, with no compile. Prints JSON.

    python benchmarks/bench_sleep.py [--dtype=float32] [--repeats=3]
"""

from __future__ import annotations

import datetime
import json
import time

import jax
from absl import app, flags

from jaxinfer import LLM, SamplingParams
from jaxinfer.engine.runner import memory_stats

flags.DEFINE_string("dtype", "float32", "the demo model's served dtype")
flags.DEFINE_integer("repeats", 3, "sleep/wake cycles per level (median seconds)")
FLAGS = flags.FLAGS

PROMPTS = ["Once upon a time", "The little dog", "Tom and Lily went to the park.", "She"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=48)


def _tokens(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY,
                                                                use_tqdm=False)]


def _cycle(llm: LLM, level: int) -> dict[str, float]:
    """One sleep and wake (`before`: of the first cycle, measured as after wake: after
    a generate, which makes the token masks the engine keeps); at level 2 the weights
    come back from a host copy taken before (as a trainer's would), their transfer
    counted in the wake."""
    host = jax.device_get(llm.engine.runner.params) if level == 2 else None
    before = llm.device_memory_bytes()
    began = time.perf_counter()
    llm.sleep(level)
    slept = time.perf_counter() - began
    asleep = llm.device_memory_bytes()
    stats = memory_stats(llm.engine.sleeper.devices)
    began = time.perf_counter()
    if level == 2:
        llm.engine.sleeper.set_params(host)
    llm.wake_up()
    jax.block_until_ready((llm.engine.runner.params, llm.engine.runner.kv_cache))
    woke = time.perf_counter() - began
    return {"before": before, "asleep": asleep, "allocator_asleep": stats and
            stats["bytes_in_use"], "sleep_s": slept, "wake_s": woke}


def main(_: list[str]) -> None:
    llm = LLM(dtype=FLAGS.dtype, strict_compile=True)
    expected = _tokens(llm)
    compiles = llm.engine.compiles.total
    result = {"date": datetime.date.today().isoformat(), "backend": jax.default_backend(),
              "device": str(jax.devices()[0].device_kind), "dtype": FLAGS.dtype,
              "weight_bytes": llm.engine.runner.weight_bytes, "levels": {}}
    for level in (1, 2):
        cycles = [_cycle(llm, level) for _ in range(FLAGS.repeats)]
        same = _tokens(llm) == expected
        after = llm.device_memory_bytes()
        median = sorted(cycles, key=lambda c: c["sleep_s"] + c["wake_s"])[len(cycles) // 2]
        result["levels"][level] = {
            "bytes_before": cycles[0]["before"], "bytes_asleep": median["asleep"],
            "bytes_after_wake": after, "allocator_bytes_asleep": median["allocator_asleep"],
            "sleep_s": round(sorted(c["sleep_s"] for c in cycles)[len(cycles) // 2], 4),
            "wake_s": round(sorted(c["wake_s"] for c in cycles)[len(cycles) // 2], 4),
            "same_greedy_tokens": same}
    result["compiles_after_warmup"] = llm.engine.compiles.total - compiles
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    app.run(main)
