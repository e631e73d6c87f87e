"""The batch runner over Ray Data (jaxinfer/ray/) on a local two-CPU Ray cluster: two
replicas of the demo model write the single-process runner's records, each id once,
also when a replica is killed mid-run; a re-run over a finished output writes nothing."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import pytest

ray = pytest.importorskip("ray")

from jaxinfer import LLM, batch  # noqa: E402
from jaxinfer.ray import run_ray  # noqa: E402
from jaxinfer.text.corpus import corpus_files  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEMO = ROOT / "checkpoints" / "demo"
ENGINE = {"dtype": "float32", "max_num_seqs": 4, "max_model_len": 128,
          "max_num_batched_tokens": 64}
BAD_LINES = ['{"id": "bad-json", "prompt": x}',
             json.dumps({"id": "bad-temperature", "prompt": "x", "temperature": -1})]


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"JAX_PLATFORMS": "cpu"}})
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="module")
def llm():
    return LLM(DEMO, **ENGINE)


def _prompts(count: int) -> list[str]:
    """Short code prompts: the first short `def` line of held-out corpus files."""
    prompts = []
    for path in corpus_files()[1]:
        lines = [s.strip() for s in path.read_text(errors="ignore").splitlines()]
        found = [s.split("(")[0] + "(" for s in lines if s.startswith("def ") and len(s) < 60]
        prompts += found[:1]
        if len(prompts) == count:
            return prompts
    raise AssertionError("the corpus has too few short def lines")


def _write_input(path: pathlib.Path, count: int, bad: bool = True) -> None:
    lines = [json.dumps({"id": f"q{i}", "prompt": prompt, "max_tokens": 12,
                         "temperature": 0.0}) for i, prompt in enumerate(_prompts(count))]
    if bad:
        lines[3:3] = BAD_LINES
    path.write_text("\n".join(lines) + "\n")


def _records(path: pathlib.Path) -> dict[str, dict]:
    """Records by id (or by line for id-less ones); fails if a key is there twice."""
    records = [json.loads(line) for line in path.read_text().splitlines()]
    keyed = {str(r.get("id", f"line {r.get('line')}")): r for r in records}
    assert len(keyed) == len(records), "an id is in the output twice"
    return keyed


def test_ray_replicas_write_the_single_process_records_and_reruns_add_nothing(
        cluster, llm, tmp_path):
    inp, want, got = tmp_path / "in.jsonl", tmp_path / "want.jsonl", tmp_path / "got.jsonl"
    _write_input(inp, 8)
    batch.run(llm, inp, want, progress=False)
    summary = run_ray(inp, got, num_replicas=2, model=DEMO, batch_size=3, progress=False,
                      **ENGINE)
    assert (summary["done"], summary["errors"], summary["missing"]) == (8, 2, 0)
    assert summary["accelerator"] == "cpu" and summary["engine"]
    assert _records(got) == _records(want)  # same fields, token ids and error records
    assert _records(got)["line 4"]["error"].startswith("line 4 is not valid JSON")
    before = got.read_bytes()
    kept = run_ray(inp, got, num_replicas=2, model=DEMO, retry_errors=False, progress=False,
                   **ENGINE)
    assert (kept["done"], kept["errors"], kept["skipped"]) == (0, 0, 10)
    assert got.read_bytes() == before  # nothing new written
    retried = run_ray(inp, got, num_replicas=2, model=DEMO, progress=False, **ENGINE)
    assert (retried["done"], retried["errors"], retried["retried"]) == (0, 2, 2)
    assert _records(got) == _records(want)


def test_batch_cli_with_ray_joins_the_cluster(cluster, llm, tmp_path):
    inp, want, got = tmp_path / "in.jsonl", tmp_path / "want.jsonl", tmp_path / "got.jsonl"
    _write_input(inp, 4)
    batch.run(llm, inp, want, progress=False)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    result = subprocess.run(
        [sys.executable, "-m", "jaxinfer", "batch", "--ray", f"--ray_address={cluster}",
         "--num_replicas=2", f"--input={inp}", f"--output={got}", f"--model={DEMO}",
         "--format=json", *(f"--{k}={v}" for k, v in ENGINE.items())],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 3, result.stderr[-3000:]  # the 2 bad lines
    summary = json.loads(result.stderr[result.stderr.index("{\n"):])
    assert (summary["done"], summary["errors"], summary["replicas"]) == (4, 2, 2)
    assert _records(got) == _records(want)


def test_run_ray_refuses_bad_arguments_before_starting_ray(tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(json.dumps({"id": "a", "prompt": "x"}) + "\n"
                   + json.dumps({"id": "a", "prompt": "y"}) + "\n")
    cases = [({"model": tmp_path / "nope"}, "is not a directory"),
             ({"num_replicas": 0}, "num_replicas=0 must be >= 1"),
             ({"max_num_seqs": 0}, "max_num_seqs=0"),
             ({"accelerator": "npu"}, "accelerator='npu' must be one of"),
             ({}, "id 'a' is on line 1 and on line 2")]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            run_ray(inp, out, **{"model": DEMO, **kwargs})
    assert not out.exists()


def _kill_a_replica_once_results_arrive(output: pathlib.Path, killed: list) -> None:
    """SIGKILL one live replica's process (a crash, not a clean exit) once the driver
    has written a few records, and note its actor id and how far the output was."""
    deadline = time.time() + 240
    while time.time() < deadline:
        if output.exists() and output.read_text().count("\n") >= 3:
            break
        time.sleep(0.05)
    from ray._private import state  # the GCS actor table; no dashboard needed

    alive = [a for a in state.actors(actor_state_name="ALIVE").values()
             if "MapBatches(Replica)" in a["ActorClassName"]]
    if alive:
        os.kill(alive[0]["Pid"], signal.SIGKILL)
        killed.append((alive[0]["ActorID"], output.read_text().count("\n")))


def test_a_killed_replica_is_restarted_and_every_id_is_written_once(cluster, llm, tmp_path):
    inp, want, got = tmp_path / "in.jsonl", tmp_path / "want.jsonl", tmp_path / "got.jsonl"
    _write_input(inp, 40)
    batch.run(llm, inp, want, progress=False)
    killed: list = []
    killer = threading.Thread(target=_kill_a_replica_once_results_arrive, args=(got, killed))
    killer.start()
    summary = run_ray(inp, got, num_replicas=2, model=DEMO, batch_size=6, progress=False,
                      **ENGINE)
    killer.join()
    (actor_id, written_at_kill), = killed
    assert written_at_kill < 42  # the replica died mid-run
    from ray._private import state

    assert state.actors(actor_id=actor_id)["NumRestarts"] >= 1  # Ray restarted it
    assert (summary["done"], summary["errors"], summary["missing"]) == (40, 2, 0)
    assert _records(got) == _records(want)  # every id once, the same tokens
    again = run_ray(inp, got, num_replicas=2, model=DEMO, retry_errors=False,
                    progress=False, **ENGINE)
    assert again["done"] == again["errors"] == 0 and len(_records(got)) == 42


def test_openai_batch_format_over_ray_answers_as_the_single_process_runner(
        cluster, llm, tmp_path):
    """A file in OpenAI's batch format: each replica answers its lines with the server's
    routes in-process, and the driver keys them by custom_id."""
    inp, want, got = tmp_path / "in.jsonl", tmp_path / "want.jsonl", tmp_path / "got.jsonl"
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": prompt, "max_tokens": 12, "temperature": 0.0}}
             if i % 2 else
             {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "user", "content": prompt}], "max_tokens": 12,
                       "temperature": 0.0}}
             for i, prompt in enumerate(_prompts(6))]
    lines.append({"custom_id": "bad-url", "method": "POST", "url": "/v1/embeddings",
                  "body": {"input": "x"}})
    inp.write_text("".join(json.dumps(line) + "\n" for line in lines))
    batch.run(llm, inp, want, progress=False)
    summary = run_ray(inp, got, num_replicas=2, model=DEMO, batch_size=3, progress=False,
                      **ENGINE)
    assert (summary["done"], summary["errors"], summary["missing"]) == (6, 1, 0)
    assert summary["completion_tokens"] > 0

    def answers(path: pathlib.Path) -> dict[str, object]:
        records = [json.loads(line) for line in path.read_text().splitlines()]
        assert len({r["custom_id"] for r in records}) == len(records) == 7
        return {r["custom_id"]: r["error"] if r["error"] else (
            r["response"]["body"]["choices"], r["response"]["body"]["usage"]["total_tokens"])
            for r in records}

    assert answers(got) == answers(want)
