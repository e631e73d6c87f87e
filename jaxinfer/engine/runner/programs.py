"""What the runner compiles: the jittable step functions (`step_function`,
`score_step_function`, `pool_step_function`), a bucket's input and state specs, their
shardings on a mesh, and `compile_steps_for`, which compiles from specs alone (for a
TPU topology from any host: docs/aot.md). See docs/architecture.md#buckets.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from jaxinfer.config import DEFAULT_OPTIONS, ModelConfig, ModelOptions
from jaxinfer.engine.core.buckets import Bucket
from jaxinfer.engine.request import MAX_LOGPROBS
from jaxinfer.engine.runner.inputs import BIAS_WIDTH, NUM_SAMPLE_POSITIONS, STOP_WIDTH
from jaxinfer.engine.runner.slots import SlotTable
from jaxinfer.engine.runner.token_masks import mask_words
from jaxinfer.model import (
    batch_state,
    layers,
    lora,
    moe,
    params_table,
    pipeline,
    scoring,
    sharding,
)
from jaxinfer.model import quantization as quantization_lib
from jaxinfer.model import step as model_step
from jaxinfer.model.attention import (
    KV_PAGES_SPEC,
    KV_SCALES_SPEC,
    QuantizedPages,
    kv_cache_shardings,
)
from jaxinfer.pallas import DEFAULT_SETTINGS, AttentionSettings, kv_quant

COMPILE_THREADS = 2  # buckets compiled at once during warm-up


def step_function(cfg: ModelConfig, *, page_size: int, decode_only: bool = False,
                  attention: AttentionSettings = DEFAULT_SETTINGS,
                  options: ModelOptions = DEFAULT_OPTIONS) -> Callable:
    """The step the runner compiles: (params, kv_cache, state, delta) -> (kv_cache,
    state, packed); `decode_only` for decode buckets (one token per request);
    `attention`: the engine's attention kernel (impl, interpret); `options`: the
    engine's for the model (experts split, features kept)."""
    return batch_state.stateful(functools.partial(
        model_step.step, cfg=cfg, options=options, num_logprobs=MAX_LOGPROBS,
        decode_only=decode_only),
        page_size=page_size, routing=cfg.moe is not None, attention=attention)


def score_step_function(cfg: ModelConfig, *, page_size: int,
                        attention: AttentionSettings = DEFAULT_SETTINGS,
                        options: ModelOptions = DEFAULT_OPTIONS) -> Callable:
    """The scoring variant the runner compiles per mixed bucket with
    `enable_prompt_logprobs`: (params, kv_cache, state, delta, score_inputs) ->
    (kv_cache, state, packed samples, packed scores)."""
    return batch_state.stateful(functools.partial(
        model_step.score_step, cfg=cfg, options=options, num_logprobs=MAX_LOGPROBS),
        page_size=page_size,
        routing=cfg.moe is not None, attention=attention)


def pool_step_function(cfg: ModelConfig, *, page_size: int, decode_only: bool = False,
                       attention: AttentionSettings = DEFAULT_SETTINGS,
                       options: ModelOptions = DEFAULT_OPTIONS) -> Callable:
    """A pooling model's step in place of `step_function`'s: (params, kv_cache, state,
    delta, mask) -> (kv_cache, state, zero samples, f32[S, 3, D] pools, f32[S, labels]
    scores); model/step.py `pool_step`."""
    return batch_state.stateful(functools.partial(
        model_step.pool_step, cfg=cfg, options=options, num_logprobs=MAX_LOGPROBS,
        decode_only=decode_only),
        page_size=page_size, routing=cfg.moe is not None, attention=attention)


def verify_step_function(cfg: ModelConfig, *, page_size: int,
                         attention: AttentionSettings = DEFAULT_SETTINGS,
                         options: ModelOptions = DEFAULT_OPTIONS) -> Callable:
    """The step of a verify bucket: (params, kv_cache, state, delta[, draft_probs]) ->
    (kv_cache, state, packed)."""
    return batch_state.stateful(functools.partial(
        model_step.verify_step, cfg=cfg, options=options, num_logprobs=MAX_LOGPROBS),
        page_size=page_size,
        routing=cfg.moe is not None, attention=attention)


def score_input_spec(bucket: Bucket) -> scoring.ScoreInputs:
    """ShapeDtypeStructs of a bucket's ScoreInputs."""
    return scoring.ScoreInputs(
        target_ids=jax.ShapeDtypeStruct((bucket.num_tokens,), jnp.int32),
        num_top=jax.ShapeDtypeStruct((1,), jnp.int32))


