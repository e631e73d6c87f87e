"""Pre-quantized AWQ (GEMM) and GPTQ (v1 and v2) int4 checkpoints, written here from tiny
random models by the formats' published packing rules: logits as the float model of the
weights dequantized by those rules (a reference written here, independent of the
loader), the same greedy tokens under tensor parallelism, bytes as planned, and each
refusal by its message."""

from __future__ import annotations

import collections
import json
import os
import pathlib
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxinfer import LLM, SamplingParams, checkpoint, testing
from jaxinfer.config import ModelConfig
from jaxinfer.engine.runner import Chunk, Runner, tree_bytes
from jaxinfer.model import quantization
from jaxinfer.sizing import planner

SMALL = dict(page_size=8, max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16,
             dtype="float32")
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
               "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
LOGIT_TOL = 1e-4
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ: nibble i of a word holds column AWQ_ORDER[i]
WIDE = dict(hidden_size=128, head_dim=32, intermediate_size=256)  # inputs of 128 and 256


# ---- the formats as published: quantize, pack, and the reference dequantization ----


def quantize_groups(w: np.ndarray, group: int, sym: bool
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """w f32 [O, I] -> (codes [O, I], zeros [G, O], float16 scales [G, O]) over groups of
    `group` inputs, asymmetric (min/max, AutoAWQ's and GPTQ's default) or symmetric
    (GPTQ's sym: zero 8); codes computed from the float16 scales as stored."""
    out, inputs = w.shape
    groups = w.reshape(out, inputs // group, group)
    low, high = np.minimum(groups.min(-1), 0), np.maximum(groups.max(-1), 0)
    scale = np.maximum(-low, high) * 2 / 15 if sym else (high - low) / 15
    scale = np.maximum(scale, 1e-5).astype(np.float16)
    zero = np.full(scale.shape, 8.0) if sym else np.clip(
        np.round(-low / scale.astype(np.float32)), 0, 15)
    codes = np.clip(np.round(groups / scale.astype(np.float32)[..., None]) + zero[..., None],
                    0, 15)
    return (codes.reshape(out, inputs).astype(np.int64), zero.T.astype(np.int64),
            scale.T.copy())


def pack_words(values: np.ndarray, order: list[int]) -> np.ndarray:
    """int [rows, 8n] -> int32 [rows, n]: nibble i of word c holds column 8c + order[i]."""
    rows, width = values.shape
    words = np.zeros((rows, width // 8), np.uint32)
    for i, column in enumerate(order):
        words |= (values[:, column::8].astype(np.uint32) & 0xF) << np.uint32(4 * i)
    return words.view(np.int32)


def unpack_words(words: np.ndarray, order: list[int]) -> np.ndarray:
    """The inverse of pack_words."""
    bits = words.view(np.uint32)
    values = np.zeros((bits.shape[0], bits.shape[1] * 8), np.int64)
    for i, column in enumerate(order):
        values[:, column::8] = (bits >> np.uint32(4 * i)) & 0xF
    return values


def awq_tensors(w: np.ndarray, group: int) -> tuple[dict, np.ndarray]:
    """AutoAWQ GEMM: qweight [I, O/8], qzeros [I/g, O/8] in AWQ's nibble order, float16
    scales [I/g, O]; and the weight [O, I] they stand for."""
    codes, zeros, scales = quantize_groups(w, group, sym=False)
    packed = {"qweight": pack_words(codes.T, AWQ_ORDER), "qzeros": pack_words(zeros, AWQ_ORDER),
              "scales": scales}
    return packed, awq_dequantize(packed, group)


def awq_dequantize(packed: dict, group: int) -> np.ndarray:
    """The reference: w = (q - z) * s per group, exact in float64."""
    codes = unpack_words(packed["qweight"], AWQ_ORDER)  # [I, O]
    zeros = np.repeat(unpack_words(packed["qzeros"], AWQ_ORDER), group, axis=0)
    scales = np.repeat(packed["scales"].astype(np.float64), group, axis=0)
    return ((codes - zeros) * scales).T  # [O, I]


def gptq_tensors(w: np.ndarray, group: int, sym: bool, v2: bool) -> tuple[dict, np.ndarray]:
    """GPTQ: qweight [I/8, O] (input row 8r + k in nibble k of row r), qzeros [I/g, O/8]
    (column 8c + k in nibble k; v1 stores zero - 1), float16 scales, g_idx [I]."""
    codes, zeros, scales = quantize_groups(w, group, sym=sym)
    inputs = codes.shape[1]
    by_input = codes.T.reshape(inputs // 8, 8, -1)  # [I/8, k, O]
    qweight = np.zeros(by_input[:, 0].shape, np.uint32)
    for k in range(8):
        qweight |= by_input[:, k].astype(np.uint32) << np.uint32(4 * k)
    packed = {"qweight": qweight.view(np.int32),
              "qzeros": pack_words(zeros - (0 if v2 else 1), list(range(8))),
              "scales": scales, "g_idx": (np.arange(inputs) // group).astype(np.int32)}
    return packed, gptq_dequantize(packed, v2)


def gptq_dequantize(packed: dict, v2: bool) -> np.ndarray:
    """The reference: w = (q - (stored zero + 1 for v1)) * scale[g_idx]."""
    bits = packed["qweight"].view(np.uint32)
    codes = np.stack([(bits >> np.uint32(4 * k)) & 0xF for k in range(8)], axis=1)
    codes = codes.reshape(-1, bits.shape[1]).astype(np.int64)  # [I, O]
    g_idx = packed["g_idx"]
    zeros = unpack_words(packed["qzeros"], list(range(8)))[g_idx] + (0 if v2 else 1)
    return ((codes - zeros) * packed["scales"].astype(np.float64)[g_idx]).T


def config(method: str, group: int, **overrides: object) -> dict:
    """quantization_config as transformers saves AwqConfig and GPTQConfig."""
    if method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                "version": "gemm", "backend": "autoawq", "modules_to_not_convert": None,
                **overrides}
    return {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False,
            "sym": True, "true_sequential": True, "damp_percent": 0.1,
            "checkpoint_format": "gptq", "meta": {"quantizer": ["gptqmodel:2.0"]},
            **overrides}


def write_checkpoints(src: pathlib.Path, quantized: pathlib.Path, reference: pathlib.Path,
                      qc: dict) -> dict:
    """From the float HF checkpoint `src`: `quantized` in the format `qc` names and
    `reference`, the float checkpoint of its weights dequantized by the reference rules
    (float32). Returns the packed tensors written."""
    shutil.copytree(src, quantized)
    shutil.copytree(src, reference)
    tensors = load_file(src / "model.safetensors")
    written, dequantized = dict(tensors), dict(tensors)
    for name in [n for n in tensors if n.endswith(tuple(p + ".weight" for p in PROJECTIONS))]:
        module, w = name.removesuffix(".weight"), tensors[name].astype(np.float32)
        if qc["quant_method"] == "awq":
            packed, back = awq_tensors(w, qc["group_size"])
        else:
            packed, back = gptq_tensors(w, qc["group_size"], qc["sym"],
                                        qc["checkpoint_format"] == "gptq_v2")
        del written[name]
        written |= {f"{module}.{key}": value for key, value in packed.items()}
        dequantized[name] = np.ascontiguousarray(back, np.float32)
    save_file(written, quantized / "model.safetensors", metadata={"format": "pt"})
    save_file(dequantized, reference / "model.safetensors", metadata={"format": "pt"})
    hf = json.loads((src / "config.json").read_text())
    (quantized / "config.json").write_text(json.dumps(hf | {"quantization_config": qc}))
    return written


CASES = {  # name -> (family, model size overrides, quantization_config)
    "awq_llama_g32": ("llama", {}, config("awq", 32)),
    "awq_qwen2_g128": ("qwen2", WIDE, config("awq", 128)),
    "awq_qwen2_g32": ("qwen2", {}, config("awq", 32)),  # one KV head: copied under TP=2
    "gptq_llama_g32_sym": ("llama", {}, config("gptq", 32)),
    "gptq_v2_qwen2_g64_asym": ("qwen2", {}, config("gptq", 64, sym=False,
                                                   checkpoint_format="gptq_v2")),
}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """case -> (quantized dir, reference float dir, packed tensors); "float": a float
    checkpoint (llama)."""
    out, floats = {}, {}
    for case, (family, sizes, qc) in CASES.items():
        key = (family, tuple(sizes.items()))
        if key not in floats:
            floats[key] = tmp_path_factory.mktemp(f"float-{family}")
            testing.make_hf_model(floats[key], family, seed=len(floats), **sizes)
        root = tmp_path_factory.mktemp(case)
        out[case] = (root / "int4", root / "float",
                     write_checkpoints(floats[key], root / "int4", root / "float", qc))
    out["float"] = floats[("llama", ())]
    return out


def _runner(root: pathlib.Path) -> Runner:
    cfg = checkpoint.load_config(root)
    return Runner(cfg, checkpoint.load_params(root, cfg), num_pages=16, page_size=8,
                  max_model_len=64)


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_equal_the_float_model_of_the_dequantized_weights(dirs, case):
    quantized, reference, _ = dirs[case]
    ours, want = _runner(quantized), _runner(reference)
    assert quantization.mode_of(ours.params) == "int4"
    assert not quantization.has_quantized_head(ours.params)  # float, as in the checkpoint
    wqkv = ours.params["layers"][0]["wqkv"]
    assert wqkv.value.dtype == np.uint8 and wqkv.scale.dtype == np.float32
    group = CASES[case][2]["group_size"]
    assert wqkv.scale.shape == (2, wqkv.shape[0] // group, wqkv.shape[1])
    ids = np.random.default_rng(0).integers(0, 256, size=37).tolist()
    chunks = [Chunk(ids, 0, [3, 1, 7, 2, 9])]
    got, expected = testing.logits(ours, chunks), testing.logits(want, chunks)
    diff = np.abs(got - expected).max()
    print(f"{case}: max |logit diff| {diff:.2e}, logit spread {np.ptp(expected):.2f}")
    assert diff < LOGIT_TOL


def test_int4_weights_dequantize_to_the_reference_exactly(dirs):
    """Every projection's int4 (fused q/k/v and gate/up) equals the reference weights."""
    for case in ("awq_llama_g32", "gptq_v2_qwen2_g64_asym"):
        quantized, reference, _ = dirs[case]
        cfg = checkpoint.load_config(quantized)
        ours = checkpoint.load_params(quantized, cfg)
        want = checkpoint.load_params(reference, cfg)
        for layer, float_layer in zip(ours["layers"], want["layers"], strict=True):
            for key in quantization.QUANTIZED_WEIGHTS:
                if key in layer:
                    np.testing.assert_array_equal(
                        np.asarray(quantization.dequantize(layer[key])),
                        np.asarray(float_layer[key]), err_msg=f"{case} {key}")


@pytest.mark.parametrize("case", ["awq_llama_g32", "awq_qwen2_g32", "gptq_llama_g32_sym"])
def test_tensor_parallel_gives_the_float_models_tokens_in_the_planned_bytes(dirs, case):
    quantized, reference, _ = dirs[case]
    prompts = [[1, 5, 9, 13, 2, 7], [40, 41, 42]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = [o.token_ids for o in LLM(reference, warm_up=False, **SMALL).generate(prompts, params)]
    one = LLM(quantized, strict_compile=True, **SMALL)
    two = LLM(quantized, tensor_parallel_size=2, warm_up=False, **SMALL)
    for llm in (one, two):
        assert [o.token_ids for o in llm.generate(prompts, params)] == want
    cfg, group = one.engine.model_config, CASES[case][2]["group_size"]
    assert tree_bytes(one.engine.runner.params) == one.engine.memory_plan.weight_bytes == \
        planner.weight_bytes(cfg, "float32", 1, "int4", quantized_head=False,
                             prequantized_group=group)
    per_device = collections.Counter()
    for leaf in jax.tree.leaves(two.engine.runner.params):
        for shard in leaf.addressable_shards:
            per_device[shard.device] += shard.data.nbytes
    expected = planner.weight_bytes(cfg, "float32", 2, "int4", quantized_head=False,
                                    prequantized_group=group)
    assert list(per_device.values()) == [expected, expected]
    wo = two.engine.runner.params["layers"][0]["wo"]  # [64, 64] split by rows: a group each
    assert wo.value.addressable_shards[0].data.shape == (16, 64)
    assert wo.scale.addressable_shards[0].data.shape == (2, 1, 64)


def test_bytes_are_half_a_byte_and_two_float32_a_group():
    cfg = ModelConfig(vocab_size=300, hidden_size=256, intermediate_size=512, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=64)
    float32 = planner.weight_bytes(cfg, "float32")
    int4 = planner.weight_bytes(cfg, "float32", quantization="int4", quantized_head=False,
                                prequantized_group=64)
    linears = [(256, (4 + 4) * 64), (256, 256), (256, 1024), (512, 256)]
    elements = cfg.num_layers * sum(i * o for i, o in linears)
    assert float32 - int4 == 4 * elements - (elements // 2 + 8 * elements // 64)


def test_cli_plan_counts_the_checkpoints_int4(dirs):
    quantized = dirs["awq_qwen2_g128"][0]
    result = subprocess.run(
        [sys.executable, "-m", "jaxinfer", "plan", f"--model={quantized}", "--memory_gb=1",
         "--dtype=float32", "--format=json"],
        cwd=pathlib.Path(__file__).parents[2], capture_output=True, text=True,
        timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["weight_bytes"] == planner.weight_bytes(
        checkpoint.load_config(quantized), "float32", 1, "int4", quantized_head=False,
        prequantized_group=128)


def test_quantization_flag_must_match_the_checkpoint(dirs):
    awq_dir, gptq_dir = dirs["awq_llama_g32"][0], dirs["gptq_llama_g32_sym"][0]
    assert checkpoint.served_quantization(awq_dir, "awq") == "int4"
    assert checkpoint.served_quantization(gptq_dir, "gptq") == "int4"
    assert checkpoint.served_quantization(awq_dir, None) == "int4"  # detected
    assert checkpoint.checkpoint_quantization(gptq_dir) == "int4"
    assert not checkpoint.quantized_head(awq_dir)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    named = LLM(awq_dir, quantization="awq", warm_up=False, **SMALL)
    assert named.engine.memory_plan.weight_bytes == tree_bytes(named.engine.runner.params)
    assert len(named.generate([[1, 2, 3]], params)[0].token_ids) == 4
    with pytest.raises(ValueError, match=r"quantization='gptq' reads a checkpoint quantized "
                       r"with GPTQ as it is, but .* holds awq weights"):
        LLM(awq_dir, quantization="gptq", warm_up=False, **SMALL)
    with pytest.raises(ValueError, match=r"quantization='awq' .* has no "
                       r"quantization_config \(float weights\); to quantize a float "
                       r"checkpoint at load use quantization='int4'"):
        LLM(dirs["float"], quantization="awq", warm_up=False, **SMALL)
    with pytest.raises(ValueError, match="holds int4 weights; quantization='int8'"):
        LLM(gptq_dir, quantization="int8", warm_up=False, **SMALL)


REFUSED = {  # case -> (quantization_config, what the error must name)
    "gptq_8bit": (config("gptq", 32, bits=8), r"gptq quantization_config: bits=8 is not "
                                              r"supported"),
    "awq_group_16": (config("awq", 16), "awq quantization_config: group_size=16 is not"),
    "gptq_per_channel": (config("gptq", -1), "group_size=-1 is not supported"),
    "gptq_desc_act": (config("gptq", 32, desc_act=True), r"desc_act=True \(act-order"),
    "awq_gemv": (config("awq", 32, version="gemv"), "version='gemv' is not supported"),
    "awq_no_zero_point": (config("awq", 32, zero_point=False),
                          "zero_point=False .* is not supported"),
    "gptq_marlin": (config("gptq", 32, checkpoint_format="marlin"),
                    "checkpoint_format='marlin' is not supported"),
    "gptq_lm_head": (config("gptq", 32, lm_head=True), "lm_head=True"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_unsupported_config_is_named_before_reading_weights(dirs, tmp_path, case):
    qc, message = REFUSED[case]
    hf = json.loads((dirs["float"] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(hf | {"quantization_config": qc}))
    with pytest.raises(ValueError, match=message):  # no weights file: none was read
        LLM(tmp_path, skip_tokenizer_init=True, warm_up=False, **SMALL)
    with pytest.raises(ValueError, match="supported: AWQ"):  # says what is
        checkpoint.load_config(tmp_path)


def test_experts_are_refused_by_name(tmp_path):
    hf = testing.hf_config("qwen2_moe").to_dict()
    (tmp_path / "config.json").write_text(json.dumps(hf | {
        "quantization_config": config("awq", 32)}))
    with pytest.raises(ValueError, match=r"awq experts \(8 a layer in qwen2_moe\) are not "
                       "supported"):
        checkpoint.load_config(tmp_path)


def _rewrite(root: pathlib.Path, dst: pathlib.Path, edit: object) -> pathlib.Path:
    shutil.copytree(root, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_checkpoint_tensors_are_checked(dirs, tmp_path):
    """Act-order g_idx, a projection left float, a quantized LM head, a wrong shape."""
    def act_order(t: dict) -> None:
        name = "model.layers.1.mlp.down_proj.g_idx"
        t[name] = np.random.default_rng(0).permutation(t[name])

    def float_down(t: dict) -> None:
        name = "model.layers.0.mlp.down_proj"
        for suffix in (".qweight", ".qzeros", ".scales", ".g_idx"):
            t.pop(name + suffix, None)
        t[name + ".weight"] = np.zeros((64, 128), np.float32)

    def quantized_head(t: dict) -> None:
        t["lm_head.qweight"] = np.zeros((64, 260 // 4), np.int32)

    def short_scales(t: dict) -> None:
        name = "model.layers.0.self_attn.o_proj.scales"
        t[name] = t[name][:1]

    cases = {"gptq_llama_g32_sym": [
        (act_order, r"down_proj.g_idx is not each input row's position // group_size \(32\)"),
        (quantized_head, r"\['lm_head.qweight'\] are gptq tensors of modules jaxinfer does "
                         r"not serve in int4"),
        (short_scales, r"o_proj.scales is float16\[1, 64\], expected float16 or bfloat16 "
                       r"or float32\[2, 64\]")],
        "awq_llama_g32": [(float_down, r"down_proj.weight is float in a awq checkpoint")]}
    for case, edits in cases.items():
        for edit, message in edits:
            bad = _rewrite(dirs[case][0], tmp_path / f"{case}-{edit.__name__}", edit)
            with pytest.raises(ValueError, match=message):
                checkpoint.load_params(bad, checkpoint.load_config(bad))


def test_groups_straddling_devices_are_refused(dirs):
    quantized = dirs["gptq_v2_qwen2_g64_asym"][0]  # wo [64, 64]: one group of 64
    with pytest.raises(ValueError, match=r"groups of 64 rows \(the checkpoint's group_size\) "
                       r"straddle the 2 devices' shares of wo \[64, 64\]"):
        LLM(quantized, tensor_parallel_size=2, warm_up=False, **SMALL)


def test_convert_to_orbax_is_refused(dirs, tmp_path):
    with pytest.raises(ValueError, match="convert does not write an AWQ or GPTQ"):
        checkpoint.convert_hf_to_orbax(dirs["awq_llama_g32"][0], tmp_path / "out")
