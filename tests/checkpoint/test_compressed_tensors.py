"""Pre-quantized compressed-tensors FP8 checkpoints, written here in that exact format with
torch's float8: values and scales loaded bit for bit (fused, transposed), logits as
transformers' on the dequantized weights, the engine, tensor parallelism and orbax
conversion keeping fp8, and named errors for every other quantization_config."""

from __future__ import annotations

import json
import logging
import pathlib
import shutil

import numpy as np
import pytest
import torch

from jaxinfer import LLM, SamplingParams, checkpoint, testing
from jaxinfer.checkpoint import compressed_tensors
from jaxinfer.config import ModelConfig
from jaxinfer.engine.runner import Chunk, Runner, tree_bytes
from jaxinfer.model import fusion, params_table, quantization

SMALL = dict(page_size=8, max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16)
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
               "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max
# Ours: activations cast to bfloat16 before each fp8 matmul (weight-only path);
# transformers: float32 throughout. Measured max |diff| 0.006 (both strategies) over
# logits spread over 3.2.
LOGIT_TOL = 0.02


def weight_args(strategy: str) -> dict:
    """`weights` of a config group as llm-compressor writes them."""
    return {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy,
            "dynamic": False, "group_size": None, "block_structure": None,
            "actorder": None, "observer": "minmax", "observer_kwargs": {}}


# FP8_DYNAMIC (channel weights, dynamic per-token activations) and FP8 (static tensor).
ACTIVATIONS = {
    "channel": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token",
                "dynamic": True, "group_size": None, "block_structure": None,
                "actorder": None, "observer": None, "observer_kwargs": {}},
    "tensor": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor",
               "dynamic": False, "group_size": None, "block_structure": None,
               "actorder": None, "observer": "minmax", "observer_kwargs": {}},
}


def quantization_config(strategy: str, **overrides: object) -> dict:
    """config.json's quantization_config in the shape llm-compressor saves."""
    return {"config_groups": {"group_0": {
                "input_activations": ACTIVATIONS[strategy], "output_activations": None,
                "targets": ["Linear"], "weights": weight_args(strategy),
                "format": "float-quantized"}},
            "format": "float-quantized", "global_compression_ratio": None,
            "ignore": ["lm_head"], "kv_cache_scheme": None,
            "quant_method": "compressed-tensors", "quantization_status": "compressed",
            "sparsity_config": {}, "transform_config": {}, "version": "0.10.2"} | overrides


def quantize_fp8(w: torch.Tensor, strategy: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 [out, in], scale) as llm-compressor's minmax observer makes them: per
    channel float32 [out, 1]; per tensor [1], here in bfloat16 (the model dtype)."""
    if strategy == "channel":
        scale = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    else:
        scale = (w.abs().max() / FP8_MAX).reshape(1).to(torch.bfloat16)
    value = (w / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return value, scale


def write_fp8_checkpoint(src: pathlib.Path, dst: pathlib.Path, strategy: str) -> dict:
    """Copy the float HF checkpoint `src` to `dst` in compressed-tensors FP8; returns the
    tensors written."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    for name in [n for n in tensors if n.endswith(tuple(p + ".weight" for p in PROJECTIONS))]:
        module = name.removesuffix(".weight")
        tensors[name], tensors[f"{module}.weight_scale"] = quantize_fp8(tensors[name], strategy)
        if strategy == "tensor":  # static activation scales, which we do not use
            tensors[f"{module}.input_scale"] = torch.tensor([0.01], dtype=torch.bfloat16)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = quantization_config(strategy)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return tensors


def dequantized_model(model: torch.nn.Module, tensors: dict) -> torch.nn.Module:
    """`model` with every fp8 weight replaced by float8 * scale (float32)."""
    import copy

    out = copy.deepcopy(model)
    state = out.state_dict()
    with torch.no_grad():
        for name, value in tensors.items():
            if value.dtype == torch.float8_e4m3fn:
                scale = tensors[name.removesuffix(".weight") + ".weight_scale"].float()
                state[name].copy_(value.float() * scale)
    return out


@pytest.fixture(scope="module")
def fp8(tmp_path_factory):
    """strategy -> (checkpoint dir, its tensors, transformers on the dequantized weights)."""
    src = tmp_path_factory.mktemp("float")
    model = testing.make_hf_model(src, "llama", seed=3)
    out = {}
    for strategy in ("channel", "tensor"):
        dst = tmp_path_factory.mktemp("ct") / strategy
        tensors = write_fp8_checkpoint(src, dst, strategy)
        out[strategy] = (dst, tensors, dequantized_model(model, tensors))
    return out


