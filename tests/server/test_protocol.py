"""Request bodies to SamplingParams without a server: defaults from the checkpoint,
chat's limits and logprobs names, echo and prompt logprobs, the context check, errors
naming the field."""

from __future__ import annotations

import pytest

from jaxinfer.engine.request import SamplingParams
from jaxinfer.server import protocol
from jaxinfer.server.protocol import APIError, ChatRequest, CompletionRequest

DEFAULTS = SamplingParams(temperature=0.6, top_p=0.95, repetition_penalty=1.1)
MESSAGES = [{"role": "user", "content": "hi"}]


def _params(model, **body):
    return protocol.sampling_params(protocol.validate(model, body), DEFAULTS)


def test_fields_not_given_keep_the_checkpoint_defaults():
    params = _params(CompletionRequest, prompt="x", temperature=0, n=2, stop="\n")
    assert (params.temperature, params.top_p, params.repetition_penalty) == (0, 0.95, 1.1)
    assert (params.n, params.stop, params.max_tokens) == (2, ("\n",), 16)


def test_chat_limits_and_logprobs():
    params = _params(ChatRequest, messages=MESSAGES, max_completion_tokens=5, max_tokens=9,
                     logprobs=True, top_logprobs=3)
    assert (params.max_tokens, params.logprobs) == (5, 3)
    assert _params(ChatRequest, messages=MESSAGES).logprobs is None
    body = protocol.validate(ChatRequest, {"messages": MESSAGES, "min_tokens": 600})
    limit = protocol.max_tokens(body)
    unbounded = protocol.sampling_params(body, DEFAULTS)
    fitted = protocol.fit_max_tokens(unbounded, 10, 512, limit)
    assert (limit.value, fitted.max_tokens, fitted.min_tokens) == (None, 502, 502)
    explicit = protocol.validate(ChatRequest, {"messages": MESSAGES, "max_tokens": 2**31 - 1})
    with pytest.raises(APIError, match="max_tokens=2147483647 asks for more than the 502"):
        protocol.fit_max_tokens(protocol.sampling_params(explicit, DEFAULTS), 10, 512,
                                protocol.max_tokens(explicit))


def test_echo_and_prompt_logprobs():
    body = protocol.validate(CompletionRequest, {"prompt": "x", "echo": True, "logprobs": 2,
                                                 "max_tokens": 0})
    params = protocol.sampling_params(body, DEFAULTS)  # one token, generated and dropped
    assert protocol.echo_only(body) and (params.max_tokens, params.logprobs,
                                         params.prompt_logprobs) == (1, 2, 2)
    assert _params(CompletionRequest, prompt="x", echo=True).prompt_logprobs is None
    assert _params(CompletionRequest, prompt="x", echo=True, logprobs=3,
                   prompt_logprobs=0).prompt_logprobs == 0
    assert _params(ChatRequest, messages=MESSAGES, prompt_logprobs=4).prompt_logprobs == 4
    with pytest.raises(APIError, match="needs a server started with --enable_prompt_log"):
        protocol.check_scoring(body, params, enabled=False)
    protocol.check_scoring(body, params, enabled=True)
    chat = protocol.validate(ChatRequest, {"messages": MESSAGES, "prompt_logprobs": 1,
                                           "stream": True})
    with pytest.raises(APIError, match="not available with stream=true") as caught:
        protocol.check_scoring(chat, protocol.sampling_params(chat, DEFAULTS), enabled=True)
    assert caught.value.param == "prompt_logprobs"


@pytest.mark.parametrize("model, body, param", [
    (CompletionRequest, {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    (CompletionRequest, {"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    (CompletionRequest, {"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs"),
    (CompletionRequest, {"prompt": "x", "echo": 1}, "echo"),
    (ChatRequest, {"messages": MESSAGES, "prompt_logprobs": 21}, "prompt_logprobs"),
    (ChatRequest, {"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
    (ChatRequest, {"messages": MESSAGES, "logprobs": True, "top_logprobs": 21},
     "top_logprobs"),
    (ChatRequest, {"messages": MESSAGES, "max_completion_tokens": 0}, "max_completion_tokens"),
    (CompletionRequest, {"prompt": "x", "top_p": 1.5}, "top_p"),
    (CompletionRequest, {"prompt": "x", "n": 65}, "n"),
    (CompletionRequest, {"prompt": "x", "max_tokens": "5"}, "max_tokens"),
    (CompletionRequest, {"prompt": "x", "tools": []}, "tools"),
    (CompletionRequest, {"prompt": "x", "temperature": float("nan")}, "temperature"),
])
def test_bad_fields_are_400s_naming_the_field(model, body, param):
    with pytest.raises(APIError) as caught:
        _params(model, **body)
    assert (caught.value.status, caught.value.param) == (400, param)
    assert caught.value.body()["error"]["type"] == "invalid_request_error"


def test_prompt_plus_max_tokens_over_the_context_is_a_400():
    params = _params(CompletionRequest, prompt="x", max_tokens=100)
    limit = protocol.MaxTokens(100)
    assert protocol.fit_max_tokens(params, 412, 512, limit) is params
    with pytest.raises(APIError, match="maximum context length is 512"):
        protocol.fit_max_tokens(params, 413, 512, limit)


@pytest.mark.parametrize("raw, message", [
    (b"\xff\xfe{}", "not valid UTF-8"), (b'{"a": NaN}', "not valid JSON"),
    (b'{"a": 1', "not valid JSON"), (b"", "not valid JSON")])
def test_bodies_that_are_not_json(raw, message):
    with pytest.raises(APIError, match=message):
        protocol.parse_json(raw)
