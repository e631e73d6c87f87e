"""The grouped matmul of a MoE layer on TPU: `jax.lax.ragged_dot` against the Pallas
megablox kernel (`gmm`), both compiled by libtpu for one chip (never run), compared by
the compiler's cost analysis (bytes accessed, flops) and the compiled code's size.

Shapes per chip: one MoE projection of Qwen3-30B-A3B under expert parallelism over 8
chips (16 of its 128 experts, gate/up [16, 1536, 2048] bf16) for a bucket of
`--tokens` tokens with top-8 routing, the choices spread evenly over the experts.

    .venv-tpu/bin/python benchmarks/grouped_matmul_tpu.py [--tokens=512]
"""

from __future__ import annotations

import json

from absl import app, flags

from jaxinfer import aot

aot.tpu_compile_environment()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental.pallas.ops.tpu.megablox import gmm as megablox_gmm  # noqa: E402

from jaxinfer.sizing import accelerators  # noqa: E402

flags.DEFINE_integer("tokens", 512, "tokens in the bucket (x 8 choices)")
flags.DEFINE_list("devices", ["v5e-1", "v6e-1"], "one-chip slices to compile for")
FLAGS = flags.FLAGS
EXPERTS, OUT, IN, TOP_K = 16, 1536, 2048, 8


def _ragged(rows, weights, sizes):
    numbers = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[0])
    return jax.lax.ragged_dot_general(rows, weights, sizes, numbers,
                                      preferred_element_type=jnp.float32)


def _megablox(rows, weights, sizes):
    return megablox_gmm(rows, weights, sizes, preferred_element_type=jnp.float32,
                   transpose_rhs=True)


def _compile(fn, device) -> dict:
    rows = jax.ShapeDtypeStruct((FLAGS.tokens * TOP_K, IN), jnp.bfloat16)
    weights = jax.ShapeDtypeStruct((EXPERTS, OUT, IN), jnp.bfloat16)
    sizes = jax.ShapeDtypeStruct((EXPERTS,), jnp.int32)
    sharding = jax.sharding.SingleDeviceSharding(device)
    compiled = jax.jit(fn, in_shardings=(sharding,) * 3, out_shardings=sharding).lower(
        rows, weights, sizes).compile()
    cost = compiled.cost_analysis() or {}
    cost = cost[0] if isinstance(cost, list) else cost
    memory = compiled.memory_analysis()
    return {"flops": cost.get("flops"), "bytes_accessed": cost.get("bytes accessed"),
            "temp_bytes": getattr(memory, "temp_size_in_bytes", None),
            "hlo_chars": len(compiled.as_text())}


def main(_: list[str]) -> None:
    out = {"tokens": FLAGS.tokens, "experts": EXPERTS, "weight": [OUT, IN], "top_k": TOP_K}
    for name in FLAGS.devices:
        device = aot.target_devices(accelerators.get(name))[0]
        out[name] = {"ragged_dot": _compile(_ragged, device),
                     "megablox_gmm": _compile(_megablox, device)}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    app.run(main)
