"""gpt-oss against transformers' eager GptOssForCausalLM: a tiny random model (attention
sinks, q/k/v/o biases, sliding and full layers with a window shorter than the prompts,
YaRN, router and expert biases, gate/up interleaved, a SwiGLU limit the tiny model
crosses) saved with `save_pretrained` and read by our loader; the same model with its
experts in MXFP4 (the published layout) against transformers' own dequantization."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from jax.sharding import PartitionSpec as P

from jaxinfer import LLM, SamplingParams, checkpoint, config, testing
from jaxinfer.checkpoint import mxfp4, safetensors_file
from jaxinfer.engine.runner import Chunk, Runner
from jaxinfer.model import layers, quantization, sharding, transformer

TOL = 1e-4
MXFP4_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, object]:
    path = tmp_path_factory.mktemp("gpt-oss")
    return path, testing.make_hf_model(path, "gpt_oss", seed=3)


def _prompt(seed: int, length: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 256, size=length).tolist()


def _hf_logits(model: torch.nn.Module, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(ids)[None]).logits[0].numpy()


def _paged_logits(model_dir: pathlib.Path, ids: list[int], cfg=None, params=None
                  ) -> np.ndarray:
    """A 30-token prefill (past the window of 12), then one token a step."""
    cfg = cfg or checkpoint.load_config(model_dir)
    params = params or checkpoint.load_params(model_dir, cfg)
    runner = Runner(cfg, params, num_pages=16, page_size=8, max_model_len=64)
    pages = [5, 2, 11, 7, 3, 9]
    pieces = [testing.logits(runner, [Chunk(ids[:30], 0, pages)])]
    pieces += [testing.logits(runner, [Chunk(ids[i:i + 1], i, pages)]) for i in range(30, len(ids))]
    return np.concatenate(pieces)


def test_config_reads_every_gpt_oss_field(gpt_oss):
    cfg = checkpoint.load_config(gpt_oss[0])
    assert cfg.architecture == "gpt_oss" and cfg.attention_sinks and cfg.o_bias
    assert cfg.qkv_bias and cfg.num_heads * cfg.head_dim != cfg.hidden_size
    assert cfg.layer_types == ("sliding_attention", "full_attention")
    assert cfg.sliding_window == 12 and cfg.rope_scaling.rope_type == "yarn"
    assert not cfg.rope_scaling.truncate
    moe = cfg.moe
    assert (moe.routing, moe.router_bias, moe.expert_bias, moe.activation) == (
        "topk_softmax", True, True, "clamped_swiglu")
    assert (moe.swiglu_alpha, moe.swiglu_limit) == (1.702, 0.4)
    assert checkpoint.load_config(gpt_oss[0]).to_hf()["layer_types"] == list(cfg.layer_types)


@pytest.mark.parametrize("truncate", [False, True])
def test_yarn_tables_match_transformers(truncate):
    """gpt-oss-20b's YaRN (and with `truncate`): inverse frequencies and the cos/sin
    factor as transformers' `_compute_yarn_parameters`."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = transformers.GptOssConfig(num_hidden_layers=2)
    hf.rope_parameters = hf.rope_parameters | {"truncate": truncate}
    want, factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
    cfg = config.ModelConfig.from_hf(hf.to_dict() | {"architectures": ["GptOssForCausalLM"]})
    assert cfg.rope_scaling.truncate == truncate
    np.testing.assert_allclose(layers.rope_inv_freq(cfg), want.numpy(), rtol=1e-6)
    assert layers.rope_scale(cfg) == pytest.approx(factor, rel=1e-12)


def test_logits_match_transformers(gpt_oss):
    """Paged (prefill past the window, then decode steps) and dense forwards."""
    path, model = gpt_oss
    ids = _prompt(1, 40)
    want = _hf_logits(model, ids)
    paged = np.abs(_paged_logits(path, ids) - want).max()
    cfg = checkpoint.load_config(path)
    params = checkpoint.load_params(path, cfg)
    dense = transformer.forward_dense(params, jnp.asarray(ids)[None], cfg=cfg)[0]
    dense = np.abs(np.asarray(dense) - want).max()
    print(f"gpt-oss: max abs logit diff paged {paged:.2e}, dense {dense:.2e}")
    assert paged < TOL and dense < TOL


def test_save_hf_writes_what_transformers_loads(gpt_oss, tmp_path):
    """Our params written back (gate/up re-interleaved, experts [E, in, out] again) load
    into transformers and give its logits."""
    path, model = gpt_oss
    cfg = checkpoint.load_config(path)
    checkpoint.save_hf(tmp_path, cfg, checkpoint.load_params(path, cfg))
    again = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, attn_implementation="eager")
    ids = _prompt(3, 20)
    np.testing.assert_allclose(_hf_logits(again, ids), _hf_logits(model, ids), atol=1e-6)


