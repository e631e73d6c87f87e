"""Batch jobs on a pooling model (docs/pooling.md#batch-jobs): OpenAI batch lines of
/v1/embeddings (and /v1/score, /v1/rerank) through the batch CLI on a tiny embedding
model, killed mid-run and resumed: each custom_id once, embeddings in base64 unless a
line asks floats, both equal to LLM.embed; a bad line is an error line, a generation
url an unsupported one. A Ray replica answers such lines the same way."""

from __future__ import annotations

import base64
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from pooling_models import SETTINGS, embedding_model

from jaxinfer import LLM, batch

ROOT = pathlib.Path(__file__).resolve().parent.parent
NUM_LINES = 300
BAD_INPUT, GENERATION, SCORE, RERANK = 40, 120, 150, 151  # line indexes
CLI_SETTINGS = SETTINGS | {"max_num_seqs": 4}  # 16 lines in flight: many small batches


def _texts(i: int) -> list[str]:
    return [f"line {i}, input {k}: " + "ab " * ((i + k) % 9) for k in range(1 + i % 3)]


def _line(i: int, model: str) -> dict:
    """An embeddings line; every 7th asks floats, every 5th names the model."""
    body: dict = {"input": _texts(i)}
    if i % 7 == 0:
        body["encoding_format"] = "float"
    if i % 5 == 0:
        body["model"] = model
    url = "/v1/embeddings"
    if i == BAD_INPUT:
        body["input"] = []
    elif i == GENERATION:
        url, body = "/v1/completions", {"prompt": "x"}
    elif i == SCORE:
        url, body = "/v1/score", {"text_1": "a fox", "text_2": ["an animal", "Paris"]}
    elif i == RERANK:
        url, body = "/v1/rerank", {"query": "a fox", "documents": ["an animal", "Paris"]}
    return {"custom_id": f"e{i}", "method": "POST", "url": url, "body": body}


def _cli(model: pathlib.Path, inp: pathlib.Path, out: pathlib.Path) -> list[str]:
    return [sys.executable, "-m", "jaxinfer", "batch", f"--model={model}", f"--input={inp}",
            f"--output={out}", "--format=json", *(f"--{k}={v}" for k, v in
                                                   CLI_SETTINGS.items())]


def _records(path: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return embedding_model(tmp_path_factory.mktemp("embed"))


@pytest.fixture(scope="module")
def llm(model):
    return LLM(str(model), **SETTINGS)


@pytest.fixture(scope="module")
def killed_and_resumed(model, tmp_path_factory):
    """The CLI over NUM_LINES lines, SIGKILLed once 30 lines are written, then run again:
    (the output, the records written when it was killed, the second run's summary)."""
    tmp = tmp_path_factory.mktemp("batch")
    inp, out = tmp / "in.jsonl", tmp / "out.jsonl"
    inp.write_text("".join(json.dumps(_line(i, str(model))) + "\n" for i in range(NUM_LINES)))
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.Popen(_cli(model, inp, out), cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while time.time() < deadline and (not out.exists() or out.read_text().count("\n") < 30):
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed = _records(out)
    second = subprocess.run(_cli(model, inp, out), cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=600)
    assert second.returncode == batch.FAILED_LINES_EXIT, second.stderr[-3000:]
    summary = json.loads(second.stderr[second.stderr.index("{\n"):])
    return out, killed, summary


def test_killed_and_resumed_writes_each_custom_id_once(killed_and_resumed):
    out, killed, summary = killed_and_resumed
    assert 30 <= len(killed) < NUM_LINES, "it really was stopped mid-run"
    records = _records(out)
    assert sorted(r["custom_id"] for r in records) == sorted(f"e{i}" for i in range(NUM_LINES))
    kept = {r["custom_id"] for r in killed if r["error"] is None}
    assert [r for r in records if r["custom_id"] in kept] == [
        r for r in killed if r["error"] is None]  # written once, never again
    assert (summary["errors"], summary["kept_errors"]) == (2, 0)
    assert summary["done"] + summary["skipped"] == NUM_LINES - 2
    assert summary["prompt_tokens"] > 0


def test_embeddings_are_base64_unless_a_line_asks_floats(killed_and_resumed, llm):
    records = {r["custom_id"]: r for r in _records(killed_and_resumed[0])}
    picked = [i for i in range(NUM_LINES) if i not in (BAD_INPUT, GENERATION, SCORE, RERANK)]
    texts = [t for i in picked for t in _texts(i)]
    want = iter(np.array([o.outputs.embedding for o in llm.embed(texts)], np.float32))
    for i in picked:
        record = records[f"e{i}"]
        assert record["error"] is None and record["response"]["status_code"] == 200
        body = record["response"]["body"]
        assert body["usage"]["prompt_tokens"] == sum(len(t.encode()) for t in _texts(i))
        for item in body["data"]:
            value = item["embedding"]
            if i % 7 == 0:
                assert isinstance(value, list)
                got = np.array(value, np.float32)
            else:
                assert isinstance(value, str)
                got = np.frombuffer(base64.b64decode(value), "<f4")
            np.testing.assert_allclose(got, next(want), atol=1e-6)


def test_score_and_rerank_lines_and_errors(killed_and_resumed, llm):
    records = {r["custom_id"]: r for r in _records(killed_and_resumed[0])}
    want = [o.outputs.score for o in llm.score("a fox", ["an animal", "Paris"])]
    scores = [d["score"] for d in records[f"e{SCORE}"]["response"]["body"]["data"]]
    np.testing.assert_allclose(scores, want, atol=1e-6)
    results = records[f"e{RERANK}"]["response"]["body"]["results"]
    assert [r["index"] for r in results] == sorted(range(2), key=lambda i: -want[i])
    bad = records[f"e{BAD_INPUT}"]
    assert bad["response"]["status_code"] == 400
    assert bad["response"]["body"]["error"]["param"] == "input"
    generation = records[f"e{GENERATION}"]
    assert generation["response"] is None and generation["error"]["code"] == "unsupported_url"
    assert "it is a pooling model" in generation["error"]["message"]
    assert "/v1/embeddings" in generation["error"]["message"]


def test_a_ray_replica_answers_embedding_lines(model, llm):
    pytest.importorskip("ray")
    from jaxinfer.ray.replica import Replica

    lines = [_line(i, str(model)) for i in (1, 7, SCORE)]
    replica = Replica(str(model), **SETTINGS)
    rows = replica({"id": np.array([x["custom_id"] for x in lines], dtype=object),
                    "line": np.array([1, 2, 3]),
                    "request": np.array([json.dumps(x) for x in lines], dtype=object)})
    records = {r["custom_id"]: r for r in map(json.loads, rows["record"])}
    assert all(r["error"] is None for r in records.values())
    vectors = [o.outputs.embedding for o in llm.embed(_texts(1) + _texts(7))]
    encoded = [d["embedding"] for d in records["e1"]["response"]["body"]["data"]]
    floats = [d["embedding"] for d in records["e7"]["response"]["body"]["data"]]
    got = [np.frombuffer(base64.b64decode(e), "<f4") for e in encoded] + floats
    np.testing.assert_allclose(np.array(got), vectors, atol=1e-6)
    metrics = json.loads(rows["metrics"][0])  # the replica's engine totals so far
    assert metrics["pooled_inputs"] > 0 and metrics["input_tokens"] > 0
