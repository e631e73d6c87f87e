"""Command line: `python -m jaxinfer <command> --flags`.

Commands: `generate` (complete a prompt; defaults to the bundled demo model),
`batch` (offline JSONL runner), `convert` (HF directory -> orbax), `plan` (the
memory plan and decode roofline), `audit` (prompt overlap: the prefill a
prefix cache would save; no weights loaded) and `aot` (compile the step for a
TPU slice with libtpu's compiler, no TPU needed; see aot.py). Engine
flags mirror `EngineConfig`. The only module that reads FLAGS and configures
logging.
"""

from __future__ import annotations

import json
import logging
import sys

from absl import app, flags

from jaxinfer.config import DEFAULT_MODEL

FLAGS = flags.FLAGS
COMMANDS = ("generate", "batch", "convert", "plan", "audit", "aot")
DEFAULT_PROMPT = "import os\n\n\ndef read_lines(path):"

flags.DEFINE_string("model", None, "model directory (HF or orbax); default: bundled demo")
flags.DEFINE_string("prompt", DEFAULT_PROMPT, "prompt text for `generate`")
flags.DEFINE_integer("max_tokens", 64, "tokens to generate (`generate`)")
flags.DEFINE_float("temperature", 0.0, "0 = greedy (`generate`)")
flags.DEFINE_integer("top_k", 0, "top-k sampling, 0 = off (`generate`)")
flags.DEFINE_float("top_p", 1.0, "top-p sampling (`generate`)")
flags.DEFINE_integer("seed", None, "sampling seed (`generate`)")
flags.DEFINE_string("input", None, "JSONL requests for `batch` and `audit`")
flags.DEFINE_string("output", None, "JSONL results for `batch`; orbax dir for `convert`")
flags.DEFINE_boolean("metrics", False, "print the engine metrics as JSON to stderr")
flags.DEFINE_float("memory_gb", None, "`plan`: memory for weights + KV cache, in GB")
flags.DEFINE_float("bandwidth_gb_per_s", None, "`plan`: memory bandwidth; default: measured")
flags.DEFINE_string("device", "v5e-1", "`aot`: TPU accelerator type (v5e-1, v6e-8, v5p-8...)")
flags.DEFINE_enum("buckets", "all", ["all", "ends"],
                  "`aot`: every bucket, or the smallest, a mixed one and the largest")
# Engine settings: EngineConfig fields.
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "weights dtype")
flags.DEFINE_enum("kv_cache_dtype", "auto", ["auto", "float32", "bfloat16"],
                  "KV pages dtype; auto = the weights' dtype")
flags.DEFINE_integer("max_num_seqs", 32, "requests in flight")
flags.DEFINE_integer("max_num_batched_tokens", 512, "tokens per step")
flags.DEFINE_integer("max_model_len", None, "longest prompt + output; default: model's")
flags.DEFINE_integer("page_size", 16, "tokens per KV page")
flags.DEFINE_integer("kv_cache_memory_bytes", None, "KV cache size; default: from limits")
flags.DEFINE_enum("scheduler", "continuous", ["continuous", "static"], "batching policy")
flags.DEFINE_boolean("strict_compile", False, "fail on any compilation after warm-up")
flags.DEFINE_string("compilation_cache_dir", None, "XLA cache; default ~/.cache/jaxinfer")
flags.DEFINE_boolean("enable_prefix_caching", True, "reuse KV pages of shared prompt prefixes")

flags.DEFINE_alias("kv_dtype", "kv_cache_dtype")

ENGINE_FLAGS = ("dtype", "kv_cache_dtype", "max_num_seqs", "max_num_batched_tokens",
                "max_model_len", "page_size", "kv_cache_memory_bytes", "scheduler",
                "strict_compile", "compilation_cache_dir", "enable_prefix_caching")


def make_llm(**defaults: object) -> object:
    """An LLM from the engine flags; `defaults` replace flags the user did not give."""
    from jaxinfer import LLM

    settings = {name: getattr(FLAGS, name) for name in ENGINE_FLAGS}
    settings |= {k: v for k, v in defaults.items() if not FLAGS[k].present}
    kwargs = {} if FLAGS.model is None else {"model": FLAGS.model}
    return LLM(**kwargs, **settings)


def generate() -> None:
    from jaxinfer import SamplingParams

    llm = make_llm(max_num_seqs=1)  # one prompt: one request slot, fewer buckets to compile
    params = SamplingParams(max_tokens=FLAGS.max_tokens, temperature=FLAGS.temperature,
                            top_k=FLAGS.top_k, top_p=FLAGS.top_p, seed=FLAGS.seed)
    (out,) = llm.generate(FLAGS.prompt, params)
    sys.stdout.write(FLAGS.prompt + out.text + "\n")
    logging.info("%d prompt tokens, %d generated, finish_reason=%s",
                 len(out.prompt_token_ids), len(out.token_ids), out.finish_reason)
    if FLAGS.metrics:
        sys.stderr.write(json.dumps(llm.metrics()) + "\n")


