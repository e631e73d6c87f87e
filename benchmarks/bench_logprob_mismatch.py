"""Engine-vs-trainer logprobs on the demo model (docs/rl.md#logprobs-that-match-the-trainers):
for float32 and bfloat16 engines, batch 1 and a mixed batch of 32 (prompt lengths 1 to
~100 tokens, all submitted together so they share steps and buckets), the sampled
tokens' logprobs the engine returns (logprobs=0) against jaxinfer.training's
sequence_logprobs on prompt + output: mean and max |delta|, and how many are bitwise
equal; with batch_invariant off and on (the trainer's function in the same mode), and
the seconds each batch took to generate in each mode, same run. Prints JSON.

    python benchmarks/bench_logprob_mismatch.py [--max_tokens=32]
"""

from __future__ import annotations

import datetime
import json
import platform
import time

import jax
import numpy as np
from absl import app, flags

from jaxinfer import LLM, SamplingParams
from jaxinfer.training import llm_sequence_logprobs, sampled_sequences

flags.DEFINE_integer("max_tokens", 32, "tokens sampled per request")
FLAGS = flags.FLAGS

TEXT = "Once upon a time there was a little dog who liked to run in the park with Tom"


def prompts(count: int) -> list[str]:
    """Prompts of mixed lengths: 1 to ~100 words."""
    return [" ".join([TEXT] * 8)[: 1 + (37 * i) % 400] for i in range(count)]


def mismatch(llm: LLM, batch: int) -> dict:
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=FLAGS.max_tokens, logprobs=0)
    llm.generate(prompts(batch), params, use_tqdm=False)  # first run: compiles nothing new
    start = time.perf_counter()
    outputs = llm.generate(prompts(batch), params, use_tqdm=False)
    seconds = time.perf_counter() - start
    seqs, engine, starts = sampled_sequences(outputs)
    ours = llm_sequence_logprobs(llm, seqs)
    got = np.concatenate([np.asarray(o[s:s + len(e)], np.float32)
                          for o, e, s in zip(ours, engine, starts, strict=True)])
    want = np.concatenate([np.asarray(e, np.float32) for e in engine])
    delta = np.abs(got - want)
    return {"batch": batch, "tokens": int(delta.size), "mean_abs": float(delta.mean()),
            "max_abs": float(delta.max()), "bitwise_equal": int((got == want).sum()),
            "generate_s": round(seconds, 3)}


def main(argv: list[str]) -> None:
    del argv
    rows = []
    for dtype in ("float32", "bfloat16"):
        for invariant in (False, True):
            llm = LLM(dtype=dtype, batch_invariant=invariant)
            for batch in (1, 32):
                rows.append({"dtype": dtype, "batch_invariant": invariant,
                             **mismatch(llm, batch)})
            del llm
    print(json.dumps({"date": datetime.date.today().isoformat(),
                      "backend": jax.default_backend(), "machine": platform.machine(),
                      "max_tokens": FLAGS.max_tokens, "rows": rows}, indent=1))


if __name__ == "__main__":
    app.run(main)
