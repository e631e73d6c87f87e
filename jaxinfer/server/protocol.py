"""The OpenAI request bodies we accept (pydantic, strict), their errors (`APIError`, in
OpenAI's shape) and their mapping to SamplingParams. See docs/serving.md#parameters.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Annotated, Any, Literal

import pydantic

from jaxinfer.engine.request import SamplingParams
from jaxinfer.server import structured
from jaxinfer.server.messages import (  # noqa: F401  (the request bodies' parts)
    MAX_NESTING,
    Body,
    FunctionCall,
    FunctionDefinition,
    FunctionName,
    Message,
    NamedToolChoice,
    TextPart,
    Tool,
    ToolCall,
    call_for_template,
    nests_deeper,
)

MAX_N = 64  # completions per prompt
MAX_STOP = 16  # stop strings per request


class APIError(Exception):
    """An error answered as `{"error": {"message", "type", "param", "code"}}`."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error",
             404: "not_found_error", 405: "invalid_request_error", 408: "invalid_request_error",
             413: "invalid_request_error", 429: "rate_limit_error", 500: "internal_error",
             503: "service_unavailable"}

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, retry_after: int | None = None,
                 close: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after
        self.close = close  # the connection cannot carry another request (`Connection: close`)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message,
                          "type": self.TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        headers = {} if self.retry_after is None else {"Retry-After": str(self.retry_after)}
        return headers | ({"Connection": "close"} if self.close else {})




