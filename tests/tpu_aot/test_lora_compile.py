"""The Llama-3.1-8B step with LoRA adapter slots (max_loras=4, rank 16) compiles for a
v5e-4 slice (TP=4; libtpu's ahead-of-time compiler, no TPU): the adapter slots are
inputs of the compiled step, placed as the planner counts them (each slot array split as
the weight it modifies), within 5% of `plan`'s lora_bytes per chip, and the step's
arguments within 1% of the plan's weights, slots and KV pool.
"""

from __future__ import annotations

import math

import jax
import numpy as np

from jaxinfer import aot, aot_rows
from jaxinfer.config import load_preset
from jaxinfer.config.lora import LoraSlots
from jaxinfer.engine.core.buckets import BucketSet
from jaxinfer.model import sharding
from jaxinfer.sizing import accelerators

SETTINGS = aot.Settings(dtype="bfloat16", kv_dtype="bfloat16", max_num_seqs=64,
                        max_num_batched_tokens=512, max_model_len=2048, page_size=16,
                        tensor_parallel_size=4, lora=LoraSlots(4, 16, "bfloat16"))


def test_llama_8b_step_with_four_rank_16_slots_compiles_for_v5e_4():
    cfg = load_preset("llama3.1-8b")
    acc = accelerators.get("v5e-4")
    plan = aot.plan_for(cfg, acc, SETTINGS, 4)
    served = sharding.served_config(cfg, 4)
    params, kv = aot.step_specs(served, plan, SETTINGS, 4)
    bucket = BucketSet(max_num_batched_tokens=SETTINGS.max_num_batched_tokens,
                       max_num_seqs=SETTINGS.max_num_seqs).all()[0]
    mesh = sharding.make_mesh(4, aot.target_devices(acc))
    [compiled] = aot.compile_buckets(served, params, kv, [bucket], SETTINGS, mesh,
                                     group_windows=aot.group_windows(plan))
    assert not isinstance(compiled, Exception), compiled
    placed = compiled.input_shardings[0][0]["lora"]
    per_chip = sum(math.prod(s.shard_shape(x.shape)) * x.dtype.itemsize for x, s in zip(
        jax.tree.leaves(params["lora"]), jax.tree.leaves(placed), strict=True))
    assert plan.lora_bytes > 100e6  # 32 layers x 7 targets x 4 slots of rank 16, bf16
    assert abs(per_chip - plan.lora_bytes) <= 0.05 * plan.lora_bytes
    arguments = compiled.memory_analysis().argument_size_in_bytes
    planned = plan.weight_bytes + plan.lora_bytes + plan.kv_cache_bytes
    assert aot_rows.agreement(planned, arguments) < 0.01
    hlo = compiled.as_text()
    assert np.sum([line.count("bf16[4096,4,16]") for line in hlo.splitlines()
                   if line.startswith("ENTRY")]) >= 1  # A of q: [in, slots, rank]
