"""Accuracy of quantized modes on the bundled demo model: perplexity through
`eval_ppl` (jaxinfer/evaluate.py) and greedy agreement, each against the unquantized
float32 baseline measured in the same run.

Text: the corpus's held-out files (`jaxinfer.text.corpus.corpus_files()[1]`, 100 standard
library files the demo model never trained on), sorted; `--files` keeps the first N
(default all), and `--max_tokens_per_file` (default 1020: two full 511-token windows)
scores each file's first tokens only, so one mode takes about a minute on 2 CPU cores:
99 non-empty files, ~79 k tokens scored (the run prints the exact count). Windows:
`--window` (default 511 = max_model_len - 1), overlapping by one token, BOS first.

Greedy agreement: `--prompts` (32) prompts, each the first `--prompt_tokens` (64)
tokens (BOS included) of a distinct held-out file (evenly spaced over the files long
enough), `--greedy_tokens` (32) greedy tokens each (ignore_eos). Reported per mode:
`greedy_agreement`, the fraction of positions whose token equals the baseline's (target:
90% of tokens), and `greedy_prefix_agreement`, the fraction of
tokens before the first disagreement (stricter: one flip makes every later token
count as a miss, although the continuation after it differs because its context does).

Modes: `--modes` is a comma-separated list; "baseline" is the float32 model with no
quantization, any other mode is EngineConfig settings "key=value" joined by "+", e.g.
`quantization=int8`, `quantization=w8a8+kv_cache_dtype=int8`, `kv_cache_dtype=fp8`,
`quantization=int4`: values are parsed by the field's type, so settings other helpers
add need no change here (a value EngineConfig refuses fails that mode with its error).
Each mode is a fresh LLM (the previous freed); warm-up uses JAX's persistent
compilation cache, so a repeated run skips compiling. Prints one JSON object.

    python benchmarks/eval_quant.py [--modes=baseline,quantization=int8,...]
"""

from __future__ import annotations

import gc
import json
import sys
import time
import typing

from absl import app, flags

from jaxinfer import LLM, SamplingParams, evaluate
from jaxinfer.config import DEFAULT_MODEL, EngineConfig
from jaxinfer.text import corpus

BASELINE = "baseline"
DEFAULT_MODES = [BASELINE, "quantization=int8", "quantization=w8a8", "quantization=fp8"]
# Targets: bounds on the perplexity increase over the baseline, and greedy agreement.
PPL_TARGETS = {"quantization=int8": 0.01, "quantization=w8a8": 0.01,
               "quantization=fp8": 0.02, "quantization=int4": 0.08,
               "kv_cache_dtype=int8": 0.01, "kv_cache_dtype=fp8": 0.02}
GREEDY_TARGETS = {"quantization=int8": 0.9}
ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=512, enable_prompt_logprobs=True)

flags.DEFINE_list("modes", DEFAULT_MODES, "modes: 'baseline' or EngineConfig "
                  "key=value settings joined by '+'")
flags.DEFINE_string("model", str(DEFAULT_MODEL), "model directory")
flags.DEFINE_integer("files", None, "held-out files used (the first N, sorted); "
                     "default: all")
flags.DEFINE_integer("max_tokens_per_file", 1020, "tokens scored per file (0: all)")
flags.DEFINE_integer("window", 511, "tokens per window (max_model_len - 1 at most)")
flags.DEFINE_integer("prompts", 32, "greedy prompts, each from a distinct held-out file")
flags.DEFINE_integer("prompt_tokens", 64, "tokens per greedy prompt (BOS included)")
flags.DEFINE_integer("greedy_tokens", 32, "greedy tokens generated per prompt")
FLAGS = flags.FLAGS


def parse_mode(mode: str) -> dict[str, object]:
    """EngineConfig settings of a mode: {} for the baseline, else "k=v+k=v" parsed by
    each field's type ("none" is None; bools are true/false)."""
    if mode == BASELINE:
        return {}
    hints = typing.get_type_hints(EngineConfig)
    settings: dict[str, object] = {}
    for part in mode.split("+"):
        key, sep, text = part.partition("=")
        if not sep or key not in hints:
            raise ValueError(f"mode {mode!r}: {part!r} must be key=value with key an "
                             f"EngineConfig field ({', '.join(sorted(hints))})")
        kinds = set(typing.get_args(hints[key])) or {hints[key]}
        if text.lower() == "none" and type(None) in kinds:
            settings[key] = None
        elif bool in kinds:
            if text.lower() not in ("true", "false"):
                raise ValueError(f"mode {mode!r}: {key}={text!r} must be true or false")
            settings[key] = text.lower() == "true"
        elif int in kinds:
            settings[key] = int(text)
        else:
            settings[key] = text
    return settings


