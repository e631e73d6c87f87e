"""`compile_steps_for` on a mesh of 4 CPU devices: the Runner's shardings, from specs
alone, and the collectives XLA:CPU inserts (tests/tpu_aot does the same for TPU
topologies). Needs 4 CPU devices (tests/conftest.py gives 8)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

from jaxinfer import aot_rows
from jaxinfer.config import ModelConfig
from jaxinfer.engine.core.buckets import Bucket
from jaxinfer.engine.runner import compile_steps_for
from jaxinfer.model import sharding
from jaxinfer.model.attention import kv_cache_spec
from jaxinfer.model.params_table import param_shapes
from jaxinfer.pallas import AttentionSettings

TP, PAGES = 4, 33
REFERENCE = AttentionSettings(impl="reference")
GATHERED = re.compile(r"= (\w+\[[\d,]+\])\S* all-gather(?:-start)?\(")


def test_compile_steps_for_splits_the_step_over_a_mesh():
    if jax.device_count() < TP:
        pytest.skip(f"needs {TP} devices (tests/conftest.py sets jax_num_cpu_devices)")
    cfg = sharding.served_config(ModelConfig(  # 2 KV heads copied to one a device
        architecture="llama", vocab_size=256, hidden_size=128, intermediate_size=384,
        num_layers=2, num_heads=8, num_kv_heads=2, head_dim=32), TP)
    params = jax.tree.map(lambda shape: jax.ShapeDtypeStruct(shape, jnp.float32),
                          param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))
    kv = kv_cache_spec(cfg, num_pages=PAGES, page_size=16, shards=TP)
    buckets = [Bucket(1, 1, True), Bucket(16, 4, False)]
    compiled = compile_steps_for(cfg, params, kv, buckets, page_size=16, max_model_len=128,
                                 mesh=sharding.make_mesh(TP), attention=REFERENCE)
    for bucket, step in zip(buckets, compiled, strict=True):
        assert not isinstance(step, Exception), step
        text = step.as_text()
        assert aot_rows.kv_page_shapes(text) == [f"f32[{PAGES},16,2,1,32]"]  # one head a device
        # 2 a layer (o, down), 1 for the vocab-split embedding lookup, and the logits
        # gathered from their vocabulary columns: R x V floats, never the [D, V] head.
        assert aot_rows.collective_counts(text) == {
            "all-reduce": 2 * cfg.num_layers + 1, "all-gather": 1, "reduce-scatter": 0,
            "all-to-all": 0, "collective-permute": 0}
        assert GATHERED.findall(text) == [f"f32[{bucket.num_slots},256]"]


def test_compile_steps_for_needs_the_targets_kernel_and_the_served_model():
    cfg = ModelConfig(architecture="llama", vocab_size=256, hidden_size=128,
                      intermediate_size=384, num_layers=1, num_heads=8, num_kv_heads=2,
                      head_dim=32)
    mesh = sharding.make_mesh(1)
    with pytest.raises(ValueError, match="not 'auto'"):
        compile_steps_for(cfg, {}, [], [], page_size=16, max_model_len=128, mesh=mesh,
                          attention=AttentionSettings())
    if jax.device_count() >= TP:
        with pytest.raises(ValueError, match="served_config"):
            compile_steps_for(cfg, {}, [], [], page_size=16, max_model_len=128,
                              mesh=sharding.make_mesh(TP), attention=REFERENCE)
