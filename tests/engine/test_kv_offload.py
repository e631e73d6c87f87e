"""The prefix cache's host tier (kv_offloading_size): the host half's slots and queue
(exact state), the pool's walk over both tiers, the device half's copies byte for byte
(bfloat16, int8, fp8 pages; split over devices; staged in pinned host memory), and the
engine's greedy tokens with a small pool and offload equal to those without and to a
pool that holds everything. Same-step hits: tests/engine/test_prefix_cache.py."""

from __future__ import annotations

import dataclasses
import random

import jax
import numpy as np
import pytest

from jaxinfer import SamplingParams
from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.engine.core.host_tier import OFFLOAD, RESTORE, HostTier, Transfer, phases
from jaxinfer.engine.core.page_pool import ROOT, PagePool
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.runner.kv_offload import HostCopies, rungs
from jaxinfer.model import sharding
from jaxinfer.model.attention import init_kv_cache, kv_cache_shardings
from jaxinfer.server import prometheus

A, B, C, D = (1, 2, 3, 4), (5, 6, 7, 8), (9, 10, 11, 12), (13, 14, 15, 16)


def _pool(num_pages=4, host_slots=2):
    return PagePool(num_pages, enable_caching=True, host=HostTier(host_slots))


def _cache(pool, chain):
    """Register `chain` (token tuples) as one request's pages, then free them."""
    pages, parent = pool.allocate(len(chain)), ROOT
    for page, tokens in zip(pages, chain, strict=True):
        parent = pool.register(page, parent, tokens)
    pool.free(pages[::-1])
    return pages


def test_an_evicted_page_goes_to_the_host_and_a_hit_brings_it_back_under_its_serial():
    pool = _pool()
    p1, p2 = _cache(pool, [A, B])
    _, s = pool.match(list(A + B), 4, 2)
    assert pool.allocate(2) == [3, p2]  # the free page, then the tail: p2 evicted
    assert [t.kind for t in pool.host.take_transfers()] == [OFFLOAD]
    assert pool.match(list(A + B), 4, 2) == ([p1], s[:1])  # the device holds only A
    pool.free([3, p2])
    pages, serials, restored = pool.take_match(list(A + B + C), 4, 3)
    assert serials == s and restored == [1] and pool.host.num_held == 1  # kept there too
    [transfer] = pool.host.take_transfers()
    assert transfer == Transfer(RESTORE, pages[1], 0)  # into a device page, from slot 0
    assert pool.refcount(pages[0]) == pool.refcount(pages[1]) == 1
    assert pool.lookup(s[0], B).page == pages[1]  # registered again, same serial


def test_the_host_tier_evicts_its_least_recent_and_never_a_slot_a_queued_restore_reads():
    host = HostTier(2)
    pool = PagePool(8, enable_caching=True, host=host)
    pages = _cache(pool, [A, B, C])
    pool.allocate(7)  # evicts C, B, A (tail first); A's offload takes C's slot
    assert host.num_held == 2 and host.stats["evictions"] == 1
    assert [(t.page, t.slot) for t in host.take_transfers()] == [
        (pages[2], 0), (pages[1], 1), (pages[0], 0)]
    assert pool.lookup_host(ROOT, A) is not None and pool.lookup_host(ROOT, C) is None
    pool.free([1, 2])
    page = pool.restore(pool.lookup_host(ROOT, A))
    pool.free([page])
    assert pool.allocate(2)[1] == page  # evicted again: the host holds it, nothing copied
    assert host.stats["copies_saved"] == 1
    assert host.take_transfers() == (Transfer(RESTORE, page, 0),)
    host.restore(pool.lookup_host(ROOT, A), 5)  # slot 0 read by a queued restore
    host.put(dataclasses.replace(pool.lookup_host(ROOT, A), hash=123, tokens=D))
    assert [(t.kind, t.slot) for t in host.take_transfers()] == [(RESTORE, 0), (OFFLOAD, 1)]
    assert host.get(123) is not None and pool.lookup_host(pool.lookup_host(
        ROOT, A).serial, B) is None  # B's slot went to the newcomer, A's stayed


