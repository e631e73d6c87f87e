"""Speculative heads' config.json and checkpoints: which configs are heads, where EAGLE-3
captures, the published tensor layouts written and read back, and the errors that
name what does not fit."""

from __future__ import annotations

import json

import jax
import ml_dtypes
import numpy as np
import pytest

from jaxinfer.checkpoint import heads, safetensors_file
from jaxinfer.config import ModelConfig, load_preset
from jaxinfer.config.heads import head_config, infer_method
from jaxinfer.config.model import FINAL_NORMED

TARGET = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=8,
                     num_heads=4, num_kv_heads=2, head_dim=8)
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32,
         "intermediate_size": 48, "num_attention_heads": 4, "num_key_value_heads": 2,
         "num_hidden_layers": 1, "vocab_size": 96, "rms_norm_eps": 1e-5}
EAGLE3 = LLAMA | {"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": 40}
MEDUSA = {"architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": 32,
          "vocab_size": 96, "num_heads": 3, "num_hidden_layers": 2}


@pytest.mark.parametrize(("hf", "method"), [
    (EAGLE3, "eagle3"),  # SafeAILab's EAGLE-3
    (LLAMA | {"architectures": ["Eagle3LlamaForCausalLM"]}, "eagle3"),  # vLLM's name
    ({"architectures": ["EAGLEModel"], "model_type": "eagle", "model": LLAMA}, "eagle"),
    (LLAMA | {"architectures": ["EagleLlamaForCausalLM"], "model_type": "eagle"}, "eagle"),
    (MEDUSA, "medusa"),
    ({"model_type": "medusa", "medusa_num_heads": 4, "medusa_num_layers": 1}, "medusa"),
    ({"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3"}, "eagle3"),
    (LLAMA, None),  # a plain Llama, and SafeAILab's EAGLE-1 configs look the same
    ({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}, None),
])
def test_infer_method(hf, method):
    assert infer_method(hf) == method


def test_head_configs_read_the_published_fields():
    eagle3 = head_config(EAGLE3, TARGET)
    assert eagle3.feature_layers == (2, 4, 5)  # entering layers 2, L // 2, L - 3
    assert (eagle3.draft_vocab_size, eagle3.feature_size, eagle3.layer.num_layers) == (
        40, 96, 1)
    assert eagle3.layer.intermediate_size == 48 and eagle3.layer.vocab_size == 96
    nested = {"architectures": ["EAGLEModel"], "model_type": "eagle",
              "model": LLAMA | {"rope_theta": 5e5}, "bias": True}
    eagle = head_config(nested, TARGET)
    assert (eagle.feature_layers, eagle.fc_bias, eagle.layer.rope_theta) == (
        (FINAL_NORMED,), True, 5e5)
    assert head_config(LLAMA, TARGET, "eagle").method == "eagle"  # SafeAILab's EAGLE-1
    medusa = head_config({"model_type": "medusa", "medusa_num_heads": 4,
                          "medusa_num_layers": 2, "hidden_size": 32, "vocab_size": 96},
                         TARGET)
    assert (medusa.num_heads, medusa.num_layers, medusa.feature_layers) == (
        4, 2, (FINAL_NORMED,))


def test_eagle3_capture_ids_follow_the_convention_of_their_field():
    top = head_config(EAGLE3 | {"eagle_aux_hidden_state_layer_ids": [1, 4, 8]}, TARGET)
    assert top.feature_layers == (1, 4, 8)  # vLLM's: the stream entering layer i
    nested = head_config(EAGLE3 | {"eagle_config": {
        "eagle_aux_hidden_state_layer_ids": [1, 3, 4]}}, TARGET)
    assert nested.feature_layers == (2, 4, 5)  # SpecForge/SGLang's: layer i's output


