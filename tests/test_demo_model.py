"""The bundled demo models: loadable by transformers and by us, same greedy text."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch

from jaxinfer import LLM, SamplingParams, checkpoint

ROOT = pathlib.Path(__file__).resolve().parent.parent
DEMO, DRAFT = ROOT / "checkpoints" / "demo", ROOT / "checkpoints" / "demo-draft"
PROMPT = "import os\n\n\ndef read_lines(path):\n"


@pytest.mark.parametrize("model_dir", [DEMO, DRAFT], ids=["demo", "draft"])
def test_demo_greedy_matches_transformers(model_dir):
    import transformers

    hf_tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = hf_tok(PROMPT)["input_ids"]
    with torch.no_grad():
        # Plain greedy: transformers would apply generation_config.json's
        # repetition_penalty even with do_sample=False.
        want = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False,
                           repetition_penalty=1.0,
                           pad_token_id=hf_tok.eos_token_id)[0, len(ids):].tolist()
    llm = LLM(model=model_dir, max_num_seqs=1, max_num_batched_tokens=32)
    (out,) = llm.generate(PROMPT, SamplingParams(max_tokens=24, temperature=0.0))
    assert out.prompt_token_ids == ids
    assert out.token_ids == want
    assert out.text == hf_tok.decode(want, skip_special_tokens=True)


def test_demo_and_draft_share_the_tokenizer():
    assert (DEMO / "tokenizer.json").read_bytes() == (DRAFT / "tokenizer.json").read_bytes()
    demo, draft = checkpoint.load_config(DEMO), checkpoint.load_config(DRAFT)
    assert demo.vocab_size == draft.vocab_size
    sizes = [sum(int(np.prod(s)) for s in _shapes(d)) for d in (DEMO, DRAFT)]
    assert sizes[0] >= 3 * sizes[1]


def _shapes(model_dir):
    from jaxinfer.checkpoint import safetensors_file

    header, _ = safetensors_file.read_header(model_dir / "model.safetensors")
    return [entry["shape"] for entry in header.values()]


def _cli(*args, cwd=ROOT):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    if args[0] != "convert":  # convert runs no engine: the flag is not its
        args = [*args, "--max_num_batched_tokens=32"]
    return subprocess.run([sys.executable, "-m", "jaxinfer", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_cli_generate_prints_completion_and_orbax_gives_the_same(tmp_path):
    first = _cli("generate", "--prompt=def add(a, b):\n", "--max_tokens=12")
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("def add(a, b):\n")
    assert len(first.stdout) > len("def add(a, b):\n") + 4
    converted = _cli("convert", f"--model={DEMO}", f"--output={tmp_path / 'orbax'}")
    assert converted.returncode == 0, converted.stderr
    second = _cli("generate", f"--model={tmp_path / 'orbax'}", "--prompt=def add(a, b):\n",
                  "--max_tokens=12")
    assert second.returncode == 0, second.stderr
    assert second.stdout == first.stdout


def test_cli_reports_unknown_model_dir(tmp_path):
    result = _cli("generate", f"--model={tmp_path / 'nope'}")
    assert result.returncode != 0
    assert "does not exist" in result.stderr


def test_demo_generation_config_sets_sampled_defaults():
    from jaxinfer.engine import loading

    for model_dir in (DEMO, DRAFT):
        assert loading.default_sampling_params(model_dir) == SamplingParams(
            temperature=0.6, top_p=0.95, repetition_penalty=1.1)
