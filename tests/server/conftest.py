"""A real `python -m jaxinfer serve` on 127.0.0.1 (ephemeral port, bundled demo model),
and an in-process LLM with the same engine settings for the expected outputs."""

from __future__ import annotations

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
import pytest

from jaxinfer import LLM
from jaxinfer.config import DEFAULT_MODEL

# Small buckets: warm-up in ~20 s; 16 slots so that 64 concurrent requests queue.
ENGINE_FLAGS = {"max_num_seqs": 16, "max_num_batched_tokens": 64, "max_model_len": 512}
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


def start_server(*flags: str, **engine_flags: object) -> Server:
    """Start `serve` on a free port and wait until it listens (after warm-up)."""
    settings = ENGINE_FLAGS | engine_flags
    command = [sys.executable, "-m", "jaxinfer", "serve", "--port=0",
               *(f"--{k}={v}" for k, v in settings.items()), *flags]
    env = os.environ | {"PYTHONPATH": str(pathlib.Path(__file__).parents[2])}
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


@pytest.fixture(scope="session")
def server():
    """One default server (scoring on) shared by the API, load, fuzz and prompt logprobs
    tests."""
    s = start_server(**SCORING)
    yield s
    s.stop()


@pytest.fixture(scope="session")
def demo_llm() -> LLM:
    """The same model and engine settings in this process: the expected outputs."""
    return LLM(DEFAULT_MODEL, **ENGINE_FLAGS)


@pytest.fixture
def client(server):
    import openai

    with openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0,
                       timeout=120) as c:
        yield c
