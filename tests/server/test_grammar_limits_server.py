"""Hostile constraints against the shared demo-model server, through real HTTP clients:
grammars past the native compiler's crash point and past its time limit are 400s and
the server's process lives on; choice lists past llguidance's parser-row limit are
served whole; a matcher that fails mid-output ends the request with an error, never
"stop"; schemas with no finite instance are 400s; many constrained completions at once
do not stall another client's stream. After each, the same greedy text comes back."""

from __future__ import annotations

import asyncio
import itertools
import json
import statistics
import time

import httpx2 as httpx
import openai
import pytest
from serving import during_streams, rss_bytes

GREEDY = {"prompt": "def main():", "max_tokens": 24, "temperature": 0}


def _chain_lark(rules: int) -> str:
    body = "".join(f'r{i}: "a" r{i + 1} | "b"\n' for i in range(rules))
    return f'start: r0\n{body}r{rules}: "z"\n'


def _chain_gbnf(rules: int) -> str:
    body = "".join(f'r{i} ::= "a" r{i + 1} | "b"\n' for i in range(rules))
    return f'root ::= r0\n{body}r{rules} ::= "z"\n'


@pytest.fixture
def greedy_before(server):
    """The server's greedy text now; each test checks it is the same afterwards."""
    response = server.post("/v1/completions", json={"model": server.model, **GREEDY})
    assert response.status_code == 200
    pid = server.process.pid
    yield response.json()["choices"][0]["text"]
    assert server.process.poll() is None and server.process.pid == pid
    after = server.post("/v1/completions", json={"model": server.model, **GREEDY})
    assert after.json()["choices"][0]["text"] == response.json()["choices"][0]["text"]


def _constrained(server, constraint: dict, **fields) -> httpx.Response:
    body = {"model": server.model, "prompt": "x", "max_tokens": 8,
            "structured_outputs": constraint} | fields
    return server.post("/v1/completions", json=body)


@pytest.mark.parametrize("grammar, message", [
    (_chain_lark(3000), "the grammar compiler crashed on it (SIGSEGV)"),
    (_chain_lark(20_000), "the grammar compiler crashed on it (SIGSEGV)"),
    (_chain_gbnf(10_000), "took longer than 10 s"),
], ids=["lark-3000", "lark-20000", "gbnf-10000"])
def test_grammars_past_the_compiler_limits_are_400s(server, greedy_before, grammar, message):
    """A Lark grammar of 3,000 chained rules once killed the server (SIGSEGV in the
    native compiler, in the server's process); 10,000 GBNF rules held a thread for
    minutes."""
    response = _constrained(server, {"grammar": grammar})
    assert response.status_code == 400, response.text[:300]
    error = response.json()["error"]
    assert error["param"] == "structured_outputs.grammar"
    assert message in error["message"]


def test_choices_past_the_parser_row_limit_are_served_whole(client, server, greedy_before):
    """10,000 choices once ended after one token with "stop" and the text "ch"."""
    choices = [f"ch{i}" for i in range(10_000)]
    response = client.completions.create(
        model=server.model, prompt="x", max_tokens=16, temperature=1.0, n=8, seed=3,
        extra_body={"structured_outputs": {"choice": choices}})
    for choice in response.choices:
        assert choice.finish_reason == "stop" and choice.text in choices, choice


def test_a_failing_matcher_is_an_error_the_client_sees(client, server, greedy_before):
    """A rule of 2,500 alternatives passes the first mask and fails after one token
    (llguidance's row limit): the client gets an error naming the field, whole or
    streamed, and the server logs one short line, not the grammar."""
    alternatives = " | ".join(f'"a{i}"' for i in range(2500))
    constraint = {"grammar": f'start: "x" r\nr: {alternatives}\n'}
    logged = len(server.log)
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=server.model, prompt="x", max_tokens=8,
                                  extra_body={"structured_outputs": constraint})
    assert error.value.body["param"] == "structured_outputs.grammar"
    assert "the output constraint failed after 1 tokens" in error.value.body["message"]
    with pytest.raises(openai.APIError) as streamed:
        for _ in client.completions.create(model=server.model, prompt="x", max_tokens=8,
                                           stream=True,
                                           extra_body={"structured_outputs": constraint}):
            pass
    assert "the output constraint failed" in str(streamed.value)
    new = server.log[logged:]
    assert any("the output constraint failed" in line for line in new)
    assert all(len(line) < 1000 for line in new), max(new, key=len)[:300]


@pytest.mark.parametrize("schema", [
    {"$ref": "#"},
    {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
], ids=["self", "cycle"])
def test_schemas_without_a_finite_instance_are_400s(server, greedy_before, schema):
    """They once gave a 200 with empty text and "stop"."""
    response = _constrained(server, {"json": schema})
    assert response.status_code == 400, response.text[:300]
    error = response.json()["error"]
    assert error["param"] == "structured_outputs.json"
    assert "no output satisfies it" in error["message"]


async def _long_streams(client: httpx.AsyncClient, streams: list[list[float]],
                       done: asyncio.Event) -> None:
    """Back-to-back streamed completions of 200 tokens until `done`: each one's event
    times (a new stream waits its turn in the queue like any request)."""
    body = {"prompt": "def main():", "max_tokens": 200, "temperature": 0,
            "ignore_eos": True, "stream": True}
    while not done.is_set():
        streams.append([])
        async with client.stream("POST", "/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    streams[-1].append(time.monotonic())


def test_many_constrained_completions_do_not_stall_other_streams(server, greedy_before):
    """Four n=64 requests with a 10,000-value enum while another client streams: the
    stream's longest gap between tokens stays under 0.5 s (7.5 s here when each
    completion's matcher was compiled on the engine thread), and the server's memory
    comes back."""
    schema = {"enum": [f"value{i}" for i in range(10_000)]}
    body = {"model": server.model, "prompt": "x", "max_tokens": 8, "n": 64,
            "temperature": 1.0, "structured_outputs": {"json": schema}}
    rss_before = rss_bytes(server.process.pid)
    streams: list[list[float]] = []

    responses, sent, answered = during_streams(
        server, lambda client, done: _long_streams(client, streams, done),
        lambda: sum(map(len, streams)) >= 20, [("/v1/completions", body)] * 4)
    for response in responses:
        assert response.status_code == 200, response.text[:300]
        for choice in response.json()["choices"]:
            assert choice["finish_reason"] == "stop"
            assert json.loads(choice["text"]) in schema["enum"]
    gaps = [b - a for times in streams for a, b in itertools.pairwise(times)
            if b > sent and a < answered]
    assert len(gaps) > 20 and streams[-1][-1] > answered
    print(f"longest gap {max(gaps):.3f} s, median {statistics.median(gaps):.4f} s, "
          f"{len(gaps)} gaps in {len(streams)} streams over {answered - sent:.1f} s")
    assert max(gaps) < 0.5, (max(gaps), statistics.median(gaps))
    assert rss_bytes(server.process.pid) - rss_before < 200 * 2**20
