"""An encoder's packed step compiled ahead of time for given devices, from specs alone
(nothing allocated): `python -m jaxinfer aot --model=<BERT directory>` compiles it for
one chip of a TPU slice with libtpu's compiler (docs/aot.md, docs/pooling.md#planning).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxinfer.config.encoder import EncoderConfig
from jaxinfer.model import encoder, sharding
from jaxinfer.pooling import encoder_runner, packing


def pick(ladder: list[packing.Bucket], which: str) -> list[packing.Bucket]:
    """"all" buckets, or the "ends" (the smallest and the one of the most tokens)."""
    if which == "all":
        return ladder
    if which not in ("ends", "smallest"):
        raise ValueError(f"buckets={which!r} must be 'all', 'ends' or 'smallest'")
    largest = max(ladder, key=lambda b: (b.num_tokens, b.row_len))
    return ladder[:1] if which == "smallest" else sorted({ladder[0], largest})


def compile_encoder(cfg: EncoderConfig, devices: Sequence[Any], *, dtype: str,
                    max_num_batched_tokens: int, max_model_len: int | None = None,
                    buckets: str = "ends",
                    row: Callable[[jax.stages.Compiled], dict[str, Any]] | None = None
                    ) -> dict[str, Any]:
    """The packed step of each chosen bucket compiled on `devices[0]` (a pooling model
    runs on one device): {"buckets": [{rows, row_len, compiled, ... `row(compiled)`}],
    "fits", "compile_s"}; the compiler's message where it refused a bucket."""
    mesh = sharding.make_mesh(1, list(devices)[:1])
    whole = sharding.replicated(mesh)
    params = jax.tree.map(lambda shape: jax.ShapeDtypeStruct(shape, jnp.dtype(dtype),
                                                             sharding=whole),
                          encoder.param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))
    step = jax.jit(encoder_runner.step_function(cfg, all_tokens=False))
    ladder = packing.buckets(min(max_model_len or cfg.max_len, cfg.max_len),
                             max_num_batched_tokens)
    began, rows = time.perf_counter(), []
    for bucket in pick(ladder, buckets):
        spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=whole),
                            encoder_runner.input_spec(bucket))
        entry: dict[str, Any] = {"rows": bucket.rows, "row_len": bucket.row_len,
                                 "tokens": bucket.num_tokens}
        try:
            with jax.set_mesh(mesh):
                compiled = step.lower(params, spec).compile()
        except Exception as err:  # the compiler's refusal, reported per bucket
            rows.append(entry | {"compiled": False, "error": str(err).splitlines()[0]})
            continue
        rows.append(entry | {"compiled": True} | (row(compiled) if row else {}))
    return {"kind": "encoder", "buckets": rows,
            "fits": all(r["compiled"] for r in rows),
            "compile_s": round(time.perf_counter() - began, 1)}
