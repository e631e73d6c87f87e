"""Speculative decoding on the bundled demo pair: tokens/s at batch 1, 4, 16
and 64 without speculation, with the draft model (k = 2, 4), with n-gram lookup, and
with the load-adaptive policy; acceptance rate and mean acceptance length.

Workload: code completion. Prompts are windows of the corpus's held-out files (the
demo models never trained on them, jaxinfer/text/corpus.py): the `--prompt_tokens` tokens
ending with a function's `def` line, then `--output_tokens` tokens of its body generated,
greedy (temperature 0, `ignore_eos`) unless `--temperature` is given. At batch b the
engine runs b requests at once (`max_num_seqs=b`, each mode a fresh `LLM` over the
same prompts); the rate is the
output tokens over the wall time of `generate`, after warm-up and an untimed short run,
the median of `--repeats` rounds; each round runs every mode once, in a new order, so
that the slow and fast spells of a shared machine fall on all modes alike. Modes
(each an engine
setting, vLLM's `speculative_config`):

- `none`: no speculation, the baseline of every ratio;
- `draft_k2`, `draft_k4`: the demo draft model (checkpoints/demo-draft), always k drafts
  (`adaptive: false`);
- `ngram`: prompt lookup, k = 4, always (`adaptive: false`); `ngram_k8` (not run by
  default): k = 8;
- `adaptive`: the draft model with k up to 4, the policy choosing per step;
- `adaptive_ngram`: n-gram lookup, k up to 4, the policy choosing per step;
- `eagle3`, `eagle`, `medusa`: heads on the target's hidden states trained for the demo
  model (checkpoints/demo-eagle3, demo-eagle, demo-medusa; tools/train_heads.py), always
  k = 4 drafts; `adaptive_eagle3`: EAGLE-3 with k up to 4, the policy choosing per step.

Any mode followed by `@sync` (`adaptive_eagle3@sync`) runs with `async_scheduling` off:
the steps the policy does not speculate in then wait for the host, as they did before
the asynchronous loop took speculative engines too.

Targets: the best method's batch-1 speed-up at least 2x; the adaptive
policy at least 0.95x of no speculation at every batch size; the best head method's
batch-1 speed-up at least 1.8x greedy (and not below n-gram lookup's) or 1.4x sampled
(`--temperature=0.8`), and at least 1.3x the draft model's. For each head mode it also
prints what bounds it (`head_ceilings`): the target's step over a decode step, and the
speed-up its acceptance would give with a free drafter. Prints one JSON object.

    python benchmarks/bench_spec.py [--batches=1,4,16,64] [--modes=...] [--repeats=2]
"""

from __future__ import annotations

import dataclasses
import gc
import json
import pathlib
import random
import re
import statistics
import sys
import time

from absl import app, flags

from jaxinfer import LLM, SamplingParams
from jaxinfer.config import DEFAULT_MODEL
from jaxinfer.text.corpus import corpus_files, read_texts
from jaxinfer.text.tokenizer import Tokenizer

DRAFT = DEFAULT_MODEL.parent / "demo-draft"
HEADS = {method: DEFAULT_MODEL.parent / f"demo-{method}" for method in ("eagle3", "eagle",
                                                                         "medusa")}
MODES = {
    "none": None,
    "draft_k2": {"method": "draft_model", "model": str(DRAFT), "num_speculative_tokens": 2,
                 "adaptive": False},
    "draft_k4": {"method": "draft_model", "model": str(DRAFT), "num_speculative_tokens": 4,
                 "adaptive": False},
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False},
    "ngram_k8": {"method": "ngram", "num_speculative_tokens": 8, "adaptive": False},
    "adaptive": {"method": "draft_model", "model": str(DRAFT), "num_speculative_tokens": 4},
    "adaptive_ngram": {"method": "ngram", "num_speculative_tokens": 4},
    **{method: {"method": method, "model": str(path), "num_speculative_tokens": 4,
                "adaptive": False} for method, path in HEADS.items()},
    "adaptive_eagle3": {"method": "eagle3", "model": str(HEADS["eagle3"]),
                        "num_speculative_tokens": 4},
}
ADAPTIVE = ("adaptive", "adaptive_ngram", "adaptive_eagle3")
HEAD_MODES = tuple(HEADS)
TARGET_SPEEDUP = 2.0
TARGET_ADAPTIVE = 0.95
# heads on the target's features: the best of them at batch 1, greedy at least 1.8x and not
# below n-gram lookup, sampled at least 1.4x; either way at least 1.3x the draft model's
TARGET_HEAD_GREEDY, TARGET_HEAD_SAMPLED, TARGET_HEAD_OVER_DRAFT = 1.8, 1.4, 1.3
PER_FILE = 2  # prompts taken from one held-out file, at most
WARM_TOKENS = 16  # an untimed run of this many tokens per engine first
SPEC_METRICS = ("spec_acceptance_rate", "spec_mean_acceptance_length",
                "spec_tokens_per_request_step", "spec_verify_steps", "spec_draft_time_share",
                "spec_skipped_cost", "spec_skipped_no_match", "spec_skipped_in_flight")

