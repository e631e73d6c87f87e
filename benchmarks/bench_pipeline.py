"""The batch pipeline, end to end: how far continuous batching, prefix caching,
speculative decoding and 8-bit arithmetic cut one offline job's runtime, with the
outputs unchanged.

Workload (benchmarks/pipeline_workload.py): `--num_docs` documents, each prompt one
shared preamble of about 240 tokens (a Python module header: instructions in a
docstring and three example functions; the demo models write code) plus one slice of a
held-out file of the bundled corpus (60-160 tokens, cut at line boundaries), outputs
of 32-96 tokens (greedy, `ignore_eos`: each output has exactly its drawn `max_tokens`),
all from `--seed`. Written as the batch runner's JSONL.

The run, as a user would do it: `python -m jaxinfer audit` on the file (the projected
prefill saving), then five arms, one after another, each a `python -m jaxinfer batch`
process over the same file with the same engine settings:

1. `static`: batches of `--max_num_seqs` in input order, run to completion, no prefix
   caching, no speculation (checked: the output file's finish order falls into those
   batches);
2. `continuous`: continuous batching, no prefix caching;
3. `prefix_cache`: + prefix caching (the engine's default);
4. `speculative`: + speculative decoding (`--proposer`, load-adaptive);
5. `quantized`: + `--quantization_arm` (int8 KV pages and/or w8a8 weights).

Per arm: the run's seconds (the summary's, after model load and warm-up) and the
process's (start-up apart), output tokens/s, prompt tokens computed as a share of arm
1's, acceptance, roofline fraction and MFU (engine metrics; null where the engine does
not report them), cost per 1,000 documents at `--price_per_hour`, and the factor over
arm 1. Checks: arms 2-4 give arm 1's token ids for every id; arm 5's agreement with arm
1 and its perplexity ratio (`eval_ppl` with and without its flags on held-out files);
arm 3's prefill share against audit's projection. `--pilot` instead compares the
proposers and the 8-bit modes on the workload (each arm `--pilot_rounds` times).
`--arms` runs a subset, pilot arms (`spec_ngram`, `quant_w8a8`, ...) included. Prints
one JSON object; `--chart=PATH` writes a PNG, `--markdown` prints tables for
docs/benchmarks.md to stderr. The children run with this interpreter and this checkout
first on PYTHONPATH, so a GPU machine's own JAX runs them too.

    python benchmarks/bench_pipeline.py [--num_docs=N] [--chart=pipeline.png] [--markdown]
    python benchmarks/bench_pipeline.py --pilot --num_docs=200
    PYTHONPATH=. python3 benchmarks/bench_pipeline.py --kv_cache_memory_bytes=4000000000
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import pipeline_report as report
import pipeline_workload as workload
from absl import app, flags

from jaxinfer.text.corpus import corpus_files
from jaxinfer.text.tokenizer import Tokenizer

REPO = pathlib.Path(__file__).resolve().parents[1]
QUANTIZATION_ARMS = {"kv_int8": ["--kv_cache_dtype=int8"], "w8a8": ["--quantization=w8a8"],
                     "w8a8_kv_int8": ["--quantization=w8a8", "--kv_cache_dtype=int8"]}
EVAL_MIN_BYTES = 4000  # held-out files shorter than this are not scored

flags.DEFINE_integer("num_docs", 2000, "documents in the workload (about 15 minutes for the "
                     "whole run on a 2-core CPU)")
flags.DEFINE_integer("seed", 0, "workload seed")
flags.DEFINE_string("model", str(REPO / "checkpoints" / "demo"), "target model directory")
flags.DEFINE_string("draft_model", str(REPO / "checkpoints" / "demo-draft"),
                    "draft model directory (--proposer=draft_model)")
flags.DEFINE_enum("dtype", "bfloat16", ["float32", "bfloat16"], "weights dtype")
flags.DEFINE_integer("max_num_seqs", 32, "requests in flight (arm 1: the static batch)")
flags.DEFINE_integer("max_num_batched_tokens", 512, "tokens per step")
flags.DEFINE_integer("max_model_len", workload.MAX_MODEL_LEN, "prompt + output")
flags.DEFINE_integer("kv_cache_memory_bytes", None, "KV pool of every arm; default: the "
                     "engine's sizing (on a GPU most of its memory, which left the draft "
                     "model's proposal loop no room on an H200: give a few GB there)")
flags.DEFINE_enum("proposer", "ngram", ["ngram", "draft_model"], "arms 4-5: the proposer")
flags.DEFINE_integer("num_speculative_tokens", 4, "arms 4-5: most drafts per step (k)")
flags.DEFINE_enum("quantization_arm", "kv_int8", list(QUANTIZATION_ARMS),
                  "arm 5: what is added to arm 4")
flags.DEFINE_float("price_per_hour", 1.0, "price of the machine per hour (a unit price)")
flags.DEFINE_integer("eval_files", 6, "held-out files eval_ppl scores (arm 5's accuracy)")
flags.DEFINE_integer("eval_tokens_per_file", 256, "eval_ppl's --max_tokens_per_file")
flags.DEFINE_list("arms", ["static", "continuous", "prefix_cache", "speculative", "quantized"],
                  "arms to run, in this order; the first is the baseline of every ratio")
flags.DEFINE_bool("pilot", False, "compare the proposers and the 8-bit modes instead")
flags.DEFINE_integer("pilot_rounds", 2, "--pilot: runs of each arm (the fastest counts)")
flags.DEFINE_string("workdir", None, "keep the input, outputs and logs here; default: a "
                    "temporary directory, removed")
flags.DEFINE_string("chart", None, "write a PNG chart here")
flags.DEFINE_bool("markdown", False, "print markdown tables to stderr at the end")
FLAGS = flags.FLAGS


def spec_flags(proposer: str) -> list[str]:
    config = {"method": proposer, "num_speculative_tokens": FLAGS.num_speculative_tokens}
    if proposer == "draft_model":
        config["model"] = FLAGS.draft_model
    return [f"--speculative_config={json.dumps(config)}"]


def arm_flags(name: str) -> list[str]:
    """The batch command's flags that make arm `name` (pilot arms included)."""
    no_cache = ["--enable_prefix_caching=false"]
    if name.startswith("spec_"):
        return spec_flags(name.removeprefix("spec_"))
    if name.startswith("quant_"):
        return spec_flags(FLAGS.proposer) + QUANTIZATION_ARMS[name.removeprefix("quant_")]
    return {"static": ["--scheduler=static", *no_cache], "continuous": no_cache,
            "prefix_cache": [], "speculative": spec_flags(FLAGS.proposer),
            "quantized": spec_flags(FLAGS.proposer)
            + QUANTIZATION_ARMS[FLAGS.quantization_arm]}[name]


