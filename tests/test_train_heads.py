"""tools/train_heads.py at its smallest: a few steps of each head on short corpus windows
(no generation, no held-out figures); the checkpoints load and the loss went down."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from jaxinfer import checkpoint
from jaxinfer.checkpoint.heads import load_head

ROOT = pathlib.Path(__file__).resolve().parent.parent
DEMO = ROOT / "checkpoints" / "demo"
METHODS = ("eagle3", "medusa", "eagle")


@pytest.mark.slow
def test_train_heads_smallest(tmp_path):
    steps = 15
    cmd = [sys.executable, str(ROOT / "tools" / "train_heads.py"), f"--target={DEMO}",
           f"--out={tmp_path}", f"--methods={','.join(METHODS)}", "--gen_prompts=0",
           "--eval_prompts=0", "--windows=8", "--prompt_tokens=32", "--output_tokens=32",
           "--batch=4", "--medusa_rows=128", "--draft_vocab=512", "--medusa_vocab=512",
           "--ttt_steps=2", "--lr=3e-3", *(f"--{m}_steps={steps}" for m in METHODS)]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    target = checkpoint.load_config(DEMO)
    for method in METHODS:
        out = tmp_path / f"demo-{method}"
        report = json.loads((out / "training.json").read_text())
        assert report["steps"] == steps
        assert report["final_loss"] < report["first_loss"], (method, report)
        head, params = load_head(out, target, "float32", method=method)
        assert head.method == method
        if method == "eagle3":
            assert head.draft_vocab_size == 512 and params["lm_head"].shape == (320, 512)
            assert head.feature_layers == (2, 4, 6)
        if method == "medusa":
            assert params["lm_heads"].shape == (4, 320, 512)
            assert params["token_map"].shape == (512,)
        assert (out / "model.safetensors").stat().st_size < 8_000_000
    summary = json.loads(run.stdout)
    assert set(summary["heads"]) == set(METHODS)