def test_sinks_biases_and_the_limit_matter(gpt_oss):
    """Each gpt-oss piece changes the logits by far more than the tolerance, so the
    parity above checks it: sinks zeroed, o bias zeroed, no SwiGLU limit, no router
    bias."""
    path, model = gpt_oss
    ids = _prompt(1, 40)
    want = _hf_logits(model, ids)
    cfg = checkpoint.load_config(path)
    params = checkpoint.load_params(path, cfg)

    def diff(cfg, params) -> float:
        got = transformer.forward_dense(params, jnp.asarray(ids)[None], cfg=cfg)[0]
        return float(np.abs(np.asarray(got) - want).max())

    for key in ("sinks", "bo", "b_router", "be_gate_up", "be_down"):
        zeroed = params | {"layers": [layer | {key: jnp.zeros_like(layer[key])}
                                      for layer in params["layers"]]}
        assert diff(cfg, zeroed) > 100 * TOL, key
    unlimited = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, swiglu_limit=1e3))
    assert diff(unlimited, params) > 100 * TOL


def _hf_generate(model: torch.nn.Module, prompt: list[int], steps: int) -> list[int]:
    """transformers' `generate`, greedy, EOS not stopping it (as `ignore_eos`)."""
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None  # an argument of None falls back to it
    try:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=steps,
                                 do_sample=False, pad_token_id=testing.TINY["eos_token_id"])
    finally:
        model.generation_config.eos_token_id = saved
    return out[0, len(prompt):].tolist()


PROMPT_SHARED = _prompt(4, 19)  # two prompts share 16 tokens: a prefix hit
PROMPTS = [PROMPT_SHARED + _prompt(5, 4), PROMPT_SHARED + _prompt(6, 7), _prompt(7, 11),
           _prompt(8, 30)]
GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


def _llm(path: pathlib.Path, **kw: object) -> LLM:
    """Chunked prefill (16-token steps) over windows of 12."""
    return LLM(model=str(path), page_size=8, max_model_len=96, max_num_seqs=4,
               max_num_batched_tokens=16, compilation_cache_dir="", strict_compile=True,
               **kw)


def test_generate_greedy_matches_transformers_with_batching(gpt_oss):
    """A KV pool of the bytes of 14 every-layer pages of 8 tokens, split by the hybrid
    KV cache between the full and the sliding layers' pages: the four requests do not
    fit at once, so some are preempted and recomputed."""
    path, model = gpt_oss
    cfg = checkpoint.load_config(path)
    page_bytes = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4 * 8  # K and V
    llm = _llm(path, kv_cache_memory_bytes=14 * page_bytes)
    outs = llm.generate(PROMPTS, GREEDY)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.token_ids == _hf_generate(model, prompt, 20)
    metrics = llm.metrics()
    assert metrics["preemptions"] > 0 and metrics["prefix_cache_hit_tokens"] >= 16
    assert metrics["compiles_after_warmup"] == 0
    assert "kv_pages_sliding_free" in metrics  # the sliding layers have their own pages


def test_logits_on_two_devices_match_transformers(gpt_oss):
    """Each device its heads' sinks and its slice of the stacked, interleaved experts:
    whole experts (expert parallelism), or half of every expert's gate/up block pairs
    and down columns."""
    path, model = gpt_oss
    ids = _prompt(1, 34)
    want = _hf_logits(model, ids)
    for ep in (True, False):
        cfg = checkpoint.load_config(path)
        mesh = sharding.make_mesh(2)
        params = checkpoint.load_params(path, cfg, mesh=mesh, expert_parallel=ep)
        assert params["layers"][0]["sinks"].sharding.spec == P("model")
        runner = Runner(cfg, params, num_pages=16, page_size=8, max_model_len=64, mesh=mesh,
                        options=config.ModelOptions(expert_parallel=ep))
        pages = [5, 2, 11, 7, 3]
        got = np.concatenate([testing.logits(runner, [Chunk(ids[:30], 0, pages)])] + [
            testing.logits(runner, [Chunk(ids[i:i + 1], i, pages)]) for i in range(30, 34)])
        assert np.abs(got - want).max() < TOL, f"EP={ep}"


@pytest.mark.slow
@pytest.mark.parametrize("ep", [True, False])
def test_two_devices_give_the_same_tokens(gpt_oss, ep):
    """Expert parallelism (4 whole experts a device) or every expert split in two, each
    device reading its slice of the stacked, interleaved experts; attention sinks split
    by head."""
    path, model = gpt_oss
    got = _llm(path, tensor_parallel_size=2, enable_expert_parallel=ep).generate(
        PROMPTS, GREEDY)
    assert [o.token_ids for o in got] == [_hf_generate(model, p, 20) for p in PROMPTS]