def make_mesh(cfg: ModelConfig, tensor_parallel_size: int, data_parallel_size: int = 1,
              replica: int = 0, expert_parallel: bool = False,
              pipeline_parallel_size: int = 1) -> Mesh:
    """Replica `replica`'s mesh (its row of the data x [stage x] model layout), after
    checking the size suits the model (whole experts per device with `expert_parallel`)
    and the devices are there (sharding.py)."""
    sharding.validate(cfg, tensor_parallel_size, jax.device_count(), expert_parallel)
    layout = sharding.layout_mesh(data_parallel_size, tensor_parallel_size,
                                  pipeline_parallel_size=pipeline_parallel_size)
    return sharding.replica_mesh(layout, replica)


def min_step_tokens(dtype: str, quantization: str | None = None) -> int:
    """Fewest token rows a step should run with weights of `dtype` (model.layers)."""
    return layers.min_matmul_rows(jnp.dtype(dtype), quantization)


def input_spec(bucket: Bucket, *, page_size: int,
               num_positions: int = NUM_SAMPLE_POSITIONS, num_groups: int = 1
               ) -> batch_state.StepDelta:
    """ShapeDtypeStructs of a bucket's step delta (an empty plan, padded), sampling
    `num_positions` (Q) positions per request; its shapes depend on the bucket alone
    (and on the KV page groups, whose page writes it carries)."""
    bucket = dataclasses.replace(bucket, num_positions=max(bucket.num_positions,
                                                           num_positions))
    delta, _ = SlotTable(bucket.num_slots, page_size=page_size,
                         num_groups=num_groups).delta([], bucket)
    return _specs(delta)


def mask_spec(bucket: Bucket, vocab_size: int) -> jax.ShapeDtypeStruct:
    """The ShapeDtypeStruct of a bucket's token mask (runner/token_masks.py)."""
    return jax.ShapeDtypeStruct((bucket.num_slots, mask_words(vocab_size)), jnp.int32)


