"""jaxinfer's own batch format: a request line's fields as engine arguments, and the result
and error records written for it (OpenAI's batch format is in openai.py). Shared by
runner.py and jaxinfer/ray/. See docs/batch.md (#input, #output).
"""

from __future__ import annotations

import dataclasses

from jaxinfer.engine.request import (
    MIN_JSON_LOGPROB,
    CompletionOutput,
    RequestOutput,
    SamplingParams,
    prompt_logprobs_json,
)
from jaxinfer.engine.structured import StructuredOutputsParams, from_response_format

PARAM_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))
REQUEST_FIELDS = PARAM_FIELDS | {"id", "prompt", "messages", "priority", "response_format"}


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
