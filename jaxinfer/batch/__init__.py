"""The offline batch runner: JSONL requests in, JSONL results out, exactly once and
resumable. records.py reads and writes the files (no model); runner.py runs them over
one LLM; jaxinfer/ray/ runs them over Ray Data replicas with the same records.
See docs/batch.md.
"""

from __future__ import annotations

from jaxinfer.batch.records import (
    Finished,
    Input,
    Request,
    check_paths,
    drop_errors,
    error_record,
    finished,
    read_requests,
    request_args,
    result_record,
    write,
)
from jaxinfer.batch.runner import complete, run, tally

__all__ = ["Finished", "Input", "Request", "check_paths", "complete", "drop_errors",
           "error_record", "finished", "read_requests", "request_args", "result_record",
           "run", "tally", "write"]