@pytest.mark.parametrize(("hf", "method", "field"), [
    (EAGLE3 | {"target_hidden_size": 64}, None, "target_hidden_size=64"),
    (EAGLE3 | {"hidden_size": 48}, None, "hidden_size=48"),
    (LLAMA | {"hidden_size": 48}, "eagle", "hidden_size=48"),
    (MEDUSA | {"hidden_size": 16}, None, "hidden_size=16"),
    (EAGLE3 | {"vocab_size": 100}, None, "vocab_size=100"),
    (MEDUSA | {"vocab_size": 100}, None, "vocab_size=100"),
    (EAGLE3, "medusa", "method='medusa' does not match"),
    (MEDUSA, "eagle3", "method='eagle3' does not match"),
    (LLAMA, None, "not a speculative head"),
    (LLAMA, "lookahead", "method='lookahead'"),
    (EAGLE3 | {"eagle_aux_hidden_state_layer_ids": [2, 4, 9]}, None,
     "eagle_aux_hidden_state_layer_ids=[2, 4, 9] is out of range"),
    (EAGLE3 | {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 4, 8]}}, None,
     "eagle_config.eagle_aux_hidden_state_layer_ids=[1, 4, 8] is out of range"),
    (EAGLE3 | {"draft_vocab_size": 200}, None, "draft_vocab_size=200"),
    (EAGLE3 | {"num_hidden_layers": 2}, None, "num_hidden_layers=2"),
    ({"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3"}, None,
     "speculators"),
])
def test_head_config_errors_name_the_field(hf, method, field):
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("(", r"\(")):
        head_config(hf, TARGET, method)


def _published(path):
    return {name: (array.dtype.name, tuple(array.shape))
            for name, array in safetensors_file.load(path / "model.safetensors").items()}


def test_eagle3_writes_the_published_layout(tmp_path):
    head, params = heads.random_head("eagle3", TARGET, jax.random.key(0),
                                     draft_vocab_size=40)
    heads.save_eagle3(tmp_path, head, params, TARGET)
    f32, d, q, kv = "float32", 32, 32, 16
    assert _published(tmp_path) == {
        "midlayer.self_attn.q_proj.weight": (f32, (q, 2 * d)),
        "midlayer.self_attn.k_proj.weight": (f32, (kv, 2 * d)),
        "midlayer.self_attn.v_proj.weight": (f32, (kv, 2 * d)),
        "midlayer.self_attn.o_proj.weight": (f32, (d, q)),
        "midlayer.mlp.gate_proj.weight": (f32, (64, d)),
        "midlayer.mlp.up_proj.weight": (f32, (64, d)),
        "midlayer.mlp.down_proj.weight": (f32, (d, 64)),
        "midlayer.input_layernorm.weight": (f32, (d,)),
        "midlayer.hidden_norm.weight": (f32, (d,)),
        "midlayer.post_attention_layernorm.weight": (f32, (d,)),
        "fc.weight": (f32, (d, 3 * d)), "norm.weight": (f32, (d,)),
        "lm_head.weight": (f32, (40, d)), "d2t": ("int64", (40,)), "t2d": ("bool", (96,)),
    }
    hf = json.loads((tmp_path / "config.json").read_text())
    assert hf["architectures"] == ["LlamaForCausalLMEagle3"] and hf["draft_vocab_size"] == 40
    t2d = safetensors_file.load(tmp_path / "model.safetensors")["t2d"]
    d2t = safetensors_file.load(tmp_path / "model.safetensors")["d2t"]
    assert np.array_equal(np.flatnonzero(t2d), np.arange(40) + d2t)


def test_eagle_and_medusa_write_the_published_layouts(tmp_path):
    head, params = heads.random_head("eagle", TARGET, jax.random.key(1), bias=True)
    heads.save_eagle(tmp_path / "eagle", head, params, TARGET)
    names = set(_published(tmp_path / "eagle"))
    assert names == {"fc.weight", "fc.bias"} | {f"layers.0.{n}" for n in (
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
        "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
        "mlp.down_proj.weight", "post_attention_layernorm.weight")}
    assert _published(tmp_path / "eagle")["fc.weight"] == ("float32", (32, 64))
    head, params = heads.random_head("medusa", TARGET, jax.random.key(2),
                                     medusa_fc_bias=True)
    heads.save_medusa(tmp_path / "medusa", head, params, TARGET, dtype="bfloat16")
    published = _published(tmp_path / "medusa")
    assert published["blocks.2.layers.0.weight"] == ("bfloat16", (32, 32))
    assert published["blocks.0.layers.0.bias"] == ("bfloat16", (32,))
    assert published["lm_heads.1.weight"] == ("bfloat16", (96, 32)) and len(published) == 9


