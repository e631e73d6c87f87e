"""benchmarks/bench_standing_table.py end to end at a tiny size on CPU: each part runs in
its own process, every request finishes with the tokens asked for, and the JSON carries
what docs/benchmarks.md records (date, commit, device, JAX version, settings)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_standing_table.py"
TINY = """[model]
architecture = "llama"
vocab_size = 512
hidden_size = 64
intermediate_size = 128
num_layers = 2
num_heads = 4
num_kv_heads = 2
head_dim = 16
max_position_embeddings = 2048
"""
NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN, MIXED = 6, 8, 4, 3


def test_standing_table_runs_every_part_at_a_tiny_size(tmp_path):
    preset = tmp_path / "tiny.toml"
    preset.write_text(TINY)
    # One request in flight and bench_throughput's batch-1 token budget: the three parts
    # then share every program through the compilation cache, which keeps this short.
    argv = [sys.executable, str(SCRIPT), f"--preset={preset}", f"--num_prompts={NUM_PROMPTS}",
            f"--input_len={INPUT_LEN}", f"--output_len={OUTPUT_LEN}",
            f"--num_requests={MIXED}", "--max_num_seqs=1", "--max_num_batched_tokens=64",
            "--compile_threads=2"]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    table = json.loads(done.stdout)

    assert table["date"] and table["commit"] and table["jax_version"]
    assert (table["device"], table["backend"]) == ("cpu", "cpu")
    assert (table["preset"], table["dtype"]) == (str(preset), "bfloat16")
    assert table["engine"] | {"max_num_seqs": 1, "max_num_batched_tokens": 64} == (
        table["engine"])

    random = table["vllm_random"]
    assert random["requests"] == random["finished_requests"] == NUM_PROMPTS
    assert random["prompt_tokens"] == NUM_PROMPTS * INPUT_LEN
    assert random["generated_tokens"] == NUM_PROMPTS * OUTPUT_LEN
    assert random["compiles_after_warmup"] == 0
    assert random["requests_per_s"] > 0
    assert random["total_tokens_per_s"] > random["output_tokens_per_s"] > 0
    assert random["ratio_to_vllm_published"] > 0
    assert random["vllm_reference"]["measured_here"] is False

    batch1 = table["batch1"]
    assert batch1["decode_tokens_per_s"] > 0 and batch1["weight_bytes"] > 0
    assert batch1["fraction_of_weight_read_bound"] > 0
    assert batch1["fraction_of_published_bandwidth_bound"] is None  # no spec for a CPU

    mixed = table["mixed128"]
    assert mixed["requests"] == mixed["finished_requests"] == MIXED
    assert mixed["generated_tokens"] == mixed["requested_output_tokens"] > 0
    assert mixed["output_tokens_per_s"] > 0
    assert not [part for part in ("vllm_random", "batch1", "mixed128")
                if "error" in table[part]]