def test_a_page_computed_again_takes_the_host_entrys_serial_so_its_children_chain():
    pool = _pool(num_pages=3, host_slots=4)
    _cache(pool, [A, B])
    serial_a = pool.lookup(ROOT, A).serial
    pool.allocate(2)  # both evicted to the host
    pool.free([1, 2])
    (page,) = pool.allocate(1)
    assert pool.register(page, ROOT, A) == serial_a and pool.host.num_held == 2
    assert pool.lookup_host(serial_a, B) is not None  # B still chains to A


def test_phases_keep_an_offload_behind_a_restore_into_the_same_page():
    queue = [Transfer(OFFLOAD, 3, 0), Transfer(RESTORE, 5, 1), Transfer(OFFLOAD, 4, 2),
             Transfer(OFFLOAD, 5, 3), Transfer(RESTORE, 6, 2)]
    assert phases(queue) == [(queue[0:1] + queue[2:3], queue[1:2]),
                             (queue[3:4], queue[4:5])]


def test_copy_rungs_are_powers_of_two_up_to_the_tier():
    assert rungs(5) == [1, 2, 4, 8] and rungs(1) == [1] and rungs(10_000)[-1] == 256


def _random_cache(dtype, shards, num_pages=6, feature_size=0):
    """A cache of random bytes in every leaf, split by KV head over `shards` devices."""
    cfg = ModelConfig(architecture="llama", vocab_size=256, hidden_size=64,
                      intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=16)
    mesh = sharding.make_mesh(shards)
    specs = init_kv_cache(cfg, num_pages=num_pages, page_size=4, dtype=dtype, shards=shards,
                          feature_size=feature_size)
    rng = np.random.default_rng(0)

    def fill(x):
        bits = rng.integers(0, 255, size=x.shape[0] * int(np.prod(x.shape[1:])) *
                            x.dtype.itemsize, dtype=np.uint8)
        return np.frombuffer(bits.tobytes(), x.dtype).reshape(x.shape)

    host = jax.tree.map(lambda x: fill(np.asarray(x)), specs)
    return jax.device_put(host, kv_cache_shardings(mesh, host)), host


@pytest.mark.parametrize("dtype,shards,memory_kind", [
    ("bfloat16", 1, None), ("int8", 1, None), ("fp8", 2, None),
    ("bfloat16", 2, "pinned_host")])
def test_a_restored_page_is_byte_identical_to_the_evicted_one(dtype, shards, memory_kind):
    cache, host = _random_cache(dtype, shards, feature_size=8 if dtype == "int8" else 0)
    copies = HostCopies(cache, num_slots=4, page_size=4, memory_kind=memory_kind)
    cache = copies.warm_up(cache)
    cache = copies.run(cache, [Transfer(OFFLOAD, 2, 3), Transfer(OFFLOAD, 5, 0)])
    cache = copies.run(cache, [Transfer(OFFLOAD, 3, 1)])  # pending; the restores wait
    cache = copies.run(cache, [Transfer(RESTORE, 4, 3), Transfer(RESTORE, 1, 0)])  # for it
    out = jax.tree.map(np.asarray, cache)
    for before, after in zip(jax.tree.leaves(host), jax.tree.leaves(out), strict=True):
        view = before.reshape(6, -1) if before.ndim == 2 else before
        got = after.reshape(6, -1) if after.ndim == 2 else after
        assert view[2].tobytes() == got[4].tobytes() and view[5].tobytes() == got[1].tobytes()
        assert view[3].tobytes() == got[3].tobytes()  # untouched
    assert (copies.stats.pages_to_host, copies.stats.pages_to_device) == (3, 2)
    assert copies.stats.bytes_to_host == 3 * copies.page_bytes


SMALL = dict(page_size=4, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64,
             compilation_cache_dir="")
PAGE_BYTES = 4 * 512  # tiny llama: 2 layers x K,V x 2 kv heads x 16 dims x 4 bytes per token


def _workload(num_prefixes=8, rounds=3):
    """`num_prefixes` distinct 4-page prefixes, each asked `rounds` times, interleaved."""
    rng = random.Random(0)
    prefixes = [[rng.randrange(3, 200) for _ in range(16)] for _ in range(num_prefixes)]
    return [p + [rng.randrange(3, 200) for _ in range(3)] for _ in range(rounds)
            for p in prefixes]


