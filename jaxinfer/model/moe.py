"""Mixture-of-experts layers (`moe_block`): a float32 router, then only the chosen
experts' weights: gathered for decode-sized buckets, grouped (megablox or ragged dot)
for larger ones, every expert on CPU; experts split whole or sliced over the model axis,
one `psum` per layer, no token dropped; MXFP4 experts decoded from their packed bytes
inside the step. See docs/moe.md (#routing, #expert-computation, #expert-parallelism,
#gpt-oss).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxinfer.config import ModelConfig
from jaxinfer.model import expert_glu, layers, mxfp4, quantization, sharding
from jaxinfer.model.expert_glu import Glu
from jaxinfer.model.quantization import QuantizedWeight

MEGABLOX_MAX_ROWS = 2048  # token choices up to which TPU takes the megablox kernel: it
# read 0.36-0.97x ragged_dot's bytes at 16-256 tokens of 8 choices, 1.28x at 512
# (benchmarks/grouped_matmul_tpu.py, libtpu's cost analysis, v5e and v6e)
EXPERT_MAJOR_TOKENS = 64  # up to this many tokens, the CPU path batches over experts
# (a matmul per expert: 3-4x faster at 4-16 tokens on XLA:CPU); beyond, one dot over
# (expert, column) pairs is faster (16 ms vs 22 at 256 tokens, the bench_moe shape)


def routing_shape(cfg: ModelConfig) -> tuple[int, int]:
    """(MoE layers, experts) of a model's routing counts; (0, 0) for a dense model."""
    if cfg.moe is None:
        return (0, 0)
    return (sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers)), cfg.moe.num_experts)


