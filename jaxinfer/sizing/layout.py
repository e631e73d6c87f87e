"""Choosing a layout: `splits` estimates every DP x TP way of running a model on a
device's chips by the decode roofline plus tensor-parallel communication, and
`recommend` picks the most tokens/s. See docs/cli.md#choosing-a-dp-x-tp-layout.
"""

from __future__ import annotations

import dataclasses
import re

from jaxinfer.config import ModelConfig
from jaxinfer.model import sharding
from jaxinfer.sizing import planner
from jaxinfer.sizing.accelerators import Accelerator, Chip

ACTIVATION_BYTES = 4  # the row-parallel matmuls accumulate, and XLA reduces, in float32
SHORT = re.compile(r"([\d.]+ GB) short")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Split:
    """One layout of the device's chips: DP replicas of TP chips each, per chip and per
    replica's decode step. A split that does not fit carries only `note`."""

    data_parallel_size: int
    tensor_parallel_size: int
    fits: bool
    note: str | None = None  # why it does not fit
    weight_bytes: int = 0  # on one chip
    kv_cache_bytes: int = 0  # the KV pool of one chip
    batch: int = 0  # requests a replica decodes at once
    kv_read_bytes: int = 0  # KV one chip reads in a step of `batch` requests
    memory_s: float = 0.0
    compute_s: float = 0.0
    communication_s: float = 0.0

    @property
    def step_s(self) -> float:
        return max(self.memory_s, self.compute_s) + self.communication_s

    @property
    def tokens_per_s(self) -> float:
        """Tokens/s of every replica together (0 when it does not fit)."""
        return self.data_parallel_size * self.batch / self.step_s if self.fits else 0.0

    def row(self) -> dict[str, object]:
        """The split as one flat row of the plan report."""
        row: dict[str, object] = {"data_parallel_size": self.data_parallel_size,
                                  "tensor_parallel_size": self.tensor_parallel_size,
                                  "fits": self.fits}
        if not self.fits:
            return row | {"note": self.note}
        return row | {
            "weight_bytes": self.weight_bytes, "kv_cache_bytes": self.kv_cache_bytes,
            "batch": self.batch, "kv_read_bytes": self.kv_read_bytes,
            "memory_ms": round(self.memory_s * 1e3, 3),
            "communication_ms": round(self.communication_s * 1e3, 3),
            "step_ms": round(self.step_s * 1e3, 3),
            "bound": "memory" if self.memory_s >= self.compute_s else "compute",
            "tokens_per_s": round(self.tokens_per_s), "note": self.note}


def all_reduce_seconds(chip: Chip, n: int, nbytes: float) -> float:
    """A ring all-reduce of `nbytes` over n chips: 2(n - 1)/n of them sent at the chip's
    ring bandwidth, and 2(n - 1) steps of latency."""
    if n == 1:
        return 0.0
    steps = 2 * (n - 1)
    return (steps / n * nbytes / chip.ring_bytes_per_s + chip.collective_latency_s
            + steps * chip.hop_latency_s)


def all_gather_seconds(chip: Chip, n: int, nbytes: float) -> float:
    """A ring all-gather of a result of `nbytes` over n chips: (n - 1)/n of it received,
    n - 1 steps."""
    if n == 1:
        return 0.0
    return ((n - 1) / n * nbytes / chip.ring_bytes_per_s + chip.collective_latency_s
            + (n - 1) * chip.hop_latency_s)


def communication_seconds(cfg: ModelConfig, chip: Chip, tp: int, batch: int) -> float:
    """The collectives of one decode step of `batch` requests over `tp` chips: 2 a layer
    over [batch, hidden]; with the vocabulary split (tp divides it), one more for the
    embedding lookup and the logits all-gather [batch, vocab]."""
    if tp == 1:
        return 0.0
    activations = batch * cfg.hidden_size * ACTIVATION_BYTES
    all_reduces = 2 * cfg.num_layers
    gather = 0.0
    if cfg.vocab_size % tp == 0:
        all_reduces += 1
        gather = all_gather_seconds(chip, tp, batch * cfg.vocab_size * ACTIVATION_BYTES)
    return all_reduces * all_reduce_seconds(chip, tp, activations) + gather


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


def evaluate(cfg: ModelConfig, acc: Accelerator, tp: int, dp: int | None = None,
             **plan_kwargs: object) -> Split:
    """The split of DP (default: the rest of the chips) replicas of `tp` chips: the plan
    of one chip (`planner.plan` with `plan_kwargs`: dtype, budget, bandwidth...) and its
    replica's decode step at max_model_len."""
    dp = dp or acc.chips // tp
    try:
        plan = planner.plan(cfg, tensor_parallel_size=tp, num_devices=dp * tp,
                            **plan_kwargs)
    except ValueError as err:
        short = SHORT.search(str(err))
        note = f"{short.group(1)} short a chip" if short else str(err)
        return Split(data_parallel_size=dp, tensor_parallel_size=tp, fits=False, note=note)
    if plan.bandwidth_gb_per_s is None:
        raise ValueError("a layout needs the chip's HBM bandwidth (bandwidth_gb_per_s)")
    batch = max(1, min(plan.max_num_seqs, plan.max_concurrent_requests))
    context = plan.max_model_len
    memory_s, compute_s = plan.decode_seconds(batch, context)
    return Split(data_parallel_size=dp, tensor_parallel_size=tp, fits=True,
                 weight_bytes=plan.weight_bytes, kv_cache_bytes=plan.kv_cache_bytes,
                 batch=batch, kv_read_bytes=batch * context * plan.kv_bytes_per_token,
                 memory_s=memory_s, compute_s=compute_s,
                 communication_s=communication_seconds(cfg, acc.chip, tp, batch))


def splits(cfg: ModelConfig, acc: Accelerator, **plan_kwargs: object) -> list[Split]:
    """Every DP x TP = acc.chips with a valid TP, smallest TP first."""
    expert_parallel = bool(plan_kwargs.get("expert_parallel", False))
    return [evaluate(cfg, acc, tp, **plan_kwargs)
            for tp in tensor_parallel_sizes(cfg, acc.chips, expert_parallel)]


def recommend(candidates: list[Split]) -> Split | None:
    """The split with the most tokens/s (the larger DP on a tie); None when none fits."""
    fitting = [s for s in candidates if s.fits]
    if not fitting:
        return None
    return max(fitting, key=lambda s: (s.tokens_per_s, s.data_parallel_size))


def report(candidates: list[Split], chosen: Split | None, acc: Accelerator,
           context: int) -> dict[str, object]:
    """The plan report's `layout` section: the table, the recommendation, the layout
    planned (`chosen`, None: not one of the table's) and the communication figures."""
    best = recommend(candidates)

    def brief(split: Split | None) -> dict[str, object] | None:
        if split is None:
            return None
        return {"data_parallel_size": split.data_parallel_size,
                "tensor_parallel_size": split.tensor_parallel_size, "fits": split.fits,
                "tokens_per_s": round(split.tokens_per_s)}

    return {"context": context, "chips": acc.chips,
            "ring_bytes_per_s": acc.chip.ring_bytes_per_s,
            "collective_latency_s": acc.chip.collective_latency_s,
            "hop_latency_s": acc.chip.hop_latency_s,
            "recommended": brief(best), "planned": brief(chosen),
            "splits": [s.row() for s in candidates]}
