"""examples/grpo.py at a smoke size, as a user runs it: every step samples, trains and
hands the new weights to the engine on device (no bytes from the host). That the
engine then samples from the new weights is tests/engine/test_update_weights.py's."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_grpo_example_runs_steps_and_syncs_weights_on_device():
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "grpo.py"), "--steps=2", "--groups=2",
         "--group_size=4", "--max_tokens=16"],
        capture_output=True, text=True, timeout=900,
        env=os.environ | {"PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr[-3000:]
    steps = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [s["step"] for s in steps] == [0, 1]
    for step in steps:
        assert 0.0 <= step["mean_reward"] <= 1.0
        assert step["sync_bytes_from_host"] == 0  # the trainer's params were on device
        assert step["rollout_s"] > 0 and step["train_s"] > 0 and step["weight_sync_s"] > 0


def test_grpo_batch_invariant_is_exactly_on_policy():
    """With --batch_invariant the trainer's logprobs of the sampled tokens equal the
    engine's bitwise before each optimizer step."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "grpo.py"), "--steps=2", "--groups=2",
         "--group_size=4", "--max_tokens=16", "--batch_invariant"],
        capture_output=True, text=True, timeout=900,
        env=os.environ | {"PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr[-3000:]
    steps = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [s["step"] for s in steps] == [0, 1]
    assert [s["max_logprob_mismatch"] for s in steps] == [0.0, 0.0]
