"""Command line: `python -m jaxinfer <command> --flags`.

Commands: `generate` (complete a prompt; defaults to the bundled demo model),
`batch` (offline JSONL runner) and `convert` (HF directory -> orbax). Engine
flags mirror `EngineConfig`. The only module that reads FLAGS and configures
logging.
"""

from __future__ import annotations

import json
import logging
import sys

from absl import app, flags

FLAGS = flags.FLAGS
COMMANDS = ("generate", "batch", "convert")
DEFAULT_PROMPT = "import os\n\n\ndef read_lines(path):"

flags.DEFINE_string("model", None, "model directory (HF or orbax); default: bundled demo")
flags.DEFINE_string("prompt", DEFAULT_PROMPT, "prompt text for `generate`")
flags.DEFINE_integer("max_tokens", 64, "tokens to generate (`generate`)")
flags.DEFINE_float("temperature", 0.0, "0 = greedy (`generate`)")
flags.DEFINE_integer("top_k", 0, "top-k sampling, 0 = off (`generate`)")
flags.DEFINE_float("top_p", 1.0, "top-p sampling (`generate`)")
flags.DEFINE_integer("seed", None, "sampling seed (`generate`)")
flags.DEFINE_string("input", None, "JSONL requests for `batch`")
flags.DEFINE_string("output", None, "JSONL results for `batch`; orbax dir for `convert`")
flags.DEFINE_boolean("metrics", False, "print the engine metrics as JSON to stderr")
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

ENGINE_FLAGS = ("dtype", "kv_cache_dtype", "max_num_seqs", "max_num_batched_tokens",
                "max_model_len", "page_size", "kv_cache_memory_bytes", "scheduler",
                "strict_compile", "compilation_cache_dir")


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


def main(argv: list[str]) -> None:
    if len(argv) != 2 or argv[1] not in COMMANDS:
        raise app.UsageError(f"usage: python -m jaxinfer {{{'|'.join(COMMANDS)}}} --flags")
    logging.getLogger("jax").setLevel(logging.WARNING)
    {"generate": generate, "batch": batch, "convert": convert}[argv[1]]()


def run() -> None:
    app.run(main)
