"""Speculative heads' programs compile for one v5e chip with the Mosaic kernel (libtpu's
ahead-of-time compiler; no TPU): the target's steps that keep the features an EAGLE-3
head reads (the decode step, and the verify step at Q = 5 with the draft's
probabilities), and the EAGLE-3 drafter's k + 1 steps in one call (`eagle.propose`: a
ragged first step over up to Q positions a slot, then a while loop around the decode
kernel, the drafter's pages carried).

Target: Llama-3.1-8B's shapes cut to 4 layers, bf16, keeping the streams entering layers
1, 2 and 3 (`feature_layers`); head: the published Llama-3.1-8B EAGLE-3 head's shapes
(SafeAILab's config: hidden 4096, intermediate 14336, 32 heads, 8 KV heads, draft vocab
32000) with those capture ids. The pool is planned as the engine plans it beside a head
(planner.plan with the head's weights and its K/V plus the kept features per token:
4 + 24 KiB a token beside the target's 16 KiB). Nothing is allocated: params, pages,
the feature store and inputs are ShapeDtypeStructs.

Measured (libtpu of .venv-tpu; per chip, `memory_analysis()`; GB = 1e9 bytes) with
the planned pool of 14,598 pages (233,568 tokens) in 0.9 of the chip's 15.75 GiB
(2026-11-26, the K/V write scattering rows, see the drafter below):
- decode step, 32 slots, without features: arguments 7,674,040,320 B (7.674 GB: the
  target's weights 3.846, its K/V 3.827, the batch state), temporaries 38,688,768 B
  (0.039 GB).
- the same step keeping features: arguments 13,414,207,488 B (13.414 GB), exactly the
  feature store more (bf16[233,568, 12,288]: 5,740,167,168 B, 5.740 GB), donated and
  aliased to the output like the pages; temporaries 43,129,344 B (0.043 GB, +4 MB).
- verify step keeping features, 32 slots x Q = 5 (160 tokens), the draft's q f32[32, 5,
  128,256] (82 MB) in: arguments 13,496,297,472 B (13.496 GB), temporaries 765,792,256 B
  (0.766 GB; the same step without features, compiled apart: 0.849 GB).
- EAGLE-3 drafter, 8 slots, K + 1 = 5 steps: arguments 8,597,128,192 B (8.597 GB: head
  0.850, the target's embedding and LM head 2.101, the drafter's pages 0.957, the store
  5.740), output 0.977 GB (the pages aliased, q), temporaries 8,543,744 B (0.009 GB):
  no copy of the drafter's pages, nor of the store. The drafter's pages stay in the
  Mosaic kernel's layout ({4,3,2,1,0:T(2,128)}) through the while loop: the K/V write
  before the compiled kernel scatters rows of the pages' [P * 16 * 8, 2, 128] view
  (reference.write_kv_pages, `word_rows`), in place. Until 2026-11-26 the write
  scattered into the 5-D pages, which libtpu gave a layout of its own inside the loop
  ({4,2,3,1,0:T(8,128)}), copying the pages whole into the kernel's once a step (and
  once before the loop and once after): temporaries 963,408,384 B (1.007x the pages),
  22.8M of the loop body's 24.6M estimated cycles a step; now the body's ops sum to
  2.1M (libtpu's cost model; nothing runs here).
Resident while the drafter runs (both models' weights, the target's pages, the store,
the drafter's pages): 15.219 GB of 16.911 GB usable.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import aot
from jaxinfer.checkpoint.heads import random_head
from jaxinfer.config import ModelOptions, load_preset
from jaxinfer.config.heads import TOP_IDS, HeadConfig, head_config
from jaxinfer.engine.core.buckets import BucketSet
from jaxinfer.engine.runner.inputs import build_metadata, sampling_inputs
from jaxinfer.engine.runner.programs import (
    input_spec,
    mask_spec,
    on_shardings,
    state_spec,
    step_shardings,
    verify_step_function,
)
from jaxinfer.model import draft as draft_model
from jaxinfer.model import eagle, sharding
from jaxinfer.model.attention import feature_dtype, kv_cache_shardings, kv_cache_spec
from jaxinfer.pallas import AttentionSettings
from jaxinfer.sizing import accelerators, planner

SETTINGS = aot.Settings(dtype="bfloat16", kv_dtype="bfloat16", max_num_seqs=32,
                        max_num_batched_tokens=256, max_model_len=2048, page_size=16)
Q = 5  # K + 1: four drafts
TPU = AttentionSettings(impl="tpu")  # the compiled Mosaic kernel
FEATURE_LAYERS = (1, 2, 3)
KEEPING = ModelOptions(feature_layers=FEATURE_LAYERS)  # the target beside the heads
DRAFT_SLOTS = 8
GB = 1e9
# SafeAILab's EAGLE-3 config for Llama-3.1-8B (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B).
PUBLISHED = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
             "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336,
             "max_position_embeddings": 2048, "num_attention_heads": 32,
             "num_key_value_heads": 8, "num_hidden_layers": 1, "rms_norm_eps": 1e-5,
             "rope_theta": 500000.0, "tie_word_embeddings": False, "vocab_size": 128256,
             "draft_vocab_size": 32000, TOP_IDS: list(FEATURE_LAYERS)}


def eagle3_param_specs(head: HeadConfig, dtype: str) -> dict:
    """ShapeDtypeStructs of an EAGLE-3 head's params as checkpoint/heads.py loads them
    (float tensors in `dtype`, d2t int32). `random_head` draws with NumPy, so it cannot
    be traced by jax.eval_shape; its tree and shapes are checked against these below."""
    layer, d = head.layer, head.hidden_size
    f, q = layer.intermediate_size, layer.num_heads * layer.head_dim
    kv = layer.num_kv_heads * layer.head_dim
    shapes = {"fc": (head.feature_size, d), "final_norm": (d,),
              "lm_head": (d, head.draft_vocab_size),
              "layer": {"attn_norm": (d,), "hidden_norm": (d,), "wqkv": (2 * d, q + 2 * kv),
                        "wo": (q, d), "mlp_norm": (d,), "w_gate_up": (d, 2 * f),
                        "w_down": (f, d)}}
    specs = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, jnp.dtype(dtype)), shapes,
                         is_leaf=lambda x: isinstance(x, tuple))
    return specs | {"d2t": jax.ShapeDtypeStruct((head.draft_vocab_size,), jnp.int32)}


def nbytes(tree: object) -> int:
    return sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


@functools.cache
def _setup() -> dict:
    target = dataclasses.replace(load_preset("llama3.1-8b"), num_layers=4)
    head = head_config(PUBLISHED, target)
    assert head.feature_layers == FEATURE_LAYERS and head.feature_size == 3 * 4096
    head_params = eagle3_param_specs(head, SETTINGS.dtype)
    acc = accelerators.get("v5e-1")
    # As the engine plans beside heads (spec_loading.plan_draft): their weights, and per
    # token their K/V and the target's kept features.
    per_token = (KEEPING.feature_size(target) * feature_dtype(SETTINGS.kv_dtype).itemsize
                 + planner.kv_bytes_per_token(head.layer, SETTINGS.kv_dtype))
    plan = planner.plan(
        target, memory_bytes=int(acc.chip.usable_hbm_bytes * SETTINGS.gpu_memory_utilization),
        dtype=SETTINGS.dtype, kv_dtype=SETTINGS.kv_dtype, max_model_len=SETTINGS.max_model_len,
        max_num_seqs=SETTINGS.max_num_seqs, page_size=SETTINGS.page_size,
        max_num_batched_tokens=SETTINGS.max_num_batched_tokens,
        draft=(nbytes(head_params), per_token))
    params, kv_plain = aot.step_specs(target, plan, SETTINGS, 1)
    _, kv_keeping = aot.step_specs(target, plan, SETTINGS, 1, FEATURE_LAYERS)
    mesh = sharding.make_mesh(1, aot.target_devices(acc))
    return dict(target=target, head=head, head_params=head_params, acc=acc,
                plan=plan, params=params, kv_plain=kv_plain, kv_keeping=kv_keeping,
                mesh=mesh)


def _memory(name: str, compiled: jax.stages.Compiled) -> dict[str, int]:
    mem = compiled.memory_analysis()
    row = {"argument": mem.argument_size_in_bytes, "output": mem.output_size_in_bytes,
           "alias": mem.alias_size_in_bytes, "temp": mem.temp_size_in_bytes}
    print(f"\n{name}: " + ", ".join(f"{k} {v:,} B ({v / GB:.3f} GB)" for k, v in row.items()))
    return row


def _buckets() -> BucketSet:
    return BucketSet(max_num_batched_tokens=SETTINGS.max_num_batched_tokens,
                     max_num_seqs=SETTINGS.max_num_seqs, verify_positions=Q)


def test_eagle3_param_specs_match_random_head():
    """The specs' tree, shapes and dtypes are those of `random_head`'s params (cast as
    the loader casts them), on a small target of the same structure."""
    small = dataclasses.replace(load_preset("llama3.1-8b"), num_layers=4, hidden_size=128,
                                intermediate_size=256, num_heads=4, num_kv_heads=2,
                                head_dim=32, vocab_size=512)
    head, params = random_head("eagle3", small, jax.random.key(0),
                               eagle_aux_hidden_state_layer_ids=list(FEATURE_LAYERS),
                               draft_vocab_size=100, intermediate_size=384,
                               num_attention_heads=4, num_key_value_heads=2)
    loaded = jax.tree.map(lambda x: x.astype(jnp.bfloat16)
                          if jnp.issubdtype(x.dtype, jnp.floating) else x, params)
    want = jax.tree.map(lambda x: (x.shape, jnp.dtype(x.dtype)), loaded)
    got = jax.tree.map(lambda x: (x.shape, jnp.dtype(x.dtype)),
                       eagle3_param_specs(head, "bfloat16"))
    assert got == want


def test_feature_keeping_steps_compile_with_the_mosaic_kernel():
    """The decode step with and without the feature store (same pool), and the verify
    step keeping features: the store is an argument (donated, aliased to the output), it
    adds its own bytes and almost no temporaries."""
    s = _setup()
    plan, target, store = s["plan"], s["target"], s["kv_keeping"][-1]
    assert store.shape == (plan.num_pages * SETTINGS.page_size, KEEPING.feature_size(target))
    assert store.dtype == jnp.bfloat16
    store_bytes = nbytes(store)
    decode = _buckets().decode()[-1]  # the 32-slot decode bucket
    rows = {}
    for name, features, kv in (("decode step, no features", (), s["kv_plain"]),
                               ("decode step, keeping features", FEATURE_LAYERS,
                                s["kv_keeping"])):
        [compiled] = aot.compile_buckets(target, s["params"], kv, [decode], SETTINGS,
                                         s["mesh"], feature_layers=features)
        assert not isinstance(compiled, Exception), compiled
        assert compiled.as_text().count("tpu_custom_call") == 2 * target.num_layers
        rows[name] = _memory(name, compiled)
    plain, kept = rows.values()
    grown = kept["argument"] - plain["argument"]
    print(f"feature store {store_bytes:,} B ({store_bytes / GB:.3f} GB); arguments grew by "
          f"{grown:,} B; pages {plan.num_pages:,}")
    assert abs(grown - store_bytes) < 0.01 * store_bytes
    assert kept["alias"] - plain["alias"] >= 0.99 * store_bytes  # donated, written in place
    # Measured: 38.7 MB of temporaries without features, 43.1 MB with (the 32 tokens'
    # features scattered into the store): the store is never copied.
    assert kept["temp"] < plain["temp"] + 0.01 * store_bytes

    cfg, mesh = target, s["mesh"]
    param_sh, kv_sh, whole = step_shardings(cfg, mesh, kv_dtype=SETTINGS.kv_dtype,
                                            options=KEEPING)
    bucket = _buckets().verify()[-1]  # 32 slots x Q
    inputs = on_shardings(input_spec(bucket, page_size=SETTINGS.page_size, num_positions=Q),
                          whole)
    state = on_shardings(state_spec(SETTINGS.max_num_seqs, page_size=SETTINGS.page_size,
                                    max_model_len=SETTINGS.max_model_len), whole)
    probs = jax.ShapeDtypeStruct((bucket.num_slots, Q, cfg.vocab_size), jnp.float32,
                                 sharding=whole)
    verify = jax.jit(verify_step_function(cfg, page_size=SETTINGS.page_size, attention=TPU,
                                          options=KEEPING),
                     in_shardings=(param_sh, kv_sh, whole, whole, whole, whole),
                     out_shardings=(kv_sh, whole, whole), donate_argnums=(1, 2))
    mask = on_shardings(mask_spec(bucket, cfg.vocab_size), whole)
    with jax.set_mesh(mesh):
        compiled = verify.lower(on_shardings(s["params"], param_sh),
                                on_shardings(s["kv_keeping"], kv_sh), state, inputs, mask,
                                probs).compile()
    assert compiled.as_text().count("tpu_custom_call") == 2 * cfg.num_layers
    row = _memory(f"verify step keeping features, {bucket.num_slots} slots x Q = {Q}",
                  compiled)
    assert row["argument"] - kept["argument"] >= nbytes(probs)  # the store and q are in
    # Measured: 766 MB of temporaries (849 MB for the same step without features,
    # compiled apart): the step's own sampling over 160 x 128,256 logits; no copy of
    # the 5.74 GB store.
    assert row["temp"] < 1 * GB


def _while_bodies(hlo: str) -> list[str]:
    """The text of each while loop's body computation in compiled HLO text."""
    computations = {}
    for block in re.split(r"\n(?=\S)", hlo):
        head = re.match(r"%?([\w.\-]+) ", block)
        if head:
            computations[head.group(1)] = block
    names = re.findall(r"body=%?([\w.\-]+)", hlo)
    return [computations.get(name, "") for name in names]


