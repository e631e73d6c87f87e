"""OpenAI's batch format, as OpenAI's Batch API and vLLM's run_batch read and write it: input
lines `{custom_id, method, url, body}`, output lines `{id, custom_id, response, error}`.
The line checks and the output records; each body is answered by the server's own route
(in_process.py). See docs/batch.md#openais-batch-format.
"""

from __future__ import annotations

import uuid
from typing import Any

GENERATE_URLS = ("/v1/completions", "/v1/chat/completions")  # a generating model's
# a pooling model's (docs/pooling.md#batch-jobs)
POOLING_URLS = ("/v1/embeddings", "/v1/score", "/v1/rerank", "/v1/classify")
URLS = GENERATE_URLS + POOLING_URLS  # the routes a line may name
LINE_FIELDS = ("custom_id", "method", "url", "body")


def is_line(record: dict) -> bool:
    """Whether an input line or output record is in OpenAI's batch format."""
    return "custom_id" in record


def urls_of(pooling: bool) -> tuple[str, ...]:
    """The urls a model's lines may name: a pooling model's, or a generating one's."""
    return POOLING_URLS if pooling else GENERATE_URLS


def line_error(custom_id: str, record: dict, urls: tuple[str, ...] = URLS) -> dict | None:
    """The error record of a line that cannot be sent to a route (an unknown field, a method
    other than POST, a url jaxinfer does not serve, or that `urls`, the model's, leave out;
    no body); None for a line that can."""
    unknown = sorted(set(record) - set(LINE_FIELDS))
    if unknown:
        return error_record(custom_id, "invalid_line", f"unknown field(s) {unknown}; a line "
                            "has custom_id, method, url and body")
    for field in LINE_FIELDS[1:]:
        if field not in record:
            return error_record(custom_id, "invalid_line", f"the line has no {field!r}")
    if record["method"] != "POST":
        return error_record(custom_id, "unsupported_method", f"method {record['method']!r} "
                            "is not supported: a line's method is POST")
    if record["url"] not in URLS:
        return error_record(custom_id, "unsupported_url", f"url {record['url']!r} is not "
                            f"supported: jaxinfer's batch runs {', '.join(URLS)}")
    if record["url"] not in urls:
        kind = "a pooling model" if urls == POOLING_URLS else "a model that generates text"
        return error_record(custom_id, "unsupported_url", f"url {record['url']!r} is not "
                            f"supported by this model: it is {kind}, whose lines name "
                            f"{', '.join(urls)}")
    return None


def error_record(custom_id: str, code: str, message: str) -> dict:
    """The output line of a request never sent to a route: no response, the error."""
    return {"id": _new_id("batch_req"), "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}


def response_record(custom_id: str, status: int, body: Any) -> dict:
    """The output line of a request a route answered: its status and JSON body; an answer
    other than 200 also fills `error` from the body's OpenAI error (its code, else its
    type), so `error` is null exactly when the line succeeded."""
    record = {"id": _new_id("batch_req"), "custom_id": custom_id,
              "response": {"status_code": status, "request_id": _new_id("req"), "body": body},
              "error": None}
    if status != 200:
        error = body.get("error") if isinstance(body, dict) else None
        error = error if isinstance(error, dict) else {}
        record["error"] = {"code": str(error.get("code") or error.get("type") or status),
                           "message": str(error.get("message") or f"HTTP status {status}")}
    return record


def token_counts(record: dict) -> tuple[int, int]:
    """(prompt tokens, completion tokens) of a successful record, from the body's usage."""
    usage = record["response"]["body"].get("usage") or {}
    return usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"