def pool_flags() -> list[str]:
    pool = FLAGS.kv_cache_memory_bytes
    return [f"--kv_cache_memory_bytes={pool}"] if pool else []


def engine_flags() -> list[str]:
    return [f"--model={FLAGS.model}", f"--dtype={FLAGS.dtype}",
            f"--max_num_seqs={FLAGS.max_num_seqs}",
            f"--max_num_batched_tokens={FLAGS.max_num_batched_tokens}",
            f"--max_model_len={FLAGS.max_model_len}", *pool_flags()]


def child_env() -> dict[str, str]:
    """This environment with this checkout first on PYTHONPATH."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def jaxinfer(command: str, args: list[str], log: pathlib.Path) -> tuple[str, str, float]:
    """Run `python -m jaxinfer COMMAND ARGS` with this interpreter and this checkout on
    PYTHONPATH; returns stdout, stderr and the process's wall seconds."""
    argv = [sys.executable, "-m", "jaxinfer", command, *args]
    started = time.perf_counter()
    proc = subprocess.run(argv, env=child_env(), capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - started
    log.write_text(proc.stderr)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}; its stderr ends:\n"
                           f"{proc.stderr[-3000:]}")
    return proc.stdout, proc.stderr, seconds


def run_arm(name: str, input_path: pathlib.Path, workdir: pathlib.Path) -> tuple[dict, float]:
    output = workdir / f"{name}.jsonl"
    output.unlink(missing_ok=True)  # the runner resumes: a stale file would skip ids
    args = [*engine_flags(), f"--input={input_path}", f"--output={output}", "--format=json",
            *arm_flags(name)]
    _, stderr, seconds = jaxinfer("batch", args, workdir / f"{name}.log")
    summary = report.last_json_object(stderr)
    print(json.dumps({"arm": name, "seconds": summary["seconds"],
                      "process_seconds": round(seconds, 1)}), file=sys.stderr, flush=True)
    return summary, seconds


