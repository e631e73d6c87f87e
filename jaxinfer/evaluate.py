"""Perplexity through prompt logprobs: `perplexity(llm, files)`, the body of
`python -m jaxinfer eval_ppl`, callable in-process by benchmarks and tests. How text is
framed, windowed and scored: docs/cli.md#eval_ppl.
"""

from __future__ import annotations

import dataclasses
import glob
import math
import pathlib
import time
from collections.abc import Sequence

from jaxinfer.api import LLM
from jaxinfer.engine.request import RequestOutput, SamplingParams

SCORE_PARAMS = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
REQUESTS_PER_CALL = 256  # windows given to one `generate` call (bounds host memory)


def expand_inputs(spec: str | Sequence[str]) -> list[pathlib.Path]:
    """The files named by comma-separated paths or glob patterns (or a list of them), in
    the order given, globs sorted, duplicates dropped. FileNotFoundError for a path that
    does not exist or a pattern that matches no file."""
    parts = spec.split(",") if isinstance(spec, str) else list(spec)
    parts = [str(p).strip() for p in parts if str(p).strip()]
    if not parts:
        raise ValueError("no input files given (--input=FILE[,FILE...] or a glob)")
    files: dict[pathlib.Path, None] = {}
    for part in parts:
        if glob.has_magic(part):
            matched = sorted(pathlib.Path(p) for p in glob.glob(part, recursive=True))
            matched = [p for p in matched if p.is_file()]
            if not matched:
                raise FileNotFoundError(f"input pattern {part!r} matches no file")
        else:
            path = pathlib.Path(part)
            if not path.is_file():
                raise FileNotFoundError(f"input file {part!r} does not exist")
            matched = [path]
        files.update(dict.fromkeys(matched))
    return list(files)


def frame_tokens(llm: LLM, text: str, max_tokens: int | None = None) -> list[int]:
    """BOS, the text's tokens, EOS; with `max_tokens`, only the first that many of the
    text's tokens, and no EOS after a text cut short."""
    tokenizer = llm.tokenizer
    if tokenizer is None:
        raise ValueError("eval_ppl needs a tokenizer (skip_tokenizer_init=False)")
    ids = tokenizer.encode(text, add_special_tokens=False)
    eos = min(tokenizer.eos_token_ids) if tokenizer.eos_token_ids else None
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else eos
    if max_tokens is not None and len(ids) > max_tokens:
        ids, eos = ids[:max_tokens], None
    return ([bos] if bos is not None else []) + ids + ([eos] if eos is not None else [])


def windows(tokens: Sequence[int], window: int) -> list[list[int]]:
    """Windows of at most `window` tokens overlapping by one: each token after the first
    is scored once (position p of a window scores its token p + 1)."""
    if window < 2:
        raise ValueError(f"window={window} must be >= 2")
    out = []
    for start in range(0, max(len(tokens) - 1, 1), window - 1):
        out.append(list(tokens[start:start + window]))
    return [w for w in out if len(w) >= 2]


@dataclasses.dataclass
class _Tally:
    tokens: int = 0
    nll: float = 0.0  # summed, nats


def window_nll(out: RequestOutput) -> tuple[int, float]:
    """(tokens scored, summed negative log-likelihood) of one window's output."""
    prompt = out.prompt_token_ids
    if out.prompt_logprobs is None:
        raise RuntimeError(f"{out.request_id}: no prompt logprobs came back")
    total = 0.0
    for token, entry in zip(prompt[1:], out.prompt_logprobs[1:], strict=True):
        total -= entry[token].logprob
    return len(prompt) - 1, total


def resolve_window(llm: LLM, window: int | None) -> int:
    """`window`, or the default max_model_len - 1; ValueError outside [2, that]."""
    limit = llm.max_model_len - 1
    window = limit if window is None else window
    if not 2 <= window <= limit:
        raise ValueError(f"window={window} must be in [2, {limit}] (max_model_len "
                         f"{llm.max_model_len} - 1: each window also generates one token)")
    return window


def perplexity(llm: LLM, files: str | Sequence[str | pathlib.Path], *,
               window: int | None = None, max_tokens_per_file: int | None = None) -> dict:
    """Score `files` (paths, or a spec for `expand_inputs`) through prompt logprobs;
    returns {"tokens", "nll", "perplexity", "files", ...} (docs/cli.md#eval_ppl).
    `max_tokens_per_file`: score only each file's first tokens (a deterministic subset).
    The LLM must be made with `enable_prompt_logprobs=True`."""
    paths = expand_inputs(files if isinstance(files, str) else [str(f) for f in files])
    window = resolve_window(llm, window)
    if max_tokens_per_file is not None and max_tokens_per_file < 1:
        raise ValueError(f"max_tokens_per_file={max_tokens_per_file} must be >= 1")
    prompts, skipped = [], 0
    for path in paths:
        text = path.read_text(encoding="utf-8", errors="replace")
        if not text:
            skipped += 1
            continue
        prompts += windows(frame_tokens(llm, text, max_tokens_per_file), window)
    if not prompts:
        raise ValueError(f"the {len(paths)} input file(s) hold no text to score")
    started, tally = time.perf_counter(), _Tally()
    for begin in range(0, len(prompts), REQUESTS_PER_CALL):
        for out in llm.generate(prompts[begin:begin + REQUESTS_PER_CALL], SCORE_PARAMS,
                                use_tqdm=False):
            tokens, nll = window_nll(out)
            tally.tokens += tokens
            tally.nll += nll
    seconds = time.perf_counter() - started
    mean = tally.nll / tally.tokens
    config = llm.engine.config
    return {"tokens": tally.tokens, "nll": mean, "perplexity": math.exp(mean),
            "files": len(paths) - skipped, "empty_files_skipped": skipped,
            "windows": len(prompts), "window": window,
            "max_tokens_per_file": max_tokens_per_file, "seconds": round(seconds, 2),
            "tokens_per_second": round(tally.tokens / seconds, 1),
            "settings": {"model": str(llm.engine.model_dir), "dtype": config.dtype,
                         "kv_cache_dtype": config.kv_cache_dtype,
                         "quantization": config.quantization,
                         "max_model_len": llm.max_model_len,
                         "max_num_batched_tokens": config.max_num_batched_tokens,
                         "max_num_seqs": config.max_num_seqs}}