@pytest.mark.parametrize(("method", "config"), [
    ("eagle3", {"draft_vocab_size": 40}),
    ("eagle3", {"hidden_size": 16, "target_hidden_size": 32, "norm_before_residual": True,
                "head_dim": 4, "eagle_aux_hidden_state_layer_ids": [0, 3, 8]}),
    ("eagle", {"bias": True}),
    ("eagle", {}),
    ("medusa", {"medusa_fc_bias": True, "num_hidden_layers": 2}),
    ("medusa", {"truncated_vocab_size": 50, "original_lm_head": True}),
])
def test_saved_heads_load_back_equal(tmp_path, method, config):
    head, params = heads.random_head(method, TARGET, jax.random.key(3), **config)
    heads.save_head(tmp_path, head, params, TARGET)
    loaded_head, loaded = heads.load_head(tmp_path, TARGET, "float32", method)
    assert loaded_head == head
    assert jax.tree.structure(loaded) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(params), strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    _, bf16 = heads.load_head(tmp_path, TARGET, "bfloat16", method)
    kinds = {leaf.dtype.name for leaf in jax.tree.leaves(bf16)}
    assert kinds <= {"bfloat16", "int32"} and "bfloat16" in kinds


def test_sharded_checkpoint_and_aliases_load(tmp_path):
    head, params = heads.random_head("medusa", TARGET, jax.random.key(4),
                                     truncated_vocab_size=50)
    heads.save_medusa(tmp_path, head, params, TARGET)
    tensors = safetensors_file.load(tmp_path / "model.safetensors")
    lm = np.zeros((96, 32), np.float32)  # a whole LM head, cut by token_map on load
    lm[tensors["token_map"]] = tensors["lm_heads.0.weight"]
    renamed = {f"medusa_heads.{n}": np.array(t) for n, t in tensors.items()}
    renamed["medusa_heads.lm_heads.0.weight"] = lm
    (tmp_path / "model.safetensors").unlink()
    names = sorted(renamed)
    weight_map = {}
    for i, part in enumerate((names[:4], names[4:])):
        file = f"model-0000{i + 1}-of-00002.safetensors"
        safetensors_file.save({n: renamed[n] for n in part}, tmp_path / file)
        weight_map |= dict.fromkeys(part, file)
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": weight_map}))
    _, loaded = heads.load_head(tmp_path, TARGET)
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(params), strict=True):
        assert np.array_equal(a, b)


def test_eagle3_reads_layers_0_as_midlayer_and_eagle_reads_past_its_input_norm(tmp_path):
    head, params = heads.random_head("eagle3", TARGET, jax.random.key(5))
    heads.save_eagle3(tmp_path, head, params, TARGET)
    tensors = {n.replace("midlayer.", "layers.0."): np.array(t) for n, t in
               safetensors_file.load(tmp_path / "model.safetensors").items()}
    safetensors_file.save(tensors, tmp_path / "model.safetensors")
    _, loaded = heads.load_head(tmp_path, TARGET)
    assert np.array_equal(loaded["layer"]["wqkv"], params["layer"]["wqkv"])
    head, params = heads.random_head("eagle", TARGET, jax.random.key(6))
    heads.save_eagle(tmp_path / "e1", head, params, TARGET)
    tensors = dict(safetensors_file.load(tmp_path / "e1" / "model.safetensors"))
    tensors["layers.0.input_layernorm.weight"] = np.full(32, 3.0, np.float32)
    tensors["embed_tokens.weight"] = np.ones((96, 32), np.float32)
    safetensors_file.save(tensors, tmp_path / "e1" / "model.safetensors")
    _, loaded = heads.load_head(tmp_path / "e1", TARGET, method="eagle")
    assert set(loaded) == {"fc", "layer"} and "attn_norm" not in loaded["layer"]


def _edited(path, edit):
    tensors = {n: np.array(t) for n, t in
               safetensors_file.load(path / "model.safetensors").items()}
    edit(tensors)
    safetensors_file.save(tensors, path / "model.safetensors")


