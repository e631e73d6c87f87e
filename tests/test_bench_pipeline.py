"""benchmarks/bench_pipeline.py: the workload's token lengths with the demo tokenizer, the
output checks and the report's rows; the whole script on a few documents (slow)."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import types

import pytest

from jaxinfer.config import DEFAULT_MODEL
from jaxinfer.text.corpus import corpus_files, read_texts
from jaxinfer.text.tokenizer import Tokenizer

BENCHMARKS = pathlib.Path(__file__).parents[1] / "benchmarks"


def _load(name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


report = _load("pipeline_report")
workload = _load("pipeline_workload")

NUM_DOCS = 24


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def records(tokenizer: Tokenizer) -> list[dict]:
    return workload.build(tokenizer, NUM_DOCS, seed=0)


def test_workload_token_lengths(tokenizer, records):
    preamble = len(tokenizer.encode(workload.PREAMBLE, add_special_tokens=False))
    assert 220 <= preamble <= 260
    assert len(records) == NUM_DOCS
    for record in records:
        prompt = len(tokenizer.prompt_ids(record["prompt"]))  # as the engine and audit do
        assert record["prompt"].startswith(workload.PREAMBLE)
        assert 60 <= prompt - preamble <= 160
        assert 32 <= record["max_tokens"] <= 96
        assert prompt + record["max_tokens"] <= workload.MAX_MODEL_LEN
        assert record["_tokens"] == {"preamble": preamble, "document": prompt - preamble,
                                     "prompt": prompt, "total": prompt + record["max_tokens"]}
    shape = workload.shape(records)
    assert shape["preamble_tokens"] == preamble
    assert shape["max_total_tokens"] <= workload.MAX_MODEL_LEN


def test_documents_are_held_out_lines_and_distinct(records):
    held_out = read_texts(corpus_files()[1])
    docs = [r["prompt"].removeprefix(workload.PREAMBLE) for r in records]
    assert len(set(docs)) == len(docs)
    for doc in docs:
        assert doc.endswith("\n")  # cut at a line boundary
        assert any(("\n" + doc) in text or text.startswith(doc) for text in held_out)


def test_workload_is_seeded(tokenizer, records):
    again = workload.build(tokenizer, NUM_DOCS, seed=0)
    assert again == records
    other = workload.build(tokenizer, NUM_DOCS, seed=1)
    assert [r["prompt"] for r in other] != [r["prompt"] for r in records]


def test_jsonl_lines_are_batch_requests(records, tmp_path):
    path = tmp_path / "in.jsonl"
    workload.write_jsonl(records, path)
    lines = [json.loads(raw) for raw in path.read_text().splitlines()]
    assert [line["id"] for line in lines] == [r["id"] for r in records]
    for line in lines:
        assert set(line) == {"id", "prompt", "max_tokens", "temperature", "ignore_eos"}
        assert line["temperature"] == 0 and line["ignore_eos"] is True


def test_output_comparisons():
    base = {"a": [1, 2, 3, 4], "b": [5, 6], "c": [7, 8]}
    other = {"a": [1, 2, 9, 4], "b": [5, 6], "c": [8, 8]}
    assert workload.differing_ids(base, other) == ["a", "c"]
    assert workload.differing_ids(base, {"a": [1, 2, 3, 4], "b": [5, 6]}) == ["c"]
    assert workload.first_differences(base, other, ["a", "c"]) == {
        "a": {"position": 2, "length": 4}, "c": {"position": 0, "length": 2}}
    # positions before the first difference: a 2, b 2, c 0 of 8; equal positions: 3, 2, 1
    assert workload.agreement(base, other) == {
        "prefix_share": 0.5, "position_share": 0.75, "identical_share": round(1 / 3, 4)}


def test_static_batches_in_order(tmp_path):
    ids = ["0", "1", "2", "3", "4"]
    path = tmp_path / "out.jsonl"

    def check(order: list[str]) -> bool:
        path.write_text("".join(json.dumps({"id": i}) + "\n" for i in order))
        return workload.static_batches_in_order(path, ids, size=2)

    assert check(["1", "0", "3", "2", "4"])
    assert not check(["1", "2", "0", "3", "4"])  # 2 finished before batch (0, 1) had
    assert not check(["0", "1", "2", "3"])  # one missing


def test_last_json_object_after_logs():
    summary = {"done": 3, "engine": {"steps": 7}}
    text = "I1126 log line {not json}\nrequests: 100%\r\n" + json.dumps(summary, indent=1)
    assert report.last_json_object(text + "\n") == summary
    assert report.last_json_object(json.dumps(summary, indent=1)) == summary


def _summary(seconds: float, computed: int, cached: int) -> dict:
    return {"seconds": seconds, "done": 10, "errors": 0, "completion_tokens": 600,
            "engine": {"prompt_tokens": computed, "prompt_tokens_cached": cached,
                       "roofline_fraction": 0.1, "steps": 5}}


def test_rows_ratios_costs_and_audit_gap():
    base = report.arm_row(_summary(36.0, 3000, 0), 50.0, num_docs=10, price_per_hour=2.0,
                          base=None)
    assert base["startup_seconds"] == 14.0
    assert base["output_tokens_per_s"] == round(600 / 36, 1)
    assert base["cost_per_1000_docs"] == 2.0  # 36 s at 2 / hour = 0.02, for 10 documents
    assert base["mfu"] is None and base["acceptance_rate"] is None
    cached = report.arm_row(_summary(12.0, 1200, 1800), 20.0, num_docs=10,
                            price_per_hour=2.0, base=base, previous=base)
    assert cached["factor_over_first_arm"] == 3.0
    assert cached["factor_over_previous_arm"] == 3.0
    assert cached["prefill_share_of_first_arm"] == 0.4
    assert cached["prefill_tokens_computed_per_doc"] == 120.0
    rows = {"static": base, "prefix_cache": cached}
    audit = {"projected_prefill_saving": 0.64, "served_tokens": 1920}
    gap = report.prefill_vs_audit(rows, audit, "prefix_cache")
    assert gap["projected_share"] == 0.36 and gap["gap_points"] == 4.0
    assert not gap["within_1_point"] and gap["cached_tokens_missed"] == 120 and "why" in gap
    wall = report.memory_wall_rows(rows, "static", ["prefix_cache", "speculative"])
    assert [r["row"].split(" ")[0] for r in wall][:2] == ["device", "device"]
    assert wall[-2] == {"row": "total runtime (s, without start-up)", "before": 36.0,
                        "after_prefix_cache": 12.0}
    table = report.markdown({"arms": rows, "memory_wall": wall})
    assert "| prefix_cache | 12.0 |" in table and "| 3.0x | **3.0x** |" in table
    assert report.notes(rows, "kv_int8") == [
        "prefix_cache: 3.0x over the arm before, 3.0x over static"]


def test_notes_say_where_an_arm_gains_nothing():
    base = report.arm_row(_summary(10.0, 3000, 0), 20.0, num_docs=10, price_per_hour=1.0,
                          base=None)
    rows = {"static": base}
    for name, seconds in (("speculative", 9.9), ("quantized", 11.0)):
        rows[name] = report.arm_row(_summary(seconds, 1200, 1800), 20.0, num_docs=10,
                                    price_per_hour=1.0, base=base,
                                    previous=rows[list(rows)[-1]])
    said = report.notes(rows, "w8a8")
    assert any(n.startswith("speculative: little or no gain") for n in said)
    assert any(n.startswith("quantized (w8a8) does not pay") for n in said)


@pytest.mark.slow
def test_whole_script_on_a_few_documents(tmp_path):
    """Every arm, audit and eval_ppl on 4 documents: the JSON's shape and the checks."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(BENCHMARKS.parent),
                                                      env.get("PYTHONPATH")]))
    chart = tmp_path / "pipeline.png"
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / "bench_pipeline.py"), "--num_docs=4",
         "--max_num_seqs=2", "--max_num_batched_tokens=512", "--eval_files=1",
         "--eval_tokens_per_file=64", f"--chart={chart}", f"--workdir={tmp_path}"],
        env=env, capture_output=True, text=True, check=False, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    arms = ["static", "continuous", "prefix_cache", "speculative", "quantized"]
    assert list(result["arms"]) == arms
    for row in result["arms"].values():
        assert row["documents_done"] == 4 and row["errors"] == 0
        assert row["output_tokens"] == result["workload"]["output_tokens"]["sum"]
    assert result["arms"]["speculative"]["acceptance_rate"] is not None
    checks = result["checks"]
    share = checks["prefill_vs_audit"]  # the cache serves at most what audit projects
    assert 0 < share["projected_share"] <= share["measured_share"] < 1
    assert share["measured_share"] == result["arms"]["prefix_cache"][
        "prefill_share_of_first_arm"]
    assert checks["static_batches_in_input_order"]
    assert isinstance(checks["identical_outputs"], bool)
    assert checks["identical_outputs"] == (not checks["differing_ids"])
    assert set(checks["quantized_agreement"]) == {"prefix_share", "position_share",
                                                  "identical_share"}
    assert result["quantized_accuracy"]["ratio"] > 0
    assert 0 < result["audit"]["projected_prefill_saving"] < 1
    assert chart.stat().st_size > 0
