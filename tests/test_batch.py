"""The offline batch runner: results, error records, logprobs and prompt logprobs, and
exactly-once resume."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from jaxinfer import LLM, SamplingParams, batch

ROOT = pathlib.Path(__file__).resolve().parent.parent
DEMO = ROOT / "checkpoints" / "demo"
LINES = [
    {"id": "a", "prompt": "import os\n", "max_tokens": 8, "temperature": 0.0},
    {"id": "b", "prompt": [10, 20, 30], "max_tokens": 5, "temperature": 0.0},
    "{not json",
    {"id": "c", "prompt": "x", "temperature": -1},
    {"id": "d", "messages": [{"role": "user", "content": "sort a list"}], "max_tokens": 6,
     "temperature": 0.0},
    {"id": "e", "prompt": "def f():", "bogus": 1},
    {"prompt": "no id"},
    {"id": "f", "prompt": "y", "max_tokens": 3, "n": 2, "temperature": 0.5, "seed": 1},
    {"id": "a", "prompt": "dup"},
    {"id": 7, "prompt": [1] * 600},
]


@pytest.fixture(scope="module")
def llm():
    return LLM(DEMO, max_num_seqs=4, max_num_batched_tokens=32)


def _write_input(path):
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in LINES) + "\n")


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_batch_results_and_error_records(llm, tmp_path):
    _write_input(tmp_path / "in.jsonl")
    summary = batch.run(llm, tmp_path / "in.jsonl", tmp_path / "out.jsonl", progress=False)
    records = {r.get("id", f"line{r.get('line')}"): r for r in _records(tmp_path / "out.jsonl")}
    assert summary["done"] == 4 and summary["errors"] == 6
    assert records["a"]["finish_reason"] == "length" and len(records["a"]["token_ids"]) == 8
    assert records["b"]["prompt_tokens"] == 3 and records["b"]["completion_tokens"] == 5
    assert records["d"]["prompt_tokens"] > 5  # the chat template was applied
    assert len(records["f"]["outputs"]) == 2
    assert records["line3"]["error"] == "the line has no 'id'"
    assert records["c"]["error"].startswith("temperature=-1 must be")
    assert "unknown field(s) ['bogus']" in records["e"]["error"]
    assert records["line7"]["error"] == "the line has no 'id'"
    assert "the prompt has" in records["7"]["error"]  # too long, id given as a number
    dup = [r for r in _records(tmp_path / "out.jsonl") if r.get("line") == 9]
    assert dup and "appears twice" in dup[0]["error"]


def test_batch_resume_skips_done_ids_and_cuts_a_torn_line(llm, tmp_path):
    _write_input(tmp_path / "in.jsonl")
    out = tmp_path / "out.jsonl"
    out.write_text(json.dumps({"id": "a", "text": "earlier", "token_ids": []}) + "\n"
                   + '{"id": "b", "te')  # a crash mid-write
    summary = batch.run(llm, tmp_path / "in.jsonl", out, progress=False)
    assert summary["skipped"] == 2  # "a" and its duplicate line
    keys = sorted((r.get("id", ""), r.get("line", 0)) for r in _records(out))
    assert keys == [("", 3), ("", 7), ("7", 10), ("a", 0), ("b", 0), ("c", 4), ("d", 0),
                    ("e", 6), ("f", 0)]  # every id once; id-less bad lines by number
    assert _records(out)[0]["text"] == "earlier"
    again = batch.run(llm, tmp_path / "in.jsonl", out, progress=False)
    assert again["done"] == again["errors"] == 0 and len(_records(out)) == len(keys)


def test_batch_records_carry_logprobs_and_prompt_logprobs(llm, tmp_path):
    lines = [{"id": "s", "prompt": "def add(a, b):", "max_tokens": 3, "temperature": 0.0,
              "prompt_logprobs": 2, "logprobs": 1},
             {"id": "p", "prompt": [10, 20, 30], "max_tokens": 2, "temperature": 0.0}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    scoring = LLM(DEMO, max_num_seqs=4, max_num_batched_tokens=32,
                  enable_prompt_logprobs=True, warm_up=False)  # compiles what it runs
    batch.run(scoring, tmp_path / "in.jsonl", tmp_path / "out.jsonl", progress=False)
    records = {r["id"]: r for r in _records(tmp_path / "out.jsonl")}
    expected = scoring.generate([x["prompt"] for x in lines], [
        SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=2, logprobs=1),
        SamplingParams(max_tokens=2, temperature=0.0)])[0]
    got = records["s"]["prompt_logprobs"]
    assert got[0] is None and len(got) == len(expected.prompt_token_ids)
    for entry, want in zip(got[1:], expected.prompt_logprobs[1:], strict=True):
        assert list(entry) == [str(t) for t in want]  # the prompt token, then the top 2
        for token, logprob in want.items():
            assert entry[str(token)]["logprob"] == pytest.approx(logprob.logprob, abs=1e-5)
            assert entry[str(token)]["rank"] == logprob.rank
            assert entry[str(token)]["decoded_token"] == logprob.decoded_token
    for entry, want in zip(records["s"]["logprobs"], expected.logprobs, strict=True):
        assert entry == pytest.approx({str(t): v.logprob for t, v in want.items()}, abs=1e-5)
    assert "prompt_logprobs" not in records["p"] and "logprobs" not in records["p"]
    batch.run(llm, tmp_path / "in.jsonl", tmp_path / "plain.jsonl", progress=False)
    refused = _records(tmp_path / "plain.jsonl")[0]  # this engine has no scoring steps
    assert refused["id"] == "s" and "enable_prompt_logprobs=True" in refused["error"]


def test_batch_cli(tmp_path):
    _write_input(tmp_path / "in.jsonl")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    result = subprocess.run(
        [sys.executable, "-m", "jaxinfer", "batch", f"--input={tmp_path / 'in.jsonl'}",
         f"--output={tmp_path / 'out.jsonl'}", "--max_num_seqs=4",
         "--max_num_batched_tokens=32", "--format=json"], cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stderr[result.stderr.index("{\n"):])
    assert summary["done"] == 4 and summary["errors"] == 6
    assert "generated_tokens_per_s" in summary["engine"]
    assert len(_records(tmp_path / "out.jsonl")) == 10


def _batch_cmd(inp, out):
    return [sys.executable, "-m", "jaxinfer", "batch", f"--input={inp}", f"--output={out}",
            "--max_num_seqs=1", "--max_num_batched_tokens=32"]


def test_batch_sigkill_then_rerun_gives_every_id_once_as_uninterrupted(tmp_path):
    import signal
    import time

    lines = [{"id": f"q{i}", "prompt": f"def f{i}(x):", "max_tokens": 24,
              "temperature": 0.0 if i % 2 else 0.8, "seed": i} for i in range(24)]
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(x) + "\n" for x in lines) + "{broken\n")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    ref, out = tmp_path / "ref.jsonl", tmp_path / "out.jsonl"
    assert subprocess.run(_batch_cmd(inp, ref), cwd=ROOT, env=env, capture_output=True,
                          timeout=300).returncode == 0
    proc = subprocess.Popen(_batch_cmd(inp, out), cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and (not out.exists() or out.read_text().count("\n") < 4):
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = out.read_text().count("\n")
    assert 4 <= killed_at < 25  # it really was stopped mid-run
    assert subprocess.run(_batch_cmd(inp, out), cwd=ROOT, env=env, capture_output=True,
                          timeout=300).returncode == 0
    got, want = _records(out), _records(ref)
    key = lambda r: str(r.get("id", r.get("line")))  # noqa: E731
    assert sorted(map(key, got)) == sorted(map(key, want))  # every id exactly once
    assert len(got) == 25
    assert sorted(got, key=key) == sorted(want, key=key)