def greedy_prompts(llm: LLM, files: list) -> list[list[int]]:
    """The first prompt_tokens tokens of evenly spaced distinct files long enough."""
    framed = [evaluate.frame_tokens(llm, text, FLAGS.prompt_tokens)
              for text in corpus.read_texts(files)]
    long_enough = [ids for ids in framed if len(ids) >= FLAGS.prompt_tokens]
    if len(long_enough) < FLAGS.prompts:
        raise ValueError(f"only {len(long_enough)} files have {FLAGS.prompt_tokens} tokens")
    step = len(long_enough) / FLAGS.prompts
    return [long_enough[int(i * step)][:FLAGS.prompt_tokens] for i in range(FLAGS.prompts)]


def agreement(tokens: list[list[int]], baseline: list[list[int]]) -> dict[str, float]:
    """Positional agreement and agreement up to the first difference, over all tokens."""
    total = sum(len(b) for b in baseline)
    same = sum(x == y for t, b in zip(tokens, baseline, strict=True)
               for x, y in zip(t, b, strict=True))
    prefix = 0
    for t, b in zip(tokens, baseline, strict=True):
        prefix += next((i for i, (x, y) in enumerate(zip(t, b, strict=True)) if x != y),
                       len(b))
    return {"greedy_agreement": same / total, "greedy_prefix_agreement": prefix / total}


def run_mode(mode: str, files: list) -> tuple[dict, list[list[int]]]:
    """One mode: warm-up, eval_ppl over the files, greedy tokens of the prompts."""
    settings = parse_mode(mode)
    started = time.perf_counter()
    llm = LLM(FLAGS.model, **ENGINE | settings)
    warmup = time.perf_counter() - started
    report = evaluate.perplexity(llm, files, window=FLAGS.window,
                                 max_tokens_per_file=FLAGS.max_tokens_per_file or None)
    params = SamplingParams(max_tokens=FLAGS.greedy_tokens, temperature=0.0,
                            ignore_eos=True)
    started = time.perf_counter()
    outs = llm.generate(greedy_prompts(llm, files), params)
    result = {"settings": settings, "perplexity": report["perplexity"],
              "nll": report["nll"], "tokens": report["tokens"],
              "warmup_seconds": round(warmup, 1), "eval_seconds": report["seconds"],
              "greedy_seconds": round(time.perf_counter() - started, 1),
              "compiles_after_warmup": llm.metrics()["compiles_after_warmup"],
              "files": report["files"], "windows": report["windows"]}
    tokens = [o.token_ids for o in outs]
    del llm, outs
    gc.collect()
    return result, tokens


def main(argv: list[str]) -> None:
    del argv
    modes = list(dict.fromkeys([BASELINE, *FLAGS.modes]))  # the baseline runs first
    files = corpus.corpus_files()[1][:FLAGS.files]
    results: dict[str, dict] = {}
    baseline_tokens: list[list[int]] = []
    for mode in modes:
        try:
            result, tokens = run_mode(mode, files)
        except ValueError as e:  # a mode this branch does not have yet, say
            results[mode] = {"error": str(e)}
            print(f"{mode}: {e}", file=sys.stderr)
            continue
        if mode == BASELINE:
            baseline_tokens = tokens
        base = results.get(BASELINE, result)
        result["ppl_change"] = result["perplexity"] / base["perplexity"] - 1
        result |= agreement(tokens, baseline_tokens)
        if mode in PPL_TARGETS:
            result["ppl_target"] = PPL_TARGETS[mode]
            result["meets_ppl_target"] = result["ppl_change"] <= PPL_TARGETS[mode]
        if mode in GREEDY_TARGETS:
            result["meets_greedy_target"] = result["greedy_agreement"] >= GREEDY_TARGETS[mode]
        results[mode] = result
        print(f"{mode}: ppl {result['perplexity']:.4f} ({result['ppl_change']:+.2%}), "
              f"greedy {result['greedy_agreement']:.3f}", file=sys.stderr)
    print(json.dumps({"model": FLAGS.model, "held_out_files": len(files),
                      "max_tokens_per_file": FLAGS.max_tokens_per_file,
                      "window": FLAGS.window, "prompts": FLAGS.prompts,
                      "prompt_tokens": FLAGS.prompt_tokens,
                      "greedy_tokens": FLAGS.greedy_tokens, "modes": results}, indent=1))


if __name__ == "__main__":
    app.run(main)
