"""Gemma 2 and Gemma 3 (text) against transformers: what makes them differ from the
Llama block, the multimodal checkpoint's text tower, bfloat16, and `LLM.generate` with
windows shorter than the prompts. The paged and dense forward passes of both families
are also checked by tests/model/test_transformer.py."""

from __future__ import annotations

import dataclasses
import logging

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxinfer import LLM, SamplingParams, checkpoint, testing
from jaxinfer.checkpoint import awq
from jaxinfer.config import ModelConfig, load_preset
from jaxinfer.engine.core.buckets import BucketSet
from jaxinfer.engine.runner import Chunk, Runner
from jaxinfer.model import sharding, transformer

GEMMA = testing.GEMMA_FAMILIES
TOL = 1e-4


def _prompt(seed: int, length: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 256, size=length).tolist()


def _hf_logits(model: torch.nn.Module, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(ids)[None]).logits[0].numpy()


def _dense(params: dict, cfg: ModelConfig, ids: list[int]) -> np.ndarray:
    return np.asarray(transformer.forward_dense(params, jnp.asarray(ids)[None], cfg=cfg)[0])


@pytest.mark.parametrize("family", GEMMA)
def test_paged_forward_matches_transformers_in_chunks_across_the_window(
        family, hf_model_dirs, hf_models):
    """A prompt in chunks whose boundaries fall before and after the 12-token window,
    then single tokens, through the paged cache."""
    cfg = checkpoint.load_config(hf_model_dirs[family])
    runner = Runner(cfg, checkpoint.load_params(hf_model_dirs[family], cfg), num_pages=16,
                    page_size=8, max_model_len=64)
    ids, pages, pieces, start = _prompt(1, 40), [5, 2, 11, 7, 9], [], 0
    for n in (7, 9, 20, 1, 1, 1, 1):
        pieces.append(testing.logits(runner, [Chunk(ids[start:start + n], start, pages)]))
        start += n
    diff = np.abs(np.concatenate(pieces) - _hf_logits(hf_models[family], ids)).max()
    print(f"{family}: paged chunked max abs logit diff {diff:.2e}")
    assert diff < TOL


CHANGES = {  # a field of the loaded config -> a value that drops that Gemma feature
    "norm_weight_offset": 0.0, "post_norms": False, "scale_embeddings": False,
    "hidden_act": "silu", "query_pre_attn_scalar": None, "layer_types": "all sliding",
    "attn_logit_softcapping": None, "final_logit_softcapping": None,
    "rope_local_theta": None, "rope_scaling": None,
}
APPLIES = {"gemma2": ("attn_logit_softcapping", "final_logit_softcapping"),
           "gemma3": ("rope_local_theta", "rope_scaling")}


@pytest.mark.parametrize("family", GEMMA)
def test_every_gemma_feature_moves_the_logits(family, hf_model_dirs, hf_models):
    """The parity above means something: without any one of Gemma's features (as the
    loader set it) our logits leave transformers' by far more than the tolerance."""
    cfg = checkpoint.load_config(hf_model_dirs[family])
    params = checkpoint.load_params(hf_model_dirs[family], cfg)
    ids = _prompt(2, 30)
    want = _hf_logits(hf_models[family], ids)
    assert np.abs(_dense(params, cfg, ids) - want).max() < TOL
    other = set(APPLIES) - {family}
    for field, value in CHANGES.items():
        if field in APPLIES[next(iter(other))]:
            continue
        if value == "all sliding":
            value = ("sliding_attention",) * cfg.num_layers
        layers = params["layers"]
        if field == "post_norms":  # the table then has no post norms and Llama's mlp_norm
            layers = [{k: v for k, v in layer.items() if not k.startswith("post_")}
                      for layer in layers]
        changed = dataclasses.replace(cfg, **{field: value})
        diff = np.abs(_dense(params | {"layers": layers}, changed, ids) - want).max()
        assert diff > 100 * TOL, (field, diff)