def _bytes(x: object) -> np.ndarray:
    return np.asarray(x).view(np.uint8)


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_fp8_values_and_scales_are_the_files(fp8, strategy):
    root, tensors, _ = fp8[strategy]
    cfg = checkpoint.load_config(root)
    params = checkpoint.load_params(root, cfg)
    assert quantization.mode_of(params) == "fp8"

    def weight(i: int, proj: str) -> tuple[np.ndarray, np.ndarray]:
        """The file's float8 [in, out] and its f32 scale broadcast to [out]."""
        value = tensors[f"model.layers.{i}.{proj}.weight"]
        scale = tensors[f"model.layers.{i}.{proj}.weight_scale"].float().reshape(-1)
        return (value.view(torch.uint8).numpy().T,
                np.broadcast_to(scale.numpy(), (value.shape[0],)))

    for i, layer in enumerate(params["layers"]):
        (q, sq), (k, sk), (v, sv) = (weight(i, f"self_attn.{n}_proj") for n in "qkv")
        (gate, sg), (up, su) = weight(i, "mlp.gate_proj"), weight(i, "mlp.up_proj")
        expected = {"wqkv": (fusion.fuse_qkv(q, k, v, cfg), fusion.fuse_qkv(sq, sk, sv, cfg)),
                    "w_gate_up": (fusion.fuse_gate_up(gate, up), fusion.fuse_gate_up(sg, su)),
                    "wo": weight(i, "self_attn.o_proj"), "w_down": weight(i, "mlp.down_proj")}
        for key, (value, scale) in expected.items():
            assert layer[key].mode == "fp8" and layer[key].scale.dtype == np.float32
            np.testing.assert_array_equal(_bytes(layer[key].value).T, value)  # [O, I]
            np.testing.assert_array_equal(np.asarray(layer[key].scale), scale)
        assert layer["attn_norm"].dtype == np.float32
    np.testing.assert_array_equal(np.asarray(params["lm_head"]),
                                  tensors["lm_head.weight"].numpy().T)  # ignored: float


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_logits_match_transformers_on_dequantized_weights(fp8, strategy):
    root, _, reference = fp8[strategy]
    cfg = checkpoint.load_config(root)
    runner = Runner(cfg, checkpoint.load_params(root, cfg), num_pages=16, page_size=8,
                    max_model_len=64)
    ids = np.random.default_rng(0).integers(0, 256, size=37)
    ours = testing.logits(runner, [Chunk(ids.tolist(), 0, [3, 1, 7, 2, 9])])
    with torch.no_grad():
        want = reference(torch.tensor(ids)[None]).logits[0].numpy()
    diff = np.abs(ours - want).max()
    print(f"{strategy}: max |logit diff| {diff:.4f}, logit spread {np.ptp(want):.2f}")
    assert diff < LOGIT_TOL
    assert (ours.argmax(-1) == want.argmax(-1)).mean() > 0.9


@pytest.fixture(scope="module")
def engine(fp8):
    return LLM(fp8["channel"][0], strict_compile=True, **SMALL)


def test_llm_serves_the_checkpoint_in_fp8_as_the_planner_counts(fp8, engine, caplog):
    runner = engine.engine.runner
    assert quantization.mode_of(runner.params) == "fp8"
    # the head stays float, as the checkpoint's ignore list says (quantized by
    # jaxinfer's own modes), and the planner counts it so
    assert not quantization.has_quantized_head(runner.params)
    assert tree_bytes(runner.params) == engine.engine.memory_plan.weight_bytes
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    tokens = engine.generate([[1, 5, 9, 13]], params)[0].token_ids
    same = LLM(fp8["channel"][0], quantization="fp8", warm_up=False, **SMALL)  # same mode
    assert same.generate([[1, 5, 9, 13]], params)[0].token_ids == tokens
    with pytest.raises(ValueError, match="holds fp8 weights; quantization='int8'"):
        LLM(fp8["channel"][0], quantization="int8", warm_up=False, **SMALL)
    with caplog.at_level(logging.WARNING, logger="jaxinfer.checkpoint.hf"):
        checkpoint.load_params(fp8["channel"][0], checkpoint.load_config(fp8["channel"][0]))
    assert "FP8 input activations (input 8-bit float dynamic per-token)" in caplog.text
    assert "activations run in bfloat16" in caplog.text