def batch() -> None:
    from jaxinfer import batch as batch_lib

    if not FLAGS.input or not FLAGS.output:
        raise app.UsageError("batch needs --input=IN.jsonl and --output=OUT.jsonl")
    summary = batch_lib.run(make_llm(), FLAGS.input, FLAGS.output)
    sys.stderr.write(json.dumps(summary, indent=1) + "\n")


def convert() -> None:
    from jaxinfer import checkpoint

    if not FLAGS.model or not FLAGS.output:
        raise app.UsageError("convert needs --model=HF_DIR and --output=ORBAX_DIR")
    checkpoint.convert_hf_to_orbax(FLAGS.model, FLAGS.output, FLAGS.dtype)
    sys.stdout.write(f"wrote {FLAGS.output}\n")


def plan() -> None:
    import pathlib

    from jaxinfer import checkpoint, planner
    from jaxinfer.config import load_preset
    from jaxinfer.engine import runner

    model = pathlib.Path(FLAGS.model or DEFAULT_MODEL)  # a model directory or a preset
    cfg = checkpoint.load_config(model) if model.is_dir() else load_preset(str(model))
    kv_dtype = runner.resolve_kv_dtype(FLAGS.kv_cache_dtype, FLAGS.dtype)
    budget = ({"memory_bytes": int(FLAGS.memory_gb * 1e9)} if FLAGS.memory_gb is not None
              else {"kv_cache_bytes": FLAGS.kv_cache_memory_bytes})
    if None in budget.values():
        raise app.UsageError("plan needs --memory_gb=GB or --kv_cache_memory_bytes=BYTES")
    bandwidth = FLAGS.bandwidth_gb_per_s or round(runner.measure_memory_bandwidth(), 1)
    try:
        result = planner.plan(cfg, dtype=FLAGS.dtype, kv_dtype=kv_dtype,
                              max_model_len=FLAGS.max_model_len,
                              max_num_seqs=FLAGS.max_num_seqs, page_size=FLAGS.page_size,
                              bandwidth_gb_per_s=bandwidth, **budget)
    except ValueError as err:
        raise app.UsageError(str(err)) from err
    sys.stdout.write(json.dumps(result.summary(), indent=1) + "\n")


def audit() -> None:
    from jaxinfer import audit as audit_lib

    if not FLAGS.input:
        raise app.UsageError("audit needs --input=PROMPTS.jsonl")
    report = audit_lib.run(FLAGS.model or DEFAULT_MODEL, FLAGS.input,
                           page_size=FLAGS.page_size)
    sys.stdout.write(json.dumps(report, indent=1) + "\n")


def aot() -> None:
    from jaxinfer import aot as aot_lib

    aot_lib.tpu_compile_environment()  # before anything starts a JAX backend
    import pathlib

    from jaxinfer import checkpoint
    from jaxinfer.config import load_preset

    model = pathlib.Path(FLAGS.model or DEFAULT_MODEL)  # a model directory or a preset
    cfg = checkpoint.load_config(model) if model.is_dir() else load_preset(str(model))
    kv_dtype = FLAGS.dtype if FLAGS.kv_cache_dtype == "auto" else FLAGS.kv_cache_dtype
    settings = aot_lib.Settings(
        dtype=FLAGS.dtype, kv_dtype=kv_dtype, max_num_seqs=FLAGS.max_num_seqs,
        max_num_batched_tokens=FLAGS.max_num_batched_tokens,
        max_model_len=FLAGS.max_model_len or cfg.max_position_embeddings,
        page_size=FLAGS.page_size, kv_cache_memory_bytes=FLAGS.kv_cache_memory_bytes)
    try:
        report = aot_lib.compile_report(cfg, device=FLAGS.device, settings=settings,
                                        buckets=FLAGS.buckets)
    except ValueError as err:
        raise app.UsageError(str(err)) from err
    sys.stdout.write(aot_lib.format_table(report) + "\n")
    sys.stdout.write(json.dumps(report, indent=1) + "\n")


def main(argv: list[str]) -> None:
    if len(argv) != 2 or argv[1] not in COMMANDS:
        raise app.UsageError(f"usage: python -m jaxinfer {{{'|'.join(COMMANDS)}}} --flags")
    logging.getLogger("jax").setLevel(logging.WARNING)
    {"generate": generate, "batch": batch, "convert": convert, "plan": plan,
     "audit": audit, "aot": aot}[argv[1]]()


def run() -> None:
    app.run(main)
