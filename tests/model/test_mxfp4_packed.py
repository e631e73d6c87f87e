"""gpt-oss's MXFP4 experts held packed on the device (quantization mode "mxfp4": uint8
blocks and e8m0 scales, decoded inside the step): transformers' logits from a tiny
MXFP4 checkpoint, 17/64 of bf16's expert bytes (what the planner counts), greedy
decoding through the engine, expert and tensor parallelism on 2 devices, the same
bytes from float experts quantized at load and through orbax, explicit modes still
decoding first, and gpt-oss-20b's plan on one v6e chip."""

from __future__ import annotations

import collections
import json
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from jaxinfer import LLM, SamplingParams, checkpoint, config, testing
from jaxinfer.checkpoint import safetensors_file, shard_source
from jaxinfer.config import load_preset
from jaxinfer.engine.runner import Chunk, Runner, tree_bytes
from jaxinfer.model import moe, quantization, sharding, transformer
from jaxinfer.sizing import planner
from tests.model.test_gpt_oss import _hf_generate, _hf_logits, _prompt, _write_mxfp4

TOL = 1e-4  # test_gpt_oss.py's: float32 logits against transformers
EXPERTS = quantization.EXPERT_WEIGHTS
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _tiny(root: pathlib.Path, **overrides: object) -> tuple[pathlib.Path, pathlib.Path, object]:
    """(float checkpoint, its MXFP4 twin, transformers on the twin, dequantized)."""
    src, dst = root / "float", root / "mxfp4"
    model = testing.make_hf_model(src, "gpt_oss", seed=3, **overrides)
    _write_mxfp4(src, dst)
    testing.write_byte_tokenizer(dst)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        dst, quantization_config=transformers.Mxfp4Config(dequantize=True),
        dtype=torch.float32, attn_implementation="eager")
    hf.generation_config = model.generation_config
    return src, dst, hf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """8 experts of 32 over a hidden size of 64 (tests/model/test_gpt_oss.py's model)."""
    return _tiny(tmp_path_factory.mktemp("gpt-oss"))


def _paged_logits(cfg, params, ids, mesh=None, expert_parallel=False) -> np.ndarray:
    """A 30-token prefill past the window of 12, then one token a step."""
    runner = Runner(cfg, params, num_pages=16, page_size=8, max_model_len=64, mesh=mesh,
                    options=config.ModelOptions(expert_parallel=expert_parallel))
    pages = [5, 2, 11, 7, 3, 9]
    pieces = [testing.logits(runner, [Chunk(ids[:30], 0, pages)])]
    pieces += [testing.logits(runner, [Chunk(ids[i:i + 1], i, pages)])
               for i in range(30, len(ids))]
    return np.concatenate(pieces)


def _expert_bytes(params: dict) -> int:
    return sum(tree_bytes(layer[name]) for layer in params["layers"] for name in layer
               if name in EXPERTS)


