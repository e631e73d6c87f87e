"""The single-process (or multi-host) batch runner over one LLM, and `complete`, the engine
loop a Ray replica runs on its share of the requests. See docs/batch.md and, multi-host,
docs/parallelism.md#multi-host-offline-jobs.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import time
from collections.abc import Callable, Sequence

from tqdm import tqdm

from jaxinfer import distributed
from jaxinfer.api import LLM
from jaxinfer.batch import in_process, openai
from jaxinfer.batch.files import (
    OPENAI,
    Finished,
    Request,
    check_formats,
    check_paths,
    drop_errors,
    finished,
    is_error,
    read_requests,
    write,
)
from jaxinfer.batch.records import error_record, request_args, result_record
from jaxinfer.pooling.engine import PoolingEngine

log = logging.getLogger(__name__)
FAILED_LINES_EXIT = 3  # the CLI's exit code when the output holds error records


def run(llm: LLM, input_path: str | os.PathLike, output_path: str | os.PathLike,
        *, progress: bool = True, retry_errors: bool = True,
        model_name: str | None = None, lora_modules: Sequence[str] = ()) -> dict:
    """Run every request of `input_path` not yet in `output_path`; returns a summary.
    `retry_errors`: lines whose earlier run ended in an error record run again (their
    old record is dropped first); False keeps those records and skips the lines.
    `model_name`: what an OpenAI-format line's body.model must name when it gives one
    (default: the model directory's name), or one of `lora_modules` (serve's
    --lora_modules: LoRA adapters by name). Multi-host: call it on every process; only
    process 0 touches `output_path`."""
    output_path, primary = pathlib.Path(output_path), distributed.is_primary()
    check_paths(input_path, output_path if primary else None)
    distributed.check_same("the batch input files", pathlib.Path(input_path).read_bytes())
    done = _finished_on_primary(output_path, primary, retry_errors)
    requests = read_requests(input_path, done.ids, done.lines,  # duplicate ids raise here
                             urls=openai.urls_of(is_pooling(llm)))
    check_formats(input_path, done, requests)
    if lora_modules and requests.format != OPENAI:
        raise ValueError(f"lora_modules: {input_path} is in jaxinfer's format, whose lines "
                         "name no model; an adapter is chosen by an OpenAI-format line's "
                         "body.model")
    if requests.format == OPENAI and distributed.process_count() > 1:
        raise ValueError(f"{input_path} is in OpenAI's batch format, which runs on one host "
                         "(or over Ray with --ray); a multi-host batch takes jaxinfer's format")
    if primary and done.retrying:
        log.warning("retrying %d requests that ended in an error (retry_errors=False "
                    "keeps their error records)", done.retrying)
        drop_errors(output_path)
    started = time.perf_counter()
    counts = {"done": 0, "errors": 0, "kept_errors": done.kept_errors,
              "skipped": requests.skipped, "retried": done.retrying, "prompt_tokens": 0,
              "completion_tokens": 0}
    sink = output_path if primary else os.devnull  # the others run every step, write none
    with open(sink, "a", encoding="utf-8") as out:
        def record_done(record: dict) -> None:
            write(out, record)
            tally(counts, record)

        for record in requests.errors:
            record_done(record)
        complete(llm, requests.pending, record_done, progress=progress and primary,
                 model_name=model_name or pathlib.Path(llm.engine.model_dir).name,
                 lora_modules=lora_modules)
    elapsed = time.perf_counter() - started
    _log_failures(counts)
    return {**counts, "seconds": round(elapsed, 2),
            "generated_tokens_per_s": round(counts["completion_tokens"] / max(elapsed, 1e-9),
                                            1),
            "engine": engine_metrics(llm)}


def is_pooling(llm: LLM) -> bool:
    """Whether `llm` serves a pooling model (embeddings, scores: docs/pooling.md)."""
    return isinstance(llm.engine, PoolingEngine)


def engine_metrics(llm: LLM) -> dict:
    """The engine's summary for a run's report (a pooling model's: its batches, inputs
    and tokens)."""
    return llm.metrics()


def exit_code(summary: dict) -> int:
    """FAILED_LINES_EXIT when a run's output holds lines that gave no result (error records
    written or kept, or, over Ray, lines that came back with none), else 0."""
    failed = summary["errors"] + summary.get("kept_errors", 0) + summary.get("missing", 0)
    return FAILED_LINES_EXIT if failed else 0


def _log_failures(counts: dict) -> None:
    if counts["errors"] or counts["kept_errors"]:
        log.warning("%d lines ended in an error record (%d written now, %d kept); a re-run "
                    "retries them", counts["errors"] + counts["kept_errors"], counts["errors"],
                    counts["kept_errors"])


def tally(counts: dict, record: dict) -> None:
    """Count one written record (either format) into a summary's done/errors and token
    counts."""
    if is_error(record):
        counts["errors"] += 1
        return
    counts["done"] += 1
    if openai.is_line(record):
        prompt_tokens, completion_tokens = openai.token_counts(record)
    else:
        prompt_tokens, completion_tokens = record["prompt_tokens"], record["completion_tokens"]
    counts["prompt_tokens"] += prompt_tokens
    counts["completion_tokens"] += completion_tokens


def _finished_on_primary(path: pathlib.Path, primary: bool, retry_errors: bool) -> Finished:
    """`finished(path)` as process 0 reads it, on every process."""
    done = finished(path, retry_errors=retry_errors) if primary else Finished(set(), set(), 0)
    ids, lines, *rest = json.loads(distributed.broadcast_from_primary(
        json.dumps([sorted(done.ids), sorted(done.lines), *done[2:]])))
    return Finished(set(ids), set(lines), *rest)


def complete(llm: LLM, requests: Sequence[Request], on_record: Callable[[dict], None], *,
             progress: bool = False, model_name: str | None = None,
             lora_modules: Sequence[str] = ()) -> None:
    """Run `requests` on `llm`, calling `on_record` with each one's record as it finishes:
    OpenAI-format lines through the server's routes (in_process.py, `model_name` and
    `lora_modules` as there; default name: the model directory's), jaxinfer's with
    `complete_lines`."""
    if requests and openai.is_line(requests[0].record):
        in_process.complete(llm, requests, on_record, progress=progress,
                            model_name=model_name or pathlib.Path(llm.engine.model_dir).name,
                            lora_modules=lora_modules)
    elif requests and is_pooling(llm):
        for request in requests:  # jaxinfer's lines are prompts to generate from
            on_record(error_record(request.line, request.id, "this is a pooling model: "
                                   "its batch lines are OpenAI's (url /v1/embeddings, "
                                   "/v1/score, /v1/rerank, /v1/classify)"))
    else:
        complete_lines(llm, requests, on_record, progress=progress)


def complete_lines(llm: LLM, requests: Sequence[Request], on_record: Callable[[dict], None],
                   *, progress: bool = False) -> None:
    """Add every request (a line of jaxinfer's format) to the engine together, then step
    until all are done, calling `on_record` with each one's record as it finishes (an
    error record at once for a request the engine refuses: a bad field, a prompt too
    long)."""
    pending: dict[str, str] = {}  # engine request id -> user id
    for index, request in enumerate(requests):
        engine_id = f"batch-{index}"  # every request is released before this returns
        try:
            prompt, messages, params, priority = request_args(
                request.record, llm.engine.default_params)
            llm.engine.add_request(engine_id, prompt, params, messages=messages,
                                   priority=priority)
        except (ValueError, TypeError) as e:
            on_record(error_record(request.line, request.id, str(e)))
            continue
        pending[engine_id] = request.id
    generated, started = 0, time.perf_counter()
    with tqdm(total=len(pending), desc="requests", disable=not progress) as bar:
        while pending:
            for output in llm.engine.step():
                if output.finished and output.request_id in pending:
                    user_id = pending.pop(output.request_id)
                    record = result_record(user_id, llm.engine.release(output.request_id))
                    on_record(record)
                    generated += record["completion_tokens"]
                    bar.update(1)
            rate = generated / max(time.perf_counter() - started, 1e-9)
            bar.set_postfix(tok_per_s=f"{rate:.0f}", refresh=False)
