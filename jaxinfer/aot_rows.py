"""A compiled step read for `aot`'s report: per-chip memory and cost, Mosaic calls, KV
page shapes and collectives of its HLO, where its inputs live, and how far its
arguments are from the memory plan. See docs/aot.md.
"""

from __future__ import annotations

import re
from typing import Any

import jax

from jaxinfer.engine.core.buckets import Bucket
from jaxinfer.sizing import accelerators, planner

# The entry's 5-D parameters: the KV pages (named kv_cache_* on one chip, param.* under
# SPMD), as one chip holds them.
KV_PARAM = re.compile(r": (\w+\[\d+(?:,\d+){4}\])")
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
               "collective-permute")
# An instruction's opcode (an async pair counted once, at its -start), not its name.
COLLECTIVE_OP = re.compile(r" (" + "|".join(COLLECTIVES) + r")(?:-start)?\(")


def kv_page_shapes(hlo_text: str) -> list[str]:
    """The distinct KV page array types among the compiled entry's parameters."""
    entry = next(line for line in hlo_text.splitlines() if line.startswith("ENTRY"))
    return sorted(set(KV_PARAM.findall(entry.split(") ->")[0])))


def collective_counts(hlo_text: str) -> dict[str, int]:
    """Collective instructions of each kind in compiled HLO text (an async start/done
    pair once)."""
    found = COLLECTIVE_OP.findall(hlo_text)
    return {kind: found.count(kind) for kind in COLLECTIVES}


def bucket_row(compiled: jax.stages.Compiled, acc: accelerators.Accelerator,
               int8: bool = False) -> dict[str, Any]:
    """Memory, cost and roofline estimate of one compiled bucket."""
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list | tuple) else cost
    flops, moved = float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0))
    peak = acc.chip.int8_ops if int8 else acc.chip.bf16_flops
    compute_s, memory_s = flops / peak, moved / acc.chip.hbm_bytes_per_s
    total = (mem.argument_size_in_bytes + mem.output_size_in_bytes
             + mem.temp_size_in_bytes - mem.alias_size_in_bytes)
    return {"argument_bytes": mem.argument_size_in_bytes,
            "output_bytes": mem.output_size_in_bytes,
            "alias_bytes": mem.alias_size_in_bytes, "temp_bytes": mem.temp_size_in_bytes,
            "total_bytes": total,
            "usable_hbm_fraction": round(total / acc.chip.usable_hbm_bytes, 4),
            "flops": flops, "bytes_accessed": moved,
            "roofline_estimate_ms": round(1e3 * max(compute_s, memory_s), 3),
            "bound": "compute" if compute_s > memory_s else "memory"}


def report_row(bucket: Bucket, compiled: jax.stages.Compiled | Exception,
               acc: accelerators.Accelerator, plan: planner.MemoryPlan) -> dict[str, Any]:
    """One bucket's row: per-chip memory and cost, Mosaic calls, KV page shapes and
    collectives of the compiled HLO, the devices its inputs are placed on, and how far
    its arguments are from the plan (weights and pool; weights alone: the arguments
    less the pool, the batch state and inputs being a few KB); or the compiler's message."""
    row: dict[str, Any] = {"tokens": bucket.num_tokens, "slots": bucket.num_slots,
                           "decode": bucket.decode}
    if isinstance(compiled, Exception):  # the compiler's own message, e.g. out of HBM
        return row | {"compiled": False, "error": _first_lines(str(compiled))}
    text = compiled.as_text()
    row |= {"compiled": True} | bucket_row(compiled, acc)
    weights = plan.weight_bytes + plan.lora_bytes  # LoRA slots sit beside the weights
    planned = weights + plan.kv_cache_bytes
    return row | {"mosaic_kernels": text.count("tpu_custom_call"),
                  "kv_pages": kv_page_shapes(text),
                  "collectives": collective_counts(text),
                  "placed_on": placed_on(compiled),
                  "args_vs_plan": round(agreement(planned, row["argument_bytes"]), 5),
                  "weights_vs_plan": round(agreement(
                      weights, row["argument_bytes"] - plan.kv_cache_bytes), 5)}


def placed_on(compiled: jax.stages.Compiled) -> list[int]:
    """The ids of the devices the executable's inputs live on, as it was compiled."""
    shardings = jax.tree.leaves(compiled.input_shardings)
    return sorted({device.id for s in shardings for device in s.device_set})


def _first_lines(message: str, lines: int = 3) -> str:
    return "\n".join(message.strip().splitlines()[:lines])


def agreement(planned: int, compiled: int) -> float:
    """|compiled - planned| / planned."""
    return abs(compiled - planned) / max(planned, 1)
