"""Loading HF checkpoints (single and sharded), orbax round trips, and bad inputs."""

from __future__ import annotations

import json
import shutil

import jax
import numpy as np
import pytest

from jaxinfer import checkpoint, testing
from jaxinfer.checkpoint import safetensors_file
from jaxinfer.model import fusion, transformer


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _params_equal(a, b) -> bool:
    return all(np.array_equal(np.asarray(x), np.asarray(y))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def test_load_hf_params_match_torch_weights(hf_model_dirs, hf_models):
    cfg = checkpoint.load_config(hf_model_dirs["qwen2"])
    params = checkpoint.load_params(hf_model_dirs["qwen2"], cfg)
    state = hf_models["qwen2"].state_dict()
    layers = [fusion.unfuse_layer(jax.device_get(layer), cfg) for layer in params["layers"]]
    np.testing.assert_array_equal(layers[1]["wq"],
                                  state["model.layers.1.self_attn.q_proj.weight"].numpy().T)
    np.testing.assert_array_equal(layers[0]["bk"],
                                  state["model.layers.0.self_attn.k_proj.bias"].numpy())
    np.testing.assert_array_equal(layers[1]["w_up"],
                                  state["model.layers.1.mlp.up_proj.weight"].numpy().T)
    assert "lm_head" not in params  # tied


def test_fused_qkv_is_grouped_by_kv_head(hf_model_dirs, hf_models):
    """Each KV head's query heads, then its k, then its v: a split of the fused axis into
    G parts gives KV head g with exactly its own query heads (tensor parallelism)."""
    cfg = checkpoint.load_config(hf_model_dirs["qwen2"])
    params = checkpoint.load_params(hf_model_dirs["qwen2"], cfg)
    state = hf_models["qwen2"].state_dict()
    prefix = "model.layers.0.self_attn."
    wq, wk, wv = (state[f"{prefix}{n}_proj.weight"].numpy().T for n in "qkv")
    h, g = cfg.head_dim, cfg.num_kv_heads
    r = cfg.num_heads // g
    groups = np.split(np.asarray(params["layers"][0]["wqkv"]), g, axis=1)
    for i, group in enumerate(groups):
        np.testing.assert_array_equal(group[:, :r * h], wq[:, i * r * h:(i + 1) * r * h])
        np.testing.assert_array_equal(group[:, r * h:(r + 1) * h], wk[:, i * h:(i + 1) * h])
        np.testing.assert_array_equal(group[:, (r + 1) * h:], wv[:, i * h:(i + 1) * h])


def test_fused_gate_up_interleaves_blocks(hf_model_dirs, hf_models):
    cfg = checkpoint.load_config(hf_model_dirs["llama"])
    params = checkpoint.load_params(hf_model_dirs["llama"], cfg)
    state = hf_models["llama"].state_dict()
    gate = state["model.layers.1.mlp.gate_proj.weight"].numpy().T
    up = state["model.layers.1.mlp.up_proj.weight"].numpy().T
    b = fusion.mlp_block(cfg.intermediate_size)
    fused = np.asarray(params["layers"][1]["w_gate_up"])
    for j in range(cfg.intermediate_size // b):
        np.testing.assert_array_equal(fused[:, 2 * j * b:(2 * j + 1) * b],
                                      gate[:, j * b:(j + 1) * b])
        np.testing.assert_array_equal(fused[:, (2 * j + 1) * b:(2 * j + 2) * b],
                                      up[:, j * b:(j + 1) * b])


def test_load_sharded_checkpoint_equals_single_file(tmp_path, hf_model_dirs, hf_models):
    hf_models["llama"].save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 2
    cfg = checkpoint.load_config(tmp_path)
    sharded = checkpoint.load_params(tmp_path, cfg)
    single = checkpoint.load_params(hf_model_dirs["llama"], cfg)
    assert _params_equal(sharded, single)


def test_orbax_convert_round_trip(tmp_path, hf_model_dirs):
    out = tmp_path / "orbax"
    checkpoint.convert_hf_to_orbax(hf_model_dirs["qwen3"], out)
    assert (out / "params").is_dir() and (out / "tokenizer.json").is_file()
    assert not list(out.glob("*.safetensors"))
    cfg = checkpoint.load_config(out)
    restored = checkpoint.load_params(out, cfg)
    assert _params_equal(restored, checkpoint.load_params(hf_model_dirs["qwen3"], cfg))
    as_bf16 = checkpoint.load_params(out, cfg, "bfloat16")
    assert as_bf16["embed"].dtype == "bfloat16"
    with pytest.raises(FileExistsError, match="not empty"):
        checkpoint.convert_hf_to_orbax(hf_model_dirs["qwen3"], out)


def test_save_hf_is_loaded_back_exactly(tmp_path):
    cfg = _tiny_cfg()
    params = transformer.init_params(cfg, jax.random.key(0))
    checkpoint.save_hf(tmp_path, cfg, params)
    assert checkpoint.load_config(tmp_path) == cfg
    assert _params_equal(checkpoint.load_params(tmp_path, cfg), params)


def _tiny_cfg():
    from jaxinfer.config import ModelConfig
    return ModelConfig.from_hf(testing.hf_config("llama").to_dict())


def test_error_unknown_model_dir(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        checkpoint.load_config(tmp_path / "nope")


def test_error_missing_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        checkpoint.load_config(tmp_path)


def test_error_unknown_architecture(tmp_path, hf_model_dirs):
    d = _copy(hf_model_dirs["llama"], tmp_path / "m")
    config = json.loads((d / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported architecture.*GPT2LMHeadModel"):
        checkpoint.load_config(d)


def test_error_missing_weights_file(tmp_path, hf_model_dirs):
    d = _copy(hf_model_dirs["llama"], tmp_path / "m")
    (d / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        checkpoint.load_params(d, checkpoint.load_config(d))


def _rewrite(d, edit):
    tensors = {k: np.array(v) for k, v in safetensors_file.load(d / "model.safetensors").items()}
    edit(tensors)
    safetensors_file.save(tensors, d / "model.safetensors")


def test_error_missing_tensor_is_named(tmp_path, hf_model_dirs):
    d = _copy(hf_model_dirs["llama"], tmp_path / "m")
    _rewrite(d, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"lacks tensor.*model\.layers\.1\.mlp\.up_proj"):
        checkpoint.load_params(d, checkpoint.load_config(d))


def test_error_misshaped_tensor_names_both_shapes(tmp_path, hf_model_dirs):
    d = _copy(hf_model_dirs["llama"], tmp_path / "m")
    name = "model.layers.0.self_attn.k_proj.weight"
    _rewrite(d, lambda t: t.__setitem__(name, t[name][:16]))
    with pytest.raises(ValueError, match=rf"{name} has shape \(16, 64\), expected \(32, 64\)"):
        checkpoint.load_params(d, checkpoint.load_config(d))


def test_error_unsupported_dtype_is_named(tmp_path, hf_model_dirs):
    d = _copy(hf_model_dirs["llama"], tmp_path / "m")
    name = "model.norm.weight"
    _rewrite(d, lambda t: t.__setitem__(name, t[name].astype(np.int32)))
    with pytest.raises(ValueError, match=f"{name} has unsupported dtype int32"):
        checkpoint.load_params(d, checkpoint.load_config(d))


def test_error_unexpected_tensor_is_named(tmp_path, hf_model_dirs):
    d = _copy(hf_model_dirs["llama"], tmp_path / "m")
    extra = "model.layers.9.mlp.up_proj.weight"
    _rewrite(d, lambda t: t.__setitem__(extra, t["model.norm.weight"]))
    with pytest.raises(ValueError, match=r"unexpected tensor.*layers\.9"):
        checkpoint.load_params(d, checkpoint.load_config(d))


@pytest.mark.parametrize("damage", ["truncate", "header", "empty"])
def test_error_corrupt_safetensors(tmp_path, hf_model_dirs, damage):
    d = _copy(hf_model_dirs["llama"], tmp_path / "m")
    path = d / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes({"truncate": data[:len(data) // 2], "header": data[:8] + b"{oops" +
                      data[13:], "empty": b""}[damage])
    with pytest.raises(safetensors_file.SafetensorsError, match="model.safetensors"):
        checkpoint.load_params(d, checkpoint.load_config(d))


def test_error_orbax_params_mismatch_config(tmp_path, hf_model_dirs):
    out = tmp_path / "orbax"
    checkpoint.convert_hf_to_orbax(hf_model_dirs["llama"], out)
    config = json.loads((out / "config.json").read_text())
    config["intermediate_size"] = 96
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="orbax params do not match config.json"):
        checkpoint.load_params(out, checkpoint.load_config(out))
