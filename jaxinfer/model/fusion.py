"""Fused projection weights: one q/k/v matmul (`wqkv`, grouped by KV head) and one
gate/up matmul (`w_gate_up`, blocks of `mlp_block(F)` columns) per layer, fused at load
(`fuse_layer`) and split again to save HF files (`unfuse_layer`), on numpy or jax arrays.
See docs/architecture.md#params-and-the-kv-cache and
docs/parallelism.md#tensor-parallelism.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.model import params_table

MAX_MLP_BLOCK = 128  # gate/up columns per interleaved block, at most
MLP_SHARD_COUNTS = (24, 8, 1)  # block counts preferred, in order: see mlp_block


def mlp_block(intermediate_size: int) -> int:
    """B: the largest divisor of F up to MAX_MLP_BLOCK leaving a block count that is a
    multiple of 24 (so 1, 2, 3, 4, 6 and 8 devices each take whole block pairs), else
    of 8, else any. 128 for Llama-3 8B (112 blocks), 64 for SmolLM-135M (24 blocks),
    74 for Qwen2-7B (256), 112 for Qwen2.5-72B (264). The layout is the same whatever
    the device count, so orbax checkpoints restore onto any valid mesh."""
    f = intermediate_size
    divisors = [b for b in range(1, MAX_MLP_BLOCK + 1) if f % b == 0]
    for count in MLP_SHARD_COUNTS:
        fitting = [b for b in divisors if (f // b) % count == 0]
        if fitting:
            return max(fitting)
    raise AssertionError("unreachable: every count divides by 1")


def _xp(x: object) -> object:
    return np if isinstance(x, np.ndarray) else jnp


def fuse_qkv(q: object, k: object, v: object, cfg: ModelConfig) -> object:
    """[..., N*H], [..., G*H], [..., G*H] -> [..., (N + 2G) * H] grouped by KV head."""
    xp, lead = _xp(q), q.shape[:-1]
    g, h = cfg.num_kv_heads, cfg.head_dim
    parts = [q.reshape(*lead, g, cfg.num_heads // g, h), k.reshape(*lead, g, 1, h),
             v.reshape(*lead, g, 1, h)]
    return xp.concatenate(parts, axis=-2).reshape(*lead, -1)


def split_qkv(qkv: object, cfg: ModelConfig) -> tuple[object, object, object]:
    """The inverse of `fuse_qkv`, as [..., N, H], [..., G, H], [..., G, H]."""
    g, h, r = cfg.num_kv_heads, cfg.head_dim, cfg.num_heads // cfg.num_kv_heads
    grouped = qkv.reshape(*qkv.shape[:-1], g, r + 2, h)
    q = grouped[..., :r, :].reshape(*qkv.shape[:-1], cfg.num_heads, h)
    return q, grouped[..., r, :], grouped[..., r + 1, :]


def fuse_gate_up(gate: object, up: object) -> object:
    """[..., F] twice -> [..., 2F] interleaved in blocks of `mlp_block(F)`."""
    xp, lead, f = _xp(gate), gate.shape[:-1], gate.shape[-1]
    b = mlp_block(f)
    pair = xp.stack([gate.reshape(*lead, f // b, b), up.reshape(*lead, f // b, b)], axis=-2)
    return pair.reshape(*lead, 2 * f)


def split_gate_up(gate_up: object) -> tuple[object, object]:
    """The inverse of `fuse_gate_up`: gate [..., F] and up [..., F]."""
    lead, f = gate_up.shape[:-1], gate_up.shape[-1] // 2
    pair = gate_up.reshape(*lead, f // mlp_block(f), 2, mlp_block(f))
    return pair[..., 0, :].reshape(*lead, f), pair[..., 1, :].reshape(*lead, f)


def fuse_layer(layer: dict, cfg: ModelConfig) -> dict:
    """A layer with HF's separate parts (weights [in, out]) -> the fused layer of the
    params pytree: each fused row of the parameter table built from its parts."""
    out = dict(layer)
    for param in params_table.layer_rows(cfg):
        keys = [part.key for part in param.parts]
        if param.layout in params_table.SWAPPED and keys[0] in out:
            out[param.key] = from_hf_experts(out.pop(keys[0]), param.layout)
        if param.fused and keys[0] in out:
            parts = [out.pop(key) for key in keys]
            if param.layout == "qkv":
                out[param.key] = fuse_qkv(*parts, cfg)
            elif param.layout == "gate_up_rows":  # [..., F, I] twice -> [..., 2F, I]
                gate, up = (x.swapaxes(-1, -2) for x in parts)
                out[param.key] = fuse_gate_up(gate, up).swapaxes(-1, -2)
            else:
                out[param.key] = fuse_gate_up(*parts)
    return out


def unfuse_layer(layer: dict, cfg: ModelConfig) -> dict:
    """The inverse of `fuse_layer`."""
    out = dict(layer)
    for param in params_table.layer_rows(cfg):
        if param.layout in params_table.SWAPPED and param.key in out:
            out[param.parts[0].key] = to_hf_experts(out.pop(param.key), param.layout)
        if param.fused and param.key in out:
            fused = out.pop(param.key)
            if param.layout == "qkv":
                lead = fused.shape[:-1]
                parts = [x.reshape(*lead, -1) for x in split_qkv(fused, cfg)]
            elif param.layout == "gate_up_rows":
                parts = [x.swapaxes(-1, -2) for x in split_gate_up(fused.swapaxes(-1, -2))]
            else:
                parts = split_gate_up(fused)
            out |= {part.key: x for part, x in zip(param.parts, parts, strict=True)}
    return out


def replicate_kv_heads(layer: dict, cfg: ModelConfig, served: ModelConfig) -> dict:
    """A fused layer of `cfg` -> the same layer of `served`, whose KV heads are each of
    cfg's copied served.num_kv_heads / cfg.num_kv_heads times (sharding.served_config):
    query heads keep their order, each KV head's group splits among its copies."""
    replicas = served.num_kv_heads // cfg.num_kv_heads
    out = dict(layer)
    for key in ("wqkv", "bqkv"):
        if key in layer:
            q, k, v = split_qkv(layer[key], cfg)
            xp, lead = _xp(q), q.shape[:-2]
            k, v = (xp.repeat(x, replicas, axis=-2).reshape(*lead, -1) for x in (k, v))
            out[key] = fuse_qkv(q.reshape(*lead, -1), k, v, served)
    return out


def from_hf_experts(x: object, layout: str) -> object:
    """gpt-oss's stacked experts [E, I, O] (or biases [E, O]) -> ours [E, O, I]: gate/up
    de-interleaved (HF's even columns gate, odd up) into blocks for
    "interleaved_gate_up"."""
    if layout == "interleaved_gate_up":
        x = fuse_gate_up(x[..., 0::2], x[..., 1::2])
    return x.swapaxes(-1, -2) if x.ndim == 3 else x


def to_hf_experts(x: object, layout: str) -> object:
    """The inverse of `from_hf_experts`."""
    x = x.swapaxes(-1, -2) if x.ndim == 3 else x
    if layout == "interleaved_gate_up":
        gate, up = split_gate_up(x)
        x = _xp(x).stack([gate, up], axis=-1).reshape(x.shape)
    return x
