"""The offline batch runner: results, error records, logprobs and prompt logprobs,
bad_words and allowed_token_ids, exactly-once resume, error records retried, duplicate
ids and bad paths refused before the model loads."""

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
    [1, 2],
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
    assert records["line3"]["error"] == ("line 3 is not valid JSON: Expecting property "
                                         "name enclosed in double quotes (column 2)")
    assert records["c"]["error"].startswith("temperature=-1 must be")
    assert "unknown field(s) ['bogus']" in records["e"]["error"]
    assert records["line7"]["error"] == "the line has no 'id'"
    assert records["line9"]["error"] == "line 9 is not a JSON object"
    assert "the prompt has" in records["7"]["error"]  # too long, id given as a number
    assert summary["retried"] == 0 and summary["skipped"] == 0


def test_batch_resume_skips_done_ids_and_cuts_a_torn_line(llm, tmp_path):
    _write_input(tmp_path / "in.jsonl")
    out = tmp_path / "out.jsonl"
    out.write_text(json.dumps({"id": "a", "text": "earlier", "token_ids": []}) + "\n"
                   + '{"id": "b", "te')  # a crash mid-write
    summary = batch.run(llm, tmp_path / "in.jsonl", out, progress=False)
    assert summary["skipped"] == 1  # "a"
    keys = sorted((r.get("id", ""), r.get("line", 0)) for r in _records(out))
    assert keys == [("", 3), ("", 7), ("", 9), ("7", 10), ("a", 0), ("b", 0), ("c", 4),
                    ("d", 0), ("e", 6), ("f", 0)]  # every id once; id-less bad lines by number
    assert _records(out)[0]["text"] == "earlier"
    kept = batch.run(llm, tmp_path / "in.jsonl", out, progress=False, retry_errors=False)
    assert kept["done"] == kept["errors"] == kept["retried"] == 0 and kept["skipped"] == 10
    again = batch.run(llm, tmp_path / "in.jsonl", out, progress=False)
    assert again["done"] == 0 and again["errors"] == again["retried"] == 6
    assert sorted((r.get("id", ""), r.get("line", 0)) for r in _records(out)) == keys


def test_a_rerun_retries_error_records_once_the_input_is_fixed(llm, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    good = {"id": "g", "prompt": "import os\n", "max_tokens": 4, "temperature": 0.0}
    bad = {"id": "c", "prompt": "x", "max_tokens": 4, "temperature": -1}
    inp.write_text(f"{json.dumps(good)}\n{json.dumps(bad)}\n{{oops\n")
    first = batch.run(llm, inp, out, progress=False)
    assert (first["done"], first["errors"]) == (1, 2)
    fixed = dict(bad, temperature=0.0)
    inp.write_text(f"{json.dumps(good)}\n{json.dumps(fixed)}\n"
                   + json.dumps({"id": "n", "prompt": "y", "max_tokens": 2}) + "\n")
    kept = batch.run(llm, inp, out, progress=False, retry_errors=False)
    assert (kept["done"], kept["errors"], kept["skipped"]) == (1, 0, 2)  # "n" is new
    assert [r.get("id") for r in _records(out)] == [None, "c", "g", "n"]
    again = batch.run(llm, inp, out, progress=False)
    assert (again["done"], again["errors"], again["skipped"], again["retried"]) == (1, 0, 2, 2)
    records = _records(out)
    assert [r["id"] for r in records] == ["g", "n", "c"]  # each id once, no error left
    assert not any("error" in r for r in records)
    assert records[2]["token_ids"] == llm.generate(
        "x", SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)[0].token_ids
    assert not list(tmp_path.glob(".out.jsonl.*"))  # the rewrite left no temporary file


def test_a_duplicate_id_refuses_the_file_naming_both_lines(llm, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join(json.dumps(x) for x in [
        {"id": "a", "prompt": "x"}, {"id": 7, "prompt": "y"}, {"id": "b", "prompt": "z"},
        {"id": "7", "prompt": "w"}]) + "\n")
    with pytest.raises(ValueError, match=r"id '7' is on line 2 and on line 4; each id "
                                         r"must be unique"):
        batch.run(llm, inp, out, progress=False)
    assert not out.exists()


def test_bad_paths_are_refused_before_any_work(llm, tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"id": "a", "prompt": "x"}) + "\n")
    cases = [(tmp_path / "missing.jsonl", tmp_path / "out.jsonl", "no such file"),
             (tmp_path, tmp_path / "out.jsonl", "is not a readable file"),
             (inp, tmp_path, "is a directory; give a file path"),
             (inp, tmp_path / "nowhere" / "out.jsonl", "does not exist")]
    for source, sink, message in cases:
        with pytest.raises(ValueError, match=message):
            batch.run(llm, source, sink, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


def test_batch_cli_checks_the_files_before_loading_the_model(tmp_path):
    """A model directory that does not exist would fail the load: these errors must
    come first."""
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"id": "a", "prompt": "x"}) + "\n"
                   + json.dumps({"id": "a", "prompt": "y"}) + "\n")
    env = dict(os.environ, JAX_PLATFORMS="cpu")

    def cli(source, sink):
        return subprocess.run(
            [sys.executable, "-m", "jaxinfer", "batch", f"--input={source}",
             f"--output={sink}", f"--model={tmp_path / 'no-model'}"], cwd=ROOT, env=env,
            capture_output=True, text=True, timeout=300)

    missing = cli(tmp_path / "missing.jsonl", tmp_path / "out.jsonl")
    assert missing.returncode == 1
    assert f"--input='{tmp_path / 'missing.jsonl'}': no such file" in missing.stderr
    directory = cli(inp, tmp_path)
    assert directory.returncode == 1 and "--output=" in directory.stderr
    assert "is a directory" in directory.stderr
    duplicate = cli(inp, tmp_path / "out.jsonl")
    assert duplicate.returncode == 1
    assert "id 'a' is on line 1 and on line 2" in duplicate.stderr
    assert not (tmp_path / "out.jsonl").exists()


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