def audit(input_path: pathlib.Path, workdir: pathlib.Path) -> dict:
    stdout, _, seconds = jaxinfer("audit", [f"--model={FLAGS.model}", f"--input={input_path}",
                                            "--format=json"], workdir / "audit.log")
    result = json.loads(stdout)
    result["process_seconds"] = round(seconds, 1)
    return result


def eval_files() -> list[str]:
    files = [p for p in corpus_files()[1] if p.stat().st_size >= EVAL_MIN_BYTES]
    return [str(p) for p in files[:FLAGS.eval_files]]


def perplexity_ratio(extra: list[str], workdir: pathlib.Path) -> dict:
    """eval_ppl on held-out files with `extra` (arm 5's 8-bit flags) and without."""
    common = [f"--model={FLAGS.model}", f"--dtype={FLAGS.dtype}",
              f"--max_model_len={FLAGS.max_model_len}", f"--input={','.join(eval_files())}",
              f"--max_tokens_per_file={FLAGS.eval_tokens_per_file}", *pool_flags()]
    ppl = {}
    for name, args in (("base", common), ("quantized", common + extra)):
        stdout, _, _ = jaxinfer("eval_ppl", args, workdir / f"eval_ppl_{name}.log")
        ppl[name] = json.loads(stdout.strip().splitlines()[-1])
    return {"flags": extra, "files": ppl["base"]["files"], "tokens": ppl["base"]["tokens"],
            "ppl_base": round(ppl["base"]["perplexity"], 4),
            "ppl_quantized": round(ppl["quantized"]["perplexity"], 4),
            "ratio": round(ppl["quantized"]["perplexity"] / ppl["base"]["perplexity"], 5)}


def output_checks(names: list[str], records: list[dict], workdir: pathlib.Path) -> dict:
    """Token ids of every arm against the first arm's."""
    outputs = {n: workload.read_outputs(workdir / f"{n}.jsonl") for n in names}
    base = outputs[names[0]]
    exact = [n for n in names[1:] if n != "quantized"]
    differing = {n: workload.differing_ids(base, outputs[n]) for n in exact}
    checks = {"identical_outputs": all(not d for d in differing.values()),
              "identical_outputs_arms": [names[0], *exact],
              "differing_ids": {n: d for n, d in differing.items() if d},
              "first_differences": {n: workload.first_differences(base, outputs[n], d)
                                    for n, d in differing.items() if d}}
    if "quantized" in outputs:
        checks["quantized_agreement"] = workload.agreement(base, outputs["quantized"])
    if names[0] == "static":
        checks["static_batches_in_input_order"] = workload.static_batches_in_order(
            workdir / "static.jsonl", [r["id"] for r in records], FLAGS.max_num_seqs)
    return checks


def run_arms(names: list[str], input_path: pathlib.Path, workdir: pathlib.Path,
             rounds: int = 1) -> dict:
    """Each arm's row; with several rounds (the order reversed every other round, so a
    slow spell of a shared machine falls on different arms) its fastest run counts."""
    runs: dict[str, list[tuple[dict, float]]] = {name: [] for name in names}
    for number in range(rounds):
        for name in names if number % 2 == 0 else names[::-1]:
            runs[name].append(run_arm(name, input_path, workdir))
    rows: dict[str, dict] = {}
    for name in names:
        summary, seconds = min(runs[name], key=lambda run: run[0]["seconds"])
        rows[name] = report.arm_row(summary, seconds, num_docs=FLAGS.num_docs,
                                    price_per_hour=FLAGS.price_per_hour,
                                    base=rows[names[0]] if rows else None,
                                    previous=rows[names[len(rows) - 1]] if rows else None)
        if rounds > 1:
            rows[name]["seconds_of_rounds"] = [run[0]["seconds"] for run in runs[name]]
    return rows