flags.DEFINE_list("batches", ["1", "4", "16", "64"], "batch sizes (requests at once)")
flags.DEFINE_list("modes", [m for m in MODES if m != "ngram_k8" and (
    MODES[m] is None or "model" not in MODES[m] or pathlib.Path(MODES[m]["model"]).is_dir())],
                  "modes to run; none is the baseline")
flags.DEFINE_integer("prompt_tokens", 192, "tokens of each prompt")
flags.DEFINE_integer("output_tokens", 128, "tokens generated per request")
flags.DEFINE_integer("batch1_requests", 4, "requests run one at a time at batch 1")
flags.DEFINE_integer("repeats", 5, "timed rounds per batch size (the median counts)")
flags.DEFINE_float("temperature", 0.0, "sampling temperature (0: greedy)")
flags.DEFINE_enum("dtype", "bfloat16", ["float32", "bfloat16"], "weights dtype (both "
                  "models; bfloat16: the fast dots of XLA:CPU, see JAX_ON_CPU.md)")
flags.DEFINE_string("compilation_cache_dir", None, "JAX's persistent compilation cache (the "
                    "modes' engines share most programs); default: ~/.cache/jaxinfer/xla; "
                    "empty: off")
FLAGS = flags.FLAGS


def prompts(tokenizer: object, count: int) -> list[list[int]]:
    """`count` prompts from the held-out files: the `--prompt_tokens` tokens that end with
    a function's `def ...:` line (at most `PER_FILE` per file), for its body to be
    completed."""
    out = []
    for text in read_texts(corpus_files()[1]):
        taken = 0
        for match in re.finditer(r"^[ \t]*def [^\n]*:\n", text, re.MULTILINE):
            window = text[max(0, match.end() - 8 * FLAGS.prompt_tokens):match.end()]
            ids = tokenizer.encode(window, add_special_tokens=False)
            if len(ids) >= FLAGS.prompt_tokens:
                out.append(ids[-FLAGS.prompt_tokens:])
                taken += 1
            if len(out) == count:
                return out
            if taken == PER_FILE:
                break
    raise ValueError(f"the held-out files give only {len(out)} prompts of "
                     f"{FLAGS.prompt_tokens} tokens")


def make_llm(mode: str, batch: int) -> LLM:
    """The engine of a mode; `<mode>@sync` runs it without asynchronous scheduling."""
    name, _, loop = mode.partition("@")
    return LLM(DEFAULT_MODEL, max_num_seqs=batch, max_num_batched_tokens=max(512, batch),
               speculative_config=MODES[name], dtype=FLAGS.dtype,
               compilation_cache_dir=FLAGS.compilation_cache_dir,
               async_scheduling=loop != "sync")