def _greedy(engine, prompts):
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=4, temperature=0.0,
                                                            ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    return [engine.release(f"r{i}").outputs[0].token_ids for i in range(len(prompts))]


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_offload_keeps_greedy_tokens_and_serves_evicted_prefixes(hf_model_dirs,
                                                                 async_scheduling):
    """A pool of 20 pages holds about a quarter of the 8 prefixes' pages (and the
    requests in flight): without the host tier nothing is hit, with it every repeat is."""
    prompts = _workload()
    settings = dict(SMALL, async_scheduling=async_scheduling)
    runs = {name: Engine(hf_model_dirs["llama"], EngineConfig(**settings, **extra))
            for name, extra in {
                "plain": dict(kv_cache_memory_bytes=20 * PAGE_BYTES),
                "offload": dict(kv_cache_memory_bytes=20 * PAGE_BYTES,
                                kv_offloading_size=64 * PAGE_BYTES / 2**30),
                "large": dict(kv_cache_memory_bytes=200 * PAGE_BYTES)}.items()}
    tokens = {name: _greedy(engine, prompts) for name, engine in runs.items()}
    assert tokens["plain"] == tokens["offload"] == tokens["large"]
    summary = {name: engine.metrics.summary() for name, engine in runs.items()}
    offload = summary["offload"]
    assert offload["prefix_cache_host_hit_tokens"] > 0
    assert offload["prompt_tokens"] == summary["large"]["prompt_tokens"]
    assert offload["prompt_tokens"] < summary["plain"]["prompt_tokens"]
    assert offload["kv_offload_pages_to_device"] > 0
    assert offload["kv_offload_bytes_to_host"] == (
        offload["kv_offload_pages_to_host"] * runs["offload"].runner.host_copies.page_bytes)
    assert all(s["compiles_after_warmup"] == 0 for s in summary.values())
    assert "kv_offload_host_pages" not in summary["plain"]
    text = prometheus.exposition(prometheus.snapshot(runs["offload"]), "m").decode()
    assert _sample(text, "prefix_cache_hits_by_tier_total", 'tier="host"') == (
        offload["prefix_cache_host_hit_tokens"])
    assert _sample(text, "kv_offload_bytes_total", 'direction="to_device"') == (
        offload["kv_offload_bytes_to_device"])


def _sample(text, family, label):
    """The value of the exposition's `jaxinfer:<family>` line that has `label`."""
    [line] = [line for line in text.splitlines()
              if line.startswith(f"jaxinfer:{family}{{") and label in line]
    return float(line.rsplit(" ", 1)[1])


@pytest.mark.parametrize("settings,field", [
    (dict(kv_offloading_size=0), "kv_offloading_size"),
    (dict(kv_offloading_size="8"), "kv_offloading_size"),
    (dict(kv_offloading_size=1, enable_prefix_caching=False), "enable_prefix_caching"),
    (dict(kv_offloading_size=1, kv_offloading_backend="lmcache"), "kv_offloading_backend"),
    (dict(kv_offloading_size=1, pipeline_parallel_size=2), "pipeline_parallel_size"),
    (dict(kv_offloading_size=1, speculative_config={
        "method": "draft_model", "model": "/draft", "num_speculative_tokens": 2}),
     "speculative_config")])
def test_bad_offload_settings_are_refused_naming_the_field(settings, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**settings)


def test_each_replica_offloads_its_own_shards_under_data_and_tensor_parallelism(
        hf_model_dirs):
    """DP 2 x TP 2: each replica's tier keeps its two devices' halves of a page; the
    tokens are one device's with a pool that holds everything."""
    from jaxinfer import LLM

    prompts = _workload()
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(
        hf_model_dirs["llama"], **SMALL, kv_cache_memory_bytes=200 * PAGE_BYTES).generate(
        prompts, greedy, use_tqdm=False)]
    llm = LLM(hf_model_dirs["llama"], **SMALL, data_parallel_size=2, tensor_parallel_size=2,
              kv_cache_memory_bytes=20 * PAGE_BYTES, kv_offloading_size=64 * PAGE_BYTES / 2**30)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    assert got == want
    metrics = llm.metrics()
    assert all(r["prefix_cache_host_hit_tokens"] > 0 for r in metrics["replicas"])
    assert metrics["compiles_after_warmup"] == 0
    for replica in llm.engine.replicas:
        copies = replica.runner.host_copies
        assert [len(per_device) for per_device in copies.store] == [2] * len(copies.store)
