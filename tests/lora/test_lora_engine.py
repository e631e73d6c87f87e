"""Adapters in the engine: a batch mixing adapters equals each request alone, loading
and unloading while requests run compiles nothing, more adapters than slots swap by
LRU with every output right, the prefix cache is keyed by adapter, and the refusals
(rank over the maximum, no enable_lora, DoRA, embedding and expert adapters)."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from lora_adapters import ALL, save_adapter

from jaxinfer import LLM, testing
from jaxinfer.checkpoint import safetensors_file
from jaxinfer.engine.request import SamplingParams
from jaxinfer.lora import LoRARequest

SMALL = dict(dtype="float32", page_size=8, max_model_len=64, max_num_seqs=8,
             max_num_batched_tokens=32)
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPT = [5, 9, 13, 2, 7, 11, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]


@pytest.fixture(scope="module")
def six(tmp_path_factory):
    """A tiny Llama and six adapters of ranks 4-16 on different modules."""
    root = tmp_path_factory.mktemp("lora-six")
    testing.make_hf_model(root / "model", "llama", seed=5)
    loras = []
    for i in range(6):
        targets = ALL if i % 2 == 0 else ["q_proj", "v_proj", "down_proj"]
        save_adapter(root / "model", root / f"a{i}", rank=4 + 2 * i, targets=targets,
                     seed=20 + i)
        loras.append(LoRARequest(f"a{i}", i + 1, str(root / f"a{i}")))
    return root, loras


@pytest.fixture(scope="module")
def alone(six):
    """Each adapter's (and the base model's) greedy tokens, one request at a time."""
    root, loras = six
    llm = LLM(str(root / "model"), enable_lora=True, max_loras=1, max_lora_rank=16,
              **SMALL)
    return {lora.lora_name if lora else None: llm.generate(
        [PROMPT], GREEDY, lora_request=lora)[0].outputs[0].token_ids
        for lora in [None, *six[1]]}


def test_a_batch_of_four_adapters_and_the_base_equals_each_alone(six, alone):
    root, loras = six
    llm = LLM(str(root / "model"), enable_lora=True, max_loras=4, max_lora_rank=16,
              strict_compile=True, **SMALL)
    chosen = [loras[0], None, loras[1], loras[2], loras[3]]
    outs = llm.generate([PROMPT] * 5, GREEDY, lora_request=chosen)
    for lora, out in zip(chosen, outs, strict=True):
        assert out.outputs[0].token_ids == alone[lora.lora_name if lora else None]
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 5


def test_more_adapters_than_slots_swap_and_load_without_compiling(six, alone):
    root, loras = six
    llm = LLM(str(root / "model"), enable_lora=True, max_loras=2, max_lora_rank=16,
              max_cpu_loras=3, strict_compile=True, **SMALL)
    compiles = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        engine = llm.engine
        chosen = [loras[i % 6] for i in range(12)] + [None]
        for i, lora in enumerate(chosen):
            engine.add_request(f"r{i}", prompt_token_ids=PROMPT, params=GREEDY,
                               lora_request=lora)
        outputs, steps, removed = {}, 0, None
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = out.outputs[0].token_ids
            assert len(engine.adapter_slots.resident()) <= 2
            steps += 1
            if steps == 3:  # unload one while requests of it may still be queued
                removed = engine.adapter_slots.loaded()[0]
                assert engine.remove_lora(removed.lora_int_id)
                assert removed.lora_int_id not in engine.list_loras()
            if steps == 4:
                assert engine.add_lora(loras[5]) in (True, False)
        assert removed is not None and not engine.remove_lora(99)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    for i, lora in enumerate(chosen):
        assert outputs[f"r{i}"] == alone[lora.lora_name if lora else None], i
    counts = engine.lora_counts()
    assert counts["slot_writes"] >= 6 and counts["slot_swaps"] >= 3  # 6 adapters, 2 slots
    assert counts["host_evictions"] >= 3  # six adapters through a host LRU of three
    assert compiles == []


def test_prefix_cache_is_keyed_by_adapter(six):
    root, loras = six
    llm = LLM(str(root / "model"), enable_lora=True, max_loras=2, max_lora_rank=16,
              **SMALL)
    engine = llm.engine

    def cached(request_id: str, lora) -> int:
        engine.add_request(request_id, prompt_token_ids=PROMPT, params=GREEDY,
                           lora_request=lora)
        while engine.has_unfinished():
            engine.step()
        request = engine._requests[request_id][0]
        engine.release(request_id)
        return request.num_cached_tokens

    assert cached("a", loras[0]) == 0
    assert cached("b", loras[1]) == 0  # same tokens, another adapter: no hit
    assert cached("c", None) == 0
    assert cached("d", loras[0]) == 16  # two full pages of the same adapter
    assert cached("e", None) == 16


def test_tensor_parallel_four_equals_one_with_adapters(six, alone):
    root, loras = six
    llm = LLM(str(root / "model"), enable_lora=True, max_loras=3, max_lora_rank=16,
              tensor_parallel_size=4, **SMALL)  # 2 KV heads over 4 devices: copied
    chosen = [loras[0], loras[1], None, loras[4]]
    outs = llm.generate([PROMPT] * 4, GREEDY, lora_request=chosen)
    for lora, out in zip(chosen, outs, strict=True):
        assert out.outputs[0].token_ids == alone[lora.lora_name if lora else None]


def test_data_parallel_and_ngram_speculation_serve_adapters(six, alone):
    root, loras = six
    spec = {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}
    for extra in (dict(data_parallel_size=2), dict(speculative_config=spec)):
        llm = LLM(str(root / "model"), enable_lora=True, max_loras=2, max_lora_rank=16,
                  **SMALL, **extra)
        chosen = [loras[2], None, loras[3], loras[2]]
        outs = llm.generate([PROMPT] * 4, GREEDY, lora_request=chosen)
        for lora, out in zip(chosen, outs, strict=True):
            assert out.outputs[0].token_ids == alone[lora.lora_name if lora else None], \
                extra


@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_quantized_base_weights_take_float_adapters(six, mode):
    root, loras = six
    llm = LLM(str(root / "model"), enable_lora=True, max_loras=2, max_lora_rank=16,
              quantization=mode, **SMALL)
    first = llm.generate([PROMPT] * 3, GREEDY, lora_request=[loras[0], None, loras[1]])
    again = [llm.generate([PROMPT], GREEDY, lora_request=lora)[0]
             for lora in (loras[0], None, loras[1])]
    tokens = [o.outputs[0].token_ids for o in first]
    assert tokens == [o.outputs[0].token_ids for o in again]
    assert len({tuple(t) for t in tokens}) == 3
    assert llm.engine.runner.params["lora"][0]["q"]["a"].dtype == np.float32


def test_refusals_name_the_problem(six, tmp_path):
    root, loras = six
    with pytest.raises(ValueError, match="enable_lora"):
        LLM(str(root / "model"), **SMALL).generate([PROMPT], GREEDY,
                                                   lora_request=loras[0])
    llm = LLM(str(root / "model"), enable_lora=True, max_loras=1, max_lora_rank=8,
              **SMALL)
    with pytest.raises(ValueError, match="rank 14, over max_lora_rank=8"):
        llm.generate([PROMPT], GREEDY, lora_request=loras[5])
    with pytest.raises(ValueError, match="no such file"):
        llm.generate([PROMPT], GREEDY, lora_request=LoRARequest("x", 9, str(tmp_path)))
    with pytest.raises(ValueError, match="lora_int_id=1 is in use"):
        llm.engine.add_lora(loras[0])
        llm.engine.add_lora(LoRARequest("other", 1, loras[1].lora_path))
    bad = {"use_dora": "DoRA", "modules_to_save": "replace whole modules"}
    for key, reason in bad.items():
        path = tmp_path / key
        path.mkdir()
        config = json.loads((root / "a0" / "adapter_config.json").read_text())
        config[key] = True if key == "use_dora" else ["lm_head"]
        (path / "adapter_config.json").write_text(json.dumps(config))
        (path / "adapter_model.safetensors").write_bytes(
            (root / "a0" / "adapter_model.safetensors").read_bytes())
        with pytest.raises(ValueError, match=reason):
            llm.engine.add_lora(LoRARequest(key, 50 + len(key), str(path)))
    for name, reason in [("base_model.model.model.embed_tokens.lora_embedding_A", "embedding"),
                         ("base_model.model.model.layers.0.mlp.experts.0.gate_proj.lora_A"
                          ".weight", "experts")]:
        path = tmp_path / reason
        path.mkdir()
        (path / "adapter_config.json").write_text(
            (root / "a0" / "adapter_config.json").read_text())
        safetensors_file.save({name: np.zeros((4, 64), np.float32)},
                              path / "adapter_model.safetensors")
        with pytest.raises(ValueError, match=reason):
            llm.engine.add_lora(LoRARequest(reason, 70 + len(reason), str(path)))


def test_sleep_level_two_keeps_the_adapters(six, alone):
    root, loras = six
    llm = LLM(str(root / "model"), enable_lora=True, max_loras=2, max_lora_rank=16,
              **SMALL)
    assert llm.generate([PROMPT], GREEDY, lora_request=loras[1])[0].outputs[0].token_ids \
        == alone["a1"]
    llm.sleep(level=2)
    llm.update_weights(str(root / "model"))
    llm.wake_up()
    for lora in (loras[1], None):  # the resident adapter's slot came back with it
        assert llm.generate([PROMPT], GREEDY, lora_request=lora)[0].outputs[0].token_ids \
            == alone[lora.lora_name if lora else None]


def test_an_adapter_gone_from_disk_fails_its_request_alone(six, alone, tmp_path):
    import shutil

    root, loras = six
    gone = tmp_path / "gone"
    shutil.copytree(loras[0].lora_path, gone)
    doomed = LoRARequest("gone", 40, str(gone))
    llm = LLM(str(root / "model"), enable_lora=True, max_loras=1, max_lora_rank=16,
              max_cpu_loras=1, **SMALL)
    engine = llm.engine
    engine.add_request("doomed", prompt_token_ids=PROMPT, params=GREEDY, lora_request=doomed)
    engine.add_request("other", prompt_token_ids=PROMPT, params=GREEDY,
                       lora_request=loras[1])  # evicts the doomed one's host copy
    shutil.rmtree(gone)
    finished = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0]
    assert finished["doomed"].finish_reason == "error"
    assert finished["other"].token_ids == alone["a1"]
