"""Choosing a layout: `splits` estimates every DP x PP x TP way of running a model on a
device's chips (DP replicas of PP pipeline stages of TP chips) by the decode roofline,
the tensor-parallel collectives and the stage-to-stage hand-offs, each over the link it
takes (sizing/hosts.py), and `recommend` picks the most tokens/s, keeping a TP group
inside a host where that host's network is slower than the chips' links. See
docs/cli.md#choosing-a-pp-x-tp-x-dp-layout.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

from jaxinfer.config import ModelConfig
from jaxinfer.model import sharding
from jaxinfer.sizing import hosts, pipeline_plan, planner
from jaxinfer.sizing.accelerators import Accelerator, Chip
from jaxinfer.sizing.hosts import Layout, Link
from jaxinfer.sizing.memory_plan import MemoryPlan

ACTIVATION_BYTES = 4  # the row-parallel matmuls accumulate, and XLA reduces, in float32
SHORT = re.compile(r"([\d.]+ GB) short")
BUDGETS = ("memory_bytes", "kv_cache_bytes")  # plan()'s, per device as the CLI gives them


@dataclasses.dataclass(frozen=True, kw_only=True)
class Split:
    """One layout of the device's chips: DP replicas of PP stages of TP chips each, per
    chip and per replica's decode step. A split that does not fit carries only `note`."""

    data_parallel_size: int
    tensor_parallel_size: int
    pipeline_parallel_size: int = 1
    fits: bool
    note: str | None = None  # why it does not fit
    tp_crosses_hosts: bool = False  # some TP group spans hosts
    tp_over_network: bool = False  # ... and its hosts talk over a network (GPU machines)
    stage_boundaries_across_hosts: int = 0  # of a replica's pp - 1
    weight_bytes: int = 0  # on one chip
    kv_cache_bytes: int = 0  # the KV pool of one chip
    batch: int = 0  # requests a replica decodes at once
    microbatches: int = 1  # a step's, pipelined
    kv_read_bytes: int = 0  # KV one chip reads in a step of `batch` requests
    stage_send_bytes: int = 0  # one stage boundary in a step, each chip to its peer
    memory_s: float = 0.0
    compute_s: float = 0.0
    communication_s: float = 0.0  # the TP collectives
    pipeline_s: float = 0.0  # the stage-to-stage hand-offs

    @property
    def step_s(self) -> float:
        return max(self.memory_s, self.compute_s) + self.communication_s + self.pipeline_s

    @property
    def bubble(self) -> float:
        return pipeline_plan.bubble_fraction(self.pipeline_parallel_size, self.microbatches)

    @property
    def tokens_per_s(self) -> float:
        """Tokens/s of every replica together (0 when it does not fit)."""
        return self.data_parallel_size * self.batch / self.step_s if self.fits else 0.0

    def row(self) -> dict[str, object]:
        """The split as one flat row of the plan report."""
        row: dict[str, object] = {"data_parallel_size": self.data_parallel_size,
                                  "pipeline_parallel_size": self.pipeline_parallel_size,
                                  "tensor_parallel_size": self.tensor_parallel_size,
                                  "fits": self.fits}
        if not self.fits:
            return row | {"note": self.note}
        return row | {
            "tp_crosses_hosts": self.tp_crosses_hosts,
            "weight_bytes": self.weight_bytes, "kv_cache_bytes": self.kv_cache_bytes,
            "batch": self.batch, "microbatches": self.microbatches,
            "bubble": round(self.bubble, 3), "kv_read_bytes": self.kv_read_bytes,
            "stage_send_bytes": self.stage_send_bytes,
            "memory_ms": round(self.memory_s * 1e3, 3),
            "communication_ms": round(self.communication_s * 1e3, 3),
            "pipeline_ms": round(self.pipeline_s * 1e3, 3),
            "step_ms": round(self.step_s * 1e3, 3),
            "bound": "memory" if self.memory_s >= self.compute_s else "compute",
            "tokens_per_s": round(self.tokens_per_s), "note": self.note}


def all_reduce_seconds(link: Chip | Link, n: int, nbytes: float) -> float:
    """A ring all-reduce of `nbytes` over n chips: 2(n - 1)/n of them sent at the link's
    ring bandwidth, and 2(n - 1) steps of latency."""
    if n == 1:
        return 0.0
    steps = 2 * (n - 1)
    return (steps / n * nbytes / link.ring_bytes_per_s + link.collective_latency_s
            + steps * link.hop_latency_s)


def all_gather_seconds(link: Chip | Link, n: int, nbytes: float) -> float:
    """A ring all-gather of a result of `nbytes` over n chips: (n - 1)/n of it received,
    n - 1 steps."""
    if n == 1:
        return 0.0
    return ((n - 1) / n * nbytes / link.ring_bytes_per_s + link.collective_latency_s
            + (n - 1) * link.hop_latency_s)