def pilot(input_path: pathlib.Path, workdir: pathlib.Path) -> dict:
    """Arm 3 against each proposer, then `--proposer` with each 8-bit mode."""
    names = ["prefix_cache", "spec_ngram", "spec_draft_model",
             *(f"quant_{q}" for q in QUANTIZATION_ARMS)]
    rows = run_arms(names, input_path, workdir, FLAGS.pilot_rounds)
    best_spec = min(("spec_ngram", "spec_draft_model"), key=lambda n: rows[n]["seconds"])
    spec_arm = f"spec_{FLAGS.proposer}"
    quant = {q: round(rows[spec_arm]["seconds"] / rows[f"quant_{q}"]["seconds"], 3)
             for q in QUANTIZATION_ARMS}
    return {"arms": rows, "rounds": FLAGS.pilot_rounds,
            "best_proposer": best_spec.removeprefix("spec_"),
            "proposers_over_prefix_cache": {
                n.removeprefix("spec_"): rows[n]["factor_over_first_arm"]
                for n in ("spec_ngram", "spec_draft_model")},
            "quantization_over_proposer_arm": {"proposer": FLAGS.proposer, **quant},
            "best_quantization": max(quant, key=quant.get),
            "quantization_pays": max(quant.values()) > 1.0}


def settings() -> dict:
    return {"model": FLAGS.model, "dtype": FLAGS.dtype, "max_num_seqs": FLAGS.max_num_seqs,
            "max_num_batched_tokens": FLAGS.max_num_batched_tokens,
            "max_model_len": FLAGS.max_model_len,
            "kv_cache_memory_bytes": FLAGS.kv_cache_memory_bytes, "proposer": FLAGS.proposer,
            "num_speculative_tokens": FLAGS.num_speculative_tokens,
            "quantization_arm": FLAGS.quantization_arm,
            "arm_flags": {n: arm_flags(n) for n in FLAGS.arms}}


def benchmark(records: list[dict], input_path: pathlib.Path, workdir: pathlib.Path) -> dict:
    result = {"audit": audit(input_path, workdir)}
    rows = run_arms(FLAGS.arms, input_path, workdir)
    result["arms"] = rows
    result["checks"] = output_checks(FLAGS.arms, records, workdir)
    if "prefix_cache" in rows and rows[FLAGS.arms[0]]["prefill_tokens_cached"] == 0:
        result["checks"]["prefill_vs_audit"] = report.prefill_vs_audit(
            rows, result["audit"], "prefix_cache")
    after = [n for n in ("speculative", "quantized") if n in rows]
    result["memory_wall"] = report.memory_wall_rows(rows, FLAGS.arms[0], after)
    if "quantized" in rows:
        result["quantized_accuracy"] = perplexity_ratio(
            QUANTIZATION_ARMS[FLAGS.quantization_arm], workdir)
    factor = rows.get("speculative", {}).get("factor_over_first_arm")
    result["targets"] = {"speculative_factor_over_first_arm": factor,
                         "at_least_2": factor is not None and factor >= 2.0}
    result["notes"] = report.notes(rows, FLAGS.quantization_arm)
    return result


def machine() -> dict:
    """What ran the arms: JAX's version and first device, asked of a child process so
    that this one never holds an accelerator the arms need."""
    probe = ("import json, jax; d = jax.devices()[0]; print(json.dumps({'jax': "
             "jax.__version__, 'backend': jax.default_backend(), 'device': d.device_kind, "
             "'devices': jax.device_count()}))")
    proc = subprocess.run([sys.executable, "-c", probe], env=child_env(), capture_output=True,
                          text=True, check=False)
    found = json.loads(proc.stdout) if proc.returncode == 0 else {"error": proc.stderr[-500:]}
    return {**found, "cpu_count": os.cpu_count(), "python": sys.version.split()[0]}


def main(argv: list[str]) -> None:
    del argv
    started = time.perf_counter()
    tokenizer = Tokenizer.from_dir(FLAGS.model)
    records = workload.build(tokenizer, FLAGS.num_docs, FLAGS.seed)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = pathlib.Path(FLAGS.workdir or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        input_path = workdir / "requests.jsonl"
        workload.write_jsonl(records, input_path)
        result = {"workload": workload.shape(records), "seed": FLAGS.seed,
                  "settings": settings(), "machine": machine(),
                  "price_per_hour": FLAGS.price_per_hour,
                  "price_unit": "price units per machine-hour; cost uses the run seconds"}
        if FLAGS.pilot:
            result["pilot"] = pilot(input_path, workdir)
        else:
            result |= benchmark(records, input_path, workdir)
    result["benchmark_seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(result, indent=1))
    if FLAGS.chart and not FLAGS.pilot:
        report.chart(result, FLAGS.chart)
    if FLAGS.markdown:
        print(report.markdown(result["pilot"] if FLAGS.pilot else result), file=sys.stderr)


if __name__ == "__main__":
    app.run(main)