def run_batch(batch: int, modes: list[str], workload: list[list[int]]) -> dict:
    """Every mode's engine at this batch size, their runs interleaved (mode after mode,
    `--repeats` rounds) so that a slow spell of the machine falls on all of them."""
    params = SamplingParams(max_tokens=FLAGS.output_tokens, temperature=FLAGS.temperature,
                            ignore_eos=True, seed=0 if FLAGS.temperature else None)
    prompts = workload[:FLAGS.batch1_requests if batch == 1 else batch]
    llms = {mode: make_llm(mode, batch) for mode in modes}
    warm = dataclasses.replace(params, max_tokens=WARM_TOKENS)
    for llm in llms.values():  # each bucket's first run is slower: leave it untimed
        llm.generate(prompts, warm)
    rates: dict[str, list[float]] = {mode: [] for mode in modes}
    order = random.Random(batch)
    for _ in range(FLAGS.repeats):
        for mode in order.sample(modes, len(modes)):  # a new order every round
            llm = llms[mode]
            started = time.perf_counter()
            outs = llm.generate(prompts, params)
            rates[mode].append(sum(len(o.token_ids) for o in outs)
                               / (time.perf_counter() - started))
    results = {}
    for mode, llm in llms.items():
        metrics = llm.metrics()
        results[mode] = {
            "tokens_per_s": round(statistics.median(rates[mode]), 1),
            "runs": [round(r, 1) for r in rates[mode]],
            "compiles_after_warmup": metrics["compiles_after_warmup"],
            **{k: metrics[k] for k in SPEC_METRICS if k in metrics}}
        print(batch, mode, results[mode], file=sys.stderr, flush=True)
    del llms
    gc.collect()
    return results


def main(argv: list[str]) -> None:
    del argv
    batches = [int(b) for b in FLAGS.batches]
    tokenizer = Tokenizer.from_dir(DEFAULT_MODEL)
    workload = prompts(tokenizer, max(max(batches), FLAGS.batch1_requests))
    by_batch = {batch: run_batch(batch, FLAGS.modes, workload) for batch in batches}
    if "none" in FLAGS.modes:
        for rows in by_batch.values():
            for row in rows.values():
                row["speedup"] = round(row["tokens_per_s"] / rows["none"]["tokens_per_s"], 3)
    out = {"dtype": FLAGS.dtype, "prompt_tokens": FLAGS.prompt_tokens,
           "output_tokens": FLAGS.output_tokens, "temperature": FLAGS.temperature,
           "repeats": FLAGS.repeats, "batches": by_batch}
    if "none" in FLAGS.modes:
        out["target_adaptive_met"] = {
            m: all(rows[m]["speedup"] >= TARGET_ADAPTIVE for rows in by_batch.values())
            for m in ADAPTIVE if m in FLAGS.modes}
    if "none" in FLAGS.modes and 1 in by_batch:
        others = [m for m in FLAGS.modes if m != "none"]
        best = max(others, key=lambda m: by_batch[1][m]["speedup"], default=None)
        out["best_batch1_mode"] = best
        out["target_batch1_speedup_met"] = bool(
            best and by_batch[1][best]["speedup"] >= TARGET_SPEEDUP)
        out |= head_targets(by_batch[1])
    print(json.dumps(out, indent=1))


def head_targets(rows: dict) -> dict:
    """The heads' batch-1 targets against n-gram lookup and the draft model, where run."""
    heads = [m for m in HEAD_MODES if m in rows]
    if not heads:
        return {}
    best = max(heads, key=lambda m: rows[m]["speedup"])
    speedup = rows[best]["speedup"]
    out = {"best_head_mode": best, "best_head_speedup": speedup}
    floor = TARGET_HEAD_SAMPLED if FLAGS.temperature else TARGET_HEAD_GREEDY
    out["target_head_speedup_met"] = speedup >= floor
    if "ngram" in rows and not FLAGS.temperature:
        out["target_head_not_below_ngram_met"] = speedup >= rows["ngram"]["speedup"]
    drafts = [rows[m]["speedup"] for m in ("draft_k2", "draft_k4") if m in rows]
    if drafts:
        out["head_over_draft_model"] = round(speedup / max(drafts), 3)
        out["target_head_over_draft_met"] = speedup >= TARGET_HEAD_OVER_DRAFT * max(drafts)
    out["head_ceilings"] = {m: ceilings(rows[m]) for m in heads}
    return out


def ceilings(row: dict) -> dict:
    """What bounds a head mode at batch 1, from its own run: the target's step (verify
    and host, all but the drafter's share of the time) over a plain decode step, and the
    speed-up the same acceptance would give with a drafter that cost nothing."""
    share, tokens = row["spec_draft_time_share"], row["spec_tokens_per_request_step"]
    return {"target_step_over_decode": round((1 - share) * tokens / row["speedup"], 3),
            "free_drafter_speedup": round(row["speedup"] / (1 - share), 3)}


if __name__ == "__main__":
    app.run(main)