def test_experts_stay_packed_and_give_transformers_logits(tiny):
    """Loaded as the checkpoint stores them (uint8 [E, O, I / 2] and [E, O, I / 32],
    gate/up rows de-interleaved), decoded in the step exactly as the host decoder
    decodes them, computed in float32 (the model's dtype): within TOL of transformers."""
    _, dst, hf = tiny
    cfg = checkpoint.load_config(dst)
    params = checkpoint.load_params(dst, cfg)
    assert quantization.mode_of(params) == "mxfp4"
    assert not quantization.has_quantized_head(params)
    e, d, f = cfg.moe.num_experts, cfg.hidden_size, cfg.moe.intermediate_size
    for layer in params["layers"]:
        for name, (rows, inputs) in {"we_gate_up": (2 * f, d), "we_down": (d, f)}.items():
            w = layer[name]
            assert w.mode == "mxfp4" and w.value.dtype == w.scale.dtype == jnp.uint8
            assert w.value.shape == (e, rows, inputs // 2)
            assert w.scale.shape == (e, rows, inputs // 32)
        assert all(not quantization.is_quantized(v) for k, v in layer.items()
                   if k not in EXPERTS)
    decoded = checkpoint.load_params(dst, cfg, quantization_mode="fp8")  # host decoder
    for packed, floats in zip(params["layers"], decoded["layers"], strict=True):
        for name in EXPERTS:
            np.testing.assert_array_equal(
                np.asarray(quantization.dequantize_experts(packed[name])),
                np.asarray(floats[name]))
    ids = _prompt(2, 40)
    diff = np.abs(_paged_logits(cfg, params, ids) - _hf_logits(hf, ids)).max()
    print(f"gpt-oss MXFP4 packed: max abs logit diff {diff:.2e}")
    assert diff < TOL


def test_packed_experts_take_17_64ths_of_bf16s_bytes(tiny):
    """Half a byte an element and a byte per 32: 17/64 of bf16's two bytes, counted on
    the loaded leaves; the planner counts the same tree to the byte."""
    src, dst, _ = tiny
    cfg = checkpoint.load_config(dst)
    packed = checkpoint.load_params(dst, cfg, "bfloat16")
    floats = checkpoint.load_params(src, cfg, "bfloat16")
    assert quantization.mode_of(floats) is None
    packed_bytes, bf16_bytes = _expert_bytes(packed), _expert_bytes(floats)
    print(f"tiny gpt-oss experts on the device: {packed_bytes:,} bytes packed, "
          f"{bf16_bytes:,} in bfloat16 ({packed_bytes / bf16_bytes:.4f})")
    assert packed_bytes * 64 == bf16_bytes * 17
    assert tree_bytes(packed) == planner.weight_bytes(cfg, "bfloat16", quantization="mxfp4")
    assert packed_bytes == planner.expert_weight_bytes(cfg, "bfloat16", quantization="mxfp4")
    assert tree_bytes(floats) - bf16_bytes == tree_bytes(packed) - packed_bytes  # the rest


def test_bfloat16_experts_compute_in_bfloat16_as_their_decoded_weights(tiny):
    """Served in bfloat16, packed experts decode to bfloat16 (exact) and compute there:
    the logits of the same experts held as bfloat16 floats."""
    _, dst, _ = tiny
    cfg = checkpoint.load_config(dst)
    params = checkpoint.load_params(dst, cfg, "bfloat16")
    floats = params | {"layers": [layer | {name: quantization.dequantize_experts(
        layer[name], jnp.bfloat16) for name in EXPERTS} for layer in params["layers"]]}
    ids = jnp.asarray(_prompt(5, 24))[None]
    got = transformer.forward_dense(params, ids, cfg=cfg)
    want = transformer.forward_dense(floats, ids, cfg=cfg)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)


def test_engine_decodes_greedily_as_transformers_with_packed_experts(tiny):
    """`LLM` on the MXFP4 directory serves mode "mxfp4" by default: packed experts in the
    runner, chunked prefill (16 tokens) across the window, transformers' tokens."""
    _, dst, hf = tiny
    llm = LLM(model=str(dst), page_size=8, max_model_len=96, max_num_seqs=2,
              max_num_batched_tokens=16, compilation_cache_dir="", strict_compile=True)
    assert quantization.mode_of(llm.engine.runner.params) == "mxfp4"
    assert llm.engine.memory_plan.weight_bytes == tree_bytes(llm.engine.runner.params)
    prompts = [_prompt(7, 11), _prompt(8, 30)]
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [_hf_generate(hf, p, 12) for p in prompts]
    assert llm.metrics()["compiles_after_warmup"] == 0


@pytest.mark.parametrize("intermediate, expert_parallel", [(32, True), (64, False)])
def test_two_devices_hold_their_share_packed_and_give_transformers_logits(
        tmp_path, tiny, intermediate, expert_parallel):
    """Whole experts a device (4 of 8), or half of every expert (gate/up block pairs,
    down's inputs: 32 of 64, one MXFP4 block): each device holds and reads its half of
    the packed bytes, and the logits stay within TOL of transformers."""
    _, dst, hf = tiny if intermediate == 32 else _tiny(tmp_path, intermediate_size=64)
    cfg = checkpoint.load_config(dst)
    mesh = sharding.make_mesh(2)
    log = shard_source.ReadLog()
    params = checkpoint.load_params(dst, cfg, mesh=mesh, log=log,
                                    expert_parallel=expert_parallel)
    down = params["layers"][0]["we_down"]
    want_spec = ("model", None, None) if expert_parallel else (None, None, "model")
    assert tuple(down.value.sharding.spec) == tuple(down.scale.sharding.spec) == want_spec
    per_device = collections.Counter()
    for leaf in jax.tree.leaves(params):
        for shard in leaf.addressable_shards:
            per_device[shard.device] += shard.data.nbytes
    expected = planner.weight_bytes(cfg, "float32", 2, "mxfp4",
                                    expert_parallel=expert_parallel)
    assert list(per_device.values()) == [expected, expected]
    stored = sum(np.asarray(part).nbytes for layer in range(cfg.num_layers)
                 for name in ("gate_up_proj", "down_proj")
                 for part in (_raw(dst, layer, name, "blocks"), _raw(dst, layer, name, "scales")))
    read = sum(n for path, _, n in log.reads if path.endswith(("gate_up_proj", "down_proj")))
    assert read == stored  # each byte once, over both devices
    ids = _prompt(1, 34)
    got = _paged_logits(cfg, params, ids, mesh, expert_parallel)
    assert np.abs(got - _hf_logits(hf, ids)).max() < TOL


def _raw(root: pathlib.Path, layer: int, name: str, part: str) -> np.ndarray:
    tensors = safetensors_file.load(root / "model.safetensors")
    return tensors[f"model.layers.{layer}.mlp.experts.{name}_{part}"]


def test_blocks_that_would_straddle_devices_are_refused(tiny):
    """Down's 32 inputs split over 2 devices would cut its one block: refused with the
    numbers before a weight is read; expert parallelism is the way out."""
    _, dst, _ = tiny
    cfg = checkpoint.load_config(dst)
    with pytest.raises(ValueError, match=r"blocks of 32 inputs straddle the 2 devices' "
                       r"shares of we_down .* must divide its 1 blocks, or enable expert"):
        planner.weight_bytes(cfg, "float32", 2, "mxfp4")
    with pytest.raises(ValueError, match="straddle"):
        LLM(model=str(dst), tensor_parallel_size=2, page_size=8, max_model_len=96,
            max_num_seqs=2, max_num_batched_tokens=16, compilation_cache_dir="")


@pytest.mark.slow
def test_two_devices_decode_greedily_as_one(tiny):
    """Expert parallelism over 2 devices through the engine: transformers' tokens."""
    _, dst, hf = tiny
    llm = LLM(model=str(dst), tensor_parallel_size=2, enable_expert_parallel=True,
              page_size=8, max_model_len=96, max_num_seqs=2, max_num_batched_tokens=16,
              compilation_cache_dir="", strict_compile=True)
    prompts = [_prompt(7, 11), _prompt(8, 30)]
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == [
        _hf_generate(hf, p, 12) for p in prompts]


def test_float_experts_quantize_to_the_checkpoints_bytes(tiny, tmp_path):
    """`quantize_params(..., "mxfp4")` on the float checkpoint's params (the device
    encoder) gives the bytes the MXFP4 file holds (the host encoder wrote them), leaves
    the rest float, the head too; an orbax conversion keeps them packed."""
    src, dst, _ = tiny
    cfg = checkpoint.load_config(dst)
    packed = checkpoint.load_params(dst, cfg)
    floats = checkpoint.load_params(src, cfg)
    encoded = jax.jit(lambda p: quantization.quantize_params(p, "mxfp4"))(floats)
    assert jax.tree.structure(encoded) == jax.tree.structure(packed)
    for got, want in zip(jax.tree.leaves(encoded), jax.tree.leaves(packed), strict=True):
        assert got.dtype == want.dtype
        if got.dtype == jnp.uint8:
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert "lm_head" in encoded and not quantization.has_quantized_head(encoded)
    out = tmp_path / "orbax"
    checkpoint.convert_hf_to_orbax(dst, out)
    assert json.loads((out / checkpoint.QUANTIZATION_FILE).read_text()) == {
        "mode": "mxfp4", "layout": quantization.LAYOUT_VERSION, "quantized_head": False}
    assert checkpoint.served_quantization(out, None) == "mxfp4"
    restored = checkpoint.load_params(out, cfg)
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(packed), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_an_explicit_mode_decodes_the_experts_first(tiny):
    """`--quantization=fp8` (or int8, w8a8) on an MXFP4 checkpoint: its experts are
    decoded to floats as they are read and quantized in that mode, as before; "mxfp4" on
    a model without experts is refused."""
    _, dst, _ = tiny
    assert checkpoint.checkpoint_quantization(dst) == "mxfp4"
    assert checkpoint.served_quantization(dst, None) == "mxfp4"
    assert checkpoint.served_quantization(dst, "fp8") == "fp8"
    cfg = checkpoint.load_config(dst)
    decoded = checkpoint.load_params(dst, cfg, quantization_mode="fp8")
    assert quantization.mode_of(decoded) is None
    fp8 = quantization.quantize_params(checkpoint.load_params(dst, cfg), "fp8")  # from packed
    want = quantization.quantize_params(decoded, "fp8")
    for got, expected in zip(jax.tree.leaves(fp8), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(got, np.float32),
                                      np.asarray(expected, np.float32))
    dense = load_preset("llama3.1-8b")
    with pytest.raises(ValueError, match="'mxfp4' quantizes mixture-of-experts weights"):
        planner.weight_bytes(dense, "bfloat16", quantization="mxfp4")


def test_decode_step_reads_only_the_chosen_experts_packed_bytes(tiny):
    """XLA:CPU's compiled MoE layer for one token (2 choices of 8 experts): the packed
    stacks feed only gathers of the 2 chosen experts' bytes, decoded after the gather."""
    _, dst, _ = tiny
    cfg = checkpoint.load_config(dst)
    layer = checkpoint.load_params(dst, cfg)["layers"][0]
    x = jnp.zeros((1, cfg.hidden_size))
    hlo = jax.jit(lambda l, x: moe.moe_block(l, x, cfg)).lower(layer, x).compile().as_text()
    entry = next(line for line in hlo.splitlines() if line.startswith("ENTRY"))
    stacks = re.findall(r"(\w[\w.]*): u8\[8,", entry)
    assert len(stacks) == 4, entry  # blocks and scales of gate/up and down
    users = [line.split("=", 1)[1].split()[0] for line in hlo.splitlines()
             if " = " in line and "parameter(" not in line
             and any(re.search(r"%" + re.escape(n) + r"[,)]", line) for n in stacks)]
    assert users and all(shape.startswith("u8[2,") for shape in users), users


def test_gpt_oss_20b_fits_one_v6e_chip_packed():
    """`plan --model=gpt-oss-20b --device=v6e-1`: the preset plans its published MXFP4
    experts packed (17 bytes per 32 elements), about vLLM's 13 GB of weights, with room
    for KV; bf16 experts (41.8 GB) could not fit at all."""
    out = subprocess.run([sys.executable, "-m", "jaxinfer", "plan", "--model=gpt-oss-20b",
                          "--device=v6e-1", "--format=json"], capture_output=True,
                         text=True, check=True).stdout
    plan = json.loads(out)
    cfg = load_preset("gpt-oss-20b")
    elements = cfg.num_layers * cfg.moe.num_experts * 3 * cfg.moe.intermediate_size * (
        cfg.hidden_size)
    assert plan["quantization"] == "mxfp4" and plan["dtype"] == "bfloat16"
    assert plan["expert_weight_bytes"] == elements * 17 // 32
    assert 13e9 < plan["weight_bytes"] < 14e9
    assert plan["kv_tokens"] > 600_000 and plan["layout"]["planned"]["fits"]
    print(f"gpt-oss-20b on v6e-1: {plan['weight_bytes']:,} bytes of weights, "
          f"{plan['kv_tokens']:,} KV tokens")
    with pytest.raises(ValueError, match="GB short"):
        planner.plan(cfg, dtype="bfloat16", memory_bytes=int(0.9 * 33_554_432_000),
                     max_model_len=4096)
