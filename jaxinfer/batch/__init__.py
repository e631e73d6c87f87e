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
a torn last line left by a crash is cut off on the next run.

Exactly once: the output holds each id once. Two input lines with the same id are
refused before any work. Re-running skips ids (and id-less bad lines) already in the
output; a bad line becomes an error record (`id` when one could be read, `line`,
`error`) and the run goes on. A re-run retries the lines that ended in an error record
(their records are dropped from the output first, atomically), unless
`retry_errors=False`, which keeps them.

records.py reads and writes the files (no model); runner.py runs them over one LLM;
jaxinfer/ray/ runs them over Ray Data replicas with the same records.
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
