"""Pooling models' steps compile for one v5e chip (libtpu's ahead-of-time compiler; no
TPU): the Qwen3-Embedding-0.6B shape's pool step with the Mosaic kernel (the paged
engine's step without an LM head, each request row's chunk pooled; its first 4 layers
in the default run, the whole model with the slow tests), and the BERT-base encoder's
packed step for the largest and smallest packing bucket. Nothing is allocated: params,
pages and inputs are ShapeDtypeStructs.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from jaxinfer import aot
from jaxinfer.config import load_preset
from jaxinfer.config.encoder import EncoderConfig
from jaxinfer.engine.core.buckets import BucketSet
from jaxinfer.engine.runner.programs import (
    input_spec,
    mask_spec,
    on_shardings,
    pool_step_function,
    state_spec,
    step_shardings,
)
from jaxinfer.model import encoder, sharding
from jaxinfer.pallas import AttentionSettings
from jaxinfer.pooling import encoder_runner, packing
from jaxinfer.sizing import accelerators

SETTINGS = aot.Settings(dtype="bfloat16", kv_dtype="bfloat16", max_num_seqs=64,
                        max_num_batched_tokens=2048, max_model_len=2048, page_size=16)
TPU = AttentionSettings(impl="tpu")
BERT_BASE = EncoderConfig(architecture="bert", vocab_size=30522, hidden_size=768,
                          num_layers=12, num_heads=12, intermediate_size=3072,
                          max_position_embeddings=512, type_vocab_size=2,
                          layer_norm_eps=1e-12, hidden_act="gelu", pad_token_id=0,
                          position_offset=0, num_labels=0, head=None)


def _compile_pool_step(num_layers: int | None, which: int) -> jax.stages.Compiled:
    cfg = dataclasses.replace(load_preset("qwen3-0.6b"), head="none")
    if num_layers:
        cfg = dataclasses.replace(cfg, num_layers=num_layers)
    acc = accelerators.get("v5e-1")
    plan = aot.plan_for(cfg, acc, SETTINGS)
    params, kv = aot.step_specs(cfg, plan, SETTINGS, 1)
    assert "lm_head" not in params  # a pooling model's head is never read
    mesh = sharding.make_mesh(1, aot.target_devices(acc))
    param_sh, kv_sh, whole = step_shardings(cfg, mesh, kv_dtype="bfloat16")
    buckets = BucketSet(max_num_batched_tokens=SETTINGS.max_num_batched_tokens,
                        max_num_seqs=SETTINGS.max_num_seqs)
    bucket = [b for b in buckets.all() if not b.decode][which]
    step = jax.jit(pool_step_function(cfg, page_size=SETTINGS.page_size, attention=TPU),
                   in_shardings=(param_sh, kv_sh, whole, whole, whole),
                   out_shardings=(kv_sh, whole, whole, whole, whole), donate_argnums=(1, 2))
    state = state_spec(SETTINGS.max_num_seqs, page_size=SETTINGS.page_size,
                       max_model_len=SETTINGS.max_model_len)
    with jax.set_mesh(mesh):
        compiled = step.lower(
            on_shardings(params, param_sh), on_shardings(kv, kv_sh),
            on_shardings(state, whole),
            on_shardings(input_spec(bucket, page_size=SETTINGS.page_size), whole),
            on_shardings(mask_spec(bucket, cfg.vocab_size), whole)).compile()
    assert compiled.as_text().count("tpu_custom_call") == 2 * cfg.num_layers
    return compiled


@pytest.mark.parametrize("which", [0, -1], ids=["smallest", "largest"])
def test_qwen3_embedding_pool_step_layers_compile(which):
    compiled = _compile_pool_step(4, which)
    assert compiled.memory_analysis().argument_size_in_bytes > 0


@pytest.mark.slow
def test_whole_qwen3_embedding_pool_step_compiles():
    _compile_pool_step(None, -1)


@pytest.mark.parametrize("which", [0, -1], ids=["smallest", "largest"])
def test_bert_base_packed_step_compiles(which):
    acc = accelerators.get("v5e-1")
    mesh = sharding.make_mesh(1, aot.target_devices(acc))
    whole = sharding.replicated(mesh)
    ladder = packing.buckets(BERT_BASE.max_len, 8192)
    bucket = ladder[which] if which == 0 else max(ladder, key=lambda b: b.num_tokens)
    params = jax.tree.map(lambda shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16,
                                                             sharding=whole),
                          encoder.param_shapes(BERT_BASE),
                          is_leaf=lambda x: isinstance(x, tuple))
    step = jax.jit(encoder_runner.step_function(BERT_BASE, all_tokens=False))
    with jax.set_mesh(mesh):
        compiled = step.lower(params, on_shardings(encoder_runner.input_spec(bucket),
                                                   whole)).compile()
    flops = compiled.cost_analysis()
    flops = (flops[0] if isinstance(flops, list) else flops).get("flops", 0)
    matmul = 2 * bucket.num_tokens * 12 * (4 * 768 * 768 + 2 * 768 * 3072)
    assert flops >= matmul  # every layer's matmuls over every packed token
    assert compiled.memory_analysis().temp_size_in_bytes < accelerators.get(
        "v5e-1").chip.usable_hbm_bytes


def test_aot_command_compiles_an_encoder_directory(tmp_path):
    """`aot --model=<a BERT directory>` compiles its packed steps (config.json only)."""
    import json
    import subprocess
    import sys

    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["BertModel"], "model_type": "bert", "vocab_size": 30522,
        "hidden_size": 768, "num_hidden_layers": 2, "num_attention_heads": 12,
        "intermediate_size": 3072, "max_position_embeddings": 512, "type_vocab_size": 2,
        "torch_dtype": "float32"}))
    result = subprocess.run([sys.executable, "-m", "jaxinfer", "aot", f"--model={tmp_path}",
                             "--buckets=ends", "--max_num_batched_tokens=2048"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["kind"] == "encoder" and report["fits"]
    assert [(b["rows"], b["row_len"]) for b in report["buckets"]] == [(1, 32), (4, 512)]
    assert all(b["flops"] > 0 for b in report["buckets"])
