"""Ahead-of-time compilation of the engine's step for a TPU slice, from any machine.

`compile_report(cfg, device="v5e-8", ...)` says whether a model and engine settings fit
and compile on a TPU slice, with libtpu's compiler on the host: compiled, never run.
How it plans, shards and reports: docs/aot.md.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxinfer.aot_rows import report_row, stage_traffic
from jaxinfer.config import ModelConfig, ModelOptions
from jaxinfer.config.lora import LoraSlots
from jaxinfer.engine import runner
from jaxinfer.engine.core.buckets import Bucket, BucketSet
from jaxinfer.model import lora as lora_lib
from jaxinfer.model import pipeline, quantization, sharding
from jaxinfer.model.attention import kv_cache_spec
from jaxinfer.model.params_table import param_shapes
from jaxinfer.pallas import AttentionSettings
from jaxinfer.sizing import accelerators, planner

INSTALL_HINT = ("pip install 'jaxinfer[tpu-aot]' (jax[tpu] and libtpu, about 700 MB), or in "
                "a checkout `make .venv-tpu/.base` and run .venv-tpu/bin/python -m jaxinfer "
                "aot ...")


class TpuCompilerMissing(OSError):
    """libtpu is not installed in this Python. An OSError, as a missing system library
    is: the command line reports it in one line (exit 1), not as a traceback."""


def require_tpu_compiler() -> None:
    """Raise TpuCompilerMissing, saying how to install it, where JAX would find no
    libtpu (neither the libtpu package nor TPU_LIBRARY_PATH)."""
    if os.environ.get("TPU_LIBRARY_PATH") or importlib.util.find_spec("libtpu"):
        return
    raise TpuCompilerMissing(f"libtpu's TPU compiler is not installed in this Python "
                             f"({sys.executable}): {INSTALL_HINT}")


def tpu_compile_environment() -> None:
    """Settings libtpu's compiler needs on a machine without a TPU; call before JAX
    starts a backend. It leaves the CPU as JAX's default platform. Several processes may
    compile at once (a CI run beside a developer's): no chip is opened, so libtpu's
    one-process lockfile (/tmp/libtpu_lockfile) is not taken.

    Without the metadata server (TPU_SKIP_MDS_QUERY) libtpu takes a placeholder warning
    text for this host's worker hostnames and accelerator type, and prints an
    `INVALID_ARGUMENT ... unexpected worker hostname` error and a `Failed to find host
    bounds` line as it loads, before its log levels (TPU_STDERR_LOG_LEVEL,
    TPU_MIN_LOG_LEVEL) apply. Naming this host's values (one worker, one chip's bounds)
    prevents them; the topologies compiled for are given explicitly (target_devices), so
    they and the compiled programs are the same either way (docs/aot.md)."""
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_HOST_BOUNDS", "1,1,1")
    jax.config.update("jax_platforms", "cpu")


def target_devices(acc: accelerators.Accelerator) -> list[Any]:
    """The abstract devices of the slice (libtpu's topology description)."""
    from jax.experimental import topologies

    kwargs = {}
    if acc.chips_per_host is not None:
        kwargs["chips_per_host_bounds"] = list(acc.chips_per_host)
    try:
        topo = topologies.get_topology_desc(platform="tpu", topology_name=acc.topology,
                                            **kwargs)
    except RuntimeError as err:  # JAX's "TPU support not installed"
        if "not installed" not in str(err):
            raise
        raise TpuCompilerMissing(f"JAX finds no libtpu: {INSTALL_HINT}") from err
    return list(topo.devices)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Settings:
    """The engine settings that shape the compiled step (mirror of the CLI flags)."""

    dtype: str = "bfloat16"
    kv_dtype: str = "bfloat16"
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    max_model_len: int = 2048
    page_size: int = 16
    kv_cache_memory_bytes: int | None = None  # default: as the engine sizes its pool
    gpu_memory_utilization: float = 0.9  # EngineConfig's: weights plus pool per chip
    tensor_parallel_size: int | None = None  # None: the slice's chips if the model splits
    data_parallel_size: int | None = None  # None: one replica; else replicas of TP chips
    quantization: str | None = None  # EngineConfig.quantization: the linear weights' mode
    quantized_head: bool = True  # False: the LM head stays float (checkpoint.quantized_head)
    hybrid_kv_cache: bool = True  # not EngineConfig.disable_hybrid_kv_cache_manager: a
    # model whose layers differ in attention compiles with a KV page group per kind
    expert_parallel: bool = False  # EngineConfig.enable_expert_parallel: whole experts a chip
    lora: LoraSlots | None = None  # EngineConfig.lora_slots: adapter slots beside the weights
    pipeline_parallel_size: int = 1  # stages of TP chips each, the layers split among them
    pipeline_microbatches: int = 0  # EngineConfig's: a pipelined step's (0: one per stage)


def choose_tensor_parallel(cfg: ModelConfig, acc: accelerators.Accelerator, s: Settings
                           ) -> tuple[int, str | None]:
    """(chips to split the step over, why fewer than the slice's, or None). A size given
    must split the model and fit the slice (ValueError); by default every chip of the
    slice when the model splits over them, else 1."""
    if s.tensor_parallel_size is not None:
        sharding.validate(cfg, s.tensor_parallel_size, acc.chips, s.expert_parallel)
        return s.tensor_parallel_size, None
    try:
        sharding.check_split(cfg, acc.chips, s.expert_parallel)
    except ValueError as err:
        return 1, f"one chip: the model does not split over the slice's {acc.chips}: {err}"
    return acc.chips, None


def choose_layout(cfg: ModelConfig, acc: accelerators.Accelerator, s: Settings
                  ) -> tuple[int, int, str | None]:
    """(tensor_parallel_size, data_parallel_size, why TP uses fewer chips or None). With
    no data_parallel_size, one replica (`choose_tensor_parallel`; with stages, TP is the
    given size or the slice's chips over the stages); with one, TP is the given size or
    the slice's chips over the replicas and stages, and the chips of every replica's
    stages must fit the slice (ValueError)."""
    dp, pp = s.data_parallel_size, s.pipeline_parallel_size
    if pp < 1:
        raise ValueError(f"pipeline_parallel_size={pp} must be >= 1")
    if dp is None and pp == 1:
        tp, why = choose_tensor_parallel(cfg, acc, s)
        return tp, 1, why
    if dp is not None and dp < 1:
        raise ValueError(f"data_parallel_size={dp} must be >= 1")
    groups = (dp or 1) * pp  # replicas x stages, each of TP chips
    tp = s.tensor_parallel_size
    if tp is None:
        if acc.chips % groups:
            sizes = [f"data_parallel_size={dp}"] * (dp is not None) + [
                f"pipeline_parallel_size={pp}"] * (pp > 1)
            raise ValueError(f"{' x '.join(sizes)} must divide the slice's {acc.chips} chips "
                             "(or give tensor_parallel_size)")
        tp = acc.chips // groups
    sharding.check_split(cfg, tp, s.expert_parallel)
    if groups * tp > acc.chips:
        stages = f" x pipeline_parallel_size={pp}" if pp > 1 else ""
        raise ValueError(f"data_parallel_size={dp or 1}{stages} x tensor_parallel_size={tp} "
                         f"needs {groups * tp} chips; {acc.name} has {acc.chips}")
    return tp, dp or 1, None


def layout_name(tp: int, dp: int, pp: int) -> str:
    """"DP 2 x TP 4", or with stages "DP 1 x PP 2 x TP 8"."""
    return f"DP {dp} x PP {pp} x TP {tp}" if pp > 1 else f"DP {dp} x TP {tp}"


def replicas_to_compile(dp: int) -> list[int]:
    """Replica 0 and the last: every replica runs the same program on its own chips, so
    the two ends show the placement (chips [r * TP, (r + 1) * TP))."""
    return sorted({0, dp - 1})


def plan_for(cfg: ModelConfig, acc: accelerators.Accelerator, s: Settings,
             tensor_parallel_size: int = 1) -> planner.MemoryPlan:
    """The memory plan on each chip of `acc` at `tensor_parallel_size` (raises ValueError
    when nothing fits): the engine's rule, weights plus pool within
    `gpu_memory_utilization` of the usable HBM. With pipeline stages, a chip of one
    stage: its layer slots, the embedding and head, its stage's pool (a chip's budget,
    as `plan` takes --kv_cache_memory_bytes too)."""
    common = dict(dtype=s.dtype, kv_dtype=s.kv_dtype, max_model_len=s.max_model_len,
                  max_num_seqs=s.max_num_seqs, page_size=s.page_size,
                  bandwidth_gb_per_s=acc.chip.hbm_bytes_per_s / 1e9,
                  tensor_parallel_size=tensor_parallel_size, quantization=s.quantization,
                  quantized_head=s.quantized_head, hybrid_kv_cache=s.hybrid_kv_cache,
                  expert_parallel=s.expert_parallel, lora=s.lora)
    pp = s.pipeline_parallel_size  # plan() takes the stages' budgets together; here a chip's
    if pp > 1:
        common |= dict(pipeline_parallel_size=pp, pipeline_microbatches=s.pipeline_microbatches)
    if s.kv_cache_memory_bytes is not None:
        return planner.plan(cfg, kv_cache_bytes=s.kv_cache_memory_bytes * pp, **common)
    budget = int(acc.chip.usable_hbm_bytes * s.gpu_memory_utilization)
    return planner.plan(cfg, memory_bytes=budget * pp, **common)


def model_options(s: Settings, feature_layers: tuple[int, ...] = ()) -> ModelOptions:
    """The options the engine runs the model with under `s`, keeping `feature_layers`
    for speculative heads."""
    return ModelOptions(expert_parallel=s.expert_parallel, feature_layers=feature_layers,
                        lora=s.lora, pipeline_stages=s.pipeline_parallel_size,
                        pipeline_microbatches=s.pipeline_microbatches)


def step_specs(served: ModelConfig, plan: planner.MemoryPlan, s: Settings, shards: int,
               feature_layers: tuple[int, ...] = ()) -> tuple[Any, Any]:
    """(params, kv_cache) of the served model as whole-array ShapeDtypeStructs in the
    TPU's storage dtypes; the KV pages hold each of `shards` chips' pool of each page
    group's pages (compile_steps_for places them on the mesh), then the feature store
    of `feature_layers` if any. With pipeline stages, the layers and their pages by slot,
    stacked [stages, ...] (model/pipeline.py), each stage's pool the plan's."""
    params = jax.tree.map(lambda shape: jax.ShapeDtypeStruct(shape, jnp.dtype(s.dtype)),
                          param_shapes(served), is_leaf=lambda x: isinstance(x, tuple))
    if s.quantization is not None:  # the quantized pytree's specs, as the Runner holds it
        params = jax.eval_shape(functools.partial(
            quantization.quantize_params, mode=s.quantization, head=s.quantized_head), params)
    if s.lora is not None:
        params = {**params, "lora": lora_lib.shapes(served, s.lora)}
    kv = kv_cache_spec(served, num_pages=[group.num_pages for group in plan.page_groups],
                       page_size=s.page_size, dtype=s.kv_dtype, backend="tpu", shards=shards,
                       group_windows=group_windows(plan),
                       feature_size=model_options(s, feature_layers).feature_size(served))
    stages = s.pipeline_parallel_size
    if stages > 1:
        params = {**params, "layers": pipeline.stack_layers(params["layers"], stages)}
        kv = pipeline.stack_layers(kv, stages)
    return params, kv


def compile_buckets(served: ModelConfig, params: Any, kv: Any, buckets: list[Bucket],
                    s: Settings, mesh: jax.sharding.Mesh,
                    group_windows: tuple[int | None, ...] = (None,),
                    feature_layers: tuple[int, ...] = (),
                    on_compiled: Callable[[int, Any], None] | None = None
                    ) -> list[jax.stages.Compiled | Exception]:
    """Each bucket's step compiled for the chips of `mesh` with the Mosaic attention
    kernel (the compiler's exception in place of a bucket it refused); `group_windows`:
    the KV page groups of `kv` (the plan's, `group_windows(plan)`); `feature_layers`:
    the features `kv`'s store keeps (step_specs); `on_compiled(i, result)` as bucket i
    is done."""
    # One compile at a time: libtpu's compiler crashed (SIGSEGV) with two TPU compiles
    # running in one process, once in four runs of the TPU compile suite.
    return runner.compile_steps_for(served, params, kv, buckets, page_size=s.page_size,
                                    max_model_len=s.max_model_len, mesh=mesh,
                                    attention=AttentionSettings(impl="tpu"), threads=1,
                                    group_windows=group_windows,
                                    options=model_options(s, feature_layers),
                                    on_compiled=on_compiled)


def group_windows(plan: planner.MemoryPlan) -> tuple[int | None, ...]:
    """The window of each KV page group's layers (model/attention.py, `page_group`)."""
    return tuple(group.window for group in plan.page_groups)


def pick_buckets(buckets: BucketSet, which: str | Sequence[Bucket]) -> list[Bucket]:
    """"all", "ends" (the smallest decode bucket, the largest bucket, and one mixed
    bucket in between), "smallest" (the smallest decode bucket: placement and the
    weights' memory at the least compile time), or the buckets given."""
    if not isinstance(which, str):
        return list(which)
    every = buckets.all()
    if which == "all":
        return every
    if which == "smallest":
        return every[:1]
    if which != "ends":
        raise ValueError(f"buckets={which!r} must be 'all', 'ends' or 'smallest'")
    mixed = [b for b in every if b.num_slots > 1 and b.num_tokens > b.num_slots]
    middle = mixed[len(mixed) // 2] if mixed else every[len(every) // 2]
    return sorted({every[0], middle, every[-1]})


def compile_report(cfg: ModelConfig, *, device: str | accelerators.Accelerator,
                   settings: Settings, buckets: str | Sequence[Bucket] = "all",
                   progress: Callable[[dict[str, Any]], None] | None = None
                   ) -> dict[str, Any]:
    """Compile every (or the `ends`) bucket's step for the `pipeline_parallel_size` x
    `tensor_parallel_size` chips of a replica of `device` (a slice's name, or its
    Accelerator), for replica 0 and the last of `data_parallel_size` (each on its own
    chips); a dict with the plan per chip, the layout, one row per bucket and replica
    (per-chip memory, cost, collectives, with stages what crosses them, the devices the
    executable was compiled for), and the compiler's message for buckets that failed.
    `buckets`: a choice of `pick_buckets`, or the buckets; "buckets": replica 0's rows.
    `progress(event)`, if given, hears of the work as it goes (`progress_events`)."""
    acc = device if isinstance(device, accelerators.Accelerator) else accelerators.get(device)
    tp, dp, why = choose_layout(cfg, acc, settings)
    pp = settings.pipeline_parallel_size
    report: dict[str, Any] = {
        "device": acc.name, "topology": acc.topology, "chips_in_slice": acc.chips,
        "chips_used": tp * pp * dp, "tensor_parallel_size": tp, "data_parallel_size": dp,
        "pipeline_parallel_size": pp, "layout": layout_name(tp, dp, pp),
        "tensor_parallel_note": why, "chip_hbm_bytes": acc.chip.hbm_bytes,
        "chip_usable_hbm_bytes": acc.chip.usable_hbm_bytes,
        "peak_bf16_flops": acc.chip.bf16_flops, "hbm_bytes_per_s": acc.chip.hbm_bytes_per_s,
        "settings": dataclasses.asdict(settings) | {"tensor_parallel_size": tp,
                                                    "data_parallel_size": dp}}
    try:  # the planner also refuses stages that cannot run one program
        plan = plan_for(cfg, acc, settings, tp)
    except ValueError as err:
        return report | {"fits": False, "error": str(err)}
    report["plan"] = plan.summary()
    chosen = pick_buckets(BucketSet(max_num_batched_tokens=settings.max_num_batched_tokens,
                                    max_num_seqs=settings.max_num_seqs), buckets)
    layout = sharding.layout_mesh(dp, tp, target_devices(acc), pipeline_parallel_size=pp)
    began = time.perf_counter()
    events = progress_events(progress, report, chosen, replicas_to_compile(dp))
    report["replicas"] = [compile_replica(cfg, acc, plan, settings, chosen, layout, replica,
                                          functools.partial(events, replica))
                          for replica in replicas_to_compile(dp)]
    report["compile_s"] = round(time.perf_counter() - began, 1)
    report["buckets"] = report["replicas"][0]["buckets"]
    report["fits"] = all(r["compiled"] for rep in report["replicas"] for r in rep["buckets"])
    report["planned_argument_bytes"] = plan.weight_bytes + plan.lora_bytes + plan.kv_cache_bytes
    return report


def compile_replica(cfg: ModelConfig, acc: accelerators.Accelerator, plan: planner.MemoryPlan,
                    s: Settings, chosen: list[Bucket], layout: jax.sharding.Mesh,
                    replica: int, on_compiled: Callable[[int, Any], None]) -> dict[str, Any]:
    """Replica `replica`'s part of the report: its chips (its row of `layout`, stages in
    order), the devices compiled for, and a row per bucket of `chosen`; with pipeline
    stages each row also says what crosses the stage axis (aot_rows.stage_traffic)."""
    mesh = sharding.replica_mesh(layout, replica)
    tp, pp = mesh.shape[sharding.MODEL_AXIS], s.pipeline_parallel_size
    served = sharding.served_config(cfg, tp)
    params, kv = step_specs(served, plan, s, tp)
    results = compile_buckets(served, params, kv, chosen, s, mesh,
                              group_windows=group_windows(plan), on_compiled=on_compiled)
    rows = []
    for bucket, compiled in zip(chosen, results, strict=True):
        row = report_row(bucket, compiled, acc, plan)
        if pp > 1 and row["compiled"]:
            row |= stage_traffic(compiled.as_text(), tp, pp)
        rows.append(row)
    first = replica * tp * pp
    return {"replica": replica, "chips": list(range(first, first + tp * pp)),
            "device_ids": [d.id for d in mesh.devices.flat], "buckets": rows}


def progress_events(progress: Callable[[dict[str, Any]], None] | None,
                    report: dict[str, Any], chosen: list[Bucket], replicas: list[int]
                    ) -> Callable[[int, int, Any], None]:
    """Tell `progress` what is to be compiled (an event with "stage": "start": the
    layout and the count of compiles), then return the callback that tells it of each
    bucket as its compile ends ("stage": "bucket": its number of the count, shape,
    whether it compiled, and seconds for it (lowering and compile) and so far)."""
    total, began = len(chosen) * len(replicas), time.perf_counter()
    last = [began]
    if progress is not None:
        progress({"stage": "start", "device": report["device"], "layout": report["layout"],
                  "buckets": len(chosen), "replicas": replicas, "total": total})

    def on_compiled(replica: int, i: int, result: Any) -> None:
        now = time.perf_counter()
        if progress is not None:
            bucket = chosen[i]
            progress({"stage": "bucket", "replica": replica, "replicas": replicas,
                      "number": replicas.index(replica) * len(chosen) + i + 1,
                      "total": total, "tokens": bucket.num_tokens,
                      "slots": bucket.num_slots, "decode": bucket.decode,
                      "compiled": not isinstance(result, Exception),
                      "seconds": now - last[0], "elapsed_s": now - began})
        last[0] = now

    return on_compiled
