"""The prompt-overlap audit: exact served tokens, the CLI on JSONL with the real
tokenizer, and its projection equal to what the engine's cache serves."""

from __future__ import annotations

import json
import subprocess
import sys

from jaxinfer import SamplingParams
from jaxinfer.cli import audit
from jaxinfer.config import EngineConfig
from jaxinfer.engine.engine import Engine

A, B = [1, 2, 3, 4], [5, 6, 7, 8]


def test_overlap_serves_leading_full_pages_but_never_the_last_token():
    prompts = [A + B + [9], A + B + [10, 11], A + [12], A + B, A + B + [9], [1, 2, 3, 5]]
    result = audit.overlap(prompts, page_size=4)
    assert result["served_per_prompt"] == [0, 8, 4, 4, 8, 0]
    assert result["prompt_tokens"] == 9 + 10 + 5 + 8 + 9 + 4
    assert result["served_tokens"] == 24
    assert result["projected_prefill_saving"] == round(24 / 45, 4)
    assert sorted((r["tokens"], r["prompts_served"], r["example"])
                  for r in result["shared_prefixes"]) == [(4, 2, 2), (8, 2, 1)]


def _write_prompts(path, texts):
    with open(path, "w", encoding="utf-8") as f:
        for i, text in enumerate(texts):
            f.write(json.dumps({"id": i, "prompt": text}) + "\n")
        f.write("not json\n")


def test_audit_command_reads_jsonl_with_the_model_tokenizer(tmp_path, hf_model_dirs):
    system = "You are a careful assistant. Answer briefly.\n"
    texts = [system + q for q in ("What is 2+2?", "Name a colour.", "Why is the sky blue?")]
    _write_prompts(tmp_path / "p.jsonl", texts)
    out = subprocess.run([sys.executable, "-m", "jaxinfer", "audit",
                          f"--model={hf_model_dirs['llama']}", f"--input={tmp_path / 'p.jsonl'}",
                          "--page_size=8", "--format=json"], capture_output=True, text=True,
                         check=True)
    report = json.loads(out.stdout)
    shared = len(system) // 8 * 8  # byte tokenizer (no BOS here): one token per byte
    assert report["served_tokens"] == 2 * shared
    assert report["longest_shared_prefixes"][0] == {
        "tokens": shared, "prompts_served": 2, "text": system[:shared]}
    assert report["errors"][0]["line"] == 4


def test_audit_projection_equals_the_engine_hits_one_request_at_a_time(hf_model_dirs):
    prompts = [A * 5 + [9, 9], A * 5 + [7], A * 3 + B + [1], B * 4, A * 5 + [9, 9]]
    engine = Engine(hf_model_dirs["llama"], EngineConfig(
        page_size=4, max_num_seqs=1, max_num_batched_tokens=16, max_model_len=64,
        compilation_cache_dir=""))
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=2, temperature=0.0))
    while engine.has_unfinished():
        engine.step()
    served = [engine.release(str(i)).num_cached_tokens for i in range(len(prompts))]
    assert served == audit.overlap(prompts, page_size=4)["served_per_prompt"] == \
        [0, 20, 12, 0, 20]
