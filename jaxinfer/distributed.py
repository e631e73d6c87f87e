"""Multi-host: joining a job with `jax.distributed` (`initialize`), and the few one-off
exchanges of its processes (`check_same`, `broadcast_from_primary`, `is_primary`).
Why every process runs the same engine, and what happens when a host dies:
docs/parallelism.md#multi-host-offline-jobs.
"""

from __future__ import annotations

import hashlib
import logging

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxinfer.config import DistributedConfig

log = logging.getLogger(__name__)


def initialize(cfg: DistributedConfig) -> bool:
    """Join the multi-host job `cfg` names (before anything uses a JAX backend); False,
    doing nothing, when it names none."""
    if not cfg.enabled:
        return False
    addressing = {} if cfg.detect_distributed else dict(
        coordinator_address=cfg.coordinator_address, num_processes=cfg.num_processes,
        process_id=cfg.process_id, cluster_detection_method="deactivate")
    jax.distributed.initialize(**addressing,
                               initialization_timeout=cfg.initialization_timeout_s,
                               heartbeat_timeout_seconds=cfg.heartbeat_timeout_s)
    log.info("process %d of %d: %d local device(s) of %d", jax.process_index(),
             jax.process_count(), jax.local_device_count(), jax.device_count())
    return True


def process_count() -> int:
    """Processes in the job (1: single-host)."""
    return jax.process_count()


def is_primary() -> bool:
    """Whether this process writes the outputs: process 0 (the only one, single-host)."""
    return jax.process_index() == 0


def check_same(what: str, value: str | bytes) -> None:
    """Raise ValueError unless every process passes the same `value` (compared by digest;
    a no-op in one process). Every process must call it at the same point."""
    if jax.process_count() == 1:
        return
    digest = np.frombuffer(hashlib.sha256(
        value.encode() if isinstance(value, str) else value).digest(), np.uint8)
    digests = np.asarray(multihost_utils.process_allgather(digest)).reshape(-1, digest.size)
    differ = [i for i, row in enumerate(digests) if not np.array_equal(row, digests[0])]
    if differ:
        raise ValueError(f"{what} differ between processes: process(es) {differ} disagree "
                         "with process 0; every process must run on the same inputs")


def barrier(name: str) -> None:
    """Wait until every process reaches the barrier `name` (a no-op in one process).
    Every process must call it at the same point."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def broadcast_from_primary(value: str) -> str:
    """Process 0's `value`, on every process (a no-op in one process). Every process
    must call it at the same point."""
    if jax.process_count() == 1:
        return value
    data = np.frombuffer(value.encode(), np.uint8) if is_primary() else np.zeros(0, np.uint8)
    size = int(multihost_utils.broadcast_one_to_all(np.array([data.size], np.int32))[0])
    buffer = np.zeros(max(size, 1), np.uint8)
    buffer[:data.size] = data
    return bytes(np.asarray(multihost_utils.broadcast_one_to_all(buffer))[:size]).decode()
