"""server/dev_routes.py against a real server with --server_dev_mode: vLLM's sleep
routes (the model answers 503 while asleep and the same tokens after waking), SGLang's
names for them, the API key, clear 400s; without the flag the routes do not exist."""

from __future__ import annotations

import concurrent.futures
import pathlib
import time

import pytest
from serving import start_server

import jaxinfer

KEY = "rl-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = {"model": "demo", "prompt": "def parse(line):", "max_tokens": 12, "temperature": 0}


@pytest.fixture(scope="module")
def dev_server():
    server = start_server("--server_dev_mode", f"--api_key={KEY}", max_num_seqs=4,
                          max_num_batched_tokens=32)
    yield server
    server.stop()


def _completion(server) -> dict:
    response = server.post("/v1/completions", json=PROMPT, headers=AUTH)
    return response.status_code, response.json()


def test_sleep_then_wake_up_serves_the_same_tokens(dev_server):
    status, before = _completion(dev_server)
    assert status == 200
    assert dev_server.post("/sleep", params={"level": 1}, headers=AUTH).status_code == 200
    assert dev_server.get("/is_sleeping", headers=AUTH).json() == {"is_sleeping": True}
    status, asleep = _completion(dev_server)
    assert status == 503 and asleep["error"]["code"] == "sleeping"
    tokenized = dev_server.post("/tokenize", json={"prompt": "def"}, headers=AUTH)
    assert tokenized.status_code == 200  # needs no weights, as in vLLM
    assert dev_server.post("/wake_up", headers=AUTH).status_code == 200
    assert dev_server.get("/is_sleeping", headers=AUTH).json() == {"is_sleeping": False}
    status, after = _completion(dev_server)
    assert status == 200
    assert after["choices"][0]["text"] == before["choices"][0]["text"]


def test_sglang_names_release_and_resume_memory(dev_server):
    status, before = _completion(dev_server)
    released = dev_server.post("/release_memory_occupation", headers=AUTH)
    assert released.json() == {"success": True}
    assert dev_server.get("/is_sleeping", headers=AUTH).json() == {"is_sleeping": True}
    assert dev_server.post("/resume_memory_occupation", headers=AUTH).json() == {
        "success": True}
    status, after = _completion(dev_server)
    assert status == 200 and after["choices"][0]["text"] == before["choices"][0]["text"]


def test_bad_level_and_missing_key_are_refused(dev_server):
    bad = dev_server.post("/sleep", params={"level": 3}, headers=AUTH)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "level"
    assert dev_server.post("/sleep").status_code == 401
    assert dev_server.get("/is_sleeping", headers=AUTH).json() == {"is_sleeping": False}


def test_without_the_flag_the_routes_do_not_exist(server):
    assert server.post("/sleep").status_code == 404
    assert server.get("/is_sleeping").status_code == 404
    assert server.post("/update_weights_from_disk", json={"model_path": "x"}).status_code == 404


def test_pause_holds_new_requests_until_resume(dev_server):
    status, before = _completion(dev_server)
    paused = dev_server.post("/pause", headers=AUTH)
    assert paused.json() == {"success": True, "aborted": 0}
    assert dev_server.get("/is_paused", headers=AUTH).json() == {"is_paused": True}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(_completion, dev_server)
        time.sleep(1.0)
        assert not pending.done()  # queued: no step runs while paused
        assert dev_server.post("/resume", headers=AUTH).status_code == 200
        status, after = pending.result(timeout=60)
    assert status == 200 and after["choices"][0]["text"] == before["choices"][0]["text"]
    assert dev_server.get("/is_paused", headers=AUTH).json() == {"is_paused": False}
    wait = dev_server.post("/pause", params={"mode": "wait"}, headers=AUTH)
    assert wait.status_code == 400 and wait.json()["error"]["param"] == "mode"


def test_update_weights_from_disk_and_flush_cache(dev_server, hf_model_dirs):
    status, before = _completion(dev_server)
    demo = pathlib.Path(jaxinfer.__file__).parent / "demo"
    updated = dev_server.post("/update_weights_from_disk", json={"model_path": str(demo)},
                              headers=AUTH)
    assert updated.status_code == 200 and updated.json()["success"] is True
    status, after = _completion(dev_server)  # the same weights again: the same tokens
    assert status == 200 and after["choices"][0]["text"] == before["choices"][0]["text"]
    other = dev_server.post("/update_weights_from_disk", headers=AUTH,
                            json={"model_path": str(hf_model_dirs["qwen2"])})
    assert other.status_code == 400 and other.json()["error"]["code"] == "invalid_state"
    status, still = _completion(dev_server)  # a refused update changed nothing
    assert still["choices"][0]["text"] == before["choices"][0]["text"]
    assert dev_server.post("/flush_cache", headers=AUTH).json() == {"success": True}
    assert dev_server.post("/reset_prefix_cache", headers=AUTH).status_code == 200
