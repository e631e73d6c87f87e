"""New weights into a runner's params, with no recompilation (the compiled steps take
params as arguments): leaves (engine/weight_sources.py makes them from a pytree, HF
names or a directory) checked, placed in the runner's shardings on device,
re-quantized for a quantized runner.
See docs/rl.md#updating-weights.
"""

from __future__ import annotations

import functools
import typing

import jax
import numpy as np

from jaxinfer.model import quantization as quantization_lib


def converted(runner: object, leaves: dict) -> dict:
    """`leaves` (leaf_name -> array or QuantizedWeight, from a pytree, HF names or a
    directory: engine/weight_sources.py) checked against the runner's params and
    placed as they are, float ones re-quantized for a quantized runner. Nothing of the
    runner changes; a name or shape that does not match is a ValueError naming it."""
    mode = quantization_lib.mode_of(runner.params)
    if mode is not None:
        leaves = _quantized(leaves, runner, mode)
    return _placed(leaves, runner.params)


def host_bytes(leaves: dict) -> int:
    """Bytes `converted` sends from host: those of leaves not already jax arrays."""
    return sum(x.nbytes for x in jax.tree.leaves(leaves) if not isinstance(x, jax.Array))


def flat_leaves(tree: object) -> dict:
    """A params pytree (whole or in part) as leaf_name -> leaf."""
    return _pytree_leaves(tree)


def apply(runner: object, leaves: dict) -> None:
    """Swap `leaves` (from `converted`) into the runner's params."""
    def pick(path: tuple, old: object) -> object:
        return leaves.get(leaf_name(path), old)
    runner.params = jax.tree_util.tree_map_with_path(
        pick, runner.params, is_leaf=quantization_lib.is_quantized)


def _pytree_leaves(tree: object) -> dict:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree,
                                                   is_leaf=quantization_lib.is_quantized)
    return {leaf_name(path): value for path, value in flat}


def _placed(leaves: dict, params: dict) -> dict:
    """Each leaf checked against the runner's and put in its sharding and dtype: on
    device with a jitted cast (no host round trip), from host with device_put."""
    current = _pytree_leaves(params)
    unknown = sorted(set(leaves) - set(current))
    if unknown:
        raise ValueError(f"unknown params leaf name(s) {unknown[:5]}; the engine's "
                         f"are like {sorted(current)[:3]}")
    out = {}
    for name, value in leaves.items():
        old = current[name]
        if jax.tree.structure(value) != jax.tree.structure(old):
            raise ValueError(f"{name}: {jax.tree.structure(value)} given, the engine "
                             f"holds {jax.tree.structure(old)}")
        for new, have in zip(jax.tree.leaves(value), jax.tree.leaves(old), strict=True):
            if tuple(new.shape) != tuple(have.shape):
                raise ValueError(f"{name}: shape {tuple(new.shape)}, the engine's is "
                                 f"{tuple(have.shape)}")
        out[name] = jax.tree.map(_like, value, old)
    return out


def _like(new: object, old: jax.Array) -> jax.Array:
    if isinstance(new, jax.Array):  # device to device, cast where it lands
        placed = jax.device_put(new, old.sharding)
        if placed.dtype == old.dtype:
            return placed
        return _cast(old.dtype, old.sharding)(placed)
    return jax.device_put(np.asarray(new, dtype=old.dtype), old.sharding)


@functools.lru_cache(maxsize=256)
def _cast(dtype: object, sharding: jax.sharding.Sharding) -> typing.Callable:
    """One jitted cast per (dtype, sharding), kept: the next update reuses it."""
    return jax.jit(lambda x: x.astype(dtype), out_shardings=sharding)


@functools.lru_cache(maxsize=8)
def _quantize(mode: str, head: bool) -> typing.Callable:
    """quantize_params jitted once per mode: later updates of the same shapes reuse it."""
    return jax.jit(functools.partial(quantization_lib.quantize_params, mode=mode, head=head))


def _quantized(leaves: dict, runner: object, mode: str) -> dict:
    """Float leaves re-quantized as the runner's are (a full update: quantize_params
    needs every layer); leaves already quantized kept."""
    floats = {k: v for k, v in leaves.items() if not quantization_lib.is_quantized(v)
              and quantization_lib.is_quantized(_pytree_leaves(runner.params).get(k))}
    if not floats:
        return leaves
    names = set(_pytree_leaves(runner.params))
    if set(leaves) != names and not set(leaves) >= {k for k in names if "layers" in k}:
        raise ValueError(f"a {mode} engine re-quantizes float weights from a full update; "
                         f"{len(names) - len(leaves)} leaves missing")
    tree = _tree_of(leaves, runner.params)
    head = quantization_lib.has_quantized_head(runner.params)
    quantized = _quantize(mode, head)(tree)
    return _pytree_leaves(quantized)


def _tree_of(leaves: dict, params: dict) -> dict:
    """`leaves` (float) arranged as a params pytree shaped like `params`' keys."""
    out = {k: leaves[k] for k in params if k != "layers" and k in leaves}
    out["layers"] = [{k: leaves[f"layers.{i}.{k}"] for k in layer}
                     for i, layer in enumerate(params["layers"])]
    return out


def float_dtype(params: dict) -> str:
    """The dtype float weights are served in (the embedding table's)."""
    return str(params["embed"].dtype)


def mesh_of(params: dict) -> jax.sharding.Mesh:
    return params["embed"].sharding.mesh


def leaf_name(path: tuple) -> str:
    """"layers.3.wqkv" for a JAX key path (checkpoint/names.py's spelling)."""
    return ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
