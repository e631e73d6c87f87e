"""What the runner compiles: the step functions, their input specs and shardings.

runner.py holds the Runner's device state and its per-step work; here,
`step_function` / `score_step_function` name the jittable entry points the
Runner compiles per bucket, `input_spec` gives a bucket's input shapes,
`step_shardings` the shardings of params, KV cache and inputs on a mesh, and
`compile_steps_for` compiles the step ahead of time from specs alone (for a TPU
topology from any host: jaxinfer/cli/aot.py).
"""

from __future__ import annotations

import concurrent.futures
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from jaxinfer.config import ModelConfig
from jaxinfer.engine.buckets import Bucket
from jaxinfer.engine.request import MAX_LOGPROBS
from jaxinfer.engine.runner.inputs import (
    NUM_SAMPLE_POSITIONS,
    build_metadata,
    proposed_ids,
    sampling_inputs,
)
from jaxinfer.model import layers, scoring, sharding, transformer
from jaxinfer.model import quantization as quantization_lib
from jaxinfer.model import step as model_step
from jaxinfer.model.attention import (
    KV_PAGES_SPEC,
    KV_SCALES_SPEC,
    QuantizedPages,
    kv_cache_shardings,
)
from jaxinfer.pallas import kv_quant

COMPILE_THREADS = 2  # buckets compiled at once during warm-up


def step_function(cfg: ModelConfig, *, decode_only: bool = False) -> functools.partial:
    """The step the runner compiles: (params, kv_cache, inputs) -> (kv_cache, packed);
    `decode_only` for decode buckets (one token per request)."""
    return functools.partial(model_step.step, cfg=cfg, num_logprobs=MAX_LOGPROBS,
                             decode_only=decode_only)


def score_step_function(cfg: ModelConfig) -> functools.partial:
    """The scoring variant the runner compiles per mixed bucket with
    `enable_prompt_logprobs`: (params, kv_cache, inputs, score_inputs) -> (kv_cache,
    packed samples, packed scores)."""
    return functools.partial(model_step.score_step, cfg=cfg, num_logprobs=MAX_LOGPROBS)


def score_input_spec(bucket: Bucket) -> scoring.ScoreInputs:
    """ShapeDtypeStructs of a bucket's ScoreInputs."""
    return scoring.ScoreInputs(
        target_ids=jax.ShapeDtypeStruct((bucket.num_tokens,), jnp.int32),
        num_top=jax.ShapeDtypeStruct((1,), jnp.int32))


def make_mesh(cfg: ModelConfig, tensor_parallel_size: int) -> Mesh:
    """The mesh a model is served on, after checking the size suits it (sharding.py)."""
    sharding.validate(cfg, tensor_parallel_size, jax.device_count())
    return sharding.make_mesh(tensor_parallel_size)


def min_step_tokens(dtype: str, quantization: str | None = None) -> int:
    """Fewest token rows a step should run with weights of `dtype` (model.layers)."""
    return layers.min_matmul_rows(jnp.dtype(dtype), quantization)


def input_spec(bucket: Bucket, *, page_size: int, max_model_len: int,
               num_positions: int = NUM_SAMPLE_POSITIONS) -> model_step.StepInputs:
    """ShapeDtypeStructs of a bucket's step inputs (an empty plan, padded), sampling
    `num_positions` (Q) positions per request."""
    token_ids, md = build_metadata([], page_size=page_size,
                                   pages_per_seq=-(-max_model_len // page_size),
                                   num_tokens=bucket.num_tokens, num_slots=bucket.num_slots,
                                   num_positions=num_positions)
    sampling = sampling_inputs([], num_rows=bucket.num_slots * num_positions,
                               history_width=max_model_len, eos_token_ids=frozenset())
    inputs = model_step.StepInputs(
        token_ids=token_ids, md=md, sampling=sampling,
        proposed_ids=proposed_ids([], num_slots=bucket.num_slots, num_positions=num_positions))
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), inputs)


