"""Prompt logprobs (SamplingParams.prompt_logprobs) and eval_ppl against transformers:
values and top-k of one-chunk and chunked prompts, a mixed batch, preemption, the
prefix-cache rule, zero compilations after warm-up, and bad inputs."""

from __future__ import annotations

import math
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch

from jaxinfer import LLM, SamplingParams, evaluate
from jaxinfer.config import EngineConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.testing import SPECIAL_TOKENS

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGE_BYTES = 4 * 512  # tiny llama: 2 layers x K,V x 2 kv heads x 16 dims x 4 bytes, 4 tokens
SMALL = dict(page_size=4, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64,
             compilation_cache_dir="", kv_cache_memory_bytes=24 * PAGE_BYTES)
BOS, EOS = 256, 257  # the byte tokenizer's special tokens (jaxinfer.testing)


@pytest.fixture(scope="module")
def llm(hf_model_dirs):
    """A 16-token budget (longer prompts are chunked) and a 24-page pool (preemption);
    strict_compile: any compilation after warm-up raises."""
    return LLM(hf_model_dirs["llama"], **SMALL, enable_prompt_logprobs=True,
               strict_compile=True)


def _reference_logprobs(model, ids: list[int]) -> np.ndarray:
    """f32[len(ids), V]: transformers' log-softmax at each position of one sequence."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1).numpy()


def _check_against(model, prompt: list[int], got: list, k: int) -> None:
    """`got` (RequestOutput.prompt_logprobs) equals transformers' values, ranks, top k."""
    ref = _reference_logprobs(model, prompt)
    assert len(got) == len(prompt) and got[0] is None
    for i in range(1, len(prompt)):
        row, token, entry = ref[i - 1], prompt[i], got[i]
        assert entry[token].logprob == pytest.approx(float(row[token]), abs=1e-4)
        assert entry[token].rank == 1 + int(np.sum(row > row[token]))
        top = np.argsort(-row, kind="stable")[:k].tolist()
        assert set(entry) == set(top) | {token}
        for rank, t in enumerate(top, start=1):
            assert entry[t].rank == rank
            assert entry[t].logprob == pytest.approx(float(row[t]), abs=1e-4)
        assert entry[token].decoded_token == bytes([token]).decode("latin-1") or token > 127


def _prompt(seed: int, length: int) -> list[int]:
    return np.random.RandomState(seed).randint(0, 256, length).tolist()


def test_prompt_logprobs_match_transformers_in_one_chunk_chunked_and_mixed(llm, hf_models):
    model = hf_models["llama"]
    short, long, plain = _prompt(1, 12), _prompt(2, 45), _prompt(3, 20)  # 45 > 16: chunked
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    params = [SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=5),
              SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=0), greedy]
    outs = llm.generate([short, long, plain], params)
    _check_against(model, short, outs[0].prompt_logprobs, 5)
    _check_against(model, long, outs[1].prompt_logprobs, 0)
    assert outs[2].prompt_logprobs is None
    # Scoring changes nothing the requests generate.
    alone = llm.generate([short, long, plain], greedy)
    assert [o.token_ids for o in outs] == [o.token_ids for o in alone]
    assert llm.generate([[7]], params[0])[0].prompt_logprobs == [None]


def test_prompt_logprobs_after_preemption_are_whole_and_unique(llm, hf_models):
    engine = llm.engine
    before = engine.scheduler.num_preemptions
    prompts = [_prompt(10 + i, 40 + i) for i in range(4)]  # 4 x 12+ pages > 24
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0,
                                                prompt_logprobs=2, ignore_eos=True))
    assert engine.scheduler.num_preemptions > before
    for prompt, out in zip(prompts, outs, strict=True):
        _check_against(hf_models["llama"], prompt, out.prompt_logprobs, 2)