def _copies(text: str, shape: tuple[int, ...]) -> int:
    """Copies of a bf16 array of `shape` in HLO text."""
    dims = ",".join(map(str, shape))
    return len(re.findall(rf"= bf16\[{dims}\]\{{[^}}]*\}} copy\(", text))


ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
            "f32": 4, "s32": 4, "u32": 4, "s64": 8, "f64": 8}


def largest_copy(text: str) -> int:
    """Bytes of the largest array a copy instruction makes in HLO text (0: none)."""
    return max([ITEMSIZE[dtype] * int(np.prod([int(d) for d in dims.split(",") if d]))
                for dtype, dims in re.findall(r"= (\w+)\[([\d,]*)\]\{[^}]*\} copy\(", text)],
               default=0)


def test_eagle3_drafter_steps_compile_in_one_call():
    """k + 1 drafter steps in one call over the target's feature store and the drafter's
    own pages (one layer). The pages stay in the kernel's layout through the while loop
    (the K/V write scatters rows of their [P * 16 * 8, 2, 128] view): no copy of them
    or of the store (read only, 5.74 GB here), anywhere; temporaries 0.009 GB (until
    2026-11-26: 0.963 GB, a copy of the pages into the kernel's layout every step)."""
    s = _setup()
    plan, head, mesh = s["plan"], s["head"], s["mesh"]
    param_sh, _, whole = step_shardings(s["target"], mesh)
    head_kv = kv_cache_spec(head.layer, num_pages=plan.num_pages,
                            page_size=SETTINGS.page_size, dtype=SETTINGS.kv_dtype,
                            backend="tpu")
    assert len(head_kv) == 1 and head_kv[0].dtype == jnp.bfloat16
    pages_sh = kv_cache_shardings(mesh, head_kv)[0]
    pages = on_shardings(head_kv[0], pages_sh)
    store = on_shardings(s["kv_keeping"][-1], whole)
    shared_sh = {k: param_sh[k] for k in ("embed", "lm_head")}
    shared = on_shardings({k: s["params"][k] for k in shared_sh}, shared_sh)
    bucket = _buckets().pick(DRAFT_SLOTS, DRAFT_SLOTS, decode=True)
    pages_per_seq = -(-SETTINGS.max_model_len // SETTINGS.page_size)
    specs = draft_model.DraftInputs(
        token_ids=np.zeros(bucket.num_tokens, np.int32),
        positions=np.zeros(bucket.num_slots, np.int32),
        page_indices=np.zeros((bucket.num_slots, pages_per_seq), np.int32),
        num_seqs=np.zeros(1, np.int32),
        sampling=sampling_inputs([], num_rows=bucket.num_slots,
                                 history_width=SETTINGS.max_model_len,
                                 eos_token_ids=frozenset()),
        num_steps=np.array(1, np.int32), attention=TPU)
    first = build_metadata([], page_size=SETTINGS.page_size, pages_per_seq=pages_per_seq,
                           num_tokens=bucket.num_slots * Q, num_slots=bucket.num_slots,
                           attention=TPU)
    first, inputs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        np.shape(x), np.asarray(x).dtype, sharding=whole), (first, specs))
    propose = jax.jit(functools.partial(
        eagle.propose, cfg=head, page_size=SETTINGS.page_size, num_positions=Q,
        vocab_size=s["target"].vocab_size),
        in_shardings=(whole, shared_sh, pages_sh, whole, whole, whole, whole),
        out_shardings=(pages_sh, whole, whole), donate_argnums=(2,))
    with jax.set_mesh(mesh):
        compiled = propose.lower(on_shardings(s["head_params"], whole), shared, pages, store,
                                 *first, inputs).compile()
    text = compiled.as_text()
    assert "while(" in text  # the k drafter steps after the first in one program
    assert text.count("tpu_custom_call") >= 2  # the first step's kernel and the loop's
    bodies = _while_bodies(text)
    assert any("tpu_custom_call" in body for body in bodies)  # the kernel in the loop
    # No layout conversion of the pages: neither their 5-D array nor the K/V write's row
    # view is copied, in the loop or around it; no copy anywhere near their size.
    rows = (pages.shape[0] * pages.shape[1] * pages.shape[2], *pages.shape[3:])
    assert sum(_copies(body, pages.shape) + _copies(body, rows) for body in bodies) == 0
    assert _copies(text, pages.shape) == _copies(text, rows) == 0
    assert _copies(text, store.shape) == 0
    row = _memory(f"EAGLE-3 drafter, {bucket.num_slots} slots, {Q} steps", compiled)
    pool = nbytes(pages)
    print(f"drafter pages {pool:,} B ({pool / GB:.3f} GB); temporaries / pages "
          f"{row['temp'] / pool:.4f}; largest copy {largest_copy(text):,} B")
    assert largest_copy(text) < 0.01 * pool
    # Measured: 8.5 MB of temporaries, 0.0089x the pages (0.963 GB, 1.007x, with the copy).
    assert row["temp"] < 0.02 * pool
    # Resident on the chip while the drafter runs: both models' weights, the target's
    # pages, the store and the drafter's pages; its temporaries must fit beside them.
    resident = (nbytes(s["params"]) + nbytes(s["head_params"]) + nbytes(s["kv_keeping"])
                + pool)
    usable = s["acc"].chip.usable_hbm_bytes
    print(f"resident {resident:,} B ({resident / GB:.3f} GB) + drafter temporaries "
          f"{row['temp'] / GB:.3f} GB of {usable / GB:.3f} GB usable")
    assert resident + row["temp"] + row["output"] - row["alias"] <= usable
