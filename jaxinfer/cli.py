"""Command line: `python -m jaxinfer <command> --flags`.

Commands: `generate` (complete a prompt; defaults to the bundled demo model)
and `convert` (HF directory -> orbax checkpoint). The only module that reads
FLAGS and configures logging.
"""

from __future__ import annotations

import logging
import sys

from absl import app, flags

FLAGS = flags.FLAGS
COMMANDS = ("generate", "convert")

flags.DEFINE_string("model", None, "model directory (HF or orbax); default: bundled demo")
DEFAULT_PROMPT = "import os\n\n\ndef read_lines(path):"
flags.DEFINE_string("prompt", DEFAULT_PROMPT, "prompt text for `generate`")
flags.DEFINE_integer("max_tokens", 64, "tokens to generate")
flags.DEFINE_float("temperature", 0.0, "0 = greedy")
flags.DEFINE_integer("top_k", 0, "top-k sampling (0 = off)")
flags.DEFINE_float("top_p", 1.0, "top-p sampling")
flags.DEFINE_integer("seed", None, "sampling seed")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "weights and KV dtype")
flags.DEFINE_integer("max_model_len", None, "longest prompt + output; default: model's")
flags.DEFINE_string("output", None, "output directory for `convert`")


def generate() -> None:
    from jaxinfer import LLM, SamplingParams

    kwargs = {} if FLAGS.model is None else {"model": FLAGS.model}
    llm = LLM(dtype=FLAGS.dtype, max_model_len=FLAGS.max_model_len, **kwargs)
    params = SamplingParams(max_tokens=FLAGS.max_tokens, temperature=FLAGS.temperature,
                            top_k=FLAGS.top_k, top_p=FLAGS.top_p, seed=FLAGS.seed)
    (out,) = llm.generate(FLAGS.prompt, params)
    sys.stdout.write(FLAGS.prompt + out.text + "\n")
    logging.info("%d prompt tokens, %d generated, finish_reason=%s",
                 len(out.prompt_token_ids), len(out.token_ids), out.finish_reason)


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
    {"generate": generate, "convert": convert}[argv[1]]()


def run() -> None:
    app.run(main)