def test_prompt_logprobs_take_no_prefix_hits_but_register_pages(llm, hf_models):
    prompt = _prompt(20, 30)
    scored = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    (first,) = llm.generate([prompt], scored)
    (plain,) = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
    (again,) = llm.generate([prompt], scored)
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 0
    assert plain.num_cached_tokens == 28  # the scoring request's 7 full pages
    _check_against(hf_models["llama"], prompt, again.prompt_logprobs, 1)


def test_n_completions_share_one_prompt_logprobs(llm, hf_models):
    prompt = _prompt(30, 18)
    (out,) = llm.generate([prompt], SamplingParams(n=2, max_tokens=3, temperature=0.8,
                                                   seed=1, prompt_logprobs=3))
    assert len(out.outputs) == 2
    _check_against(hf_models["llama"], prompt, out.prompt_logprobs, 3)


def _framed(text: str) -> list[int]:
    return [BOS, *text.encode(), EOS]  # the byte tokenizer: ids are bytes


def _reference_nll(model, files: list[pathlib.Path], window: int) -> tuple[int, float]:
    """Tokens scored and summed NLL over windows overlapping by one, by hand."""
    count, total = 0, 0.0
    for path in files:
        ids = _framed(path.read_text())
        for start in range(0, len(ids) - 1, window - 1):
            piece = ids[start:start + window]
            ref = _reference_logprobs(model, piece)
            total -= sum(float(ref[p, piece[p + 1]]) for p in range(len(piece) - 1))
            count += len(piece) - 1
    return count, total


def test_eval_ppl_equals_transformers_over_the_same_windows(llm, hf_models, tmp_path):
    files = [tmp_path / "a.py", tmp_path / "b.txt"]
    files[0].write_text("import os\n\ndef read(path):\n    return open(path).read()\n")
    files[1].write_text("perplexity of a second, shorter file")
    report = evaluate.perplexity(llm, f"{tmp_path}/*.py,{files[1]}", window=24)
    count, total = _reference_nll(hf_models["llama"], files, 24)
    assert report["tokens"] == count == sum(len(f.read_text()) + 1 for f in files)
    assert report["nll"] == pytest.approx(total / count, rel=1e-5)
    assert report["perplexity"] == pytest.approx(math.exp(total / count), rel=1e-5)
    windows = sum(math.ceil((len(f.read_text()) + 1) / 23) for f in files)
    assert report["files"] == 2 and report["windows"] == windows == 5
    assert llm.metrics()["compiles_after_warmup"] == 0  # strict_compile would have raised


def test_bad_prompt_logprobs_requests_and_eval_inputs_fail_clearly(llm, hf_model_dirs,
                                                                   tmp_path):
    for bad in (-1, 21, True, 1.5):
        with pytest.raises(ValueError, match=r"prompt_logprobs=.* must be None or an int"):
            SamplingParams(prompt_logprobs=bad)
    plain = Engine(hf_model_dirs["llama"], EngineConfig(**SMALL), warm_up=False)
    with pytest.raises(ValueError, match="enable_prompt_logprobs=True"):
        plain.add_request("r", [1, 2, 3], SamplingParams(prompt_logprobs=0))
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        evaluate.perplexity(llm, [tmp_path / "missing.txt"])
    with pytest.raises(FileNotFoundError, match="matches no file"):
        evaluate.perplexity(llm, f"{tmp_path}/*.nothing")
    with pytest.raises(ValueError, match="hold no text"):
        evaluate.perplexity(llm, [empty])
    with pytest.raises(ValueError, match=r"window=64 must be in \[2, 63\]"):
        evaluate.perplexity(llm, [empty], window=64)
    assert SPECIAL_TOKENS[0] == "<|bos|>"  # BOS/EOS ids above assume this tokenizer


def test_eval_ppl_command_reports_missing_input_in_one_line():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, "-m", "jaxinfer", "eval_ppl",
                             "--input=/nonexistent/file.txt"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "jaxinfer: error: eval_ppl: input file '/nonexistent/file.txt' does not exist"]