def test_layers_follow_layer_types_and_rope_kinds(hf_model_dirs):
    cfg2 = checkpoint.load_config(hf_model_dirs["gemma2"])
    cfg3 = checkpoint.load_config(hf_model_dirs["gemma3"])
    assert cfg2.sliding_layers() == (0,) and cfg2.layer_window(1) is None
    assert cfg3.sliding_layers() == (0, 1, 2, 3, 4) and cfg3.layer_window(5) is None
    assert [cfg3.layer_rope(i) for i in range(6)] == ["local"] * 5 + ["global"]
    assert {cfg2.layer_rope(i) for i in range(2)} == {"global"}
    assert cfg3.rope_scaling.rope_type == "linear" and cfg3.rope_scaling.factor == 4.0
    assert (cfg3.rope_theta, cfg3.rope_local_theta) == (50000.0, 1000.0)
    assert cfg2.attention_scale() == cfg3.attention_scale() == 24 ** -0.5


@pytest.mark.parametrize("family, tp", [("gemma2", 4), ("gemma3", 2)])
def test_tensor_parallel_logits_match_transformers(family, tp, hf_model_dirs, hf_models):
    """Split over virtual CPU devices: 2 KV heads copied to 4 (Gemma 2) or one a device
    (Gemma 3), the tied, scaled embedding and the soft-capped logits split by vocabulary."""
    cfg = checkpoint.load_config(hf_model_dirs[family])
    mesh = sharding.make_mesh(tp)
    params = checkpoint.load_params(hf_model_dirs[family], cfg, mesh=mesh)
    runner = Runner(sharding.served_config(cfg, tp), params, num_pages=16, page_size=8,
                    max_model_len=64, mesh=mesh,
                    buckets=BucketSet(max_num_batched_tokens=32, max_num_seqs=4))
    ids = _prompt(9, 30)
    ours = testing.logits(runner, [Chunk(ids, 0, [4, 1, 7, 2])])
    assert np.abs(ours - _hf_logits(hf_models[family], ids)).max() < TOL


@pytest.mark.parametrize("family", GEMMA)
def test_save_hf_writes_a_gemma_transformers_loads(family, tmp_path):
    """Our random params written by `save_hf` (config.json from `to_hf`): transformers
    builds the same family from them and computes our logits; the config reads back."""
    import jax
    import transformers

    cfg = ModelConfig.from_hf(testing.hf_config(family).to_dict())
    params = transformer.init_params(cfg, jax.random.key(0), std=0.3)
    params = jax.tree.map(  # norm weights away from zero, so (1 + w) matters
        lambda x: x + 0.1 * jax.random.normal(jax.random.key(1), x.shape), params)
    checkpoint.save_hf(tmp_path, cfg, params)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, attn_implementation="eager").eval()
    assert type(model).__name__ == {"gemma2": "Gemma2ForCausalLM",
                                    "gemma3": "Gemma3ForCausalLM"}[family]
    ids = _prompt(10, 30)
    assert np.abs(_dense(params, cfg, ids) - _hf_logits(model, ids)).max() < TOL
    assert checkpoint.load_config(tmp_path) == cfg


def _conditional_generation(path) -> torch.nn.Module:
    """A tiny Gemma3ForConditionalGeneration (the tiny gemma3 text tower, a one-layer
    SigLIP), saved by transformers."""
    import transformers

    vision = transformers.SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        image_size=32, patch_size=8)
    config = transformers.Gemma3Config(
        text_config=testing.hf_config("gemma3").to_dict(), vision_config=vision.to_dict(),
        mm_tokens_per_image=4, image_token_index=259, boi_token_index=256,
        eoi_token_index=257)
    torch.manual_seed(4)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    model.save_pretrained(path)
    return model


