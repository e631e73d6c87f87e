"""The batch runner's files, without a model: the JSONL input read into requests, what the
output already holds, and the records written (results and errors), shared by runner.py
and jaxinfer/ray/. See docs/batch.md (#output, #exactly-once-and-re-runs).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
import tempfile
from typing import IO, NamedTuple

from jaxinfer.engine.request import (
    MIN_JSON_LOGPROB,
    CompletionOutput,
    RequestOutput,
    SamplingParams,
    prompt_logprobs_json,
)
from jaxinfer.engine.structured import StructuredOutputsParams, from_response_format

log = logging.getLogger(__name__)
PARAM_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))
REQUEST_FIELDS = PARAM_FIELDS | {"id", "prompt", "messages", "priority", "response_format"}


class Request(NamedTuple):
    """One readable input line not yet in the output."""

    line: int  # 1-based line number in the input file
    id: str  # the line's `id`, as a string
    record: dict  # the parsed line


class Input(NamedTuple):
    """What `read_requests` found in the input."""

    pending: list[Request]
    errors: list[dict]  # error records of the lines that cannot be read as requests
    skipped: int  # lines already in the output


class Finished(NamedTuple):
    """What the output already holds (see `finished`)."""

    ids: set[str]
    lines: set[int]  # line numbers of id-less error records
    retrying: int  # error records left out of `ids`/`lines`, to be run again


def check_paths(input_path: str | os.PathLike, output_path: str | os.PathLike | None, *,
                input_name: str = "input_path", output_name: str = "output_path") -> None:
    """Raise ValueError unless `input_path` is a readable file and `output_path` (None: not
    checked) a file that can be appended to; the names say which argument or flag."""
    source = pathlib.Path(input_path)
    if not source.exists():
        raise ValueError(f"{input_name}={str(source)!r}: no such file")
    if not source.is_file() or not os.access(source, os.R_OK):
        raise ValueError(f"{input_name}={str(source)!r} is not a readable file")
    if output_path is None:
        return
    sink = pathlib.Path(output_path)
    parent = sink.parent if str(sink.parent) else pathlib.Path(".")
    if sink.is_dir():
        raise ValueError(f"{output_name}={str(sink)!r} is a directory; give a file path "
                         "(results are appended as JSON lines)")
    if not parent.is_dir():
        raise ValueError(f"{output_name}={str(sink)!r}: the directory {str(parent)!r} does "
                         "not exist")
    if sink.exists() and not os.access(sink, os.W_OK):
        raise ValueError(f"{output_name}={str(sink)!r} is not writable")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{output_name}={str(sink)!r}: cannot write in {str(parent)!r}")


def read_requests(input_path: str | os.PathLike, done_ids: set[str] | frozenset = frozenset(),
                  done_lines: set[int] | frozenset = frozenset()) -> Input:
    """Every line of the input not in the output yet: a request per readable line, an
    error record per line that is not (not JSON, not an object, no usable `id`). Raises
    ValueError if two lines give the same id, whatever the output holds: each id must
    end up in the output once, so the file is refused before any work."""
    first_line: dict[str, int] = {}
    pending, errors, skipped = [], [], 0
    with open(input_path, encoding="utf-8") as f:
        for line_no, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            record, problem = _parse(raw, line_no)
            user_id = None if problem else str(record["id"])
            if user_id is not None and user_id in first_line:
                raise ValueError(f"{input_path}: id {user_id!r} is on line "
                                 f"{first_line[user_id]} and on line {line_no}; each id "
                                 "must be unique (the output holds one result per id)")
            if user_id is not None:
                first_line[user_id] = line_no
            if user_id in done_ids or (user_id is None and line_no in done_lines):
                skipped += 1
            elif problem:
                errors.append(error_record(line_no, None, problem))
            else:
                pending.append(Request(line_no, user_id, record))
    return Input(pending, errors, skipped)


def _parse(raw: str, line_no: int) -> tuple[dict | None, str | None]:
    """(the line's object, None), or (None, why it cannot be read as a request)."""
    try:
        record = json.loads(raw)
    except json.JSONDecodeError as e:
        return None, f"line {line_no} is not valid JSON: {e.msg} (column {e.colno})"
    if not isinstance(record, dict):
        return None, f"line {line_no} is not a JSON object"
    if "id" not in record:
        return None, "the line has no 'id'"
    if isinstance(record["id"], bool) or not isinstance(record["id"], str | int):
        return None, f"'id' must be a string or an integer, not {json.dumps(record['id'])}"
    return record, None


def request_args(record: dict, default_params: SamplingParams
                 ) -> tuple[object, list | None, SamplingParams, int]:
    """(prompt, messages, SamplingParams, priority) of one request line; fields it leaves
    out take `default_params`. Raises ValueError or TypeError naming a bad field."""
    unknown = set(record) - REQUEST_FIELDS
    if unknown:
        raise ValueError(f"unknown field(s) {sorted(unknown)}")
    if ("prompt" in record) == ("messages" in record):
        raise ValueError("give exactly one of 'prompt' or 'messages'")
    given = {k: v for k, v in record.items() if k in PARAM_FIELDS}
    if "response_format" in record:  # OpenAI's shape of a constraint
        if "structured_outputs" in record:
            raise ValueError("give at most one of 'response_format' or 'structured_outputs'")
        given["structured_outputs"] = _response_format(record["response_format"])
    params = dataclasses.replace(default_params, **given)
    return record.get("prompt"), record.get("messages"), params, record.get("priority", 0)


def _response_format(value: object) -> StructuredOutputsParams | None:
    if not isinstance(value, dict):
        raise ValueError(f"response_format must be an object, not {type(value).__name__}")
    return from_response_format(value)


def finished(path: str | os.PathLike, *, retry_errors: bool = False) -> Finished:
    """The ids and id-less line numbers already in the output; cuts a torn last line.
    With `retry_errors`, error records count as not done (`retrying` says how many);
    `drop_errors` then takes them out before new records are appended."""
    ids, lines, retrying = set(), set(), 0
    for raw in _output_lines(pathlib.Path(path)):
        record = json.loads(raw)
        if retry_errors and "error" in record:
            retrying += 1
        elif "id" in record:
            ids.add(str(record["id"]))
        else:
            lines.add(record["line"])
    return Finished(ids, lines, retrying)


def drop_errors(path: str | os.PathLike) -> int:
    """Rewrite the output without its error records (atomically: a temporary file in the
    same directory, then os.replace); returns how many were dropped."""
    path = pathlib.Path(path)
    lines = _output_lines(path)
    kept = [raw for raw in lines if "error" not in json.loads(raw)]
    dropped = len(lines) - len(kept)
    if not dropped:
        return 0
    fd, temp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.writelines(raw + "\n" for raw in kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        pathlib.Path(temp).unlink(missing_ok=True)
        raise
    return dropped


def _output_lines(path: pathlib.Path) -> list[str]:
    """The output's lines, after cutting a torn last line (a crash mid-write)."""
    if not path.exists():
        return []
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        keep = data.rfind(b"\n") + 1
        log.warning("%s: cutting a torn last line (%d bytes)", path, len(data) - keep)
        with open(path, "r+b") as f:
            f.truncate(keep)
        data = data[:keep]
    return data.decode("utf-8").splitlines()


def error_record(line: int, user_id: str | None, message: str) -> dict:
    """The record of a line that gave no result: `id` when one could be read."""
    record = {"line": line, "error": message}
    return record if user_id is None else {"id": user_id, **record}


def result_record(user_id: str, output: RequestOutput) -> dict:
    """The record of a finished request: its first completion's fields, token counts,
    every completion when `n` > 1, and prompt logprobs when asked."""
    record = {"id": user_id, **_completion(output.outputs[0]),
              "prompt_tokens": len(output.prompt_token_ids),
              "completion_tokens": sum(len(o.token_ids) for o in output.outputs)}
    if len(output.outputs) > 1:
        record["outputs"] = [_completion(o) for o in output.outputs]
    if output.prompt_logprobs is not None:
        record["prompt_logprobs"] = prompt_logprobs_json(output.prompt_logprobs)
    failed = next((o for o in output.outputs if o.finish_reason == "error"), None)
    if failed is not None:  # its output constraint failed: an error record, retried
        record["error"] = str(failed.stop_reason)
    return record


def _completion(completion: CompletionOutput) -> dict:
    """text, token ids, finish reason and, when asked, per token {str(id): logprob}."""
    out = {"text": completion.text, "token_ids": completion.token_ids,
           "finish_reason": completion.finish_reason}
    if completion.logprobs is not None:
        out["logprobs"] = [{str(t): max(lp.logprob, MIN_JSON_LOGPROB)
                            for t, lp in entry.items()} for entry in completion.logprobs]
    return out


def write(out: IO[str], record: dict) -> None:
    """One record as one JSON line, in one write call, flushed."""
    out.write(json.dumps(record, ensure_ascii=False) + "\n")
    out.flush()
