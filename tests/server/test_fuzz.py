"""Hostile and malformed requests against the real server: several hundred, built
systematically (broken JSON and UTF-8, non-objects, non-finite numbers, every field
with wrong types and out-of-range values, unknown fields, bad messages and prompts,
oversized bodies, unknown models, routes and methods). Each gets the 4xx it deserves,
never a 500 or a hang, in OpenAI's error shape with `param` naming the bad field;
afterwards the server still answers a greedy request exactly as `LLM.generate` does."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator

import httpx2 as httpx
from serving import greedy, metric_values

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
ENDPOINTS = (COMPLETIONS, CHAT)
BASE = {COMPLETIONS: {"prompt": "def f(x):", "max_tokens": 2},
        CHAT: {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}}
VOCAB, MAX_MODEL_LEN = 4096, 512  # the bundled demo model, conftest's engine flags
ANY = object()  # a case whose `param` is not checked (no single field is at fault)
GREEDY_PROMPT = "import numpy as np\n"


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    path: str
    body: bytes
    status: int = 400
    param: object = ANY
    method: str = "POST"


def _json(path: str, body: dict, name: str, param: object = ANY, status: int = 400) -> Case:
    return Case(name, path, json.dumps(body).encode(), status, param)


def _with(path: str, param: object = ANY, status: int = 400, **fields: object) -> Case:
    """The endpoint's valid base body with `fields` replaced."""
    return _json(path, BASE[path] | fields, f"{path} {fields!r}"[:160], param, status)


# ---- the cases -------------------------------------------------------------------------

