"""The batch runner in OpenAI's batch format (docs/batch.md#openais-batch-format): a file of
completions and chat lines, killed mid-run and resumed, writes each custom_id once, each
line in OpenAI's batch output schema, the bodies as the server answers them (the texts of
a greedy LLM.generate); failed lines are error lines and the exit code says so; a
duplicate custom_id, or a line without one, refuses the file before the model loads."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import jsonschema
import pytest

from jaxinfer import LLM, batch

ROOT = pathlib.Path(__file__).resolve().parent.parent
DEMO = ROOT / "checkpoints" / "demo"
ENGINE_FLAGS = ["--max_num_seqs=4", "--max_num_batched_tokens=32"]  # test_batch.py's
NUM_LINES = 200
BAD_BODY, BAD_URL = 50, 100  # line indexes of the two lines that fail

# OpenAI's BatchRequestOutput ("the per-line object of the batch output and error files",
# OpenAI's openapi.yaml), each field as it documents it; all four are always written.
BATCH_OUTPUT = {
    "type": "object",
    "required": ["id", "custom_id", "response", "error"],
    "properties": {
        "id": {"type": "string"},
        "custom_id": {"type": "string"},
        "response": {
            "type": ["object", "null"],
            "required": ["status_code", "request_id", "body"],
            "properties": {"status_code": {"type": "integer"},
                           "request_id": {"type": "string"},
                           "body": {"type": "object"}},
        },
        "error": {
            "type": ["object", "null"],
            "required": ["code", "message"],
            "properties": {"code": {"type": "string"}, "message": {"type": "string"}},
        },
    },
}
USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
         "properties": {k: {"type": "integer"} for k in ("prompt_tokens", "completion_tokens",
                                                        "total_tokens")}}
# The response bodies' documented fields (OpenAI's Completion and ChatCompletion objects).
COMPLETION = {
    "type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
    "properties": {
        "id": {"type": "string"}, "object": {"const": "text_completion"},
        "created": {"type": "integer"}, "model": {"const": "demo"}, "usage": USAGE,
        "choices": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["index", "text", "logprobs", "finish_reason"],
            "properties": {"index": {"type": "integer"}, "text": {"type": "string"},
                           "finish_reason": {"enum": ["stop", "length"]},
                           "logprobs": {"type": ["object", "null"]}}}},
    },
}
CHAT = {
    "type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
    "properties": {
        "id": {"type": "string"}, "object": {"const": "chat.completion"},
        "created": {"type": "integer"}, "model": {"const": "demo"}, "usage": USAGE,
        "choices": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["index", "message", "logprobs", "finish_reason"],
            "properties": {"index": {"type": "integer"},
                           "finish_reason": {"enum": ["stop", "length"]},
                           "logprobs": {"type": ["object", "null"]},
                           "message": {"type": "object", "required": ["role", "content"],
                                       "properties": {"role": {"const": "assistant"},
                                                      "content": {"type": "string"}}}}}},
    },
}


def _line(i: int) -> dict:
    """Line i: completions on even lines, chat on odd ones, greedy, 8 tokens or fewer."""
    if i % 2 == 0:
        url, body = "/v1/completions", {"prompt": f"def f{i}(x):", "max_tokens": 8}
        if i % 20 == 2:
            body["logprobs"] = 2
    else:
        url = "/v1/chat/completions"
        body = {"messages": [{"role": "user", "content": f"write function number {i}"}]}
        body["max_completion_tokens" if i % 4 == 3 else "max_tokens"] = 8
        if i % 20 == 3:
            body |= {"logprobs": True, "top_logprobs": 2}
    body |= {"temperature": 0.0} | ({"model": "demo"} if i % 3 else {})
    if i == BAD_BODY:
        body["bogus"] = 1
    if i == BAD_URL:
        url, body = "/v1/embeddings", {"model": "demo", "input": "x"}
    return {"custom_id": f"q{i}", "method": "POST", "url": url, "body": body}


def _write(path: pathlib.Path, lines: list[dict]) -> None:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def _records(path: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _cli(inp: pathlib.Path, out: pathlib.Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "jaxinfer", "batch", f"--input={inp}", f"--output={out}",
            "--format=json", *ENGINE_FLAGS, *extra]


def _summary(stderr: str) -> dict:
    return json.loads(stderr[stderr.index("{\n"):])


@pytest.fixture(scope="module")
def run_killed_and_resumed(tmp_path_factory):
    """The CLI over NUM_LINES lines, killed with SIGKILL mid-run, then run again: (the
    output, the records written when it was killed, the second run's summary, exit code
    and stderr)."""
    tmp = tmp_path_factory.mktemp("openai")
    inp, out = tmp / "in.jsonl", tmp / "out.jsonl"
    _write(inp, [_line(i) for i in range(NUM_LINES)])
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.Popen(_cli(inp, out), cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while time.time() < deadline and (not out.exists() or out.read_text().count("\n") < 30):
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed = _records(out)
    second = subprocess.run(_cli(inp, out), cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=600)
    return out, killed, _summary(second.stderr), second.returncode, second.stderr


def test_a_killed_run_resumed_writes_each_custom_id_once_in_openais_schema(
        run_killed_and_resumed):
    out, killed, summary, code, stderr = run_killed_and_resumed
    assert 30 <= len(killed) < NUM_LINES, "it really was stopped mid-run"
    assert code == batch.FAILED_LINES_EXIT == 3, stderr[-3000:]  # two lines failed
    records = _records(out)
    assert len(records) == NUM_LINES
    assert sorted(r["custom_id"] for r in records) == sorted(f"q{i}" for i in range(NUM_LINES))
    ids = [r["id"] for r in records] + [r["response"]["request_id"] for r in records
                                        if r["response"] is not None]
    assert len(set(ids)) == len(ids)  # every id and request id its own
    for record in records:
        jsonschema.validate(record, BATCH_OUTPUT)
        assert record["id"].startswith("batch_req_")
        if record["error"] is None:
            i = int(record["custom_id"][1:])
            assert record["response"]["status_code"] == 200
            assert record["response"]["request_id"].startswith("req_")
            jsonschema.validate(record["response"]["body"], CHAT if i % 2 else COMPLETION)
    # the re-run skipped what the killed run had written but its error lines, which it ran
    # again (the url error at once, the bad body's when its answer had come back)
    failed_before = sum(r["error"] is not None for r in killed)
    assert 1 <= failed_before <= 2 and summary["retried"] == failed_before
    assert summary["skipped"] == len(killed) - failed_before
    assert summary["done"] == NUM_LINES - 2 - summary["skipped"]
    assert (summary["errors"], summary["kept_errors"]) == (2, 0)
    assert [r for r in records if r["custom_id"] in {k["custom_id"] for k in killed}
            and r["error"] is None] == [k for k in killed if k["error"] is None]  # kept as is


def test_failed_lines_are_error_lines_naming_the_field_or_url(run_killed_and_resumed):
    records = {r["custom_id"]: r for r in _records(run_killed_and_resumed[0])}
    assert {k for k, r in records.items() if r["error"] is not None} == {
        f"q{BAD_BODY}", f"q{BAD_URL}"}
    bad_body = records[f"q{BAD_BODY}"]
    assert bad_body["response"]["status_code"] == 400  # the server's own 400
    assert bad_body["response"]["body"] == {"error": {
        "message": "bogus: unknown or unsupported parameter", "type": "invalid_request_error",
        "param": "bogus", "code": None}}
    assert bad_body["error"] == {"code": "invalid_request_error",
                                 "message": "bogus: unknown or unsupported parameter"}
    bad_url = records[f"q{BAD_URL}"]
    assert bad_url["response"] is None
    assert bad_url["error"]["code"] == "unsupported_url"
    assert "url '/v1/embeddings' is not supported" in bad_url["error"]["message"]


@pytest.fixture(scope="module")
def llm():
    return LLM(DEMO, max_num_seqs=4, max_num_batched_tokens=32, warm_up=False)


def test_bodies_are_what_the_server_answers(run_killed_and_resumed, llm):
    records = {r["custom_id"]: r for r in _records(run_killed_and_resumed[0])}
    # the server's sampling: the body's fields over the checkpoint's defaults
    greedy = dataclasses.replace(llm.engine.default_params, max_tokens=8, temperature=0.0)
    picked = [0, 2, 4, 102, 198]
    wants = llm.generate([_line(i)["body"]["prompt"] for i in picked], greedy, use_tqdm=False)
    for i, want in zip(picked, wants, strict=True):
        body = records[f"q{i}"]["response"]["body"]
        (choice,) = body["choices"]
        assert choice["text"] == want.text and choice["finish_reason"] == want.finish_reason
        assert body["usage"] == {"prompt_tokens": len(want.prompt_token_ids),
                                 "completion_tokens": len(want.token_ids),
                                 "total_tokens": len(want.prompt_token_ids)
                                 + len(want.token_ids),
                                 "prompt_tokens_details": body["usage"]["prompt_tokens_details"]}
    for i in (1, 3, 101, 199):
        messages = _line(i)["body"]["messages"]
        (want,) = llm.chat(messages, greedy, use_tqdm=False)
        (choice,) = records[f"q{i}"]["response"]["body"]["choices"]
        assert choice["message"] == {"role": "assistant", "content": want.text}
        assert records[f"q{i}"]["response"]["body"]["usage"]["prompt_tokens"] == len(
            want.prompt_token_ids)


def test_logprobs_take_each_routes_openai_shape(run_killed_and_resumed):
    records = {r["custom_id"]: r for r in _records(run_killed_and_resumed[0])}
    (completion,) = records["q2"]["response"]["body"]["choices"]
    logprobs = completion["logprobs"]
    assert sorted(logprobs) == ["text_offset", "token_logprobs", "tokens", "top_logprobs"]
    assert "".join(logprobs["tokens"]) == completion["text"]
    assert all(len(top) <= 2 and isinstance(next(iter(top)), str)  # keyed by token text
               for top in logprobs["top_logprobs"])
    (chat,) = records["q3"]["response"]["body"]["choices"]
    content = chat["logprobs"]["content"]
    assert "".join(entry["token"] for entry in content) == chat["message"]["content"]
    for entry in content:
        assert sorted(entry) == ["bytes", "logprob", "token", "top_logprobs"]
        assert len(entry["top_logprobs"]) == 2
    assert records["q4"]["response"]["body"]["choices"][0]["logprobs"] is None


def test_a_rerun_keeping_errors_runs_nothing_and_still_says_lines_failed(
        run_killed_and_resumed, llm, tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_bytes(run_killed_and_resumed[0].read_bytes())
    inp = tmp_path / "in.jsonl"
    _write(inp, [_line(i) for i in range(NUM_LINES)])
    kept = batch.run(llm, inp, out, progress=False, retry_errors=False)
    assert (kept["done"], kept["errors"], kept["kept_errors"], kept["skipped"]) == (
        0, 0, 2, NUM_LINES)
    assert batch.exit_code(kept) == 3
    assert out.read_bytes() == run_killed_and_resumed[0].read_bytes()
    fixed = [_line(i) for i in range(NUM_LINES)]
    fixed[BAD_BODY]["body"].pop("bogus")
    _write(inp, fixed)
    again = batch.run(llm, inp, out, progress=False)  # the default retries the 2 errors
    assert (again["done"], again["errors"], again["retried"]) == (1, 1, 2)
    assert batch.exit_code(again) == 3  # /v1/embeddings still fails
    records = _records(out)
    assert len(records) == NUM_LINES and len({r["custom_id"] for r in records}) == NUM_LINES
    (fixed_record,) = [r for r in records if r["custom_id"] == f"q{BAD_BODY}"]
    assert fixed_record["error"] is None
    greedy = dataclasses.replace(llm.engine.default_params, max_tokens=8, temperature=0.0)
    assert fixed_record["response"]["body"]["choices"][0]["text"] == llm.generate(
        fixed[BAD_BODY]["body"]["prompt"], greedy, use_tqdm=False)[0].text


def test_a_duplicate_custom_id_refuses_the_file_before_the_model_loads(tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(inp, [_line(i) for i in range(NUM_LINES)] + [dict(_line(5), url="/v1/completions")])
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    result = subprocess.run(_cli(inp, out, f"--model={tmp_path / 'no-model'}"), cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stderr
    assert (f"custom_id 'q5' is on line 6 and on line {NUM_LINES + 1}; each custom_id must "
            "be unique") in result.stderr
    assert not out.exists()


@pytest.mark.parametrize(("bad", "message"), [
    ("{oops", "line 2 is not valid JSON"),
    (json.dumps([1]), "line 2 is not a JSON object"),
    (json.dumps({"id": "a", "prompt": "x"}), "line 2 has no 'custom_id'"),
    (json.dumps({"custom_id": 7, "method": "POST"}), "line 2: 'custom_id' must be a string, "
                                                     "not 7"),
])
def test_a_line_without_a_custom_id_refuses_the_file(tmp_path, bad, message):
    """Its output line would have no custom_id: OpenAI's Batch API refuses such a file too."""
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps(_line(0)) + "\n" + bad + "\n")
    with pytest.raises(ValueError, match=message) as refused:
        batch.read_requests(inp)
    assert "OpenAI's batch format" in str(refused.value)