class StreamOptions(Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage in every chunk (server/usage.py)


class _Sampling(Body):
    """Fields shared by /v1/completions and /v1/chat/completions (vLLM's extras included)."""

    model: str | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    user: str | None = None  # OpenAI's end-user tag: taken out first (server/fields.py)
    logit_bias: dict[str, float] | None = None  # token id (a JSON key) -> bias in [-100, 100]
    # an output constraint: OpenAI's, or vLLM's (json, regex, choice, grammar); checked
    # in server/structured.py, compiled by the engine
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    # vLLM's extras (docs/serving.md#parameters)
    include_stop_str_in_output: bool | None = None
    bad_words: list[str] | None = None  # words never generated (SamplingParams')
    allowed_token_ids: list[int] | None = None  # the only token ids that may be
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    truncate_prompt_tokens: int | None = None
    priority: int = 0  # lower runs first


TokenIds = Annotated[list[int], pydantic.Field(min_length=1)]


class CompletionRequest(_Sampling):
    prompt: str | TokenIds | list[str] | list[TokenIds]
    max_tokens: int | None = 16  # OpenAI's default for completions; 0 only with echo
    logprobs: int | None = None
    echo: bool = False  # the prompt leads the text (and logprobs: its scores, see below)
    prompt_logprobs: int | None = None  # vLLM's extra: top-k per prompt token


class ChatRequest(_Sampling):
    messages: Annotated[list[Message], pydantic.Field(min_length=1)]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    prompt_logprobs: int | None = None  # vLLM's extra; returned beside `choices`
    continue_final_message: bool = False  # vLLM's: go on writing the last message
    echo: bool = False  # vLLM's: the reply starts with the last message if it is the reply's
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: template variables
    reasoning_effort: Literal["low", "medium", "high"] | None = None  # to the template
    tools: list[Tool] | None = None  # server/tools.py
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None


def echo_only(body: CompletionRequest | ChatRequest) -> bool:
    """`echo` with `max_tokens=0`: the prompt scored, nothing generated (vLLM runs one
    token and drops it; so does the server)."""
    return isinstance(body, CompletionRequest) and body.echo and body.max_tokens == 0


def prompt_logprobs(body: CompletionRequest | ChatRequest) -> int | None:
    """The top-k the prompt is scored with: `prompt_logprobs`, else `logprobs` under
    `echo` (vLLM's rule: echoed logprobs cover the prompt), else None (not scored)."""
    if isinstance(body, CompletionRequest) and body.prompt_logprobs is None and body.echo:
        return body.logprobs
    return body.prompt_logprobs


def check_scoring(body: CompletionRequest | ChatRequest, params: SamplingParams, *,
                  enabled: bool) -> None:
    """400 for a request that scores its prompt on a server started without
    --enable_prompt_logprobs, or for chat's prompt_logprobs with stream=true (refused, as
    vLLM does; completions stream them in each choice's first chunk)."""
    if params.prompt_logprobs is None:
        return
    asked = body.prompt_logprobs is not None
    field, what = ("prompt_logprobs", "prompt_logprobs") if asked else (
        "echo", "echo with logprobs (it scores the prompt)")
    if not enabled:
        raise APIError(400, f"{what} needs a server started with --enable_prompt_logprobs "
                       "(it compiles the prompt-scoring steps at warm-up); this one was not",
                       param=field, code="prompt_logprobs_disabled")
    if isinstance(body, ChatRequest) and body.stream:
        raise APIError(400, "prompt_logprobs are not available with stream=true in chat",
                       param=field)


def _field_names() -> frozenset[str]:
    """Every field name of every body model (Body's subclasses, /tokenize's too): a location
    part that is none of them names a union member."""
    names, todo = set(), [Body]
    while todo:
        model = todo.pop()
        names.update(model.model_fields)
        todo += model.__subclasses__()
    return frozenset(names)


def parse_json(raw: bytes) -> Any:
    """The body's JSON; invalid UTF-8, NaN/Infinity, malformed JSON and JSON nested more
    than MAX_NESTING levels are 400s."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"the request body is not valid UTF-8: {e}") from None
    try:
        data = json.loads(text, parse_constant=_refuse_constant)
    except RecursionError:  # the decoder's own limit, ~1,000 levels
        raise APIError(400, f"the request body nests more than {MAX_NESTING} levels "
                       "deep") from None
    except (json.JSONDecodeError, ValueError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    _check_nesting(data)
    return data


def _check_nesting(data: Any) -> None:
    """400 for a field nested deeper than MAX_NESTING levels (counting the body's): what
    reads the body after pydantic (the chat template, the constraint compiler) recurses."""
    if not isinstance(data, dict):
        return
    for key, value in data.items():
        if nests_deeper(value, MAX_NESTING - 1):
            field = shortened(key)
            raise APIError(400, f"{field}: the request body nests more than {MAX_NESTING} "
                           "levels deep here", param=field)


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


def validate(model: type[Body], data: Any) -> Any:
    """`data` as a `model`, or a 400 naming the first bad field."""
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, not {_kind(data)}")
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as e:
        errors = e.errors(include_url=False)
        error = errors[0]
        if error["type"] == "extra_forbidden":
            field = shortened(".".join(str(p) for p in error["loc"]))
            raise APIError(400, f"{field}: unknown or unsupported parameter",
                           param=field) from None
        loc, tag = _split_union(error["loc"])
        field = shortened(".".join(str(p) for p in loc)) or None
        message = error["msg"] if tag is None else _union_message(loc, errors)
        raise APIError(400, f"{field}: {message}" if field else message, param=field) from None


def shortened(text: str, limit: int = 80) -> str:
    """`text` as an error may echo it: at most `limit` characters (a client's field name or
    path can be megabytes)."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _split_union(loc: tuple) -> tuple[tuple, str | None]:
    """An error location up to the first union member pydantic names in it (`prompt.str`,
    `messages.0.content.list[TextPart]`), and that member (None: no union on the way)."""
    fields = _field_names()
    for i, part in enumerate(loc):
        if isinstance(part, str) and part not in fields:
            return loc[:i], part
    return loc, None


def _union_message(loc: tuple, errors: list[dict[str, Any]]) -> str:
    """What each alternative of the union at `loc` wanted (its first error)."""
    said: dict[str, str] = {}
    for error in errors:
        if error["loc"][:len(loc)] != loc or len(error["loc"]) == len(loc):
            continue
        tag, rest = error["loc"][len(loc)], error["loc"][len(loc) + 1:]
        where = f" at {'.'.join(map(str, rest))}" if rest else ""
        said.setdefault(str(tag), f"as {tag}{where}: {error['msg']}")
    return "matches none of the accepted types (" + "; ".join(said.values()) + ")"


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def sampling_params(body: _Sampling, defaults: SamplingParams) -> SamplingParams:
    """The body's sampling fields over `defaults` (the checkpoint's generation_config)."""
    if not 1 <= body.n <= MAX_N:
        raise APIError(400, f"n={body.n} must be in [1, {MAX_N}]", param="n")
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > MAX_STOP:
        raise APIError(400, f"at most {MAX_STOP} stop strings", param="stop")
    given = {"n": body.n, "stop": tuple(stop),
             "stop_token_ids": tuple(body.stop_token_ids or ()), "logit_bias": body.logit_bias}
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                 "frequency_penalty", "repetition_penalty", "seed", "ignore_eos",
                 "min_tokens", "include_stop_str_in_output", "skip_special_tokens",
                 "spaces_between_special_tokens", "truncate_prompt_tokens", "bad_words",
                 "allowed_token_ids"):
        value = getattr(body, name)
        if value is not None:
            given[name] = value
    names = {}
    if isinstance(body, ChatRequest):
        given |= _chat_limits(body, names)
    else:
        if body.max_tokens == 0 and not body.echo:
            raise APIError(400, "max_tokens=0 must be >= 1 (0 only with echo=true: the "
                           "prompt alone, scored)", param="max_tokens")
        given["max_tokens"] = 1 if echo_only(body) else body.max_tokens
        given["logprobs"] = body.logprobs
    given["prompt_logprobs"] = prompt_logprobs(body)
    try:
        given["structured_outputs"] = structured.constraint(body)
    except structured.FieldError as e:
        raise APIError(400, str(e), param=e.param) from None
    if body.prompt_logprobs is None and given["prompt_logprobs"] is not None:
        names["prompt_logprobs"] = "logprobs"  # under echo
    return _build(defaults, given, names)


def _chat_limits(body: ChatRequest, names: dict[str, str]) -> dict[str, Any]:
    limit = body.max_completion_tokens
    out: dict[str, Any] = {"max_tokens": body.max_tokens if limit is None else limit}
    if body.max_completion_tokens is not None:
        names["max_tokens"] = "max_completion_tokens"
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    out["logprobs"] = (body.top_logprobs or 0) if body.logprobs else None
    names["logprobs"] = "top_logprobs"
    return out


def _build(defaults: SamplingParams, given: dict[str, Any],
           names: dict[str, str]) -> SamplingParams:
    """SamplingParams; `max_tokens=None` ("as many as the context leaves", see
    `MaxTokens`) holds a stand-in until `fit_max_tokens` knows the prompt's length."""
    if given.get("max_tokens") is None:
        given["max_tokens"] = max(given.get("min_tokens", defaults.min_tokens), 1)
    try:
        return dataclasses.replace(defaults, **given)
    except ValueError as e:
        field = error_field(e) or ""
        raise APIError(400, str(e).replace(field, names.get(field, field), 1),
                       param=names.get(field, field) or None) from None


def error_field(error: Exception) -> str | None:
    """The SamplingParams field a ValueError opens with (`top_k=...`, `min_tokens with
    20 stop ids`), None when it names none: SamplingParams and the engine word their
    errors so."""
    head = re.match(r"\w*", str(error)).group()
    return head if head in SamplingParams.__dataclass_fields__ else None


@dataclasses.dataclass(frozen=True)
class MaxTokens:
    """A request's output limit and the field that gave it; `value` None: as many tokens
    as the context leaves after the prompt (chat's default, as OpenAI's)."""

    value: int | None
    field: str = "max_tokens"


def max_tokens(body: CompletionRequest | ChatRequest) -> MaxTokens:
    if isinstance(body, ChatRequest) and body.max_completion_tokens is not None:
        return MaxTokens(body.max_completion_tokens, "max_completion_tokens")
    return MaxTokens(body.max_tokens)


def fit_max_tokens(params: SamplingParams, prompt_len: int, max_model_len: int,
                   limit: MaxTokens) -> SamplingParams:
    """Resolve a limit of None to the room left; refuse prompt + limit over the context."""
    room = max_model_len - prompt_len
    if limit.value is None:
        return dataclasses.replace(params, max_tokens=room,
                                   min_tokens=min(params.min_tokens, room))
    if params.max_tokens > room:
        raise APIError(400, f"this model's maximum context length is {max_model_len} "
                       f"tokens; the prompt has {prompt_len} and {limit.field}="
                       f"{params.max_tokens} asks for more than the {room} left",
                       param=limit.field)
    return params


def finite(value: float) -> float:
    """A logprob as JSON can carry it: -inf becomes -9999.0 (as vLLM sends it)."""
    return value if math.isfinite(value) else -9999.0