def test_conditional_generation_checkpoint_serves_its_text_tower(tmp_path, caplog):
    model = _conditional_generation(tmp_path)
    with caplog.at_level(logging.INFO, logger="jaxinfer.checkpoint.text_tower"):
        cfg = checkpoint.load_config(tmp_path)
        params = checkpoint.load_params(tmp_path, cfg)
    assert cfg.architecture == "gemma3" and cfg.num_layers == 6
    assert "vision tensors ignored" in caplog.text
    ids = _prompt(3, 30)
    with torch.no_grad():
        want = model(input_ids=torch.tensor(ids)[None]).logits[0].numpy()
    assert np.abs(_dense(params, cfg, ids) - want).max() < TOL


@pytest.mark.parametrize("family", GEMMA)
def test_bfloat16_close_to_float32(family, hf_model_dirs, hf_models):
    """bf16 weights and KV: near transformers' float32 logits, the same argmax mostly."""
    cfg = checkpoint.load_config(hf_model_dirs[family])
    params = checkpoint.load_params(hf_model_dirs[family], cfg, "bfloat16")
    runner = Runner(cfg, params, num_pages=16, page_size=8, max_model_len=64,
                    kv_dtype="bfloat16")
    ids = _prompt(7, 30)
    ours = testing.logits(runner, [Chunk(ids, 0, [3, 5, 1, 9])])
    ref = _hf_logits(hf_models[family], ids)
    assert np.abs(ours - ref).max() < 0.05 * np.abs(ref).max()
    assert (ours.argmax(-1) == ref.argmax(-1)).mean() > 0.9


def _hf_generate(model: torch.nn.Module, ids: list[int], steps: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=steps, do_sample=False,
                             pad_token_id=258, eos_token_id=None)
    return out[0, len(ids):].tolist()


# Gemma 3 (5:1 layers, two RoPE kinds) in the default run; Gemma 2 adds ~45 s: slow.
@pytest.fixture(scope="module", params=[pytest.param("gemma2", marks=pytest.mark.slow),
                                        "gemma3"])
def gemma_llm(request, hf_model_dirs):
    """16-token steps (prompts prefill in chunks across the 12-token window) and a KV
    pool of the bytes of 14 every-layer pages of 8 tokens, which the hybrid KV cache
    splits between the global and the sliding layers' pages: the four requests below
    do not fit at once, so some are preempted and recomputed."""
    cfg = checkpoint.load_config(hf_model_dirs[request.param])
    page_bytes = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4 * 8  # K and V
    llm = LLM(model=hf_model_dirs[request.param], page_size=8, max_model_len=96,
              max_num_seqs=4, max_num_batched_tokens=16, kv_cache_memory_bytes=14 * page_bytes,
              compilation_cache_dir="", strict_compile=True)
    return request.param, llm


def test_generate_greedy_matches_transformers_with_batching(gemma_llm, hf_models):
    family, llm = gemma_llm
    shared = _prompt(4, 19)  # two prompts share 16 tokens: a prefix hit
    prompts = [shared + _prompt(5, 4), shared + _prompt(6, 7), _prompt(7, 11), _prompt(8, 30)]
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, greedy)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == _hf_generate(hf_models[family], prompt, 20)
    metrics = llm.metrics()
    assert metrics["preemptions"] > 0 and metrics["prefix_cache_hit_tokens"] >= 16
    assert metrics["compiles_after_warmup"] == 0
    assert "kv_pages_sliding_free" in metrics  # the sliding layers have their own pages


def test_prompt_logprobs_are_of_the_soft_capped_logits(hf_model_dirs, hf_models):
    """Gemma 2's final soft cap applies to prompt scores too: a 30-token prompt scored in
    16-token chunks gives transformers' log-softmax (buckets compiled as met)."""
    llm = LLM(model=hf_model_dirs["gemma2"], page_size=8, max_model_len=64, max_num_seqs=2,
              max_num_batched_tokens=16, enable_prompt_logprobs=True,
              compilation_cache_dir="", warm_up=False)
    ids = _prompt(12, 30)
    (out,) = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0.0,
                                                prompt_logprobs=0))
    want = torch.log_softmax(torch.tensor(_hf_logits(hf_models["gemma2"], ids)), -1).numpy()
    got = [out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))]
    diff = np.abs(np.array(got) - want[np.arange(len(ids) - 1), ids[1:]]).max()
    assert out.prompt_logprobs[0] is None and diff < TOL


