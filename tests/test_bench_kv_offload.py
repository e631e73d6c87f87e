"""benchmarks/bench_kv_offload.py end to end at its --small size on CPU: with the host
tier on, repeats of an evicted preamble hit host memory, fewer prompt tokens are
computed, the greedy outputs equal the arm without it, and nothing compiles after
warm-up. Counts only, no timings."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_kv_offload.py"


def test_host_tier_cuts_prompt_tokens_at_a_tiny_size():
    done = subprocess.run([sys.executable, str(SCRIPT), "--small"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    off, on = report["arms"]["off"], report["arms"]["on"]
    work = report["workload"]

    assert report["outputs_equal"] is True
    assert report["requests_with_equal_outputs"] == work["requests"]
    assert off["compiles_after_warmup"] == on["compiles_after_warmup"] == 0
    assert off["generated_tokens"] == on["generated_tokens"] > 0
    # off: the pool keeps fewer preambles than come between two uses of one, so every
    # prompt token is computed; on: every repeat finds its preamble in host memory
    assert off["prompt_tokens_computed"] == work["prompt_tokens"]
    assert off["hit_tokens_host"] == off["kv_offload_bytes_to_host"] == 0
    assert on["hit_tokens_host"] > 0
    assert on["prompt_tokens_computed"] < off["prompt_tokens_computed"]
    assert on["prompt_tokens_computed"] + on["prompt_tokens_cached"] == work["prompt_tokens"]
    repeats = (work["questions"] - 1) * work["num_preambles"]
    hits = on["hit_tokens_host"] + on["hit_tokens_device"]
    assert hits >= repeats * work["preamble_tokens"]
    assert on["kv_offload_bytes_to_host"] > 0 and on["kv_offload_bytes_to_device"] > 0
    assert report["prompt_tokens_computed_off_over_on"] > 1
