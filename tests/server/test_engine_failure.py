"""An engine step that raises fails the requests in flight with a 500 (none hangs),
turns /health to 503 and refuses new requests with 503. The failure is injected: a
real CPU device cannot be broken on purpose, so the runner's `execute` is wrapped to
raise on its fifth call. The server runs in this process (uvicorn on a thread)."""

from __future__ import annotations

import json
import threading
import time

import httpx2 as httpx
import pytest
import uvicorn
from serving import ENGINE_FLAGS

from jaxinfer import LLM, server
from jaxinfer.config import DEFAULT_MODEL, ServerConfig
from jaxinfer.server.app import ServerState, create_app
from jaxinfer.server.engine_loop import EngineLoop


@pytest.fixture(scope="module")
def failing_server():
    llm = LLM(DEFAULT_MODEL, **ENGINE_FLAGS)
    collect, calls = llm.engine.runner.collect, []

    def collect_then_fail(step):
        calls.append(step)
        if len(calls) >= 5:  # a device failure surfaces when a step is read back
            raise RuntimeError("device lost")
        return collect(step)

    llm.engine.runner.collect = collect_then_fail
    loop = EngineLoop(llm.engine, max_waiting_requests=16)
    state = ServerState(loop=loop, config=ServerConfig(), model_name="demo",
                        model_root=str(DEFAULT_MODEL), max_model_len=llm.max_model_len,
                        defaults=llm.engine.default_params, token_text=None)
    uv = uvicorn.Server(uvicorn.Config(create_app(state), log_config=None, lifespan="off"))
    sock = server.bind("127.0.0.1", 0)
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    loop.start()
    thread.start()
    while not uv.started:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    uv.should_exit = True
    thread.join(30)
    loop.stop()


def test_engine_failure_fails_in_flight_requests(failing_server):
    url = failing_server
    assert httpx.get(url + "/health").status_code == 200
    body = {"prompt": "import os\n", "max_tokens": 50, "ignore_eos": True, "stream": True}
    results = {}

    def whole() -> None:
        results["whole"] = httpx.post(url + "/v1/completions", timeout=60,
                                      json=body | {"stream": False})

    thread = threading.Thread(target=whole)
    thread.start()
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200  # the failure comes after the stream started
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    thread.join(60)
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert events[-1] == "data: [DONE]"
    assert "device lost" in error["message"] and error["code"] == "engine_failed"
    assert results["whole"].status_code == 500
    assert "device lost" in results["whole"].json()["error"]["message"]
    health = httpx.get(url + "/health")
    assert health.status_code == 503 and "device lost" in health.json()["error"]["message"]
    refused = httpx.post(url + "/v1/completions", json=body | {"stream": False}, timeout=30)
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "engine_failed"