def route(x: jax.Array, w_router: jax.Array, cfg: ModelConfig,
          bias: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """(weights f32[T, k], experts i32[T, k]) for tokens x f[T, D]: softmax over all
    experts' logits in float32, the top k, renormalised when the family does; or
    (gpt-oss, "topk_softmax") the top k of the logits (plus the router's bias),
    softmaxed over those k."""
    logits = jnp.matmul(x.astype(jnp.float32), w_router.astype(jnp.float32))
    if bias is not None:
        logits = logits + bias.astype(jnp.float32)
    if cfg.moe.routing == "topk_softmax":
        top, experts = jax.lax.top_k(logits, cfg.moe.num_experts_per_tok)
        return jax.nn.softmax(top, axis=-1), experts.astype(jnp.int32)
    probs = jax.nn.softmax(logits, axis=-1)
    weights, experts = jax.lax.top_k(probs, cfg.moe.num_experts_per_tok)
    if cfg.moe.norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def moe_block(layer: dict, x: jax.Array, cfg: ModelConfig, *, expert_parallel: bool = False,
              with_experts: bool = False) -> jax.Array | tuple[jax.Array, jax.Array]:
    """The MoE MLP of x f32[..., D] (already normed) -> f32[..., D], its experts whole
    per device with `expert_parallel` (ModelOptions); `with_experts`: and each token's
    chosen experts i32[T, k]."""
    lead, d = x.shape[:-1], x.shape[-1]
    x = x.reshape(-1, d)
    weights, experts = route(x, layer["w_router"], cfg, layer.get("b_router"))
    gate_up = layer["we_gate_up"]
    if "be_gate_up" in layer:  # per-expert biases [E, 2F] and [E, D] (gpt-oss)
        gate_up = (gate_up, layer["be_gate_up"])
    # MXFP4 experts compute in the model's float dtype, which the router keeps
    y = expert_mlps(x, gate_up, layer["we_down"], weights, experts, cfg, expert_parallel,
                    dtype=layer["w_router"].dtype)
    if "be_down" in layer:  # added once, after the devices' shares are summed
        y = y + jnp.einsum("tk,tkd->td", weights, layer["be_down"][experts].astype(
            jnp.float32))
    if "ws_gate_up" in layer:  # Qwen2-MoE's shared expert, behind a sigmoid gate
        gate = jax.nn.sigmoid(layers.linear(x, layer["w_shared_gate"]))
        y = y + gate * layers.swiglu(x, layer["ws_gate_up"], layer["ws_down"])
    y = y.reshape(*lead, d)
    return (y, experts) if with_experts else y


def expert_counts(experts: jax.Array, num_tokens: jax.Array, num_experts: int
                  ) -> jax.Array:
    """i32[E]: how many of the first `num_tokens` tokens chose each expert (the rest of
    a bucket is padding)."""
    real = (jnp.arange(experts.shape[0]) < num_tokens).astype(jnp.int32)
    return jnp.zeros((num_experts,), jnp.int32).at[experts].add(real[:, None])


def expert_mlps(x: jax.Array, w_gate_up: jax.Array, w_down: jax.Array,
                weights: jax.Array, experts: jax.Array, cfg: ModelConfig,
                expert_parallel: bool = False, dtype: jnp.dtype = jnp.bfloat16
                ) -> jax.Array:
    """sum_k weights[t, k] * expert_{experts[t, k]}(x[t]) -> f32[T, D]; on a mesh, each
    device its experts (`expert_parallel`) or its slice of each, and one psum.
    `w_gate_up` may be a pair (weights, biases [E, 2F]): the bias is added to the
    gate/up outputs. `dtype`: what MXFP4 experts are decoded into and compute in."""
    shards = sharding.model_axis_size()
    glu = expert_glu.glu_of(cfg)
    local = functools.partial(_local_experts, glu=glu, shards=shards,
                              expert_parallel=expert_parallel, dtype=jnp.dtype(dtype))
    if shards == 1:
        return local(x, w_gate_up, w_down, weights, experts)
    axis = sharding.MODEL_AXIS
    if expert_parallel:
        gate_up_spec = down_spec = P(axis, None, None)
    else:
        gate_up_spec, down_spec = P(None, axis, None), P(None, None, axis)
    weight, bias = _with_bias(w_gate_up)
    if quantization.is_quantized(weight):  # scales split as the values (expert_spec)
        gate_up_spec = quantization.expert_spec(gate_up_spec, weight.mode)
        down_spec = quantization.expert_spec(down_spec, w_down.mode)
    if bias is not None:  # [E, 2F] split as the weights' first two axes
        gate_up_spec = (gate_up_spec, P(*(gate_up_spec.value if isinstance(
            gate_up_spec, QuantizedWeight) else gate_up_spec)[:2]))
    mapped = jax.shard_map(local, in_specs=(P(), gate_up_spec, down_spec, P(), P()),
                           out_specs=P(), check_vma=False)
    return mapped(x, w_gate_up, w_down, weights, experts)


def _local_experts(x: jax.Array, w_gate_up: jax.Array, w_down: jax.Array,
                   weights: jax.Array, experts: jax.Array, *, glu: Glu, shards: int,
                   expert_parallel: bool, dtype: jnp.dtype) -> jax.Array:
    """One device's share: its experts [E_local, 2F_local, D], [E_local, D, F_local]."""
    held = _num_experts(w_gate_up)
    if expert_parallel and shards > 1:  # global ids -> this device's, others weigh 0
        first = jax.lax.axis_index(sharding.MODEL_AXIS) * held
        experts = experts - first
        mine = (experts >= 0) & (experts < held)
        weights = jnp.where(mine, weights, 0.0)
        experts = jnp.where(mine, experts, held)  # past the last group: sorted last
    tokens, k = experts.shape
    if tokens * k < held:
        y = _gathered(x, w_gate_up, w_down, weights, experts, glu, dtype)
    else:  # ragged_dot where it is grouped; on CPU its masked form costs k x all experts
        y = jax.lax.platform_dependent(
            x, w_gate_up, w_down, weights, experts,
            cpu=functools.partial(_all_experts, glu=glu, dtype=dtype),
            default=functools.partial(_grouped, glu=glu, dtype=dtype))
    return jax.lax.psum(y, sharding.MODEL_AXIS) if shards > 1 else y


def _num_experts(w: jax.Array | QuantizedWeight | tuple) -> int:
    w, _ = _with_bias(w)
    return (w.value if quantization.is_quantized(w) else w).shape[0]


def _with_bias(w: jax.Array | QuantizedWeight | tuple) -> tuple:
    """(weights, biases or None) of a gate/up argument."""
    return w if isinstance(w, tuple) else (w, None)


def _unpacked(w: jax.Array | QuantizedWeight | tuple, dtype: jnp.dtype
              ) -> jax.Array | QuantizedWeight | tuple:
    """`w` (or its weights of a (weights, biases) pair) with MXFP4 experts decoded whole
    to `dtype`, for the paths that read every held expert; other weights unchanged."""
    weight, bias = _with_bias(w)
    if not (quantization.is_quantized(weight) and weight.mode == mxfp4.MODE):
        return w
    # one expert at a time: the decode's temporaries stay one expert's, not a layer's
    weight = jax.lax.map(lambda packed: mxfp4.decode(*packed, dtype),
                         (weight.value, weight.scale))
    return weight if bias is None else (weight, bias)


def _swiglu_rows(h: jax.Array, glu: Glu | int) -> jax.Array:
    """The activation of gate/up columns interleaved in blocks (model/expert_glu.py)."""
    return expert_glu.gated(h, glu)


def _gathered(x: jax.Array, w_gate_up: jax.Array, w_down: jax.Array, weights: jax.Array,
              experts: jax.Array, glu: Glu, dtype: jnp.dtype = jnp.bfloat16) -> jax.Array:
    """Each token choice gathers its expert's weights: reads T * k experts at most
    (MXFP4: their packed bytes, decoded to `dtype`)."""
    held = _num_experts(w_gate_up)
    tokens, k = experts.shape
    ids = jnp.minimum(experts, held - 1).reshape(-1)  # another device's: any, weight 0
    rows = jnp.repeat(x, k, axis=0)  # [T * k, D], one per choice
    w_gate_up, bias = _with_bias(w_gate_up)
    h = _gathered_dot(rows, w_gate_up, ids, dtype)  # experts' [2F, D] rows, read in order
    if bias is not None:
        h = h + bias[ids].astype(jnp.float32)
    out = _gathered_dot(_swiglu_rows(h, glu), w_down, ids, dtype)
    return jnp.einsum("tkd,tk->td", out.reshape(tokens, k, -1), weights)


def _gathered_dot(rows: jax.Array, w: jax.Array | QuantizedWeight, ids: jax.Array,
                  dtype: jnp.dtype = jnp.bfloat16) -> jax.Array:
    """rows f[n, I], each through its expert ids[n] of w [E, O, I] -> f32[n, O]; MXFP4
    experts: the chosen experts' blocks decoded to `dtype`."""
    if not quantization.is_quantized(w):
        return jnp.einsum("nd,nfd->nf", rows.astype(w.dtype), w[ids],
                          preferred_element_type=jnp.float32)
    if w.mode == mxfp4.MODE:
        chosen = mxfp4.decode(w.value[ids], w.scale[ids], dtype)  # [n, O, I]
        return jnp.einsum("nd,nfd->nf", rows.astype(dtype), chosen,
                          preferred_element_type=jnp.float32)
    value, scale = w.value[ids], w.scale[ids]
    if w.mode == "w8a8":  # int8 x int8 -> int32, as quantization.linear
        xq, x_scale = quantization.quantize_rows(rows)
        y = jnp.einsum("nd,nfd->nf", xq, value, preferred_element_type=jnp.int32)
        return y.astype(jnp.float32) * x_scale * scale
    y = jnp.einsum("nd,nfd->nf", rows.astype(jnp.bfloat16), value.astype(jnp.bfloat16),
                   preferred_element_type=jnp.float32)
    return y * scale


def _grouped(x: jax.Array, w_gate_up: jax.Array, w_down: jax.Array, weights: jax.Array,
             experts: jax.Array, glu: Glu, dtype: jnp.dtype = jnp.bfloat16) -> jax.Array:
    """Token choices sorted by expert, a grouped matmul per projection, scattered back
    weighted. Choices of another device's experts sort last, outside every group
    (ragged_dot leaves those rows zero). MXFP4 experts are decoded to `dtype` first."""
    w_gate_up, w_down = _unpacked(w_gate_up, dtype), _unpacked(w_down, dtype)
    held = _num_experts(w_gate_up)
    tokens, k = experts.shape
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    token_of = order // k
    sizes = jnp.bincount(flat, length=held + 1)[:held].astype(jnp.int32)
    group = jnp.minimum(flat[order], held - 1)  # each sorted row's expert
    dot = _ragged_dot
    if tokens * k <= MEGABLOX_MAX_ROWS:  # on TPU the megablox kernel reads fewer bytes
        def dot(rows, w, sizes, group):  # noqa: ANN001, ANN202 (the same signature)
            return jax.lax.platform_dependent(rows, w, sizes, group, tpu=_megablox_dot,
                                              default=_ragged_dot)
    w_gate_up, bias = _with_bias(w_gate_up)
    h = dot(x[token_of], w_gate_up, sizes, group)  # [T * k, 2F]
    if bias is not None:
        h = h + bias[group].astype(jnp.float32)
    out = dot(_swiglu_rows(h, glu), w_down, sizes, group)
    out = out * weights.reshape(-1)[order][:, None]
    return jnp.zeros((tokens, x.shape[-1]), jnp.float32).at[token_of].add(out)


def _megablox_dot(rows: jax.Array, w: jax.Array | QuantizedWeight, sizes: jax.Array,
                  group: jax.Array, *, interpret: bool = False) -> jax.Array:
    """`_ragged_dot` through the Pallas megablox kernel (`gmm`): rows padded to whole
    row tiles, and rows outside every group (which it leaves unwritten) set to zero."""
    from jax.experimental.pallas.ops.tpu.megablox import gmm

    quantized = quantization.is_quantized(w)
    weights = w.value.astype(jnp.bfloat16) if quantized else w
    m = rows.shape[0]
    tile = min(128, -(-m // 16) * 16)
    padded = jnp.pad(rows.astype(weights.dtype), ((0, -(-m // tile) * tile - m), (0, 0)))
    y = gmm(padded, weights, sizes, preferred_element_type=jnp.float32,
            tiling=(tile, 128, 128), transpose_rhs=True, interpret=interpret)[:m]
    y = jnp.where((jnp.arange(m) < jnp.sum(sizes))[:, None], y, 0.0)
    return y * w.scale[group] if quantized else y


def _ragged_dot(rows: jax.Array, w: jax.Array | QuantizedWeight, sizes: jax.Array,
                group: jax.Array) -> jax.Array:
    """rows [M, I] (sorted by group; `group` i32[M] each one's) times their group's
    weights [G, O, I] -> f32[M, O]. Quantized weights are converted to bfloat16 for the
    grouped matmul (w8a8 too: weight-only here) and their scales applied per row."""
    numbers = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[0])
    quantized = quantization.is_quantized(w)
    weights = w.value.astype(jnp.bfloat16) if quantized else w
    y = jax.lax.ragged_dot_general(rows.astype(weights.dtype), weights, sizes, numbers,
                                   preferred_element_type=jnp.float32)
    return y * w.scale[group] if quantized else y


def _all_experts(x: jax.Array, w_gate_up: jax.Array, w_down: jax.Array, weights: jax.Array,
                 experts: jax.Array, glu: Glu, dtype: jnp.dtype = jnp.bfloat16) -> jax.Array:
    """Every held expert for every token, weighted by the routing (0 where not chosen):
    one batched matmul per projection, for buckets that read every expert anyway
    (MXFP4 experts decoded to `dtype` first)."""
    w_gate_up, w_down = _unpacked(w_gate_up, dtype), _unpacked(w_down, dtype)
    held = _num_experts(w_gate_up)
    rows = jnp.arange(x.shape[0])[:, None]
    full = jnp.zeros((x.shape[0], held + 1), jnp.float32).at[rows, experts].add(weights)
    w_gate_up, bias = _with_bias(w_gate_up)
    bias = jnp.zeros((), jnp.float32) if bias is None else bias.astype(jnp.float32)
    float_weights = not quantization.is_quantized(w_gate_up)
    if x.shape[0] > EXPERT_MAJOR_TOKENS and float_weights:  # one dot over (e, column)
        x = x.astype(w_gate_up.dtype)
        h = jnp.einsum("td,efd->tef", x, w_gate_up, preferred_element_type=jnp.float32)
        hidden = _swiglu_rows(h + bias, glu) * full[:, :held, None]
        return jnp.einsum("tef,edf->td", hidden.astype(w_down.dtype), w_down,
                          preferred_element_type=jnp.float32)
    h = _expert_major_dot(jnp.broadcast_to(x, (held, *x.shape)), w_gate_up)
    h = h + (bias[:, None, :] if bias.ndim else bias)
    hidden = _swiglu_rows(h, glu) * full[:, :held].T[..., None]
    return jnp.sum(_expert_major_dot(hidden, w_down), axis=0)


def _expert_major_dot(x: jax.Array, w: jax.Array | QuantizedWeight) -> jax.Array:
    """x f[E, T, I] through each expert of w [E, O, I] -> f32[E, T, O]."""
    if not quantization.is_quantized(w):
        return jnp.einsum("etd,efd->etf", x.astype(w.dtype), w,
                          preferred_element_type=jnp.float32)
    if w.mode == "w8a8":
        xq, x_scale = quantization.quantize_rows(x)
        y = jnp.einsum("etd,efd->etf", xq, w.value, preferred_element_type=jnp.int32)
        return y.astype(jnp.float32) * x_scale * w.scale[:, None, :]
    y = jnp.einsum("etd,efd->etf", x.astype(jnp.bfloat16), w.value.astype(jnp.bfloat16),
                   preferred_element_type=jnp.float32)
    return y * w.scale[:, None, :]