def test_line_errors_and_the_format_of_each_file(tmp_path):
    """The format is the first JSON object's; OpenAI lines that name no route are error
    lines; a jaxinfer line with a custom_id is told why it has no id."""
    inp = tmp_path / "in.jsonl"
    lines = [_line(0), dict(_line(1), method="GET"), {"custom_id": "x", "method": "POST",
                                                      "url": "/v1/completions"},
             dict(_line(2), extra=1)]
    inp.write_text("{broken\n" + "".join(json.dumps(x) + "\n" for x in lines[:1]))
    with pytest.raises(ValueError, match="line 1 is not valid JSON"):
        batch.read_requests(inp)  # OpenAI's format, from the first object on line 2
    _write(inp, lines)
    assert batch.detect_format(inp) == batch.OPENAI
    found = batch.read_requests(inp)
    assert [r.id for r in found.pending] == ["q0"] and found.format == batch.OPENAI
    errors = {r["custom_id"]: r["error"] for r in found.errors}
    assert errors["q1"] == {"code": "unsupported_method",
                            "message": "method 'GET' is not supported: a line's method is POST"}
    assert errors["x"] == {"code": "invalid_line", "message": "the line has no 'body'"}
    assert errors["q2"]["message"].startswith("unknown field(s) ['extra']")
    _write(inp, [{"id": "a", "prompt": "x"}, _line(0)])
    found = batch.read_requests(inp)
    assert found.format == batch.JAXINFER
    assert found.errors[0]["error"].startswith("the line has no 'id' (a custom_id is OpenAI's")


def test_one_output_file_holds_one_format(tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(inp, [_line(0)])
    out.write_text(json.dumps({"id": "a", "text": "", "token_ids": []}) + "\n")
    done = batch.finished(out)
    with pytest.raises(ValueError, match="the output already holds records of jaxinfer's"):
        batch.check_formats(inp, done, batch.read_requests(inp, done.ids, done.lines))
