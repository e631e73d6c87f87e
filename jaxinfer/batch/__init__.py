"""The offline batch runner: JSONL requests in, JSONL results out, exactly once and
resumable, in jaxinfer's format (records.py) or OpenAI's batch format (openai.py, answered
by the server's routes in-process: in_process.py). files.py reads and writes the files (no
model); runner.py runs them over one LLM; jaxinfer/ray/ runs them over Ray Data replicas
with the same records. See docs/batch.md.
"""

from __future__ import annotations

from jaxinfer.batch.files import (
    JAXINFER,
    OPENAI,
    Finished,
    Input,
    Request,
    check_formats,
    check_paths,
    detect_format,
    drop_errors,
    finished,
    is_error,
    read_requests,
    record_key,
    write,
)
from jaxinfer.batch.records import error_record, request_args, result_record
from jaxinfer.batch.runner import (
    FAILED_LINES_EXIT,
    complete,
    complete_lines,
    engine_metrics,
    exit_code,
    run,
    tally,
)

__all__ = ["FAILED_LINES_EXIT", "JAXINFER", "OPENAI", "Finished", "Input", "Request",
           "check_formats", "check_paths", "complete", "complete_lines", "detect_format",
           "drop_errors", "engine_metrics", "error_record", "exit_code", "finished", "is_error",
           "read_requests", "record_key", "request_args", "result_record", "run", "tally",
           "write"]
