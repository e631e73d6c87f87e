"""The host tier's copy programs (engine/runner/kv_offload.py) compile for v5e with their
rows in pinned_host memory, beside the step they run before.

Llama-3.1-8B cut to 4 layers (bf16) with the pool planned as the engine plans it: on
one chip the smallest bucket's step and the gather and donated scatter of three rungs
of the copy ladder; over the 4 chips of a v5e:2x2 (TP 4) the copies alone, each chip
moving its own KV heads' shard of a page. Specs only: nothing is allocated.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from jaxinfer import aot
from jaxinfer.config import load_preset
from jaxinfer.engine.core.buckets import BucketSet
from jaxinfer.engine.runner import kv_offload
from jaxinfer.engine.runner.programs import on_shardings
from jaxinfer.model import sharding
from jaxinfer.model.attention import kv_cache_shardings
from jaxinfer.sizing import accelerators

SETTINGS = aot.Settings(dtype="bfloat16", kv_dtype="bfloat16", max_num_seqs=16,
                        max_num_batched_tokens=256, max_model_len=2048, page_size=16)
PINNED = "pinned_host"


def _llama_4_layers():
    return dataclasses.replace(load_preset("llama3.1-8b"), num_layers=4)


def _placed(device: str):
    """(accelerator, plan, mesh, served config, params specs, KV specs on the mesh)."""
    acc = accelerators.get(device)
    cfg = _llama_4_layers()
    plan = aot.plan_for(cfg, acc, SETTINGS, acc.chips)
    mesh = sharding.replica_mesh(sharding.layout_mesh(1, acc.chips, aot.target_devices(acc)),
                                 0)
    served = sharding.served_config(cfg, acc.chips)
    params, kv = aot.step_specs(served, plan, SETTINGS, acc.chips)
    return acc, plan, mesh, served, params, kv, on_shardings(kv, kv_cache_shardings(mesh, kv))


def _compile_copies(kv_placed, rungs: list[int]) -> dict[int, tuple]:
    """rung -> (compiled gather, compiled scatter) of CopyPrograms in pinned_host."""
    programs = kv_offload.CopyPrograms(kv_placed, SETTINGS.page_size, memory_kind=PINNED)
    out = {}
    for count in rungs:
        pages = jax.ShapeDtypeStruct((count,), jnp.int32)
        gather = programs.gather.lower(kv_placed, pages).compile()
        rows = programs.row_specs(kv_placed, count)
        assert all(r.sharding.memory_kind == PINNED for r in rows)
        scatter = programs.scatter.lower(kv_placed, rows, pages).compile()
        out[count] = (gather, scatter)
    return out


def _check_copies(compiled: dict[int, tuple], plan, kv_placed, chips: int) -> None:
    """A page's shards on the chips make the runner's page (every layer, all chips).
    Per chip: the gather writes `count` pages' shards to host memory and nothing but
    the page ids to the device; the scatter reads them from host memory and takes the
    whole pool, donated (aliased to its output)."""
    shard_page = plan.page_bytes  # one page, every layer, on one chip
    assert chips * shard_page == kv_offload.page_bytes(kv_placed, SETTINGS.page_size)
    for count, (gather, scatter) in compiled.items():
        outs = jax.tree.leaves(gather.output_shardings)
        assert len(outs) == 4 and all(s.memory_kind == PINNED for s in outs)
        assert all(s.spec[2] == sharding.MODEL_AXIS for s in outs)  # by KV head, as the pool
        g = gather.memory_analysis()
        assert g.host_output_size_in_bytes == count * shard_page, (count, g)
        assert g.argument_size_in_bytes >= plan.kv_cache_bytes  # the pool, read in place
        assert g.temp_size_in_bytes < plan.kv_cache_bytes / 100  # no copy of the pool
        ins = jax.tree.leaves(scatter.input_shardings)
        assert [s.memory_kind for s in ins[4:8]] == [PINNED] * 4  # the rows
        s = scatter.memory_analysis()
        assert s.host_argument_size_in_bytes == count * shard_page, (count, s)
        assert plan.kv_cache_bytes <= s.argument_size_in_bytes < plan.kv_cache_bytes + 4096
        assert s.alias_size_in_bytes == plan.kv_cache_bytes  # donated: written in place
        assert s.temp_size_in_bytes < plan.kv_cache_bytes / 100


def test_step_and_copy_programs_compile_for_v5e_with_pinned_host():
    """One chip: the smallest bucket's step, and the gather and scatter of three rungs
    of the copy ladder the runner warms up (the smallest, one between, the largest)."""
    acc, plan, mesh, served, params, kv, kv_placed = _placed("v5e-1")
    chosen = aot.pick_buckets(BucketSet(max_num_batched_tokens=SETTINGS.max_num_batched_tokens,
                                        max_num_seqs=SETTINGS.max_num_seqs), "smallest")
    [step] = aot.compile_buckets(served, params, kv, chosen, SETTINGS, mesh)
    assert not isinstance(step, Exception), step
    assert step.memory_analysis().argument_size_in_bytes >= plan.kv_cache_bytes
    ladder = kv_offload.rungs(kv_offload.MAX_RUNG)
    assert ladder == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    _check_copies(_compile_copies(kv_placed, [1, 16, 256]), plan, kv_placed, acc.chips)


@pytest.mark.parametrize("device", ["v5e-4"])
def test_copy_programs_compile_per_chip_shards_under_tensor_parallelism(device):
    """TP 4 on v5e:2x2: each chip copies its own 2 KV heads' quarter of a page."""
    acc, plan, _, _, _, _, kv_placed = _placed(device)
    _check_copies(_compile_copies(kv_placed, [1, 256]), plan, kv_placed, acc.chips)
