"""The batch runner's files, without a model: which format the input is in, its lines read
into requests, what the output already holds (done, torn, errors) and each record written.
Both formats share it: jaxinfer's (records.py) and OpenAI's batch format (openai.py).
See docs/batch.md (#input, #exactly-once-and-re-runs, #openais-batch-format).
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import tempfile
from typing import IO, NamedTuple

from jaxinfer.batch import openai
from jaxinfer.batch.records import error_record

log = logging.getLogger(__name__)
JAXINFER, OPENAI = "jaxinfer", "openai"  # the two formats of a file


class Request(NamedTuple):
    """One readable input line not yet in the output."""

    line: int  # 1-based line number in the input file
    id: str  # the line's `id` (as a string) or, in OpenAI's format, its `custom_id`
    record: dict  # the parsed line


class Input(NamedTuple):
    """What `read_requests` found in the input."""

    pending: list[Request]
    errors: list[dict]  # error records of the lines that cannot be run
    skipped: int  # lines already in the output
    format: str = JAXINFER  # JAXINFER or OPENAI: the format of the file and of its records


class Finished(NamedTuple):
    """What the output already holds (see `finished`)."""

    ids: set[str]
    lines: set[int]  # line numbers of id-less error records
    retrying: int  # error records left out of `ids`/`lines`, to be run again
    kept_errors: int = 0  # error records kept (counted as done): retry_errors=False
    format: str | None = None  # the format of its records; None: empty


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


def detect_format(input_path: str | os.PathLike) -> str:
    """OPENAI when the file's first line that is a JSON object has a `custom_id`, else
    JAXINFER. One format a file: its output then holds records of one schema."""
    with open(input_path, encoding="utf-8") as f:
        for raw in f:
            try:
                record = json.loads(raw)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict):
                return OPENAI if openai.is_line(record) else JAXINFER
    return JAXINFER


def read_requests(input_path: str | os.PathLike, done_ids: set[str] | frozenset = frozenset(),
                  done_lines: set[int] | frozenset = frozenset(), *,
                  urls: tuple[str, ...] = openai.URLS) -> Input:
    """Every line of the input not in the output yet: a request per line that can run, an
    error record per line that cannot. Raises ValueError if two lines give the same id,
    whatever the output holds: each id must end up in the output once, so the file is
    refused before any work. In OpenAI's format a line with no readable custom_id is
    refused too (its output line would have none); `urls`: the routes the model serves
    (openai.urls_of), any other url an error line."""
    file_format = detect_format(input_path)
    first_line: dict[str, int] = {}
    pending, errors, skipped = [], [], 0
    with open(input_path, encoding="utf-8") as f:
        for line_no, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            record, problem = _parse(raw, line_no)
            if file_format == OPENAI:
                user_id = _custom_id(input_path, line_no, record, problem)
                error = openai.line_error(user_id, record, urls)
            else:
                user_id, problem = _id(record, problem)
                error = None if problem is None else error_record(line_no, None, problem)
            _check_unique(input_path, file_format, first_line, user_id, line_no)
            if user_id in done_ids or (user_id is None and line_no in done_lines):
                skipped += 1
            elif error is not None:
                errors.append(error)
            else:
                pending.append(Request(line_no, user_id, record))
    return Input(pending, errors, skipped, file_format)


def _check_unique(input_path: str | os.PathLike, file_format: str,
                  first_line: dict[str, int], user_id: str | None, line_no: int) -> None:
    if user_id is None:
        return
    if user_id in first_line:
        name = "custom_id" if file_format == OPENAI else "id"
        raise ValueError(f"{input_path}: {name} {user_id!r} is on line {first_line[user_id]} "
                         f"and on line {line_no}; each {name} must be unique (the output "
                         "holds one result per id)")
    first_line[user_id] = line_no


def _parse(raw: str, line_no: int) -> tuple[dict | None, str | None]:
    """(the line's object, None), or (None, why it is not a JSON object)."""
    try:
        record = json.loads(raw)
    except json.JSONDecodeError as e:
        return None, f"line {line_no} is not valid JSON: {e.msg} (column {e.colno})"
    if not isinstance(record, dict):
        return None, f"line {line_no} is not a JSON object"
    return record, None


def _id(record: dict | None, problem: str | None) -> tuple[str | None, str | None]:
    """A jaxinfer line's id as a string, or (None, why it has no usable one)."""
    if problem is not None:
        return None, problem
    if "id" not in record:
        hint = (" (a custom_id is OpenAI's batch format, which this file's first line is "
                "not in)") if openai.is_line(record) else ""
        return None, f"the line has no 'id'{hint}"
    if isinstance(record["id"], bool) or not isinstance(record["id"], str | int):
        return None, f"'id' must be a string or an integer, not {json.dumps(record['id'])}"
    return str(record["id"]), None


def _custom_id(input_path: str | os.PathLike, line_no: int, record: dict | None,
               problem: str | None) -> str:
    """An OpenAI line's custom_id; ValueError for a line that has none to key its output by."""
    if problem is None and not openai.is_line(record):
        problem = f"line {line_no} has no 'custom_id'"
    elif problem is None and not isinstance(record["custom_id"], str):
        problem = (f"line {line_no}: 'custom_id' must be a string, not "
                   f"{json.dumps(record['custom_id'])}")
    if problem is not None:
        raise ValueError(f"{input_path}: {problem}; the file is in OpenAI's batch format (its "
                         "first line has a custom_id), where every line is a JSON object "
                         "with a unique string custom_id, which its output line carries")
    return record["custom_id"]


def record_key(record: dict) -> str | None:
    """The id an output record answers: its `custom_id` (OpenAI's format) or `id`; None for
    an id-less error record (its `line` says which)."""
    if openai.is_line(record):
        return record["custom_id"]
    return None if "id" not in record else str(record["id"])


def is_error(record: dict) -> bool:
    """Whether an output record (either format) says its line failed."""
    return record.get("error") is not None


def record_format(record: dict) -> str:
    return OPENAI if openai.is_line(record) else JAXINFER


def finished(path: str | os.PathLike, *, retry_errors: bool = False) -> Finished:
    """The ids and id-less line numbers already in the output; cuts a torn last line.
    With `retry_errors`, error records count as not done (`retrying` says how many);
    `drop_errors` then takes them out before new records are appended."""
    ids, lines, retrying, kept, formats = set(), set(), 0, 0, set()
    for raw in _output_lines(pathlib.Path(path)):
        record = json.loads(raw)
        formats.add(record_format(record))
        if retry_errors and is_error(record):
            retrying += 1
            continue
        kept += is_error(record)
        key = record_key(record)
        if key is not None:
            ids.add(key)
        else:
            lines.add(record["line"])
    if len(formats) > 1:
        raise ValueError(f"{path} holds records of both jaxinfer's format and OpenAI's "
                         "batch format; give an output file of one format")
    return Finished(ids, lines, retrying, kept, next(iter(formats), None))


def check_formats(input_path: str | os.PathLike, done: Finished, requests: Input) -> None:
    """Refuse to append one format's records to an output of the other format."""
    if done.format is not None and done.format != requests.format:
        raise ValueError(f"{input_path} is in {_FORMAT_NAMES[requests.format]}, but the "
                         f"output already holds records of {_FORMAT_NAMES[done.format]}: "
                         "give another output file")


_FORMAT_NAMES = {JAXINFER: "jaxinfer's format", OPENAI: "OpenAI's batch format"}


def drop_errors(path: str | os.PathLike) -> int:
    """Rewrite the output without its error records (atomically: a temporary file in the
    same directory, then os.replace); returns how many were dropped."""
    path = pathlib.Path(path)
    lines = _output_lines(path)
    kept = [raw for raw in lines if not is_error(json.loads(raw))]
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


def write(out: IO[str], record: dict) -> None:
    """One record as one JSON line, in one write call, flushed."""
    out.write(json.dumps(record, ensure_ascii=False) + "\n")
    out.flush()
