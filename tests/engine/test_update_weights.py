"""LLM.update_weights: new weights match a fresh engine token for token with no
compile, the prefix cache is reset, and requests in flight follow the policy
(docs/rl.md#updating-weights)."""

from __future__ import annotations

import shutil

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

from jaxinfer import LLM, SamplingParams, checkpoint, testing

SMALL = dict(page_size=4, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64,
             enable_prefix_caching=True, compilation_cache_dir="")
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [20, 21, 22]]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
SEEDED = SamplingParams(max_tokens=8, temperature=1.0, seed=3)


@pytest.fixture(scope="module")
def two_models(tmp_path_factory):
    """Two tiny llamas of the same shapes, different weights."""
    old, new = tmp_path_factory.mktemp("old"), tmp_path_factory.mktemp("new")
    testing.make_hf_model(old, "llama", seed=0)
    testing.make_hf_model(new, "llama", seed=1)
    return old, new


@pytest.fixture(scope="module")
def expected(two_models):
    llm = LLM(str(two_models[1]), **SMALL)
    return _tokens(llm)


def _tokens(llm: LLM) -> list[list[int]]:
    out = llm.generate(PROMPTS, GREEDY, use_tqdm=False) + llm.generate(
        PROMPTS, SEEDED, use_tqdm=False)
    return [o.outputs[0].token_ids for o in out]


def _hf_tensors(path) -> dict[str, np.ndarray]:
    return load_file(str(next(path.glob("*.safetensors"))))


def _compiles(llm: LLM) -> int:
    return llm.metrics()["compiles_after_warmup"]


def test_pytree_update_matches_a_fresh_engine_without_compiling(two_models, expected):
    old, new = two_models
    fresh = LLM(str(new), **SMALL)
    llm = LLM(str(old), **SMALL, strict_compile=True)
    before = _tokens(llm)
    report = llm.update_weights(fresh.engine.runner.params)
    assert report["bytes_from_host"] == 0  # already on device
    assert _tokens(llm) == expected != before
    assert _compiles(llm) == 0


def test_hf_numpy_update_and_a_directory_update(two_models, expected):
    old, new = two_models
    llm = LLM(str(old), **SMALL, strict_compile=True)
    tensors = _hf_tensors(new)
    report = llm.update_weights(tensors)
    assert report["bytes_from_host"] == sum(t.nbytes for t in tensors.values())
    assert _tokens(llm) == expected
    llm.update_weights(str(old))
    llm.update_weights(str(new))
    assert _tokens(llm) == expected and _compiles(llm) == 0


def test_partial_update_changes_only_what_it_names(two_models, expected):
    old, new = two_models
    llm = LLM(str(old), **SMALL)
    tensors = _hf_tensors(new)
    first = {k: v for k, v in tensors.items() if ".layers.0." in k}
    rest = {k: v for k, v in tensors.items() if k not in first}
    llm.update_weights(first)
    assert _tokens(llm) != expected
    llm.update_weights(rest)
    assert _tokens(llm) == expected


def test_mismatches_are_named_and_change_nothing(two_models):
    old, new = two_models
    llm = LLM(str(old), **SMALL)
    before = _tokens(llm)
    tensors = _hf_tensors(new)
    name = next(k for k in tensors if k.endswith("q_proj.weight"))
    with pytest.raises(ValueError, match="no_such.weight"):
        llm.update_weights({"model.no_such.weight": tensors[name]})
    with pytest.raises(ValueError, match=name):
        llm.update_weights({name: tensors[name][:1]})
    with pytest.raises(ValueError, match="k_proj|v_proj"):
        llm.update_weights({name: tensors[name]})  # q without k and v: a fused leaf
    params = jax.tree.map(lambda x: x, llm.engine.runner.params)
    params["embed"] = params["embed"][:3]
    with pytest.raises(ValueError, match="embed"):
        llm.update_weights(params)
    assert _tokens(llm) == before