@pytest.mark.parametrize("edit, message", [
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention=true"),
    ({"hidden_activation": "gelu"}, "hidden_activation='gelu'"),
    ({"attention_bias": True}, "attention_bias=true"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0},
                          "full_attention": {"rope_type": "default"}}},
     "sliding_attention rope_type='linear'"),
])
def test_from_hf_refuses_what_is_not_supported(edit, message):
    hf = testing.hf_config("gemma3").to_dict() | edit
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf(hf)


def test_from_hf_reads_legacy_gemma3_and_a_sparse_text_config():
    """A Hub Gemma3ForConditionalGeneration config.json (transformers 4.x): the text
    config names only what differs from Gemma3TextConfig's defaults; rope_theta and
    rope_scaling are the global layers', rope_local_base_freq the local ones'."""
    text = {"head_dim": 128, "hidden_size": 5376, "intermediate_size": 21504,
            "model_type": "gemma3_text", "num_attention_heads": 32, "num_hidden_layers": 62,
            "num_key_value_heads": 16, "query_pre_attn_scalar": 168,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024}
    hf = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
          "text_config": text, "vision_config": {"model_type": "siglip_vision_model"}}
    cfg = ModelConfig.from_hf(hf)
    assert cfg == load_preset("gemma-3-27b")
    assert cfg.layer_types[:6] == ("sliding_attention",) * 5 + ("full_attention",)
    assert (cfg.rope_theta, cfg.rope_local_theta) == (1e6, 1e4)
    assert cfg.vocab_size == 262208 and cfg.tie_word_embeddings
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg


def test_from_hf_reads_legacy_gemma3_1b():
    """google/gemma-3-1b-it's config.json (transformers 4.x): a text model of its own,
    no RoPE scaling, a 512-token window."""
    hf = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
          "attn_logit_softcapping": None, "final_logit_softcapping": None, "head_dim": 256,
          "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152,
          "intermediate_size": 6912, "max_position_embeddings": 32768,
          "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1,
          "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000,
          "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512,
          "sliding_window_pattern": 6, "vocab_size": 262144}
    cfg = ModelConfig.from_hf(hf)
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.rope_scaling) == (1e6, 1e4, None)
    assert cfg.sliding_layers() == tuple(i for i in range(26) if (i + 1) % 6)
    assert cfg.sliding_window == 512 and cfg.qk_norm and cfg.tie_word_embeddings
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg


def test_gemma2_9b_preset_is_its_published_config():
    """google/gemma-2-9b's config.json (transformers 4.x: no layer_types, rope_theta)."""
    hf = {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2",
          "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "head_dim": 256,
          "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
          "hidden_size": 3584, "intermediate_size": 14336, "max_position_embeddings": 8192,
          "num_attention_heads": 16, "num_hidden_layers": 42, "num_key_value_heads": 8,
          "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_theta": 10000.0,
          "sliding_window": 4096, "vocab_size": 256000, "cache_implementation": "hybrid"}
    cfg = ModelConfig.from_hf(hf)
    assert cfg == load_preset("gemma-2-9b")
    assert cfg.sliding_layers() == tuple(range(0, 42, 2))
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg


@pytest.mark.parametrize("family", GEMMA)
def test_awq_refuses_gemma(family, hf_model_dirs):
    cfg = checkpoint.load_config(hf_model_dirs[family])
    with pytest.raises(ValueError, match=r"int4.*not supported for gemma.*norm_weight_offset"):
        awq.check_supported(cfg)