def test_tensor_parallel_gives_the_same_tokens(fp8, engine):
    """TP=2 splits q/k/v and gate/up columns (and their scales); TP=4 also copies the two
    KV heads, with their scales."""
    prompts = [[1, 5, 9, 13, 2, 7]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = engine.generate(prompts, params)[0].token_ids
    for tp in (2, 4):
        llm = LLM(fp8["channel"][0], tensor_parallel_size=tp, warm_up=False, **SMALL)
        assert llm.generate(prompts, params)[0].token_ids == want, tp
        scale = llm.engine.runner.params["layers"][0]["wqkv"].scale
        assert scale.addressable_shards[0].data.shape[0] == scale.shape[0] // tp


def test_each_device_reads_only_its_slice_of_the_fp8_tensors(fp8):
    from jaxinfer.checkpoint import shard_source
    from jaxinfer.model import sharding

    root = fp8["tensor"][0]
    log = shard_source.ReadLog()
    params = checkpoint.load_params(root, checkpoint.load_config(root), mesh=sharding.make_mesh(2),
                                    log=log)
    reads: dict[str, list[int]] = {}
    for name, _, nbytes in log.reads:
        reads.setdefault(name, []).append(nbytes)
    for key in (k for k in params["layers"][1] if k in quantization.QUANTIZED_WEIGHTS):
        weight = params["layers"][1][key]
        for name, leaf in ((f"layers.1.{key}", weight.value), (f"layers.1.{key}.scale",
                                                                 weight.scale)):
            shard_bytes = leaf.addressable_shards[0].data.nbytes  # fp8 / f32, as read
            slices = len({str(s.index) for s in leaf.addressable_shards})
            assert reads[name] == [shard_bytes] * slices, name
        assert weight.value.addressable_shards[0].data.nbytes == weight.value.nbytes // 2


def test_convert_to_orbax_keeps_fp8(fp8, engine, tmp_path):
    out = tmp_path / "orbax"
    checkpoint.convert_hf_to_orbax(fp8["channel"][0], out)
    assert checkpoint.checkpoint_quantization(out) == "fp8"
    assert not checkpoint.quantized_head(out)  # kept float, as in the HF checkpoint
    llm = LLM(out, warm_up=False, **SMALL)
    restored = llm.engine.runner.params["layers"][1]["w_gate_up"]
    loaded = engine.engine.runner.params["layers"][1]["w_gate_up"]
    np.testing.assert_array_equal(_bytes(restored.value), _bytes(loaded.value))
    np.testing.assert_array_equal(np.asarray(restored.scale), np.asarray(loaded.scale))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    assert llm.generate([[4, 8, 15]], params)[0].token_ids == \
        engine.generate([[4, 8, 15]], params)[0].token_ids
    with pytest.raises(ValueError, match="holds fp8 weights; quantization='w8a8'"):
        checkpoint.convert_hf_to_orbax(fp8["channel"][0], tmp_path / "w8a8",
                                       quantization_mode="w8a8")


def _group(**weights: object) -> dict:
    return {"group_0": {"targets": ["Linear"], "weights": weight_args("channel") | weights,
                        "input_activations": None}}


UNSUPPORTED = {  # quantization_config -> what the error must name
    "awq_gemv": ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv",
                  "zero_point": True}, "version='gemv' is not supported"),
    "gptq_8bit": ({"quant_method": "gptq", "bits": 8, "group_size": 128, "desc_act": False},
                  "bits=8 is not supported"),
    "hf_fp8": ({"quant_method": "fp8", "activation_scheme": "dynamic",
                "weight_block_size": [128, 128]}, "quant_method='fp8' is not supported"),
    "bitsandbytes": ({"quant_method": "bitsandbytes", "load_in_4bit": True},
                     "quant_method='bitsandbytes' is not supported"),
    "int4_packed": (quantization_config("channel", format="pack-quantized", config_groups=_group(
        num_bits=4, type="int", strategy="group", group_size=128)),
        "format='pack-quantized' is not supported"),
    "int8": (quantization_config("channel", format="int-quantized", config_groups=_group(
        type="int")), "format='int-quantized' is not supported"),
    "int8_group_format": (quantization_config("channel", format="naive-quantized",
                                              config_groups=_group(type="int")),
                          "weights num_bits=8 type='int'"),
    "fp8_group": (quantization_config("channel", config_groups=_group(
        strategy="group", group_size=128)), "weight strategy='group' is not supported"),
    "fp8_block": (quantization_config("channel", config_groups=_group(
        strategy="block", block_structure=[128, 128])), "weight strategy='block'"),
    "sparse_2of4": (quantization_config("channel", sparsity_config={
        "format": "sparse-24-bitmask", "sparsity_structure": "2:4"}),
        "sparsity_config format='sparse-24-bitmask' \\(structure '2:4'\\)"),
    "asymmetric": (quantization_config("channel", config_groups=_group(symmetric=False)),
                   "asymmetric weights"),
    "preset": (quantization_config("channel", config_groups={"FP8_DYNAMIC": ["Linear"]}),
               "preset names are not supported"),
}