def test_prefix_cache_is_reset(two_models):
    old, new = two_models
    llm = LLM(str(old), **SMALL)
    prompt = [list(range(30, 50))]
    llm.generate(prompt, GREEDY, use_tqdm=False)
    llm.generate(prompt, GREEDY, use_tqdm=False)
    hits = llm.metrics()["prefix_cache_hit_tokens"]
    assert hits > 0
    report = llm.update_weights(_hf_tensors(new))
    assert report["prefix_pages_dropped"] > 0
    llm.generate(prompt, GREEDY, use_tqdm=False)
    assert llm.metrics()["prefix_cache_hit_tokens"] == hits  # no hit on old pages


def _start(llm: LLM, request_id: str = "r") -> None:
    engine = llm.engine
    engine.add_request(request_id, PROMPTS[0], SamplingParams(max_tokens=12,
                                                              temperature=0.0))
    for _ in range(4):
        engine.step()


def _finish(llm: LLM, request_id: str = "r") -> list[int]:
    while llm.engine.has_unfinished():
        llm.engine.step()
    return llm.engine.release(request_id).outputs[0].token_ids


def test_abort_policy_finishes_in_flight_with_reason_abort(two_models):
    old, new = two_models
    llm = LLM(str(old), **SMALL)
    _start(llm)
    report = llm.update_weights(_hf_tensors(new), policy="abort")
    assert report["aborted"] == 1
    output = llm.engine.release("r")
    assert output.finished and output.outputs[0].finish_reason == "abort"


def test_wait_policy_finishes_on_old_weights_then_updates(two_models, expected):
    old, new = two_models
    llm = LLM(str(old), **SMALL)
    plain = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=12, temperature=0.0),
                         use_tqdm=False)[0].outputs[0].token_ids
    _start(llm)
    llm.update_weights(_hf_tensors(new), policy="wait")
    assert not llm.engine.has_unfinished()
    assert llm.engine.release("r").outputs[0].token_ids == plain
    assert _tokens(llm) == expected


def test_keep_policy_continues_on_new_weights(two_models):
    old, new = two_models
    llm = LLM(str(old), **SMALL)
    plain = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=12, temperature=0.0),
                         use_tqdm=False)[0].outputs[0].token_ids
    _start(llm)
    report = llm.update_weights(_hf_tensors(new), policy="keep")
    assert report["aborted"] == 0 and llm.engine.has_unfinished()
    kept = _finish(llm)
    assert len(kept) == 12 and kept != plain
    assert kept[:2] == plain[:2]  # the tokens before the update came from the old weights
    hits = llm.metrics()["prefix_cache_hit_tokens"]
    llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)  # the kept request's pages: old KV
    assert llm.metrics()["prefix_cache_hit_tokens"] == hits


def test_pause_and_resume(two_models):
    old, _ = two_models
    llm = LLM(str(old), **SMALL)
    _start(llm)
    assert llm.pause_generation(mode="keep") == 0
    with pytest.raises(RuntimeError, match="resume_generation"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert llm.engine.step() == [] and llm.engine.has_unfinished()
    llm.pause_generation(mode="wait")  # paused already: the kept request finishes
    assert not llm.engine.has_unfinished() and llm.engine.step() == []
    llm.resume_generation()
    assert len(llm.engine.release("r").outputs[0].token_ids) == 12
    assert llm.reset_prefix_cache() >= 0
    with pytest.raises(ValueError, match="policy"):
        llm.update_weights({}, policy="later")


def test_orbax_directory_update(two_models, expected, tmp_path):
    old, new = two_models
    orbax_dir = tmp_path / "orbax"
    orbax_dir.mkdir()
    shutil.copy(new / "config.json", orbax_dir)
    params = checkpoint.load_params(new, checkpoint.load_config(new))
    checkpoint.save_orbax(orbax_dir / "params", params)
    llm = LLM(str(old), **SMALL, strict_compile=True)
    assert llm.update_weights(str(orbax_dir))["bytes_from_host"] == 0
    assert _tokens(llm) == expected


def test_update_while_asleep_gives_the_weights_back(two_models, expected):
    old, new = two_models
    llm = LLM(str(old), **SMALL, strict_compile=True)
    llm.sleep(level=2)  # weights dropped: the update brings new ones
    llm.update_weights(_hf_tensors(new))
    llm.wake_up()
    assert _tokens(llm) == expected and _compiles(llm) == 0