def state_spec(num_slots: int, *, page_size: int, max_model_len: int,
               experts: tuple[int, int] = (0, 0),
               group_windows: tuple[int | None, ...] = (None,)) -> batch_state.BatchState:
    """ShapeDtypeStructs of the batch state of `num_slots` slots (model/batch_state.py);
    `experts`: `moe.routing_shape(cfg)`; `group_windows`: the KV page groups'."""
    return jax.eval_shape(functools.partial(
        batch_state.init, num_slots, pages_per_seq=-(-max_model_len // page_size),
        max_model_len=max_model_len, num_stop_ids=STOP_WIDTH, bias_width=BIAS_WIDTH,
        experts=experts, group_windows=group_windows))


def _specs(tree: object) -> object:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def compile_steps_for(cfg: ModelConfig, params: object, kv_cache: object,
                      buckets: Sequence[Bucket], *, page_size: int, max_model_len: int,
                      mesh: Mesh, attention: AttentionSettings,
                      threads: int = COMPILE_THREADS,
                      group_windows: tuple[int | None, ...] = (None,),
                      options: ModelOptions = DEFAULT_OPTIONS,
                      on_compiled: Callable[[int, jax.stages.Compiled | Exception], None]
                      | None = None) -> list[jax.stages.Compiled | Exception]:
    """Compile the step ahead of time for the devices of `mesh` from specs alone
    (ShapeDtypeStructs: nothing is allocated), e.g. n chips of a TPU topology on a CPU
    machine; one result per bucket, the exception where the compiler refused (out of
    memory, say). Shardings as the Runner's: params by the spec table, KV pages split by
    head, inputs and the packed output replicated (the specs' own shardings are replaced).
    `cfg` is the served model (`sharding.served_config`). Lowering is serial, under the
    mesh (tracing is not thread-safe); compiles run on `threads` threads.
    `attention.impl` must name the target's kernel: "auto" would read this host's
    default backend. `group_windows`: the KV page groups of `kv_cache` (kv_cache_spec's),
    whose page tables the state and deltas carry; `options`: the engine's for the model.
    `on_compiled(i, result)` is called as bucket i's compile ends, in bucket order; with
    one thread each bucket is lowered just before its compile, so the calls come at an
    even pace rather than after every lowering."""
    if attention.impl == "auto":
        raise ValueError("compile_steps_for needs attention.impl set for the target "
                         "('tpu', 'gpu' or 'reference'), not 'auto'")
    shards = mesh.shape[sharding.MODEL_AXIS]
    if cfg.num_kv_heads % shards:
        raise ValueError(f"cfg.num_kv_heads={cfg.num_kv_heads} must be divisible by the "
                         f"{shards} devices: pass sharding.served_config(cfg, {shards})")
    param_shardings, _, whole = step_shardings(
        cfg, mesh, quantization_lib.mode_of(params),
        quantized_head=quantization_lib.has_quantized_head(params), options=options)
    kv_shardings = kv_cache_shardings(mesh, kv_cache)  # float or 8-bit with scales
    params, kv_cache = on_shardings(params, param_shardings), on_shardings(
        kv_cache, kv_shardings)
    # a model without an LM head is a pooling model: its step pools (two more outputs)
    make, pooled = ((pool_step_function, (whole, whole)) if cfg.head != "lm"
                    else (step_function, ()))
    steps = {decode: jax.jit(make(cfg, page_size=page_size, decode_only=decode,
                                  attention=attention, options=options),
                             in_shardings=(param_shardings, kv_shardings, whole, whole,
                                           whole),
                             out_shardings=(kv_shardings, whole, whole) + pooled,
                             donate_argnums=(1, 2))
             for decode in (False, True)}
    state = on_shardings(state_spec(max((b.num_slots for b in buckets), default=1),
                                    page_size=page_size, max_model_len=max_model_len,
                                    experts=moe.routing_shape(cfg),
                                    group_windows=group_windows), whole)

    def lower(b: Bucket) -> jax.stages.Lowered:
        with jax.set_mesh(mesh):
            return steps[b.decode].lower(params, kv_cache, state, on_shardings(input_spec(
                b, page_size=page_size, num_groups=len(group_windows)), whole), on_shardings(
                    mask_spec(b, cfg.vocab_size), whole))

    return _compile_each(lower, buckets, threads, on_compiled)


def _compile_each(lower: Callable[[Bucket], jax.stages.Lowered], buckets: Sequence[Bucket],
                  threads: int, on_compiled: Callable | None
                  ) -> list[jax.stages.Compiled | Exception]:
    """Each bucket's compiled step (or the compiler's exception), lowered in the calling
    thread and compiled on `threads` threads; `on_compiled(i, result)` in bucket order."""

    def compile_one(item: jax.stages.Lowered) -> jax.stages.Compiled | Exception:
        try:
            return item.compile()
        except Exception as err:  # reported per bucket by the caller
            return err

    done: list[jax.stages.Compiled | Exception] = []
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        results = ((compile_one(lower(b)) for b in buckets) if threads == 1
                   else pool.map(compile_one, [lower(b) for b in buckets]))
        for i, result in enumerate(results):
            done.append(result)
            if on_compiled is not None:
                on_compiled(i, result)
    return done


def step_shardings(cfg: ModelConfig, mesh: Mesh, quantization: str | None = None,
                   kv_dtype: str = "float32", quantized_head: bool = True,
                   options: ModelOptions = DEFAULT_OPTIONS
                   ) -> tuple[object, list, NamedSharding]:
    """(params, KV cache, replicated) shardings of the step on `mesh`, as the Runner's;
    8-bit `kv_dtype` ("int8", "fp8"): each layer's pages and scales split by KV head;
    `quantized_head=False`: a quantized model's LM head kept float; `options`: experts
    whole per device, a feature store after the layers' pages."""
    shards = mesh.shape[sharding.MODEL_AXIS]
    specs = quantization_lib.partition_specs(
        params_table.param_partition_specs(cfg, shards, options.expert_parallel),
        quantization, head=quantized_head)
    if options.lora is not None:  # adapter slots (model/lora.py), split as their targets
        specs = {**specs, "lora": lora.partition_specs(cfg, options.lora)}
    stages = options.pipeline_stages
    if stages > 1:  # layers by slot, stacked by stage (model/pipeline.py)
        specs = {**specs, "layers": pipeline.stack_layers(specs["layers"], stages)}
    params = sharding.named(mesh, specs)
    layer = _named_kv(mesh, KV_PAGES_SPEC, stages)
    if kv_quant.is_quantized(kv_dtype):
        layer = QuantizedPages(layer, _named_kv(mesh, KV_SCALES_SPEC, stages))
    store = [sharding.replicated(mesh)] * bool(options.feature_layers)
    layers_held = pipeline.slot_count(cfg.num_layers, stages)
    kv_cache = [layer] * layers_held + store
    return params, kv_cache, sharding.replicated(mesh)


def _named_kv(mesh: Mesh, spec: object, stages: int) -> NamedSharding:
    return NamedSharding(mesh, pipeline.stage_spec(spec) if stages > 1 else spec)


def on_shardings(specs: object, shardings: object) -> object:
    """ShapeDtypeStructs `specs` placed on `shardings` (one sharding, or a matching tree)."""
    if isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                           sharding=shardings), specs)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        specs, shardings)
