"""A server with an API key, room for 4 waiting completions and a 3 s shutdown deadline
(16 slots, conftest's engine flags): 401s without the key; a burst fills the batch,
the excess gets 503 with Retry-After and every accepted stream is exact; clients that
all go away leave the server admitting again; SIGTERM under load (the last test: it
stops the server) lets streams finish or ends them with an error event, refuses new
requests, and exits 0. Started without --enable_prompt_logprobs, it refuses prompt
logprobs with a 400 naming the flag. Counts only: no timing is asserted."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import signal
import time

import httpx2 as httpx
import openai
import pytest
from serving import ENGINE_FLAGS, greedy, metric_values, start_server

KEY, WAITING, SHUTDOWN_S = "sekrit", 4, 1
SLOTS = ENGINE_FLAGS["max_num_seqs"]
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPTS = ["import os\n", "def main():\n", "class Config:\n", "for i in range(",
           "# Copyright", "if __name__ ==", "return self.", "x = ["]


@pytest.fixture(scope="module")
def keyed_server():
    s = start_server(f"--max_waiting_requests={WAITING}", f"--shutdown_timeout={SHUTDOWN_S}",
                     f"--api_key={KEY}")
    yield s
    s.stop()


@dataclasses.dataclass
class Result:
    """One streaming request as its client saw it."""

    status: int | None = None
    headers: dict[str, str] = dataclasses.field(default_factory=dict)
    error: dict | None = None  # the error body (HTTP error) or the error event (stream)
    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int | None = None
    done: bool = False  # `data: [DONE]` arrived
    transport_error: str | None = None  # connection refused or closed
    first_token: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)


async def _stream(client: httpx.AsyncClient, body: dict, result: Result) -> Result:
    """POST a streaming completion and read every event into `result`."""
    body = body | {"stream": True, "stream_options": {"include_usage": True}}
    try:
        async with client.stream("POST", "/v1/completions", json=body, headers=AUTH) as r:
            result.status, result.headers = r.status_code, dict(r.headers)
            if r.status_code != 200:
                result.error = json.loads(await r.aread())
                return result
            async for line in r.aiter_lines():
                _event(line, result)
    except httpx.TransportError as e:
        result.transport_error = type(e).__name__
    return result


def _event(line: str, result: Result) -> None:
    if not line.startswith("data: "):
        return
    if line == "data: [DONE]":
        result.done = True
        return
    data = json.loads(line.removeprefix("data: "))
    if "error" in data:
        result.error = data
        return
    if data.get("usage"):
        result.completion_tokens = data["usage"]["completion_tokens"]
    for choice in data["choices"]:
        result.text += choice["text"]
        result.finish_reason = choice["finish_reason"] or result.finish_reason
        result.first_token.set()


def _client(server, connections: int = 64) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=server.url.removesuffix("/v1"), timeout=60,
                             limits=httpx.Limits(max_connections=connections))


def _assert_error_shape(body: dict, type_: str, code: str) -> None:
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert (body["error"]["type"], body["error"]["code"]) == (type_, code)
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]


def _body(index: int, max_tokens: int) -> dict:
    return {"prompt": PROMPTS[index % len(PROMPTS)], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}


# ---- the API key ---------------------------------------------------------------------------

@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"},
                                     {"Authorization": "sekrit"},
                                     {"Authorization": "Basic sekrit"},
                                     {"Authorization": "Bearer sekrit2"},
                                     {"X-Api-Key": "sekrit"}])
def test_api_key_missing_or_wrong_is_401(keyed_server, headers):
    body = {"prompt": "hi", "max_tokens": 2}
    for method, path, content in (("POST", "/v1/completions", json.dumps(body)),
                                  ("POST", "/v1/chat/completions", "not even JSON"),
                                  ("POST", "/v1/completions", "x" * 10_000_000),
                                  ("GET", "/v1/models", None)):
        response = httpx.request(method, keyed_server.url.removesuffix("/v1") + path,
                                 content=content, headers=headers, timeout=60)
        assert response.status_code == 401, (path, response.text)  # before the body is read
        _assert_error_shape(response.json(), "authentication_error", "invalid_api_key")


def test_api_key_given_is_200_and_health_metrics_need_none(keyed_server):
    assert keyed_server.get("/health").json() == {"status": "ok"}
    assert "jaxinfer:kv_cache_pages_in_use" in keyed_server.get("/metrics").text
    assert keyed_server.get("/v1/models", headers=AUTH).status_code == 200
    with openai.OpenAI(base_url=keyed_server.url, api_key=KEY, max_retries=0) as client:
        completion = client.completions.create(model=keyed_server.model, prompt="hi",
                                               max_tokens=3, extra_body={"ignore_eos": True})
        assert completion.usage.completion_tokens == 3
    with openai.OpenAI(base_url=keyed_server.url, api_key="wrong", max_retries=0) as client, \
            pytest.raises(openai.AuthenticationError):
        client.completions.create(model=keyed_server.model, prompt="hi", max_tokens=3)


def test_n_up_to_slots_plus_waiting_fits_beyond_is_400(keyed_server):
    body = {"prompt": "hi", "max_tokens": 2, "ignore_eos": True}
    fits = keyed_server.post("/v1/completions", json=body | {"n": SLOTS + WAITING},
                             headers=AUTH)
    assert fits.status_code == 200
    assert fits.json()["usage"]["completion_tokens"] == 2 * (SLOTS + WAITING)
    never = keyed_server.post("/v1/completions", json=body | {"n": SLOTS + WAITING + 1},
                              headers=AUTH)
    assert never.status_code == 400  # a 503 would be retried, and never clear
    assert never.json()["error"]["param"] == "n"


ABORTED = "jaxinfer:request_success_total{finished_reason=abort}"
PROMPT_TOKENS = "jaxinfer:prompt_tokens_total"


@pytest.mark.parametrize("prompts,n", [(SLOTS + WAITING + 1, 1), (7, 3), (2000, 1)])
def test_a_list_prompt_over_the_admission_capacity_is_400_and_starts_nothing(
        keyed_server, prompts, n):
    """It could never be admitted: a 400 naming the numbers, decided before any work (a
    503 here was retried for ever, after starting and aborting up to 20 completions)."""
    before = metric_values(keyed_server)
    response = keyed_server.post("/v1/completions", headers=AUTH, json={
        "prompt": [f"x{i}" for i in range(prompts)], "n": n, "max_tokens": 2})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "prompt"
    assert f"{prompts * n} completions" in error["message"]
    assert f"{SLOTS + WAITING} (max_num_seqs {SLOTS} + max_waiting_requests {WAITING})" \
        in error["message"]
    after = metric_values(keyed_server)
    assert after.get(ABORTED, 0) == before.get(ABORTED, 0)
    assert after[PROMPT_TOKENS] == before[PROMPT_TOKENS]


def test_a_list_prompt_that_fits_is_admitted_whole(keyed_server):
    body = {"prompt": [f"x{i}" for i in range(SLOTS + WAITING)], "max_tokens": 2,
            "ignore_eos": True}
    response = keyed_server.post("/v1/completions", headers=AUTH, json=body)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == SLOTS + WAITING


def test_a_list_prompt_that_fits_only_later_is_503_before_any_work(keyed_server):
    """With 10 slots busy, 15 prompts fit the server but not now: one 503, nothing of
    them started (a list's prompts are admitted all or none)."""
    async def run() -> tuple[httpx.Response, dict, dict]:
        async with _client(keyed_server) as client:
            tasks, _ = await _fill(client, [480] * 10)
            before = metric_values(keyed_server)
            response = await client.post("/v1/completions", headers=AUTH, json={
                "prompt": [f"x{i}" for i in range(15)], "max_tokens": 2})
            after = metric_values(keyed_server)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return response, before, after

    response, before, after = asyncio.run(run())
    assert response.status_code == 503 and int(response.headers["retry-after"]) >= 1
    _assert_error_shape(response.json(), "service_unavailable", "overloaded")
    assert after.get(ABORTED, 0) == before.get(ABORTED, 0)
    assert after[PROMPT_TOKENS] == before[PROMPT_TOKENS]


def test_prompt_logprobs_without_the_flag_are_400_and_serving_goes_on(keyed_server):
    """This server was started without --enable_prompt_logprobs."""
    body = {"prompt": "def f(x):", "max_tokens": 2, "temperature": 0}
    for asked, param in (({"prompt_logprobs": 1}, "prompt_logprobs"),
                         ({"echo": True, "logprobs": 1, "max_tokens": 0}, "echo"),
                         ({"prompt_logprobs": 0, "stream": True}, "prompt_logprobs")):
        refused = keyed_server.post("/v1/completions", json=body | asked, headers=AUTH)
        assert refused.status_code == 400
        error = refused.json()["error"]
        assert error["param"] == param and "--enable_prompt_logprobs" in error["message"]
    echoed = keyed_server.post("/v1/completions", json=body | {"echo": True}, headers=AUTH)
    assert echoed.status_code == 200  # echo without logprobs scores nothing
    assert echoed.json()["choices"][0]["text"].startswith(body["prompt"])
    plain = keyed_server.post("/v1/completions", json=body, headers=AUTH)
    assert plain.status_code == 200 and plain.json()["usage"]["completion_tokens"] == 2


# ---- overload ------------------------------------------------------------------------------

async def _sample_metrics(client: httpx.AsyncClient, stop: asyncio.Event,
                          samples: list[tuple[float, float]]) -> None:
    while not stop.is_set():
        values = _gauges((await client.get("/metrics")).text)
        samples.append((values["jaxinfer:num_requests_running"],
                        values["jaxinfer:num_requests_waiting"]))
        await asyncio.sleep(0.01)


def _gauges(text: str) -> dict[str, float]:
    """The num_requests_* gauges of a /metrics text (by name, labels dropped)."""
    return {line.split("{")[0]: float(line.split()[-1]) for line in text.splitlines()
            if line.startswith("jaxinfer:num_requests")}


def test_burst_fills_the_batch_and_refuses_the_excess_with_503(keyed_server, demo_llm):
    burst, max_tokens = 40, 48
    samples: list[tuple[float, float]] = []

    async def run() -> list[Result]:
        stop = asyncio.Event()
        async with _client(keyed_server) as client, _client(keyed_server, 1) as sampler:
            sampling = asyncio.create_task(_sample_metrics(sampler, stop, samples))
            results = await asyncio.gather(*(_stream(client, _body(i, max_tokens), Result())
                                             for i in range(burst)))
            stop.set()
            await sampling
        return results

    results = asyncio.run(run())
    accepted = [i for i, r in enumerate(results) if r.status == 200]
    refused = [r for r in results if r.status != 200]
    # Nothing else runs: the first SLOTS + WAITING always get in; the rest are decided
    # long before one of those finishes (48 steps), so at least one is refused.
    assert SLOTS + WAITING <= len(accepted) < burst
    for r in refused:
        assert r.status == 503 and int(r.headers["retry-after"]) >= 1
        _assert_error_shape(r.error, "service_unavailable", "overloaded")
    expected = demo_llm.generate([PROMPTS[i % len(PROMPTS)] for i in accepted],
                                 greedy(demo_llm, max_tokens, ignore_eos=True))
    assert [results[i].text for i in accepted] == [o.text for o in expected]
    assert all(results[i].finish_reason == "length" and results[i].done
               and results[i].completion_tokens == max_tokens for i in accepted)
    assert samples and all(running <= SLOTS and running + waiting <= SLOTS + WAITING
                           for running, waiting in samples)
    after = metric_values(keyed_server)
    assert after["jaxinfer:num_requests_running"] == after["jaxinfer:num_requests_waiting"] \
        == after["jaxinfer:kv_cache_pages_in_use"] == 0


async def _fill(client: httpx.AsyncClient, max_tokens: list[int]
                ) -> tuple[list[asyncio.Task], list[Result]]:
    """A stream per entry of `max_tokens`, each retried on 503 until admitted (up to 500
    tries); returns once all are admitted and one has a token."""
    results = [Result() for _ in max_tokens]

    async def admitted(index: int) -> Result:
        for _ in range(500):
            result = results[index] = await _stream(client, _body(index, max_tokens[index]),
                                                    results[index])
            if result.status != 503:
                return result
            results[index] = Result()
            await asyncio.sleep(0.02)
        return results[index]

    tasks = [asyncio.create_task(admitted(i)) for i in range(len(max_tokens))]
    while not all(r.status == 200 for r in results) or not any(
            r.first_token.is_set() for r in results):
        await asyncio.sleep(0.01)
        assert not any(t.done() and results[i].status != 200 for i, t in enumerate(tasks))
    return tasks, results


async def _refusing(server) -> None:
    """Once the server has taken the signal: /health on a new connection is 503, or
    the connection is refused."""
    async with _client(server, 1) as client:
        for _ in range(1000):
            try:
                if (await client.get("/health")).status_code == 503:
                    return
            except httpx.TransportError:
                return
            await asyncio.sleep(0.01)


def test_clients_that_all_go_away_leave_the_server_admitting(keyed_server):
    """Aborting every request of a full server refreshes the admission counts even
    though no engine step runs, so the next request is admitted (200), not 503."""
    async def run() -> tuple[float, float]:
        async with _client(keyed_server) as client:
            tasks, _ = await _fill(client, [480] * (SLOTS + WAITING))
            full = _gauges((await client.get("/metrics")).text)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return full["jaxinfer:num_requests_running"], full["jaxinfer:num_requests_waiting"]

    running, waiting = asyncio.run(run())
    assert running + waiting == SLOTS + WAITING
    for _ in range(600):  # the server sees the disconnects
        values = metric_values(keyed_server)
        if values["jaxinfer:num_requests_running"] == values[
                "jaxinfer:num_requests_waiting"] == 0:
            break
        time.sleep(0.01)
    assert values["jaxinfer:kv_cache_pages_in_use"] == 0
    response = keyed_server.post("/v1/completions", headers=AUTH,
                                 json={"prompt": "hi", "max_tokens": 2, "ignore_eos": True})
    assert response.status_code == 200, response.text


# ---- SIGTERM -------------------------------------------------------------------------------

def test_sigterm_under_load_finishes_or_fails_every_stream_and_exits_0(keyed_server):
    max_tokens = [64, 480] * ((SLOTS + WAITING) // 2)  # some may finish in time, some not

    async def run() -> tuple[list[Result], Result, int]:
        async with _client(keyed_server) as client:
            tasks, _ = await _fill(client, max_tokens)
            keyed_server.process.send_signal(signal.SIGTERM)
            await _refusing(keyed_server)
            async with _client(keyed_server) as late_client:  # a new connection
                late = await _stream(late_client, _body(0, 4), Result())
            done = await asyncio.wait_for(asyncio.gather(*tasks), SHUTDOWN_S + 30)
        code = await asyncio.to_thread(keyed_server.process.wait, SHUTDOWN_S + 15)
        return done, late, code

    results, late, code = asyncio.run(run())
    assert code == 0
    # refused: 503, or the connection refused or closed unanswered as the listener shuts
    assert late.status == 503 or (late.status is None and late.transport_error), late
    outcomes = [_outcome(r, m) for r, m in zip(results, max_tokens, strict=True)]
    assert set(outcomes) <= {"full", "shut out", "closed"}, outcomes
    # the 480-token streams need 480 steps each (~2.4 s on a 2-core CPU where a step of
    # 16 requests takes ~5 ms): more than the 1 s deadline
    assert "shut out" in outcomes


def _outcome(result: Result, max_tokens: int) -> str:
    """How a stream admitted before SIGTERM ended: its full answer, the shutdown error
    event then [DONE], the connection closed; anything else is wrong."""
    if result.status != 200:
        return f"status {result.status}"
    if result.error is None and result.transport_error is None:
        full = result.finish_reason == "length" and result.done and \
            result.completion_tokens == max_tokens
        return "full" if full else "cut short without an error"
    if result.error is not None and result.done:
        _assert_error_shape(result.error, "service_unavailable", "shutting_down")
        return "shut out"
    return "closed" if result.transport_error is not None else "unexplained"
