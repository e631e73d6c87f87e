"""Multi-host: joining a job with `jax.distributed`, and the few one-off exchanges of
its processes.

One process per host owns that host's devices. `initialize(DistributedConfig)` joins
the job, before anything starts a JAX backend: with `coordinator_address`,
`num_processes` and `process_id` given (the CLI's flags), or with `detect_distributed`
(JAX's own detection: Cloud TPU VM slices on GCE or GKE, Slurm, Open MPI); neither: a
single process, nothing is initialized (never implicitly). Afterwards `jax.devices()`
lists every host's devices in JAX's global order, and the tensor-parallel mesh
(sharding.make_mesh) over the first `tensor_parallel_size` of them spans hosts.

Scheduling: every process runs the same engine (scheduler, page pool, request seeds
drawn from EngineConfig.seed) on the same requests, so each computes the same StepPlan
and feeds the same host inputs to the same compiled step, whose packed output is
replicated: each process reads identical tokens from its own devices. Chosen over
process 0 deciding and broadcasting each step's plan because it puts no host-to-host
exchange on the step's critical path and adds no second code path (the single-host
engine is the multi-host one). Its price is that inputs must be identical, and a
mismatch would desynchronize the processes' collectives into a hang or garbage; so
`check_same` compares digests once, at the start: the served model, engine settings
and page pool (loading.py), the batch input file (batch.py), the prompt and sampling
(the CLI's generate). The server, whose requests reach process 0 only, runs the same
engine on every process too: process 0 publishes what it added and aborted before each
step, the others apply it before theirs (jaxinfer/engine/parallel/lockstep.py, over the
coordination service's key-value store: jaxinfer/engine/parallel/channel.py; docs/serving.md,
"Multi-host serving").

Outputs: only process 0 (`is_primary`) writes result files and prints results; the
others run every step and discard them. `broadcast_from_primary` hands process 0's
view of the output file (what a resumed batch skips) to the others. From Python: call
`initialize` before making the `LLM`, make the same calls on every process, and write
only where `is_primary()`.

Failure behaviour (jax 0.10.2's distributed runtime, measured on CPU with two
processes; the timeouts are DistributedConfig's, JAX's defaults): processes that do not
all join within `initialization_timeout_s` (300 s) abort in `initialize`
(DEADLINE_EXCEEDED). Once running, each process heartbeats to the coordinator service in
process 0. A process that dies makes its peers' next collective fail at once (gloo:
"Connection reset by peer", a JaxRuntimeError out of the step), and each peer, exiting,
waits in JAX's shutdown barrier; a host that vanishes without closing its connections
is noticed by heartbeats alone. The coordinator declares a process dead after
`heartbeat_timeout_s` (100 s) without a heartbeat and tells every other process, whose
runtime terminates it ("Terminating process because the JAX distributed service
detected fatal errors", SIGABRT, exit 134): with a 10 s heartbeat the survivor was gone
7 s after `kill -9` of process 1. If the coordinator dies, the others' error polling
fails and they terminate likewise: 0.3 s after `kill -9` of process 0. So a dead host
stops the job with an error within about the heartbeat timeout, never a silent hang
(tests/test_multihost.py kills one mid-run). Not covered for generate and batch: a
process hung while alive keeps heartbeating, and its peers wait in the step's collective
as long as XLA's collective timeouts allow. The server fails a step that runs past
`heartbeat_timeout_s` itself and exits non-zero, as it does when a step raises
(server/__init__.py, engine/parallel/lockstep.py's Watchdog).
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