@pytest.mark.parametrize(("edit", "message"), [
    (lambda t: t.pop("midlayer.hidden_norm.weight"),
     r"lacks tensor\(s\) \['midlayer.hidden_norm.weight'\]"),
    (lambda t: t.pop("d2t"), r"lacks tensor\(s\) \['d2t'\]"),
    (lambda t: t.update({"fc.weight": np.zeros((32, 64), np.float32)}),
     r"tensor fc.weight has shape \(32, 64\), expected \(32, 96\)"),
    (lambda t: t.update({"d2t": t["d2t"].astype(np.float32)}),
     "tensor d2t has dtype float32"),
    (lambda t: t.update({"midlayer.extra.weight": np.zeros(3, np.float32)}),
     r"unexpected tensor\(s\) \['midlayer.extra.weight'\]"),
    (lambda t: t.update({"d2t": t["d2t"] + 100}), "d2t maps draft ids outside"),
])
def test_checkpoint_errors_name_the_tensor(tmp_path, edit, message):
    head, params = heads.random_head("eagle3", TARGET, jax.random.key(7),
                                     draft_vocab_size=40)
    heads.save_eagle3(tmp_path, head, params, TARGET)
    _edited(tmp_path, edit)
    with pytest.raises(ValueError, match=message):
        heads.load_head(tmp_path, TARGET)


def test_eagle3_of_another_width_needs_its_own_embedding(tmp_path):
    head, params = heads.random_head("eagle3", TARGET, jax.random.key(8), hidden_size=16,
                                     target_hidden_size=32, head_dim=4)
    heads.save_eagle3(tmp_path, head, params, TARGET)
    _edited(tmp_path, lambda t: t.pop("embed_tokens.weight"))
    with pytest.raises(ValueError, match="embed_tokens.weight"):
        heads.load_head(tmp_path, TARGET)


def test_pickle_only_directory_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(EAGLE3))
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04not really")
    with pytest.raises(ValueError, match=r"pickle weights \['pytorch_model.bin'\].*never "
                                         "unpickles"):
        heads.load_head(tmp_path, TARGET)


def test_bfloat16_checkpoint_loads_as_float32(tmp_path):
    head, params = heads.random_head("eagle", TARGET, jax.random.key(9))
    heads.save_eagle(tmp_path, head, params, TARGET, dtype="bfloat16")
    assert _published(tmp_path)["fc.weight"][0] == "bfloat16"
    _, loaded = heads.load_head(tmp_path, TARGET, method="eagle")
    want = np.asarray(params["fc"]).astype(ml_dtypes.bfloat16).astype(np.float32)
    assert loaded["fc"].dtype == np.float32 and np.array_equal(loaded["fc"], want)


def test_published_llama3_head_configs_fit_llama3_8b():
    """SafeAILab's EAGLE-3 and EAGLE configs for Llama-3 8B (as on the hub) against the
    8B target's shape."""
    target = load_preset("llama3.1-8b")
    llama = {"hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336,
             "max_position_embeddings": 2048, "model_type": "llama",
             "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 1,
             "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
             "torch_dtype": "float16", "vocab_size": 128256, "bos_token_id": 128000}
    eagle3 = head_config(llama | {"architectures": ["LlamaForCausalLMEagle3"],
                                  "draft_vocab_size": 32000}, target)
    assert eagle3.feature_layers == (2, 16, 29) and eagle3.feature_size == 3 * 4096
    assert (eagle3.layer.head_dim, eagle3.layer.num_kv_heads, eagle3.draft_vocab_size) == (
        128, 8, 32000)
    eagle = head_config(llama | {"architectures": ["LlamaForCausalLM"]}, target, "eagle")
    assert eagle.feature_layers == (FINAL_NORMED,) and eagle.layer.rope_theta == 500000.0
    layout = heads.published_layout(eagle3)
    assert layout["midlayer.self_attn.q_proj.weight"].shapes == ((4096, 8192),)
    assert layout["fc.weight"].shapes == ((4096, 12288),) and not layout[
        "embed_tokens.weight"].required
