"""Helpers of the server tests (importable as `serving`, see pyproject's pythonpath)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time

import httpx2 as httpx  # the HTTP client openai 3.x is built on
from prometheus_client.parser import text_string_to_metric_families


def greedy(llm, max_tokens: int, **overrides):
    """The params the server builds for a request giving temperature 0: the checkpoint's
    defaults with those fields replaced."""
    return dataclasses.replace(llm.engine.default_params, temperature=0,
                               max_tokens=max_tokens, **overrides)


def metric_values(server) -> dict[str, float]:
    """Every sample of /metrics by name (labels folded into the name, but `model_name`,
    which every sample must carry: the served model's name)."""
    text = server.get("/metrics").text
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = dict(sample.labels)
            if labels.pop("model_name", None) != server.model:
                raise AssertionError(f"{sample} lacks model_name={server.model!r}")
            labels = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
            values[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return values


# Small buckets: warm-up in ~20 s; 16 slots so that 64 concurrent requests queue.
ENGINE_FLAGS = {"max_num_seqs": 16, "max_num_batched_tokens": 64, "max_model_len": 512,
                "dtype": "float32"}  # pinned: exact comparisons across batch shapes
# The shared server also compiles the prompt-scoring steps (--enable_prompt_logprobs:
# a few seconds more with the compilation cache warm); the other servers do not.
SCORING = {"enable_prompt_logprobs": True}
READY = re.compile(r"serving '(?P<name>[^']*)' at (?P<url>http://\S+)/v1")
START_TIMEOUT_S = 300


@dataclasses.dataclass
class Server:
    """A server process, its base URL (…/v1) and what it wrote to stderr."""

    process: subprocess.Popen
    url: str
    model: str
    log: list[str]

    def get(self, path: str, **kwargs) -> httpx.Response:
        return httpx.get(self.url.removesuffix("/v1") + path, timeout=30, **kwargs)

    def post(self, path: str, **kwargs) -> httpx.Response:
        return httpx.post(self.url.removesuffix("/v1") + path, timeout=60, **kwargs)

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM; the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout)


def start_server(*flags: str, env: dict[str, str] | None = None,
                 **engine_flags: object) -> Server:
    """Start `serve` on a free port and wait until it listens (after warm-up); `env`:
    more environment variables."""
    settings = ENGINE_FLAGS | engine_flags
    command = [sys.executable, "-m", "jaxinfer", "serve", "--port=0",
               *(f"--{k}={v}" for k, v in settings.items()), *flags]
    env = os.environ | {"PYTHONPATH": str(pathlib.Path(__file__).parents[2])} | (env or {})
    process = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                               text=True, env=env)
    log: list[str] = []
    found: dict[str, str] = {}
    ready = threading.Event()

    def read() -> None:  # keeps draining stderr so the server never blocks on it
        for line in process.stderr:
            log.append(line)
            match = READY.search(line)
            if match and not ready.is_set():
                found.update(match.groupdict())
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    ready.wait(START_TIMEOUT_S)
    if not found:
        process.kill()
        raise RuntimeError("the server did not start:\n" + "".join(log[-30:]))
    server = Server(process, found["url"] + "/v1", found["name"], log)
    _wait_healthy(server)
    return server


def _wait_healthy(server: Server) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if server.get("/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise RuntimeError("the server listens but /health never said ok")


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


async def ticker(client: httpx.AsyncClient, arrivals: list[float],
                 done: asyncio.Event) -> None:
    """Back-to-back streamed completions until `done`: the arrival time of every event."""
    body = {"prompt": "def main():", "max_tokens": 64, "temperature": 0, "ignore_eos": True,
            "stream": True}
    while not done.is_set():
        async with client.stream("POST", "/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    arrivals.append(time.monotonic())


def during_streams(server: Server, streamer, ready, posts: list[tuple[str, dict]],
                   timeout: float = 300) -> tuple[list[httpx.Response], float, float]:
    """Start `streamer(client, done)`, wait until `ready()`, send `posts` ((path, body)
    pairs) at once, and stop the streamer 0.2 s after the last answer: (the responses,
    when they were sent, when the last was answered)."""
    async def run() -> tuple[list[httpx.Response], float, float]:
        done = asyncio.Event()
        async with httpx.AsyncClient(base_url=server.url.removesuffix("/v1"),
                                     timeout=timeout) as client:
            streaming = asyncio.create_task(streamer(client, done))
            while not ready():
                await asyncio.sleep(0.01)
            sent = time.monotonic()
            responses = await asyncio.gather(*(client.post(path, json=body)
                                               for path, body in posts))
            answered = time.monotonic()
            await asyncio.sleep(0.2)
            done.set()
            await streaming
        return responses, sent, answered

    return asyncio.run(run())
