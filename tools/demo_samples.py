"""Sample the demo model over a grid of sampling settings, to choose the defaults its
generation_config.json carries (checkpoints/README.md records the choice).

    python tools/demo_samples.py [--model=checkpoints/demo] [--max_tokens=64] [--show=2]
        [--temperature=0.6,0.8,1.0 --top_p=0.9,0.95 --repetition_penalty=1.0,1.1] [--seeds=4]

For every setting (greedy, then temperature x top_p x repetition_penalty) it completes
the same prompts with the same seeds and prints two crude scores next to the samples:
`distinct`, the share of distinct 4-grams among the generated tokens (a loop scores
low), and `python`, the share of prompt + completion texts, cut at their last full
line, that Python's compiler accepts as complete or incomplete (not invalid) code.
The scores only sort the grid; the choice is made by reading the samples.
"""

from __future__ import annotations

import codeop
import itertools
import json
import warnings

from absl import app, flags

from jaxinfer import LLM, SamplingParams
from jaxinfer.config import DEFAULT_MODEL

FLAGS = flags.FLAGS
flags.DEFINE_string("model", str(DEFAULT_MODEL), "model directory")
flags.DEFINE_integer("max_tokens", 64, "tokens per completion")
flags.DEFINE_integer("seeds", 4, "completions per prompt and setting")
flags.DEFINE_integer("show", 2, "samples printed per setting")

# Like `make run`'s prompt, they end on the colon: the tokenizer merges a newline with
# the indentation after it, so a prompt ending in "\n" leaves the model off its tokens.
PROMPTS = ("import os\n\n\ndef read_lines(path):", "class Stack:\n    def push(self, item):",
           "def add(a, b):", "import json\n\n\ndef load(path):",
           "def parse_header(line):")
flags.DEFINE_list("temperature", ["0.6", "0.8", "1.0"], "temperatures of the grid")
flags.DEFINE_list("top_p", ["0.9", "0.95"], "top_p values of the grid")
flags.DEFINE_list("repetition_penalty", ["1.0", "1.1"], "repetition penalties of the grid")
flags.DEFINE_boolean("greedy", True, "start with greedy decoding")


def grid() -> list[dict[str, float]]:
    axes = [[float(v) for v in FLAGS[name].value]
            for name in ("temperature", "top_p", "repetition_penalty")]
    return [dict(temperature=0.0)] * FLAGS.greedy + [
        dict(temperature=t, top_p=p, repetition_penalty=r) for t, p, r in itertools.product(*axes)]


def distinct_4grams(ids: list[int]) -> float:
    grams = [tuple(ids[i:i + 4]) for i in range(len(ids) - 3)]
    return len(set(grams)) / max(len(grams), 1)


def accepted(text: str) -> bool:
    """Complete or incomplete Python up to the last full line; False if invalid."""
    text = text[:text.rfind("\n") + 1] if "\n" in text else text
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            codeop.compile_command(text, symbol="exec")
    except (SyntaxError, ValueError, OverflowError):
        return False
    return True


def main(argv: list[str]) -> None:
    del argv
    llm = LLM(FLAGS.model, max_num_seqs=8, max_num_batched_tokens=64)
    for setting in grid():
        prompts = [p for p in PROMPTS for _ in range(FLAGS.seeds)]
        params = [SamplingParams(max_tokens=FLAGS.max_tokens, seed=i, **setting)
                  for i in range(len(prompts))]
        outs = llm.generate(prompts, params)
        scores = {"distinct": sum(distinct_4grams(o.token_ids) for o in outs) / len(outs),
                  "python": sum(accepted(p + o.text) for p, o in zip(prompts, outs,
                                                                       strict=True)) / len(outs)}
        print(json.dumps({"setting": setting} | {k: round(v, 3) for k, v in scores.items()}))
        for prompt, out in list(zip(prompts, outs, strict=True))[::FLAGS.seeds][:FLAGS.show]:
            print("-" * 60 + "\n" + prompt + out.text)
        print("=" * 60, flush=True)


if __name__ == "__main__":
    app.run(main)