def _raw_cases(path: str) -> Iterator[Case]:
    """Bodies that are not a JSON object: 400, no param."""
    good = json.dumps(BASE[path]).encode()
    raws = [b"", b"   ", b"\n", good[:1], good[: len(good) // 2], good[:-1], good + b"}",
            good + b" x", good + b",", good + b"\x00", good + good, b"{'prompt': 'hi'}",
            b'{"prompt": "hi",}', b'{prompt: "hi"}', b'{"prompt": "hi" // c\n}',
            b'{"prompt": True}', b'{"prompt": None}', b"\xef\xbb\xbf" + good, b"[]",
            b"[{}]", b"[" + good + b"]", b'"hi"', b"42", b"-1.5", b"null", b"true",
            b"\xff\xfe{}", b'{"prompt": "\xc3\x28"}', b'{"prompt": "\xed\xa0\x80"}',
            b'{"prompt": "\xc0\xaf"}', b'{"prompt": "hi\xf8"}', good[:-1] + b', "\x80": 1}',
            b"[" * 100_000, b'{"a":' * 50_000,
            good[:-1] + b', "max_tokens": 1' + b"0" * 5000 + b"}"]
    for i, raw in enumerate(raws):
        yield Case(f"{path} raw #{i} {raw[:40]!r}", path, raw)
    for literal in (b"NaN", b"Infinity", b"-Infinity", b"nan", b"inf"):
        yield Case(f"{path} temperature={literal!r}", path,
                   good[:-1] + b', "temperature": ' + literal + b"}")
    for field in ("temperature", "top_p", "max_tokens", "seed"):
        for number in (b"1e400", b"-1e400"):
            yield Case(f"{path} {field}={number!r}", path,
                       good[:-1] + b', "' + field.encode() + b'": ' + number + b"}",
                       param=field)


# wrong types by kind of field; None only where the field is not optional
INT, FLOAT, BOOL, STR = ("5", 5.5, True, [5], {"a": 1}), ("0.5", [0.5], True, {}, "NaN"), \
    ("true", 1, 0, [], {}), (1, [], {}, True)
SHARED_TYPES = {"model": STR, "user": STR, "n": (*INT, None), "stream": (*BOOL, None),
                "temperature": FLOAT, "top_p": FLOAT, "min_p": FLOAT,
                "presence_penalty": FLOAT, "frequency_penalty": FLOAT,
                "repetition_penalty": FLOAT, "top_k": INT, "seed": INT, "min_tokens": INT,
                "max_tokens": INT, "ignore_eos": BOOL,
                "stop": (1, [1], {}, [["a"]], True, ["a", None]),
                "stop_token_ids": ("1", [1.5], ["a"], 1, [[1]], {}, [True]),
                "stream_options": ("x", True, [], 1)}
ENDPOINT_TYPES = {
    COMPLETIONS: {"prompt": ({}, 1, True, None, 1.5, [1.5], ["a", 1], [[1, "a"]], [[]],
                             [{}], [None], [[1], [2.0]], [True]),
                  "logprobs": ("1", True, 1.5, [], {}), "echo": (*BOOL, None),
                  "prompt_logprobs": INT},
    CHAT: {"messages": ({}, "hi", None, 1, [1], ["hi"], [[]], [None], [[{"role": "user"}]]),
           "max_completion_tokens": INT, "top_logprobs": INT,
           "logprobs": ("true", 1, 0, None, [], {}),
           "add_generation_prompt": (*BOOL, None), "prompt_logprobs": INT}}


def _type_cases(path: str) -> Iterator[Case]:
    for field, values in (SHARED_TYPES | ENDPOINT_TYPES[path]).items():
        for value in values:
            yield _with(path, param=field, **{field: value})
    yield _with(path, param="stream_options.include_usage",
                stream_options={"include_usage": "yes"}, stream=True)
    yield _with(path, param="stream_options.foo", stream_options={"foo": True}, stream=True)


SHARED_VALUES = [("max_tokens", -1), ("max_tokens", 0), ("max_tokens", 10**30),
                 ("temperature", -1), ("temperature", -1e-9), ("top_p", 0), ("top_p", 2),
                 ("top_p", -0.5), ("top_k", -5), ("top_k", 2**31), ("top_k", 2**40),
                 ("n", 0), ("n", -1), ("n", 65), ("n", 10**6), ("seed", -2**63 - 1),
                 ("seed", 2**64), ("seed", 2**70), ("min_p", -0.1), ("min_p", 1.5),
                 ("presence_penalty", 3), ("presence_penalty", -3),
                 ("frequency_penalty", 2.5), ("repetition_penalty", 0),
                 ("repetition_penalty", -1), ("min_tokens", -1), ("min_tokens", 3),
                 ("stop", ""), ("stop", ["a", ""]), ("stop", ["x"] * 17),
                 ("stop_token_ids", [-1]), ("stop_token_ids", [VOCAB]),
                 ("stop_token_ids", [10**12]), ("stop_token_ids", [2**70])]
ENDPOINT_VALUES = {
    COMPLETIONS: [("logprobs", 21), ("logprobs", -1), ("logprobs", 10**9),
                  ("prompt_logprobs", 21), ("prompt_logprobs", -1)],
    CHAT: [("max_completion_tokens", 0), ("max_completion_tokens", -1),
           ("max_completion_tokens", 10**30), ("prompt_logprobs", 21)]}


def _value_cases(path: str) -> Iterator[Case]:
    """Right types, wrong values (min_tokens 3 is over the base's max_tokens 2); each
    also as a stream, which must fail before any event is sent."""
    for stream in (False, True):
        for field, value in SHARED_VALUES + ENDPOINT_VALUES[path]:
            yield _with(path, param=field, stream=stream, **{field: value})
        yield _with(path, param="min_tokens", stream=stream, min_tokens=1,
                    stop_token_ids=list(range(20)))  # masks at most 16 stop ids
    if path == CHAT:
        for logprobs in (True, False):
            yield _with(path, param="top_logprobs", logprobs=logprobs, top_logprobs=21)
            yield _with(path, param="top_logprobs", logprobs=logprobs, top_logprobs=-1)
        yield _with(path, param="top_logprobs", top_logprobs=2)
        yield _with(path, param="top_logprobs", logprobs=False, top_logprobs=2)


UNKNOWN = ("foo", "tools", "tool_choice", "functions", "response_format", "logit_bias",
           "best_of", "suffix", "parallel_tool_calls", "guided_json", "",
           "Prompt", "max_tokens ")


def _unknown_field_cases(path: str) -> Iterator[Case]:
    for field in UNKNOWN:
        yield _with(path, param=field, **{field: 1})
    other = {COMPLETIONS: {"messages": BASE[CHAT]["messages"], "max_completion_tokens": 1,
                           "top_logprobs": 1, "add_generation_prompt": True},
             CHAT: {"prompt": BASE[COMPLETIONS]["prompt"]}}[path]
    for field, value in other.items():  # the other endpoint's fields
        yield _with(path, param=field, **{field: value})


def _message_cases() -> Iterator[Case]:
    user = {"role": "user", "content": "hi"}
    bad = [([], "messages"), ([{"role": "wizard", "content": "x"}], "messages.0.role"),
           ([{"content": "x"}], "messages.0.role"), ([{"role": None}], "messages.0.role"),
           ([{"role": 1, "content": "x"}], "messages.0.role"),
           ([{"role": "USER", "content": "x"}], "messages.0.role"),
           ([user, {"role": "bot", "content": "x"}], "messages.1.role"),
           ([{"role": "user", "content": 1}], "messages.0.content"),
           ([{"role": "user", "content": {"text": "x"}}], "messages.0.content"),
           ([{"role": "user", "content": [1]}], "messages.0.content"),
           ([{"role": "user", "content": ["x"]}], "messages.0.content"),
           ([{"role": "user", "content": [{"type": "image_url", "image_url": {
               "url": "data:image/png;base64,iVBORw0KGgo="}}]}], "messages.0.content"),
           ([{"role": "user", "content": [{"type": "input_audio"}]}], "messages.0.content"),
           ([{"role": "user", "content": [{"type": "text"}]}], "messages.0.content"),
           ([{"role": "user", "content": [{"type": "text", "text": 1}]}],
            "messages.0.content"),
           ([{"role": "user", "content": "x", "name": 1}], "messages.0.name"),
           ([{"role": "user", "content": "x", "tool_calls": []}], "messages.0.tool_calls"),
           ([{"role": "user", "content": "x" * 5000}], "messages")]
    for messages, param in bad:
        yield _with(CHAT, param=param, messages=messages)
        yield _with(CHAT, param=param, messages=messages, stream=True)
    yield Case("chat lone surrogate", CHAT,
               b'{"messages": [{"role": "user", "content": "\\ud800"}]}', param="messages")
    long_chat = [{"role": "user", "content": "word " * 150}]
    yield _with(CHAT, param="max_tokens", messages=long_chat, max_tokens=500)
    yield _with(CHAT, param="max_completion_tokens", messages=long_chat,
                max_completion_tokens=500)


def _prompt_cases() -> Iterator[Case]:
    prompts = ["", [], [""], ["hi", ""], [[1], []], [-1], [VOCAB], [10**12], [2**70],
               [1, 2, -5], [[1], [VOCAB]], [[1]] * 2 + [[]], [1] * MAX_MODEL_LEN,
               [1] * 600, [[1], [1] * MAX_MODEL_LEN], ["hi", "x" * 200_000], "y" * 200_000]
    for stream in (False, True):
        for prompt in prompts:
            yield _with(COMPLETIONS, param="prompt", prompt=prompt, stream=stream)
        yield _with(COMPLETIONS, param="max_tokens", prompt=[1] * 500, max_tokens=100,
                    stream=stream)
        yield _with(COMPLETIONS, param="max_tokens", prompt=[[1], [1] * 500],
                    max_tokens=100, stream=stream)
    yield Case("prompt lone surrogate", COMPLETIONS, b'{"prompt": "\\ud800"}', param="prompt")
    yield Case("batch lone surrogate", COMPLETIONS, b'{"prompt": ["a", "\\udfff"]}',
               param="prompt")


def _route_cases() -> Iterator[Case]:
    for path in ENDPOINTS:
        for model in ("nope", "", "DEMO", "demo ", "../demo"):
            yield _with(path, param="model", status=404, model=model)
        yield _with(path, param="model", status=404, model="nope", stream=True)
        big = json.dumps(BASE[path] | {"user": "u" * 10_000_000}).encode()
        yield Case(f"{path} 10 MB JSON", path, big, status=413)
        yield Case(f"{path} 10 MB garbage", path, b"\x00" * 10_000_000, status=413)
        for method in ("GET", "PUT", "DELETE", "PATCH"):
            yield Case(f"{method} {path}", path, b"", status=405, method=method)
    for method, path in (("POST", "/v1/models"), ("POST", "/health"), ("POST", "/metrics"),
                         ("DELETE", "/v1/models")):
        yield Case(f"{method} {path}", path, b"{}", status=405, method=method)
    for path in ("/nope", "/v1", "/v1/embedding", "/v1/completion", "/v2/completions",
                 "/v1/models/demo", "/v1/respond", "/%ff"):
        yield Case(f"POST {path}", path, b"{}", status=404)
        yield Case(f"GET {path}", path, b"", status=404, method="GET")


def fuzz_cases() -> list[Case]:
    cases = [case for path in ENDPOINTS for build in (_raw_cases, _type_cases, _value_cases,
                                                       _unknown_field_cases)
             for case in build(path)]
    return cases + [*_message_cases(), *_prompt_cases(), *_route_cases()]


# ---- the checks --------------------------------------------------------------------------

def _problem(case: Case, response: httpx.Response) -> str | None:
    """What is wrong with the answer to `case`, or None."""
    if response.status_code != case.status:
        return f"status {response.status_code}, expected {case.status}: {response.text[:200]}"
    try:
        body = response.json()
    except ValueError:
        return f"not JSON: {response.text[:200]!r}"
    error = body.get("error") if isinstance(body, dict) else None
    if set(body) != {"error"} or not isinstance(error, dict) or \
            set(error) != {"message", "type", "param", "code"}:
        return f"not OpenAI's error shape: {body}"
    if not (isinstance(error["message"], str) and error["message"]
            and isinstance(error["type"], str) and error["type"]
            and isinstance(error["param"], str | None)
            and isinstance(error["code"], str | None)):
        return f"bad error field types: {error}"
    param = error["param"]  # the field, or an item of it (`stop_token_ids.0`)
    if case.param is not ANY and not (
            isinstance(param, str) and re.fullmatch(rf"{re.escape(case.param)}(\.\d+)*", param)):
        return f"param {param!r}, expected {case.param!r} ({error['message']})"
    return None


def test_fuzz_cases_are_many_and_distinct():
    cases = fuzz_cases()
    assert len(cases) >= 200
    assert len({(c.method, c.path, c.body) for c in cases}) == len(cases)


def test_hostile_requests_get_openai_4xx_then_the_server_answers_exactly(
        server, client, demo_llm):
    cases = fuzz_cases()
    log_start = len(server.log)
    base_url = server.url.removesuffix("/v1")
    failures = []
    with httpx.Client(base_url=base_url, timeout=httpx.Timeout(60)) as http:
        for case in cases:
            try:
                response = http.request(case.method, case.path, content=case.body)
            except httpx.TransportError as e:  # a hang (timeout) or a dropped connection
                failures.append(f"{case.name}: {type(e).__name__}: {e}")
                continue
            problem = _problem(case, response)
            if problem is not None:
                failures.append(f"{case.name}: {problem}")
    assert not failures, f"{len(failures)} of {len(cases)} cases failed:\n" + \
        "\n".join(failures)
    assert server.process.poll() is None
    assert not [line for line in server.log[log_start:] if "Traceback" in line]
    assert metric_values(server)["jaxinfer:kv_cache_pages_in_use"] == 0  # nothing admitted
    response = client.completions.create(model=server.model, prompt=GREEDY_PROMPT,
                                         temperature=0, max_tokens=16)
    expected = demo_llm.generate(GREEDY_PROMPT, greedy(demo_llm, 16))[0]
    assert response.choices[0].text == expected.text
    assert response.usage.completion_tokens == len(expected.outputs[0].token_ids)
