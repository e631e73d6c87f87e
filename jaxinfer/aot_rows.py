"""A compiled step read for `aot`'s report: per-chip memory and cost, Mosaic calls, KV
page shapes and collectives of its HLO (their replica groups, and with pipeline stages
what crosses the stage axis), where its inputs live, and how far its arguments are from
the memory plan. See docs/aot.md.
"""

from __future__ import annotations

import re
from typing import Any

import jax
import numpy as np

from jaxinfer.engine.core.buckets import Bucket
from jaxinfer.sizing import accelerators, planner

# The entry's 5-D parameters: the KV pages (named kv_cache_* on one chip, param.* under
# SPMD), as one chip holds them.
KV_PARAM = re.compile(r": (\w+\[\d+(?:,\d+){4}\])")
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
               "collective-permute")
# An instruction's opcode (an async pair counted once, at its -start), not its name.
COLLECTIVE_OP = re.compile(r" (" + "|".join(COLLECTIVES) + r")(?:-start)?\(")


# The replica groups of an HLO collective, in any of three forms: explicit
# {{0,1},{2,3}}; iota [groups, size]<=[dims]T(perm) (device ids arange(prod(dims))
# reshaped to dims, transposed by perm, cut into rows); or over a mesh,
# mesh['a'=4,'b'=2], device_ids=([dims]T(perm)) {'a'} (the ids laid on the mesh, one
# group per point of the axes not named).
EXPLICIT = re.compile(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}")
IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(\[([\d,]+)\]"
                  r"(?:T\(([\d,]+)\))?\))? \{([^}]*)\}")
# A collective-permute: its (first) result shape, then its source -> target pairs.
PERMUTE_SHAPE = re.compile(r"= \(?(\w+)\[([\d,]*)\]")
PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2,
               "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8,
               "f64": 8}


def _iota(dims: str, perm: str | None) -> np.ndarray:
    shape = [int(d) for d in dims.split(",")]
    ids = np.arange(np.prod(shape)).reshape(shape)
    return ids.transpose([int(p) for p in perm.split(",")]) if perm else ids


def replica_groups(line: str, num_devices: int | None = None) -> list[list[int]]:
    """The groups of device ids (the mesh's order: logical ids, not the chips' own) of
    one collective's HLO line; `replica_groups={}` is every one of `num_devices`."""
    if "replica_groups={}" in line:
        if num_devices is None:
            raise ValueError(f"replica_groups={{}} (all devices) needs num_devices: {line}")
        return [list(range(num_devices))]
    if match := EXPLICIT.search(line):
        return [[int(i) for i in g.split(",") if i] for g in
                re.findall(r"\{([\d,]*)\}", match.group(1))]
    if match := IOTA.search(line):
        return _iota(match.group(3), match.group(4)).reshape(
            int(match.group(1)), int(match.group(2))).tolist()
    match = MESH.search(line)
    if match is None:
        raise ValueError(f"no replica groups read in: {line}")
    axes = re.findall(r"'(\w+)'=(\d+)", match.group(1))
    sizes = [int(size) for _, size in axes]
    ids = (_iota(match.group(2), match.group(3)) if match.group(2)
           else np.arange(np.prod(sizes))).reshape(sizes)
    grouped = [i for i, (name, _) in enumerate(axes) if f"'{name}'" in match.group(4)]
    rest = [i for i in range(len(axes)) if i not in grouped]
    size = int(np.prod([sizes[i] for i in grouped]))
    return ids.transpose(rest + grouped).reshape(-1, size).tolist()


def collective_permutes(hlo_text: str) -> list[dict[str, Any]]:
    """Each collective-permute of compiled HLO text (an async pair once): its operand's
    type ("f32[8,8192]"), bytes (what each source device sends) and (source, target)
    pairs of logical device ids."""
    found = []
    for line in hlo_text.splitlines():
        match = COLLECTIVE_OP.search(line)
        if match is None or match.group(1) != "collective-permute":
            continue
        dtype, dims = PERMUTE_SHAPE.search(line).groups()
        elements = int(np.prod([int(d) for d in dims.split(",") if d]))
        pairs = re.findall(r"\{(\d+),(\d+)\}", PAIRS.search(line).group(1))
        found.append({"shape": f"{dtype}[{dims}]", "bytes": elements * DTYPE_BYTES[dtype],
                      "pairs": [(int(a), int(b)) for a, b in pairs]})
    return found


def stage_traffic(hlo_text: str, chips_per_stage: int, stages: int) -> dict[str, Any]:
    """What crosses the stage axis of a pipelined step's HLO over `stages` x
    `chips_per_stage` devices, stage-major (logical id // chips_per_stage is the
    stage): the collective permutes (count and
    bytes sent by a device, all and those between stages, the crossing ones' types), and
    the other collectives whose groups span stages, by kind (none expected: tensor
    parallelism's all-reduces and gathers stay within a stage)."""
    permutes = collective_permutes(hlo_text)
    crossing = [p for p in permutes if any(a // chips_per_stage != b // chips_per_stage
                                           for a, b in p["pairs"])]
    spanning = dict.fromkeys(COLLECTIVES[:-1], 0)
    for line in hlo_text.splitlines():
        match = COLLECTIVE_OP.search(line)
        if match is None or match.group(1) == "collective-permute":
            continue
        groups = replica_groups(line, num_devices=stages * chips_per_stage)
        if any(len({d // chips_per_stage for d in group}) > 1 for group in groups):
            spanning[match.group(1)] += 1
    return {"collective_permutes": len(permutes),
            "collective_permute_bytes": sum(p["bytes"] for p in permutes),
            "cross_stage_permutes": len(crossing),
            "cross_stage_permute_bytes": sum(p["bytes"] for p in crossing),
            "cross_stage_permute_shapes": sorted({p["shape"] for p in crossing}),
            "cross_stage_collectives": spanning}


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