def _write_mxfp4(src: pathlib.Path, dst: pathlib.Path) -> None:
    """`src`'s checkpoint with its experts in MXFP4, as published gpt-oss stores them:
    `<proj>_blocks`/`<proj>_scales` over each expert's [out, in]."""
    dst.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, value in safetensors_file.load(src / "model.safetensors").items():
        value = np.asarray(value)
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = mxfp4.encode(value.swapaxes(-1, -2))
            tensors |= {f"{name}_blocks": blocks, f"{name}_scales": scales}
        else:
            tensors[name] = value
    safetensors_file.save(tensors, dst / "model.safetensors", {"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = MXFP4_CONFIG
    (dst / "config.json").write_text(json.dumps(config))


def test_mxfp4_checkpoint_matches_transformers_dequantized(gpt_oss, tmp_path):
    """transformers on CPU dequantizes MXFP4 (Mxfp4Config(dequantize=True)) into the
    model's float32; we decode as each slice is read. The quantization moves the logits
    by far more than the tolerance, so matching means decoding the same values."""
    path, model = gpt_oss
    _write_mxfp4(path, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, quantization_config=transformers.Mxfp4Config(dequantize=True),
        dtype=torch.float32, attn_implementation="eager")
    ids = _prompt(2, 40)
    want = _hf_logits(hf, ids)
    assert np.abs(want - _hf_logits(model, ids)).max() > 100 * TOL
    diff = np.abs(_paged_logits(tmp_path, ids) - want).max()
    print(f"gpt-oss MXFP4: max abs logit diff {diff:.2e}")
    assert diff < TOL


@pytest.mark.slow
def test_mxfp4_checkpoint_generates_as_transformers(gpt_oss, tmp_path):
    """An MXFP4 directory served by `LLM` (decoded on load) gives transformers' greedy
    tokens for the same file."""
    _write_mxfp4(gpt_oss[0], tmp_path)
    testing.write_byte_tokenizer(tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, quantization_config=transformers.Mxfp4Config(dequantize=True),
        dtype=torch.float32, attn_implementation="eager")
    hf.generation_config = gpt_oss[1].generation_config
    outs = _llm(tmp_path).generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == [_hf_generate(hf, p, 20) for p in PROMPTS]


def test_mxfp4_experts_quantize_to_fp8_after_decoding(gpt_oss, tmp_path):
    """`--quantization=fp8` on an MXFP4 checkpoint: decoded, then quantized as any float
    experts (a scale per expert and row); logits near the decoded float model's."""
    path, _ = gpt_oss
    _write_mxfp4(path, tmp_path)
    assert checkpoint.served_quantization(tmp_path, "fp8") == "fp8"
    cfg = checkpoint.load_config(tmp_path)
    params = checkpoint.load_params(tmp_path, cfg)
    fp8 = quantization.quantize_params(params, "fp8")
    assert quantization.is_quantized(fp8["layers"][0]["we_gate_up"])
    assert fp8["layers"][0]["we_gate_up"].value.shape == (8, 64, 64)
    ids = jnp.asarray(_prompt(2, 24))[None]
    want = transformer.forward_dense(params, ids, cfg=cfg)
    got = transformer.forward_dense(fp8, ids, cfg=cfg)
    diff = float(np.abs(np.asarray(got) - np.asarray(want)).max())
    print(f"gpt-oss MXFP4 -> fp8: max abs logit diff {diff:.2e}")
    assert diff < 0.25  # fp8 e4m3 keeps 3 mantissa bits: steps of 1/16 relative


# openai/gpt-oss-20b's config.json, the fields that shape the model (the Hub file also
# names its tokens, quantization and training settings)
HUB_20B = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "head_dim": 64,
    "hidden_act": "silu", "hidden_size": 2880, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64,
    "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8,
    "num_local_experts": 32, "rms_norm_eps": 1e-05, "rope_theta": 150000,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                     "original_max_position_embeddings": 4096, "rope_type": "yarn",
                     "truncate": False},
    "sliding_window": 128, "swiglu_limit": 7.0, "tie_word_embeddings": False,
    "vocab_size": 201088, "quantization_config": MXFP4_CONFIG}


@pytest.mark.parametrize(("name", "layers", "experts"), [("gpt-oss-20b", 24, 32),
                                                         ("gpt-oss-120b", 36, 128)])
def test_presets_are_the_published_configs(name, layers, experts):
    """Each preset equals transformers' GptOssConfig defaults at its size, and the 20b
    one the Hub's config.json."""
    hf = transformers.GptOssConfig(num_hidden_layers=layers, num_local_experts=experts)
    want = config.ModelConfig.from_hf(hf.to_dict() | {"architectures": ["GptOssForCausalLM"]})
    assert config.load_preset(name) == want
    if name == "gpt-oss-20b":
        assert config.ModelConfig.from_hf(HUB_20B) == want