def compile_steps_for(cfg: ModelConfig, params: object, kv_cache: object,
                      buckets: Sequence[Bucket], *, page_size: int, max_model_len: int,
                      mesh: Mesh, threads: int = COMPILE_THREADS
                      ) -> list[jax.stages.Compiled | Exception]:
    """Compile the step ahead of time for the devices of `mesh` from specs alone
    (ShapeDtypeStructs: nothing is allocated), e.g. n chips of a TPU topology on a CPU
    machine; one result per bucket, the exception where the compiler refused (out of
    memory, say). Shardings as the Runner's: params by the spec table, KV pages split by
    head, inputs and the packed output replicated (the specs' own shardings are replaced).
    `cfg` is the served model (`sharding.served_config`). Lowering is serial, under the
    mesh (tracing is not thread-safe); compiles run on `threads` threads.
    `cfg.attention_impl` must name the target's kernel: "auto" would read this host's
    default backend."""
    if cfg.attention_impl == "auto":
        raise ValueError("compile_steps_for needs cfg.attention_impl set for the target "
                         "('tpu', 'gpu' or 'reference'), not 'auto'")
    shards = mesh.shape[sharding.MODEL_AXIS]
    if cfg.num_kv_heads % shards:
        raise ValueError(f"cfg.num_kv_heads={cfg.num_kv_heads} must be divisible by the "
                         f"{shards} devices: pass sharding.served_config(cfg, {shards})")
    param_shardings, _, whole = step_shardings(
        cfg, mesh, quantization_lib.mode_of(params),
        quantized_head=quantization_lib.has_quantized_head(params))
    kv_shardings = kv_cache_shardings(mesh, kv_cache)  # float or 8-bit with scales
    params, kv_cache = on_shardings(params, param_shardings), on_shardings(
        kv_cache, kv_shardings)
    steps = {decode: jax.jit(step_function(cfg, decode_only=decode),
                             in_shardings=(param_shardings, kv_shardings, whole),
                             out_shardings=(kv_shardings, whole), donate_argnums=(1,))
             for decode in (False, True)}
    with jax.set_mesh(mesh):
        lowered = [steps[b.decode].lower(params, kv_cache, on_shardings(input_spec(
            b, page_size=page_size, max_model_len=max_model_len), whole)) for b in buckets]

    def compile_one(item: jax.stages.Lowered) -> jax.stages.Compiled | Exception:
        try:
            return item.compile()
        except Exception as err:  # reported per bucket by the caller
            return err

    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        return list(pool.map(compile_one, lowered))


def step_shardings(cfg: ModelConfig, mesh: Mesh, quantization: str | None = None,
                   kv_dtype: str = "float32", quantized_head: bool = True
                   ) -> tuple[object, list, NamedSharding]:
    """(params, KV cache, replicated) shardings of the step on `mesh`, as the Runner's;
    8-bit `kv_dtype` ("int8", "fp8"): each layer's pages and scales split by KV head;
    `quantized_head=False`: a quantized model's LM head kept float."""
    shards = mesh.shape[sharding.MODEL_AXIS]
    specs = quantization_lib.partition_specs(transformer.param_partition_specs(cfg, shards),
                                             quantization, head=quantized_head)
    params = sharding.named(mesh, specs)
    layer = NamedSharding(mesh, KV_PAGES_SPEC)
    if kv_quant.is_quantized(kv_dtype):
        layer = QuantizedPages(layer, NamedSharding(mesh, KV_SCALES_SPEC))
    kv_cache = [layer] * cfg.num_layers
    return params, kv_cache, sharding.replicated(mesh)


def on_shardings(specs: object, shardings: object) -> object:
    """ShapeDtypeStructs `specs` placed on `shardings` (one sharding, or a matching tree)."""
    if isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                           sharding=shardings), specs)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        specs, shardings)
