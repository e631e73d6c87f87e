"""The offline batch runner: JSONL requests in, JSONL results out, resumable.

Each input line is a JSON object with `id`, then `prompt` (text or token ids)
or `messages` (chat), and optional SamplingParams fields (those not given take
the checkpoint's generation_config.json defaults). A result has `text`, `token_ids`,
`finish_reason` and token counts; a line asking for `logprobs` also gets per generated
token {str(token id): logprob}, one asking for `prompt_logprobs` vLLM's list (None for
the first prompt token, then {str(token id): {"logprob", "rank", "decoded_token"}}, as
`RequestOutput.prompt_logprobs`; the engine must be made with `enable_prompt_logprobs`,
else the line is an error record); -inf is written as -9999.0. Results are appended as
JSON lines and flushed as each request finishes; a line is written with one call, and
a torn last line left by a crash is cut off on the next run. Re-running skips ids (and
id-less bad lines) already in the output, so every request ends up exactly once. A bad
line becomes an error record (`id` when one could be read, `line`, `error`) and the run
goes on.

Multi-host (distributed.py): every process reads the same input file (checked by
digest) and runs every request; only process 0 reads and writes the output file, and
hands what it skips to the others, so all schedule the same requests.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
import time

from tqdm import tqdm

from jaxinfer import distributed
from jaxinfer.api import LLM
from jaxinfer.engine.request import (
    MIN_JSON_LOGPROB,
    CompletionOutput,
    RequestOutput,
    SamplingParams,
    prompt_logprobs_json,
)

log = logging.getLogger(__name__)
PARAM_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


def run(llm: LLM, input_path: str | os.PathLike, output_path: str | os.PathLike,
        *, progress: bool = True) -> dict:
    """Run every request of `input_path` not yet in `output_path`; returns a summary.
    Multi-host: call it on every process; only process 0 touches `output_path`."""
    output_path, primary = pathlib.Path(output_path), distributed.is_primary()
    distributed.check_same("the batch input files", pathlib.Path(input_path).read_bytes())
    done_ids, done_lines = _finished_on_primary(output_path, primary)
    started, counts = time.perf_counter(), {"done": 0, "errors": 0, "skipped": 0}
    sink = output_path if primary else os.devnull  # the others run every step, write none
    with open(sink, "a", encoding="utf-8") as out:
        pending = _queue(llm, input_path, out, done_ids, done_lines, counts)
        tokens = _drive(llm, pending, out, counts, progress and primary)
    elapsed = time.perf_counter() - started
    return {**counts, **tokens, "seconds": round(elapsed, 2),
            "generated_tokens_per_s": round(tokens["completion_tokens"] / max(elapsed, 1e-9), 1),
            "engine": llm.metrics()}


def _finished_on_primary(path: pathlib.Path, primary: bool) -> tuple[set[str], set[int]]:
    """`_finished(path)` as process 0 reads it, on every process."""
    ids, lines = _finished(path) if primary else (set(), set())
    ids, lines = json.loads(distributed.broadcast_from_primary(
        json.dumps([sorted(ids), sorted(lines)])))
    return set(ids), set(lines)


def _finished(path: pathlib.Path) -> tuple[set[str], set[int]]:
    """Ids and id-less line numbers already in the output; cuts a torn last line."""
    if not path.exists():
        return set(), set()
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        keep = data.rfind(b"\n") + 1
        log.warning("%s: cutting a torn last line (%d bytes)", path, len(data) - keep)
        with open(path, "r+b") as f:
            f.truncate(keep)
        data = data[:keep]
    ids, lines = set(), set()
    for raw in data.decode("utf-8").splitlines():
        record = json.loads(raw)
        if "id" in record:
            ids.add(str(record["id"]))
        else:
            lines.add(record["line"])
    return ids, lines


def _queue(llm: LLM, input_path: str | os.PathLike, out: object, done_ids: set[str],
           done_lines: set[int], counts: dict) -> dict[str, str]:
    """Add every new valid request to the engine; returns engine id -> user id."""
    pending: dict[str, str] = {}
    with open(input_path, encoding="utf-8") as f:
        for line_no, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            user_id = _read_id(raw)
            if (user_id is not None and user_id in done_ids) or line_no in done_lines:
                counts["skipped"] += 1
                continue
            try:
                if user_id is None:
                    raise ValueError("the line has no 'id'")
                if user_id in pending.values():
                    raise ValueError(f"id {user_id!r} appears twice in the input")
                engine_id = f"batch-{line_no}"
                _add(llm, engine_id, json.loads(raw))
                pending[engine_id] = user_id
            except (ValueError, TypeError) as e:
                record = {"line": line_no, "error": str(e)}
                _write(out, record if user_id is None else {"id": user_id, **record})
                counts["errors"] += 1
    return pending


def _read_id(raw: str) -> str | None:
    try:
        record = json.loads(raw)
    except json.JSONDecodeError:
        return None
    if not isinstance(record, dict) or not isinstance(record.get("id"), str | int):
        return None
    return str(record["id"])


def _add(llm: LLM, engine_id: str, record: object) -> None:
    if not isinstance(record, dict):
        raise ValueError("the line is not a JSON object")
    unknown = set(record) - PARAM_FIELDS - {"id", "prompt", "messages", "priority"}
    if unknown:
        raise ValueError(f"unknown field(s) {sorted(unknown)}")
    if ("prompt" in record) == ("messages" in record):
        raise ValueError("give exactly one of 'prompt' or 'messages'")
    given = {k: v for k, v in record.items() if k in PARAM_FIELDS}
    params = dataclasses.replace(llm.engine.default_params, **given)
    llm.engine.add_request(engine_id, record.get("prompt"), params,
                           messages=record.get("messages"),
                           priority=record.get("priority", 0))


def _drive(llm: LLM, pending: dict[str, str], out: object, counts: dict,
           progress: bool) -> dict[str, int]:
    tokens = {"prompt_tokens": 0, "completion_tokens": 0}
    started = time.perf_counter()
    with tqdm(total=len(pending), desc="requests", disable=not progress) as bar:
        while pending:
            for output in llm.engine.step():
                if output.finished and output.request_id in pending:
                    user_id = pending.pop(output.request_id)
                    record = _result(user_id, llm.engine.release(output.request_id))
                    _write(out, record)
                    tokens["prompt_tokens"] += record["prompt_tokens"]
                    tokens["completion_tokens"] += record["completion_tokens"]
                    counts["done"] += 1
                    bar.update(1)
            rate = tokens["completion_tokens"] / max(time.perf_counter() - started, 1e-9)
            bar.set_postfix(tok_per_s=f"{rate:.0f}", refresh=False)
    return tokens


def _result(user_id: str, output: RequestOutput) -> dict:
    record = {"id": user_id, **_completion(output.outputs[0]),
              "prompt_tokens": len(output.prompt_token_ids),
              "completion_tokens": sum(len(o.token_ids) for o in output.outputs)}
    if len(output.outputs) > 1:
        record["outputs"] = [_completion(o) for o in output.outputs]
    if output.prompt_logprobs is not None:
        record["prompt_logprobs"] = prompt_logprobs_json(output.prompt_logprobs)
    return record


def _completion(completion: CompletionOutput) -> dict:
    """text, token ids, finish reason and, when asked, per token {str(id): logprob}."""
    out = {"text": completion.text, "token_ids": completion.token_ids,
           "finish_reason": completion.finish_reason}
    if completion.logprobs is not None:
        out["logprobs"] = [{str(t): max(lp.logprob, MIN_JSON_LOGPROB)
                            for t, lp in entry.items()} for entry in completion.logprobs]
    return out


def _write(out: object, record: dict) -> None:
    out.write(json.dumps(record, ensure_ascii=False) + "\n")
    out.flush()
