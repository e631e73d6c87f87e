"""The parameter table: its rows agree with what transformers writes and what the
model, the loader and quantization use."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxinfer import checkpoint, testing
from jaxinfer.checkpoint import names, safetensors_file
from jaxinfer.config import ModelConfig, MoEConfig
from jaxinfer.model import fusion, params_table, quantization, transformer


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma2", "gemma3", "gpt_oss"])
def test_table_names_every_tensor_save_pretrained_writes(tmp_path, family):
    """The HF names and shapes the table derives are exactly those of a transformers
    checkpoint: q/k/v biases for Qwen2, q/k norms for Qwen3 and Gemma 3, Gemma's four
    norms a layer, no LM head when tied."""
    testing.make_hf_model(tmp_path, family)
    cfg = checkpoint.load_config(tmp_path)
    tensors = safetensors_file.load(tmp_path / "model.safetensors")
    expected = names.hf_names(cfg)
    assert set(expected) == set(tensors) - ({"lm_head.weight"} if cfg.tie_word_embeddings
                                            else set())
    shapes = names.hf_shapes(cfg)
    for name, tensor in expected.items():
        want = names.hf_shape(shapes, tensor)
        assert tensors[name].shape == (want[::-1] if tensor.transposed else want), name


def _cfg(**kw: object) -> ModelConfig:
    base = dict(architecture="qwen3", vocab_size=24, hidden_size=8, intermediate_size=48,
                num_layers=2, num_heads=4, num_kv_heads=2, head_dim=4, qkv_bias=True,
                qk_norm=True)
    return ModelConfig(**(base | kw))


def test_fusing_the_parts_gives_the_table_shapes_and_round_trips():
    cfg = _cfg()
    rng = np.random.default_rng(0)
    hf = {k: rng.normal(size=s) for k, s in params_table.hf_layer_shapes(cfg).items()}
    fused = fusion.fuse_layer(hf, cfg)
    assert {k: v.shape for k, v in fused.items()} == params_table.param_shapes(cfg)["layers"][0]
    back = fusion.unfuse_layer(fused, cfg)
    assert set(back) == set(hf)
    for key in hf:
        np.testing.assert_array_equal(back[key], hf[key])


def test_rows_follow_the_config():
    shapes = params_table.param_shapes(_cfg(qkv_bias=False, qk_norm=False,
                                            tie_word_embeddings=True))
    assert "lm_head" not in shapes
    assert set(shapes["layers"][0]) == {"attn_norm", "wqkv", "wo", "mlp_norm",
                                        "w_gate_up", "w_down"}
    assert shapes["layers"][0]["wqkv"] == (8, (4 + 2 * 2) * 4)
    assert len(shapes["layers"]) == 2


def test_partition_specs_split_matrices_and_a_divisible_vocabulary():
    cfg = _cfg()
    specs = params_table.param_partition_specs(cfg, 2)
    layer = specs["layers"][0]
    assert layer["wqkv"] == layer["w_gate_up"] == P(None, "model")
    assert layer["wo"] == layer["w_down"] == P("model", None)
    assert layer["bqkv"] == P("model") and layer["q_norm"] == P()
    assert specs["embed"] == P("model", None) and specs["lm_head"] == P(None, "model")
    odd = params_table.param_partition_specs(_cfg(vocab_size=25), 2)
    assert odd["embed"] == odd["lm_head"] == P()


@pytest.mark.parametrize("moe", [False, True])
def test_quantized_weights_are_the_layer_matrices(moe):
    """Every matrix of a layer quantizes, the stacked experts included, but the routers
    (float, as the families run them); norms and biases stay float."""
    cfg = _cfg()
    if moe:
        cfg = _cfg(architecture="qwen2_moe", qk_norm=False, moe=MoEConfig(
            num_experts=4, num_experts_per_tok=2, intermediate_size=24,
            shared_expert_intermediate_size=24))
    params = transformer.init_params(cfg, jax.random.key(0))
    quantized = quantization.quantize_params(params, "int8")
    for layer, original in zip(quantized["layers"], params["layers"], strict=True):
        want = {k for k, v in original.items() if v.ndim >= 2} - {"w_router", "w_shared_gate"}
        assert {k for k, v in layer.items() if quantization.is_quantized(v)} == want
        assert want <= set(quantization.QUANTIZED_WEIGHTS) | set(quantization.EXPERT_WEIGHTS)


def test_leaf_layouts_read_the_parts_in_the_table_order():
    cfg = _cfg()
    layouts = names.leaf_layouts(cfg)
    assert layouts["layers.1.wqkv"].kind == "qkv"
    assert layouts["layers.1.wqkv"].names == tuple(
        f"model.layers.1.self_attn.{p}_proj.weight" for p in "qkv")
    assert layouts["layers.0.w_down"].kind == "transposed"
    assert layouts["embed"].kind == "plain" and layouts["lm_head"].kind == "transposed"
    assert set(layouts) == {names.leaf_name(path) for path, _ in
                            jax.tree_util.tree_flatten_with_path(
                                params_table.param_shapes(cfg),
                                is_leaf=lambda x: isinstance(x, tuple))[0]}
    for param in params_table.TOP + params_table.LAYER:
        assert param.split in params_table.SPLITS and param.kind in params_table.LAYOUTS
