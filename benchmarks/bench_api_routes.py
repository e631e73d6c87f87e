"""What /v1/messages (Anthropic's Messages API) and /v1/responses (OpenAI's Responses
API) cost over /v1/chat/completions, the route both are translated onto, in one run.

A server is started here (`python -m jaxinfer serve`, the bundled demo model by default,
on a free port of 127.0.0.1, awaited on /health, stopped with SIGTERM; `--serve_flags`
adds flags to it). Every request is the same conversation: one short user message
(`--prompt`), temperature 0, `--max_tokens` (32) as each route spells it; `ignore_eos`
only if all three routes take it (the new routes' bodies are strict, so none gets it and
the tokens each answer holds are reported); /v1/responses keeps its default `store`
(true: each response is stored, as a client that does not say otherwise has it). Through
httpx (one client, one connection pool), after `--warmup` untimed requests per route and
mode:

* sequential: `--num_requests` (50) requests per route, whole and streamed, the three
  routes taking turns (the order rotated every round, so drift hits them alike); per
  route the latency's p50 and mean, tokens/s (output tokens over the summed latencies),
  and for streams the time to first token (the first event carrying text) and to the
  stream's end;
* concurrent: `--num_requests` requests per route with `--concurrency` (16) in flight,
  whole and streamed, `--rounds` (5) rounds with the routes taking turns, after one
  untimed wave per route: output tokens/s over the summed wall times, the latency's
  (and for streams the TTFT's) p50 and mean.

Each new route gets its ratios to chat from the same run (latency > 1: slower;
tokens/s < 1: slower). The greedy texts must be equal: every sequential answer (whole
and streamed, batch 1) of every route equals chat's first whole answer (asserted);
concurrent answers are counted against it, not asserted (a batch's rounding may move a
near tie). Prints one JSON object.

    python benchmarks/bench_api_routes.py
    python benchmarks/bench_api_routes.py --num_requests=100 --concurrency=32 \\
        --serve_flags=--max_num_seqs=32
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import time
import typing
from collections.abc import Callable

import httpx2 as httpx  # the HTTP client openai 3.x is built on
import numpy as np
from absl import app, flags
from server_process import stop_server, tail

FLAGS = flags.FLAGS
REPO = pathlib.Path(__file__).resolve().parents[1]
CHAT, MESSAGES, RESPONSES = "/v1/chat/completions", "/v1/messages", "/v1/responses"
ROUTES = (CHAT, MESSAGES, RESPONSES)
NAMES = {CHAT: "chat", MESSAGES: "messages", RESPONSES: "responses"}


def define_flags() -> None:
    """The CLI (defined on demand, so that tests can import the pure functions)."""
    flags.DEFINE_string("model", "checkpoints/demo", "model directory")
    flags.DEFINE_string("prompt", "Write a Python function that reverses a list.",
                        "the user message")
    flags.DEFINE_integer("max_tokens", 32, "max tokens of every answer")
    flags.DEFINE_integer("num_requests", 50, "timed requests per route and mode")
    flags.DEFINE_integer("warmup", 3, "untimed requests per route and mode, first")
    flags.DEFINE_integer("concurrency", 16, "requests in flight in the concurrent part")
    flags.DEFINE_integer("rounds", 5, "rounds of the concurrent part")
    flags.DEFINE_list("serve_flags", [], "more flags for `serve` (--name=value, ...)")
    flags.DEFINE_integer("startup_timeout", 900, "seconds to wait for /health")


# ---- the three routes' bodies and answers ----------------------------------------------

def body(route: str, model: str, prompt: str, max_tokens: int, *, stream: bool,
         ignore_eos: bool) -> dict[str, typing.Any]:
    """The same conversation as `route` spells it."""
    extra = {"ignore_eos": True} if ignore_eos else {}
    if route == CHAT:
        return {"model": model, "messages": [{"role": "user", "content": prompt}],
                "max_tokens": max_tokens, "temperature": 0, "stream": stream, **extra,
                **({"stream_options": {"include_usage": True}} if stream else {})}
    if route == MESSAGES:
        return {"model": model, "messages": [{"role": "user", "content": prompt}],
                "max_tokens": max_tokens, "temperature": 0, "stream": stream, **extra}
    return {"model": model, "input": prompt, "max_output_tokens": max_tokens,
            "temperature": 0, "stream": stream, **extra}


def whole_answer(route: str, data: dict[str, typing.Any]) -> tuple[str, int]:
    """(text, output tokens) of a whole answer."""
    if route == CHAT:
        return data["choices"][0]["message"]["content"] or "", data["usage"][
            "completion_tokens"]
    if route == MESSAGES:
        text = "".join(b["text"] for b in data["content"] if b["type"] == "text")
        return text, data["usage"]["output_tokens"]
    text = "".join(part["text"] for item in data["output"] if item["type"] == "message"
                   for part in item["content"] if part["type"] == "output_text")
    return text, data["usage"]["output_tokens"]


def stream_event(route: str, event: dict[str, typing.Any]) -> tuple[str, int | None]:
    """(text delta, output tokens if this event gives the total) of one streamed event."""
    if route == CHAT:
        text = "".join(c["delta"].get("content") or "" for c in event.get("choices", ()))
        usage = event.get("usage")
        return text, usage["completion_tokens"] if usage and not event["choices"] else None
    kind = event.get("type")
    if route == MESSAGES:
        if kind == "content_block_delta" and event["delta"]["type"] == "text_delta":
            return event["delta"]["text"], None
        return "", event["usage"]["output_tokens"] if kind == "message_delta" else None
    if kind == "response.output_text.delta":
        return event["delta"], None
    if kind in ("response.completed", "response.incomplete"):
        return "", event["response"]["usage"]["output_tokens"]
    return "", None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Result:
    """One request, times in seconds from its send."""

    text: str
    tokens: int
    latency: float  # to the whole answer, or to the stream's end
    ttft: float | None = None  # streams: to the first event carrying text


async def send(client: httpx.AsyncClient, route: str, payload: dict) -> Result:
    started = time.perf_counter()
    if not payload["stream"]:
        response = await client.post(route, json=payload)
        if response.status_code != 200:
            raise RuntimeError(f"{route}: {response.status_code} {response.text[:500]}")
        text, tokens = whole_answer(route, response.json())
        return Result(text=text, tokens=tokens, latency=time.perf_counter() - started)
    parts, tokens, first = [], None, None
    async with client.stream("POST", route, json=payload) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{route}: {response.status_code} {(await response.aread())[:500]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            if "error" in event or event.get("type") in ("error", "response.failed"):
                raise RuntimeError(f"{route}: {line[:500]}")
            text, total = stream_event(route, event)
            if text:
                first = first or time.perf_counter()
                parts.append(text)
            tokens = total if total is not None else tokens
    ended = time.perf_counter()
    if tokens is None:
        raise RuntimeError(f"{route}: the stream gave no token count")
    return Result(text="".join(parts), tokens=tokens, latency=ended - started,
                  ttft=None if first is None else first - started)


# ---- the two parts -----------------------------------------------------------------------

def ms(values: list[float]) -> dict[str, float]:
    """p50 and mean of seconds, in ms."""
    array = np.asarray(values) * 1e3
    return {"p50": round(float(np.median(array)), 2), "mean": round(float(array.mean()), 2)}


def sequential_stats(results: list[Result]) -> dict[str, typing.Any]:
    stats = {"requests": len(results), "latency_ms": ms([r.latency for r in results]),
             "tokens_per_s": round(sum(r.tokens for r in results)
                                   / sum(r.latency for r in results), 2),
             "output_tokens": sorted({r.tokens for r in results})}
    if results[0].ttft is not None:
        stats["ttft_ms"] = ms([r.ttft for r in results if r.ttft is not None])
    return stats


async def sequential(client: httpx.AsyncClient, payloads: dict[str, dict],
                     n: int) -> dict[str, list[Result]]:
    """`n` requests per route, one at a time, the routes taking turns (rotated order)."""
    results: dict[str, list[Result]] = {route: [] for route in payloads}
    order = list(payloads)
    for i in range(n):
        for route in order[i % len(order):] + order[:i % len(order)]:
            results[route].append(await send(client, route, payloads[route]))
    return results


async def concurrent(client: httpx.AsyncClient, route: str, payload: dict, n: int,
                     width: int) -> tuple[list[Result], float]:
    """`n` requests with `width` in flight; the results and the wall seconds."""
    gate = asyncio.Semaphore(width)

    async def one() -> Result:
        async with gate:
            return await send(client, route, payload)

    started = time.perf_counter()
    results = await asyncio.gather(*(one() for _ in range(n)))
    return list(results), time.perf_counter() - started


def ratios(report: dict[str, dict]) -> dict[str, dict[str, float]]:
    """Each new route's figures over chat's (latency, TTFT: > 1 slower; tokens/s: < 1
    slower)."""
    def over(new: dict, chat: dict) -> dict[str, float]:
        out = {}
        for key in ("latency_ms", "ttft_ms"):
            for stat in ("p50", "mean") if key in chat else ():
                out[f"{key.removesuffix('_ms')}_{stat}"] = round(
                    new[key][stat] / chat[key][stat], 3)
        out["tokens_per_s"] = round(new["tokens_per_s"] / chat["tokens_per_s"], 3)
        return out

    chat = NAMES[CHAT]
    return {NAMES[route]: {part: over(report[part][NAMES[route]], report[part][chat])
                           for part in report}
            for route in (MESSAGES, RESPONSES)}


async def concurrent_part(client: httpx.AsyncClient, model: str, stream: bool,
                          ignore_eos: bool) -> tuple[dict[str, dict], dict[str, list[Result]]]:
    """`--rounds` rounds of `--num_requests` requests per route, `--concurrency` in
    flight, the routes taking turns, after one untimed wave each: per route the stats
    and the results."""
    payloads = {route: body(route, model, FLAGS.prompt, FLAGS.max_tokens, stream=stream,
                            ignore_eos=ignore_eos) for route in ROUTES}
    for route in ROUTES:  # warms the batched steps' shapes too
        await concurrent(client, route, payloads[route], FLAGS.concurrency, FLAGS.concurrency)
    runs: dict[str, list] = {route: [] for route in ROUTES}
    for i in range(FLAGS.rounds):
        for route in ROUTES[i % 3:] + ROUTES[:i % 3]:
            runs[route].append(await concurrent(client, route, payloads[route],
                                                FLAGS.num_requests, FLAGS.concurrency))
    stats, results = {}, {}
    for route in ROUTES:
        results[route] = [r for run, _ in runs[route] for r in run]
        wall = sum(seconds for _, seconds in runs[route])
        stats[NAMES[route]] = sequential_stats(results[route]) | {
            "wall_s": round(wall, 3),
            "tokens_per_s": round(sum(r.tokens for r in results[route]) / wall, 2)}
    return stats, results


async def ignore_eos_taken(client: httpx.AsyncClient, model: str) -> dict[str, bool]:
    """Whether each route takes `ignore_eos` in its body (one small request each)."""
    taken = {}
    for route in ROUTES:
        payload = body(route, model, FLAGS.prompt, 1, stream=False, ignore_eos=True)
        taken[NAMES[route]] = (await client.post(route, json=payload)).status_code == 200
    return taken


async def bench(root: str) -> dict[str, typing.Any]:
    limits = httpx.Limits(max_connections=FLAGS.concurrency + 4)
    async with httpx.AsyncClient(base_url=root, timeout=600, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        taken = await ignore_eos_taken(client, model)
        ignore_eos = all(taken.values())
        report: dict[str, dict] = {}
        texts: dict[str, list[str]] = {}
        for stream in (False, True):
            payloads = {route: body(route, model, FLAGS.prompt, FLAGS.max_tokens,
                                    stream=stream, ignore_eos=ignore_eos) for route in ROUTES}
            await sequential(client, payloads, FLAGS.warmup)
            results = await sequential(client, payloads, FLAGS.num_requests)
            part = "sequential_" + ("streamed" if stream else "whole")
            report[part] = {NAMES[r]: sequential_stats(results[r]) for r in ROUTES}
            for route in ROUTES:
                texts.setdefault(NAMES[route], []).extend(r.text for r in results[route])
            print(json.dumps({part: report[part]}), file=sys.stderr)
        runs: dict[str, list] = {route: [] for route in ROUTES}
        for stream in (False, True):
            part = "concurrent_" + ("streamed" if stream else "whole")
            report[part], got = await concurrent_part(client, model, stream, ignore_eos)
            for route in ROUTES:
                runs[route] += got[route]
            print(json.dumps({part: report[part]}), file=sys.stderr)
    reference = texts[NAMES[CHAT]][0]
    differing = {name: sum(t != reference for t in got) for name, got in texts.items()}
    concurrent_differing = {NAMES[route]: sum(r.text != reference for r in runs[route])
                            for route in ROUTES}
    return {"model": model, "ignore_eos_taken": taken, "ignore_eos_sent": ignore_eos,
            "results": report, "ratios_to_chat": ratios(report),
            "greedy_text": {"text": reference,
                            "sequential_differing": differing,
                            "concurrent_differing": concurrent_differing,
                            "equal": not any(differing.values())}}


# ---- the server --------------------------------------------------------------------------

def start_server(port: int, log: typing.IO) -> subprocess.Popen:
    command = [sys.executable, "-m", "jaxinfer", "serve", f"--model={FLAGS.model}",
               "--host=127.0.0.1", f"--port={port}", *FLAGS.serve_flags]
    env = os.environ | {"PYTHONPATH": os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    print("starting:", " ".join(command), file=sys.stderr)
    return subprocess.Popen(command, stdout=log, stderr=log, env=env)


def wait_ready(root: str, process: subprocess.Popen, log: typing.IO) -> float:
    """Seconds until GET /health answers 200; raises if the server exits or times out."""
    started = time.perf_counter()
    while time.perf_counter() - started < FLAGS.startup_timeout:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}:\n{tail(log)}")
        try:
            if httpx.get(root + "/health", timeout=5).status_code == 200:
                return time.perf_counter() - started
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"no /health after {FLAGS.startup_timeout} s:\n{tail(log)}")


def serve_and_bench(run: Callable[[str], typing.Awaitable[dict]]) -> tuple[dict, dict]:
    with socket.socket() as sock:  # a free port
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    root = f"http://127.0.0.1:{port}"
    with tempfile.NamedTemporaryFile(prefix="bench_api_routes_", suffix=".log") as log:
        process = start_server(port, log)
        try:
            ready = wait_ready(root, process, log)
            report = asyncio.run(run(root))
        finally:
            code = stop_server(process, log) if process.poll() is None else process.returncode
    return {"port": port, "startup_s": round(ready, 1), "exit_code": code}, report


def main(argv: list[str]) -> None:
    del argv
    logging.getLogger("httpx2").setLevel(logging.WARNING)  # a line per request otherwise
    server, report = serve_and_bench(bench)
    settings = {"model": FLAGS.model, "prompt": FLAGS.prompt, "max_tokens": FLAGS.max_tokens,
                "temperature": 0, "num_requests": FLAGS.num_requests, "warmup": FLAGS.warmup,
                "concurrency": FLAGS.concurrency, "rounds": FLAGS.rounds,
                "serve_flags": FLAGS.serve_flags}
    print(json.dumps({"settings": settings, "server": server, **report}, indent=2))
    assert report["greedy_text"]["equal"], report["greedy_text"]


if __name__ == "__main__":
    define_flags()
    app.run(main)
