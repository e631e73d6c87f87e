"""Speculative decoding's programs compile for one v5e chip with the Mosaic kernel (libtpu's
ahead-of-time compiler; no TPU): the target's verify step (Q = k + 1 = 5 positions a
request, the draft's probabilities as an input) for the smallest and the largest
verify bucket, and a draft model's k + 1 steps in one call (a while loop around the
decode kernel, the draft's KV cache carried). Target: the Qwen3-0.6B shape; draft: two
of its layers. Nothing is allocated: params, pages and inputs are ShapeDtypeStructs.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import aot
from jaxinfer.config import load_preset
from jaxinfer.engine.core.buckets import BucketSet
from jaxinfer.engine.runner.inputs import sampling_inputs
from jaxinfer.engine.runner.programs import (
    input_spec,
    mask_spec,
    on_shardings,
    state_spec,
    step_shardings,
    verify_step_function,
)
from jaxinfer.model import draft as draft_model
from jaxinfer.model import sharding
from jaxinfer.pallas import AttentionSettings
from jaxinfer.sizing import accelerators

SETTINGS = aot.Settings(dtype="bfloat16", kv_dtype="bfloat16", max_num_seqs=32,
                        max_num_batched_tokens=256, max_model_len=2048, page_size=16)
Q = 5
TPU = AttentionSettings(impl="tpu")  # the compiled Mosaic kernel


def _setup(num_layers=None, **settings):
    cfg = load_preset("qwen3-0.6b")
    if num_layers:
        cfg = dataclasses.replace(cfg, num_layers=num_layers)
    acc = accelerators.get("v5e-1")
    chosen = dataclasses.replace(SETTINGS, **settings)
    plan = aot.plan_for(cfg, acc, chosen)
    params, kv = aot.step_specs(cfg, plan, chosen, 1)
    mesh = sharding.make_mesh(1, aot.target_devices(acc))
    param_sh, kv_sh, whole = step_shardings(cfg, mesh, kv_dtype="bfloat16")
    return cfg, on_shardings(params, param_sh), on_shardings(kv, kv_sh), mesh, (
        param_sh, kv_sh, whole)


@pytest.mark.parametrize("which", [0, -1], ids=["smallest", "largest"])
def test_verify_step_compiles_with_the_mosaic_kernel(which):
    cfg, params, kv, mesh, (param_sh, kv_sh, whole) = _setup()
    bucket = BucketSet(max_num_batched_tokens=SETTINGS.max_num_batched_tokens,
                       max_num_seqs=SETTINGS.max_num_seqs, verify_positions=Q).verify()[which]
    inputs = on_shardings(input_spec(bucket, page_size=SETTINGS.page_size,
                                     num_positions=Q), whole)
    state = on_shardings(state_spec(SETTINGS.max_num_seqs, page_size=SETTINGS.page_size,
                                    max_model_len=SETTINGS.max_model_len), whole)
    probs = jax.ShapeDtypeStruct((bucket.num_slots, Q, cfg.vocab_size), jnp.float32,
                                 sharding=whole)
    verify = jax.jit(verify_step_function(cfg, page_size=SETTINGS.page_size, attention=TPU),
                     in_shardings=(param_sh, kv_sh, whole, whole, whole, whole),
                     out_shardings=(kv_sh, whole, whole), donate_argnums=(1, 2))
    mask = on_shardings(mask_spec(bucket, cfg.vocab_size), whole)
    with jax.set_mesh(mesh):
        compiled = verify.lower(params, kv, state, inputs, mask, probs).compile()
    text = compiled.as_text()
    assert text.count("tpu_custom_call") == 2 * cfg.num_layers  # the kernel's two passes
    assert compiled.memory_analysis().argument_size_in_bytes > 0


DRAFT_POOL_BYTES = 2 * 10**9
ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
            "f32": 4, "s32": 4, "u32": 4, "s64": 8, "f64": 8}


def test_draft_model_steps_compile_in_one_call():
    """Compiles with the draft's pages in the Mosaic kernel's layout all through the
    while loop (the K/V write scatters rows of their [P * 16 * W, 2, 128] view): no copy
    of the pool, temporaries 4,258,816 B (0.002x the 2 GB pool). Until 2026-11-26 the
    5-D K/V scatter got a layout of its own inside the loop and the pool was copied
    whole into the kernel's every step: temporaries 1.003x the pool."""
    cfg, params, kv, mesh, (param_sh, kv_sh, whole) = _setup(
        num_layers=2, kv_cache_memory_bytes=DRAFT_POOL_BYTES)
    slots, pages_per_seq = 8, -(-SETTINGS.max_model_len // SETTINGS.page_size)
    specs = draft_model.DraftInputs(
        token_ids=np.zeros(slots, np.int32), positions=np.zeros(slots, np.int32),
        page_indices=np.zeros((slots, pages_per_seq), np.int32),
        num_seqs=np.zeros(1, np.int32),
        sampling=sampling_inputs([], num_rows=slots, history_width=SETTINGS.max_model_len,
                                 eos_token_ids=frozenset()),
        num_steps=np.array(1, np.int32), attention=TPU)
    inputs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype,
                                                         sharding=whole), specs)
    propose = jax.jit(functools.partial(
        draft_model.propose, cfg=cfg, page_size=SETTINGS.page_size, num_positions=Q,
        vocab_size=cfg.vocab_size), in_shardings=(param_sh, kv_sh, whole),
        out_shardings=(kv_sh, whole, whole), donate_argnums=(1,))
    with jax.set_mesh(mesh):
        compiled = propose.lower(params, kv, inputs).compile()
    text = compiled.as_text()
    assert "while(" in text  # k + 1 steps in one program
    assert text.count("tpu_custom_call") >= cfg.num_layers
    pool = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(kv))
    temporaries = compiled.memory_analysis().temp_size_in_bytes
    largest_copy = max([ITEMSIZE[dtype] * int(np.prod([int(d) for d in dims.split(",") if d]))
                        for dtype, dims in re.findall(r"= (\w+)\[([\d,]*)\]\{[^}]*\} copy\(",
                                                      text)], default=0)
    print(f"\ndraft pool {pool:,} B, temporaries {temporaries:,} B "
          f"({temporaries / pool:.4f}x), largest copy {largest_copy:,} B")
    assert largest_copy < 0.01 * pool  # no copy of the pool, whole or a layer's
    assert temporaries < 0.01 * pool  # measured: 0.002x