def permute_seconds(link: Chip | Link, nbytes: float) -> float:
    """A collective permute: each chip sends `nbytes` to one peer, one step."""
    return nbytes / link.ring_bytes_per_s + link.collective_latency_s + link.hop_latency_s


def communication_seconds(cfg: ModelConfig, link: Chip | Link, tp: int, batch: int,
                          pp: int = 1, microbatches: int = 1) -> float:
    """The TP collectives of one decode step of `batch` requests over `tp` chips: 2 a
    layer slot over [batch / m, hidden] each of the m + pp - 1 ticks (one tick without
    stages); with the vocabulary split (tp divides it), one more for the embedding lookup
    [batch, hidden] and the logits all-gather [batch, vocab]."""
    if tp == 1:
        return 0.0
    ticks = pipeline_plan.ticks(pp, microbatches)
    micro = -(-batch // microbatches) * cfg.hidden_size * ACTIVATION_BYTES
    slots = pipeline_plan.layer_slots(cfg, pp)
    seconds = ticks * 2 * slots * all_reduce_seconds(link, tp, micro)
    if cfg.vocab_size % tp == 0:
        seconds += (all_reduce_seconds(link, tp, batch * cfg.hidden_size * ACTIVATION_BYTES)
                    + all_gather_seconds(link, tp, batch * cfg.vocab_size * ACTIVATION_BYTES))
    return seconds


def pipeline_seconds(cfg: ModelConfig, acc: Accelerator, layout: Layout, batch: int,
                     microbatches: int) -> float:
    """The stage hand-offs of one decode step: a permute of a microbatch's rows every
    tick (its slowest boundary's link), then the last stage's `batch` rows to every
    stage, pp - 1 permutes one after another (model/pipeline.py)."""
    if layout.pp == 1:
        return 0.0
    boundaries = [hosts.pair_link(acc, layout, s, s + 1) for s in range(layout.pp - 1)]
    slowest = min(boundaries, key=lambda link: link.ring_bytes_per_s)
    tick_bytes = pipeline_plan.microbatch_bytes(cfg, batch, microbatches)
    rows = batch * cfg.hidden_size * ACTIVATION_BYTES
    return (pipeline_plan.ticks(layout.pp, microbatches) * permute_seconds(slowest, tick_bytes)
            + sum(permute_seconds(hosts.pair_link(acc, layout, a, b), rows)
                  for a, b in pipeline_plan.broadcast_hops(layout.pp)))


def tensor_parallel_sizes(cfg: ModelConfig, chips: int, expert_parallel: bool = False
                          ) -> list[int]:
    """The TP sizes that divide `chips` and split the model (`sharding.check_split`;
    whole experts per chip with `expert_parallel`)."""
    sizes = []
    for tp in range(1, chips + 1):
        if chips % tp:
            continue
        try:
            sharding.check_split(cfg, tp, expert_parallel)
        except ValueError:
            continue
        sizes.append(tp)
    return sizes


def stage_budget(plan_kwargs: dict, pp: int) -> dict:
    """`plan_kwargs` with a chip's budget (memory_bytes or kv_cache_bytes, per device as
    the CLI gives them) as plan() takes it for pp stages: the stages' together."""
    return {k: v * pp if k in BUDGETS and v is not None else v
            for k, v in plan_kwargs.items()}


def evaluate(cfg: ModelConfig, acc: Accelerator, tp: int, dp: int | None = None,
             pp: int = 1, pipeline_microbatches: int = 0,
             check_stages: Callable[[int], object] | None = None,
             **plan_kwargs: object) -> Split:
    """The split of DP (default: the rest of the chips) replicas of `pp` stages of `tp`
    chips: the plan of one chip (`planner.plan` with `plan_kwargs`: dtype, budget per
    chip, bandwidth...) and its replica's decode step at max_model_len. `check_stages(pp)`
    raises ValueError where the engine's settings cannot run pp > 1 stages (the CLI's:
    EngineConfig's checks); such a split does not fit, with the reason."""
    dp = dp or acc.chips // (tp * pp)
    layout = Layout(dp=dp, pp=pp, tp=tp)
    try:
        if pp > 1 and check_stages is not None:
            check_stages(pp)
        plan = planner.plan(cfg, tensor_parallel_size=tp, num_devices=dp * pp * tp,
                            pipeline_parallel_size=pp,
                            pipeline_microbatches=pipeline_microbatches,
                            **stage_budget(plan_kwargs, pp))
    except ValueError as err:
        short = SHORT.search(str(err))
        note = f"{short.group(1)} short a chip" if short else str(err)
        return Split(data_parallel_size=dp, tensor_parallel_size=tp,
                     pipeline_parallel_size=pp, fits=False, note=note)
    if plan.bandwidth_gb_per_s is None:
        raise ValueError("a layout needs the chip's HBM bandwidth (bandwidth_gb_per_s)")
    return _split(cfg, acc, layout, plan)


def _split(cfg: ModelConfig, acc: Accelerator, layout: Layout, plan: MemoryPlan) -> Split:
    """A fitting split's figures from its chip's plan."""
    batch = max(1, min(plan.max_num_seqs, plan.max_concurrent_requests))
    context, m = plan.max_model_len, plan.microbatches(batch)
    memory_s, compute_s = plan.decode_seconds(batch, context)
    crosses = hosts.tp_crosses_hosts(acc, layout)
    kv_read = pipeline_plan.ticks(layout.pp, m) * batch / m * context * plan.kv_bytes_per_token
    return Split(data_parallel_size=layout.dp, tensor_parallel_size=layout.tp,
                 pipeline_parallel_size=layout.pp, fits=True, tp_crosses_hosts=crosses,
                 tp_over_network=crosses and acc.network_bytes_per_s is not None,
                 stage_boundaries_across_hosts=hosts.boundaries_crossing_hosts(acc, layout),
                 weight_bytes=plan.weight_bytes, kv_cache_bytes=plan.kv_cache_bytes,
                 batch=batch, microbatches=m, kv_read_bytes=round(kv_read),
                 stage_send_bytes=pipeline_plan.stage_send_bytes(cfg, batch, layout.pp, m),
                 memory_s=memory_s, compute_s=compute_s,
                 communication_s=communication_seconds(
                     cfg, hosts.tp_link(acc, layout), layout.tp, batch, layout.pp, m),
                 pipeline_s=pipeline_seconds(cfg, acc, layout, batch, m))


def splits(cfg: ModelConfig, acc: Accelerator, pipeline_microbatches: int = 0,
           check_stages: Callable[[int], object] | None = None,
           **plan_kwargs: object) -> list[Split]:
    """Every DP x PP x TP = acc.chips with a valid TP, by PP then TP, smallest first. A PP
    the model's layers (or `check_stages`, see `evaluate`) cannot take is listed, not
    fitting, with the reason."""
    expert_parallel = bool(plan_kwargs.get("expert_parallel", False))
    return [evaluate(cfg, acc, tp, pp=pp, pipeline_microbatches=pipeline_microbatches,
                     check_stages=check_stages, **plan_kwargs)
            for pp in range(1, acc.chips + 1) if acc.chips % pp == 0
            for tp in tensor_parallel_sizes(cfg, acc.chips // pp, expert_parallel)]


def recommend(candidates: list[Split]) -> Split | None:
    """The split with the most tokens/s, none whose TP group spans hosts over a network
    when one that keeps TP in a host fits; on a tie the larger DP, then the fewer stages.
    None when none fits."""
    fitting = [s for s in candidates if s.fits]
    if not fitting:
        return None
    in_host = [s for s in fitting if not s.tp_over_network]
    return max(in_host or fitting, key=lambda s: (s.tokens_per_s, s.data_parallel_size,
                                                  -s.pipeline_parallel_size))


def report(candidates: list[Split], chosen: Split | None, acc: Accelerator,
           context: int) -> dict[str, object]:
    """The plan report's `layout` section: the table, the recommendation, the layout
    planned (`chosen`, None: not one of the table's) and the links' figures."""
    best = recommend(candidates)

    def brief(split: Split | None) -> dict[str, object] | None:
        if split is None:
            return None
        return {"data_parallel_size": split.data_parallel_size,
                "pipeline_parallel_size": split.pipeline_parallel_size,
                "tensor_parallel_size": split.tensor_parallel_size, "fits": split.fits,
                "tp_crosses_hosts": split.tp_crosses_hosts,
                "tokens_per_s": round(split.tokens_per_s)}

    between = hosts.host_link(acc) if acc.hosts > 1 else None
    return {"context": context, "chips": acc.chips, "hosts": acc.hosts,
            "host_chips": acc.host_chips or acc.chips,
            "ring_bytes_per_s": acc.chip.ring_bytes_per_s,
            "collective_latency_s": acc.chip.collective_latency_s,
            "hop_latency_s": acc.chip.hop_latency_s,
            "between_hosts": between and between.name,  # None: one host
            "host_link_bytes_per_s": between and between.ring_bytes_per_s,
            "host_link_hop_latency_s": between and between.hop_latency_s,
            "recommended": brief(best), "planned": brief(chosen),
            "splits": [s.row() for s in candidates]}
