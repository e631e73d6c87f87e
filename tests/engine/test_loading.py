"""loading.py through the engine: generation_config.json defaults, checkpoints without a
tokenizer (skip_tokenizer_init), attention_impl chosen by the engine, the bandwidth
probe run once per process, an Engine that leaves JAX's compilation cache alone."""

from __future__ import annotations

import json
import shutil

import jax
import pytest

from jaxinfer import LLM, SamplingParams, checkpoint
from jaxinfer.config import EngineConfig
from jaxinfer.engine import loading, runner
from jaxinfer.engine.engine import Engine

SMALL = dict(page_size=8, max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16,
             compilation_cache_dir="")
PROMPTS = [[5, 6, 7, 8], [9, 10]]


def _copy(src, dst, *, drop=(), generation=None):
    shutil.copytree(src, dst)
    for name in drop:
        (dst / name).unlink()
    if generation is not None:
        (dst / "generation_config.json").write_text(json.dumps(generation))
    return dst


def test_generation_config_sets_defaults_of_requests_without_params(hf_model_dirs, tmp_path):
    generation = {"eos_token_id": 257, "temperature": 0.0, "top_p": 0.8, "top_k": 7,
                  "repetition_penalty": 1.0, "max_new_tokens": 5, "do_sample": True}
    model = _copy(hf_model_dirs["llama"], tmp_path / "m", generation=generation)
    llm = LLM(model, warm_up=False, **SMALL)
    assert llm.engine.default_params == SamplingParams(
        temperature=0.0, top_p=0.8, top_k=7, repetition_penalty=1.0, max_tokens=5)
    greedy = SamplingParams(max_tokens=5, temperature=0.0, top_p=0.8, top_k=7)
    defaulted = llm.generate(PROMPTS)  # no params: the checkpoint's (greedy, 5 tokens)
    assert [o.token_ids for o in defaulted] == [o.token_ids for o in llm.generate(PROMPTS,
                                                                                  greedy)]
    assert all(len(o.token_ids) == 5 or o.finish_reason == "stop" for o in defaulted)
    given = SamplingParams(max_tokens=9, temperature=1.0, seed=3, ignore_eos=True)
    plain = LLM(hf_model_dirs["llama"], warm_up=False, **SMALL)
    assert plain.engine.default_params == SamplingParams()
    explicit = llm.generate(PROMPTS, given)  # used as given: same as without the file
    assert [o.token_ids for o in explicit] == [o.token_ids for o in plain.generate(PROMPTS,
                                                                                   given)]
    assert all(len(o.token_ids) == 9 for o in explicit)


def test_generation_config_with_a_bad_value_names_the_file(hf_model_dirs, tmp_path):
    model = _copy(hf_model_dirs["llama"], tmp_path / "m", generation={"top_p": 0})
    with pytest.raises(ValueError, match=r"generation_config.json: top_p=0 must be in"):
        loading.default_sampling_params(model)


def test_skip_tokenizer_init_serves_token_ids_without_tokenizer_files(hf_model_dirs, tmp_path):
    model = _copy(hf_model_dirs["llama"], tmp_path / "m",
                  drop=("tokenizer.json", "tokenizer_config.json"))
    with pytest.raises(FileNotFoundError, match="pass skip_tokenizer_init=True"):
        LLM(model, warm_up=False, **SMALL)
    bare = LLM(model, warm_up=False, skip_tokenizer_init=True, **SMALL)
    assert bare.tokenizer is None
    assert bare.engine.eos_token_ids == {257}  # from config.json / generation_config.json
    params = SamplingParams(max_tokens=6, temperature=0.0)
    with_tokenizer = LLM(hf_model_dirs["llama"], warm_up=False, **SMALL)
    outs = bare.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in with_tokenizer.generate(
        PROMPTS, params)]
    assert all(o.text == "" and o.prompt is None and o.token_ids for o in outs)
    with pytest.raises(ValueError, match="prompt 0: this engine has no tokenizer"):
        bare.generate("def f():", params)
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        bare.generate(PROMPTS, SamplingParams(stop=["\n"]))


def test_attention_impl_is_the_engines_choice_not_the_checkpoints(hf_model_dirs, tmp_path):
    model = _copy(hf_model_dirs["qwen2"], tmp_path / "m")
    hf = json.loads((model / "config.json").read_text()) | {"attention_impl": "gpu"}
    (model / "config.json").write_text(json.dumps(hf))
    assert not hasattr(checkpoint.load_config(model), "attention_impl")  # never read
    engine = Engine(model, EngineConfig(**SMALL, attention_impl="reference"), warm_up=False)
    assert engine.runner.attention.impl == "reference"
    assert not hasattr(engine.model_config, "attention_impl")  # beside it, not in it
    with pytest.raises(ValueError, match="attention_impl='cuda' must be one of"):
        EngineConfig(attention_impl="cuda")


def test_a_second_engine_does_not_probe_the_bandwidth_again(hf_model_dirs, tmp_path):
    """Nor the peak FLOP/s: on CPU a matmul measured once per process and dtype."""
    first = Engine(hf_model_dirs["qwen2"], EngineConfig(**SMALL), warm_up=False)
    probes, matmul_probes = runner.probe_count(), runner.flops_probe_count()
    cache_dir = jax.config.jax_compilation_cache_dir
    second = Engine(hf_model_dirs["qwen3"], EngineConfig(**SMALL | {
        "compilation_cache_dir": str(tmp_path)}), warm_up=False)
    assert runner.probe_count() == probes == 1
    assert second.metrics.bandwidth_gb_per_s == first.metrics.bandwidth_gb_per_s > 0
    assert runner.flops_probe_count() == matmul_probes >= 1
    peaks = [e.metrics.flop_count.peak_flops_per_s for e in (first, second)]
    assert peaks[0] == peaks[1] > 0 and second.metrics.flop_count.peak_source == "measured"
    assert jax.config.jax_compilation_cache_dir == cache_dir  # an Engine leaves it alone