def test_batch_lines_take_bad_words_and_allowed_token_ids(llm, tmp_path):
    common = {"prompt": "import os\n", "max_tokens": 6, "temperature": 0.0}
    lines = [{"id": "free", **common}, {"id": "bad", **common, "bad_words": ["from"]},
             {"id": "allowed", **common, "allowed_token_ids": [7, 8]},
             {"id": "empty", **common, "allowed_token_ids": []}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    batch.run(llm, tmp_path / "in.jsonl", tmp_path / "out.jsonl", progress=False)
    records = {r["id"]: r for r in _records(tmp_path / "out.jsonl")}
    assert records["free"]["text"].startswith("from")  # the demo model's greedy start
    assert not records["bad"]["text"].startswith("from")
    assert set(records["allowed"]["token_ids"]) <= {7, 8}
    assert records["empty"]["error"].startswith("allowed_token_ids must be None or a "
                                                "non-empty list")


def test_batch_cli(tmp_path):
    _write_input(tmp_path / "in.jsonl")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    result = subprocess.run(
        [sys.executable, "-m", "jaxinfer", "batch", f"--input={tmp_path / 'in.jsonl'}",
         f"--output={tmp_path / 'out.jsonl'}", "--max_num_seqs=4",
         "--max_num_batched_tokens=32", "--format=json"], cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 3, result.stderr  # lines failed: docs/cli.md#exit-codes
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
                          timeout=300).returncode == 3  # the broken line
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
                          timeout=300).returncode == 3
    got, want = _records(out), _records(ref)
    key = lambda r: str(r.get("id", r.get("line")))  # noqa: E731
    assert sorted(map(key, got)) == sorted(map(key, want))  # every id exactly once
    assert len(got) == 25
    assert sorted(got, key=key) == sorted(want, key=key)


def _cli_without_ray(*args):
    """The CLI in a process where `import ray` fails, as in an install without the extra."""
    code = ("import sys; sys.modules['ray'] = None; from jaxinfer.cli import run; "
            f"run(['jaxinfer', 'batch', *{list(args)!r}])")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_batch_cli_ray_flags_refused_with_a_reason(tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(json.dumps({"id": "a", "prompt": "x"}) + "\n")
    files = [f"--input={inp}", f"--output={out}"]
    missing = _cli_without_ray("--ray", *files)
    assert missing.returncode == 2
    assert "pip install 'jaxinfer[ray]'" in missing.stderr
    multi_host = _cli_without_ray("--ray", *files, "--coordinator_address=127.0.0.1:9",
                                  "--num_processes=2", "--process_id=1")
    assert multi_host.returncode == 2  # refused, not waiting for a coordinator
    assert "--ray cannot be combined with --coordinator_address" in multi_host.stderr
    no_ray = _cli_without_ray("--num_replicas=2", *files)
    assert no_ray.returncode == 2 and "--num_replicas needs --ray" in no_ray.stderr
    assert not out.exists()


def test_importing_jaxinfer_and_its_batch_runner_does_not_import_ray():
    code = ("import sys, jaxinfer, jaxinfer.batch, jaxinfer.cli.main; "
            "jaxinfer.LLM; print('ray' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.stdout.strip() == "False", result.stderr
