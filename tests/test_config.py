"""ModelConfig from HF config.json dicts, presets, and validation messages."""

from __future__ import annotations

import pytest

from jaxinfer import config, testing
from jaxinfer.config import ModelConfig, RopeScaling


@pytest.mark.parametrize("family", list(testing.FAMILIES))
def test_from_hf_reads_each_family(family):
    hf = testing.hf_config(family).to_dict()
    cfg = ModelConfig.from_hf(hf)
    assert cfg.architecture == family
    assert cfg.num_kv_heads == hf["num_key_value_heads"]
    assert cfg.head_dim == hf["head_dim"]  # 16, gpt-oss's 32 (4 heads of a 64 hidden)
    assert cfg.qkv_bias == family.startswith(("qwen2", "gpt_oss"))
    assert cfg.qk_norm == family.startswith(("qwen3", "gemma3"))
    assert (cfg.moe is not None) == (family in (*testing.MOE_FAMILIES, "gpt_oss"))
    assert cfg.sliding_window == testing.FAMILIES[family].get("sliding_window")
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg


def test_from_hf_llama3_rope_both_spellings():
    new = testing.hf_config("llama").to_dict()
    cfg = ModelConfig.from_hf(new)
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling == RopeScaling(factor=8.0, low_freq_factor=1.0,
                                           high_freq_factor=4.0,
                                           original_max_position_embeddings=64)
    legacy = {k: v for k, v in new.items() if k != "rope_parameters"}
    legacy |= {"rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}
    assert ModelConfig.from_hf(legacy) == cfg


def test_from_hf_head_dim_defaults_to_hidden_over_heads():
    hf = testing.hf_config("llama").to_dict()
    del hf["head_dim"]
    assert ModelConfig.from_hf(hf).head_dim == 64 // 4


@pytest.mark.parametrize("edit, message", [
    ({"architectures": ["BertModel"]}, "unsupported architecture"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"rope_parameters": {"rope_type": "longrope", "factor": 4.0}}, "rope_type='longrope'"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}},
     "yarn rope scaling lacks"),
    ({"num_key_value_heads": 3}, "num_heads=4 must be a multiple of self.num_kv_heads=3"),
    ({"vocab_size": 0}, "vocab_size=0 must be a positive int"),
])
def test_from_hf_rejects_with_named_field(edit, message):
    hf = testing.hf_config("llama").to_dict() | edit
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ModelConfig.from_hf(hf)


def test_from_hf_rejects_missing_field():
    hf = testing.hf_config("llama").to_dict()
    del hf["intermediate_size"]
    with pytest.raises(ValueError, match="no 'intermediate_size'"):
        ModelConfig.from_hf(hf)


def test_presets_all_load():
    names = config.preset_names()
    assert {"llama2-7b", "llama3.1-8b", "mistral-7b", "qwen2-7b", "qwen3-0.6b",
            "smollm-135m"} <= set(names)
    for name in names:
        cfg = config.load_preset(name)
        assert cfg.num_heads % cfg.num_kv_heads == 0
    assert config.load_preset("llama3.1-8b").rope_scaling is not None


def test_unknown_preset_lists_known():
    with pytest.raises(FileNotFoundError, match="known presets.*llama3.1-8b"):
        config.load_preset("gpt5")


def test_config_is_hashable_and_frozen():
    cfg = config.load_preset("smollm-135m")
    assert hash(cfg) == hash(config.load_preset("smollm-135m"))
    with pytest.raises(AttributeError):
        cfg.num_layers = 3
