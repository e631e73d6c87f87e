"""update_weights into tensor- and expert-parallel engines from jax.Arrays sharded
otherwise (fused on device, 0 bytes from host), and into an int8 engine
(docs/rl.md#updating-weights)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from safetensors.numpy import load_file

from jaxinfer import LLM, SamplingParams, testing

SMALL = dict(page_size=4, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64,
             compilation_cache_dir="")
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [20, 21, 22]]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


def _pair(tmp_path_factory, family: str, **overrides):
    old, new = tmp_path_factory.mktemp(f"{family}-old"), tmp_path_factory.mktemp("new")
    testing.make_hf_model(old, family, seed=0, **overrides)
    testing.make_hf_model(new, family, seed=1, **overrides)
    return old, new


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _sharded_over_4(path) -> dict[str, jax.Array]:
    """The HF tensors of `path`, each split over devices 4-7 along its largest axis
    divisible by 4 (else replicated there): a trainer's layout, not the engine's."""
    mesh = Mesh(np.array(jax.devices()[4:8]), ("fsdp",))
    out = {}
    for name, value in load_file(str(next(path.glob("*.safetensors")))).items():
        axes = [a for a in range(value.ndim) if value.shape[a] % 4 == 0]
        spec = [None] * value.ndim
        if axes:
            spec[max(axes, key=lambda a: value.shape[a])] = "fsdp"
        out[name] = jax.device_put(value, NamedSharding(mesh, PartitionSpec(*spec)))
    return out


@pytest.mark.parametrize("family, settings, overrides", [
    ("llama", dict(tensor_parallel_size=4), dict(num_key_value_heads=4)),
    ("qwen2_moe", dict(tensor_parallel_size=4, enable_expert_parallel=True),
     dict(num_key_value_heads=4)),
])
def test_device_arrays_sharded_otherwise_update_with_no_host_bytes(
        tmp_path_factory, family, settings, overrides):
    old, new = _pair(tmp_path_factory, family, **overrides)
    expected = _tokens(LLM(str(new), **SMALL, **settings))
    llm = LLM(str(old), **SMALL, **settings, strict_compile=True)
    assert _tokens(llm) != expected
    report = llm.update_weights(_sharded_over_4(new))
    assert report["bytes_from_host"] == 0
    assert _tokens(llm) == expected
    assert llm.metrics()["compiles_after_warmup"] == 0


def test_kv_head_copies_take_the_host_path_and_count_it(tmp_path_factory):
    old, new = _pair(tmp_path_factory, "llama")  # 2 KV heads over 4 devices: copied
    expected = _tokens(LLM(str(new), **SMALL, tensor_parallel_size=4))
    llm = LLM(str(old), **SMALL, tensor_parallel_size=4)
    weights = _sharded_over_4(new)
    report = llm.update_weights(weights)
    assert report["bytes_from_host"] == sum(v.nbytes for v in weights.values())
    assert _tokens(llm) == expected


def test_int8_engine_requantizes_float_weights(tmp_path_factory):
    old, new = _pair(tmp_path_factory, "llama")
    expected = _tokens(LLM(str(new), **SMALL, quantization="int8"))
    llm = LLM(str(old), **SMALL, quantization="int8", strict_compile=True)
    llm.update_weights(load_file(str(next(new.glob("*.safetensors")))))
    assert _tokens(llm) == expected
    llm.update_weights(str(old))
    llm.update_weights(str(new))
    assert _tokens(llm) == expected
    assert llm.metrics()["compiles_after_warmup"] == 0


def test_data_parallel_engines_refuse_by_name(tmp_path_factory):
    old, _ = _pair(tmp_path_factory, "llama")
    llm = LLM(str(old), **SMALL, data_parallel_size=2)
    for call in (lambda: llm.update_weights(str(old)), llm.reset_prefix_cache,
                 llm.pause_generation):
        with pytest.raises(NotImplementedError, match="data_parallel_size"):
            call()