@pytest.mark.parametrize("case", sorted(UNSUPPORTED))
def test_unsupported_quantization_config_is_named_before_reading_weights(fp8, tmp_path,
                                                                         case):
    qc, message = UNSUPPORTED[case]
    config = json.loads((fp8["channel"][0] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"quantization_config": qc}))
    with pytest.raises(ValueError, match=message):  # no weights file: none was read
        LLM(tmp_path, skip_tokenizer_init=True, warm_up=False, **SMALL)
    with pytest.raises(ValueError, match="compressed-tensors"):  # says what is supported
        checkpoint.load_config(tmp_path)


def _rewrite(root: pathlib.Path, dst: pathlib.Path, edit: object) -> pathlib.Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(root, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_quantized_lm_head_or_float_projection_is_refused(fp8, tmp_path):
    root, tensors, _ = fp8["channel"]
    head = tensors["lm_head.weight"].float()

    def quantize_head(t: dict) -> None:
        t["lm_head.weight"], t["lm_head.weight_scale"] = quantize_fp8(head, "channel")

    def float_down(t: dict) -> None:
        name = "model.layers.1.mlp.down_proj"
        t[f"{name}.weight"] = t[f"{name}.weight"].float() * t.pop(f"{name}.weight_scale")

    for edit, message in ((quantize_head, r"\['lm_head.weight'\] are quantized"),
                          (float_down, "model.layers.1.mlp.down_proj.weight has dtype "
                                       "float32, expected float8_e4m3fn")):
        bad = _rewrite(root, tmp_path / edit.__name__, edit)
        with pytest.raises(ValueError, match=message):
            checkpoint.load_params(bad, checkpoint.load_config(bad))


def test_scheme_reports_what_is_not_used():
    scheme = compressed_tensors.scheme_of(
        {"quantization_config": quantization_config("tensor", kv_cache_scheme={
            "num_bits": 8, "type": "float", "strategy": "tensor"})}, "config.json")
    assert scheme.strategies == ("tensor",) and scheme.ignore == ("lm_head",)
    notes = " ".join(scheme.notes())
    assert "input 8-bit float static per-tensor" in notes and "kv_cache_dtype" in notes
    weight_only = quantization_config("channel", format="naive-quantized")
    weight_only["config_groups"]["group_0"]["input_activations"] = None
    assert compressed_tensors.scheme_of({"quantization_config": weight_only}, "x").notes() == []
    assert compressed_tensors.scheme_of({}, "x") is None
    matrices = {key for key, shape in params_table.hf_layer_shapes(  # every layer matrix
        ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1,
                    num_heads=2, num_kv_heads=1, head_dim=4, qkv_bias=True, qk_norm=True)).items()
        if len(shape) == 2}
    assert matrices <= set(compressed_tensors.FP8_PARTS)  # and a shared expert's
    mixed = quantization_config("channel", format="mixed-precision")  # groups name theirs
    mixed["config_groups"]["group_1"] = mixed["config_groups"]["group_0"] | {
        "weights": weight_args("tensor"), "targets": ["re:.*down_proj"]}
    assert compressed_tensors.scheme_of({"quantization_config": mixed}, "x").strategies == \
        ("channel", "tensor")
    mixed["config_groups"]["group_1"]["format"] = "pack-quantized"
    with pytest.raises(ValueError, match=r"config_groups\['group_1'\]: format='pack-quantized'"):
        compressed_tensors.scheme_of({"quantization_config": mixed}, "x")


def test_cli_plan_counts_the_checkpoint_in_fp8(fp8):
    import os
    import subprocess
    import sys

    from jaxinfer.sizing import planner

    root = fp8["channel"][0]
    result = subprocess.run(
        [sys.executable, "-m", "jaxinfer", "plan", f"--model={root}", "--memory_gb=1",
         "--dtype=float32", "--format=json"],
        cwd=pathlib.Path(__file__).parents[2], capture_output=True, text=True,
        timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert result.returncode == 0, result.stderr
    fp8_bytes = planner.weight_bytes(checkpoint.load_config(root), "float32", 1, "fp8",
                                     quantized_head=False)  # the checkpoint's float head
    assert json.loads(result.stdout)["weight_bytes"] == fp8_bytes
