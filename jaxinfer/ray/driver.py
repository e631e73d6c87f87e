"""`run_ray`: the batch runner over Ray Data replicas; the driver reads the input and
output as the single-process runner does and writes the one JSONL output itself.
See docs/batch.md#ray-data.
"""

from __future__ import annotations

import json
import logging
import math
import os
import pathlib
import time

import ray
import ray.data

from jaxinfer.batch import (
    Request,
    check_formats,
    check_paths,
    drop_errors,
    finished,
    read_requests,
    record_key,
    tally,
    write,
)
from jaxinfer.config import DEFAULT_MODEL, EngineConfig
from jaxinfer.ray.replica import Replica

log = logging.getLogger(__name__)
ACCELERATORS = ("cpu", "gpu", "tpu")


def _drop_retried(done: object, output_path: str | os.PathLike) -> None:
    """Drop the error records of requests run again (retry_errors=True)."""
    if done.retrying:
        log.warning("retrying %d requests that ended in an error (retry_errors=False "
                    "keeps their error records)", done.retrying)
        drop_errors(output_path)


def _initial_counts(done: object, requests: object) -> dict:
    """The summary's counters before any result comes back."""
    return {"done": 0, "errors": 0, "kept_errors": done.kept_errors,
            "skipped": requests.skipped, "retried": done.retrying, "missing": 0,
            "prompt_tokens": 0, "completion_tokens": 0, "first_result_s": None}


def run_ray(input_path: str | os.PathLike, output_path: str | os.PathLike, *,
            num_replicas: int = 1, ray_address: str | None = None,
            model: str | os.PathLike | None = None, batch_size: int | None = None,
            retry_errors: bool = True, accelerator: str | None = None,
            num_cpus_per_replica: float = 1, progress: bool = True,
            **engine_settings: object) -> dict:
    """Run every request of `input_path` not yet in `output_path` on `num_replicas`
    engines (Ray actors), each made from `model` and `engine_settings` (EngineConfig
    fields; data_parallel_size x tensor_parallel_size devices per replica); returns a
    summary.

    `model`: default the bundled demo model. `ray_address`: the cluster to join
    (default: the one this process is connected to, else a new local one, shut down at
    the end). `accelerator`: cpu, gpu or tpu (default: gpu or tpu when the cluster has
    them, else cpu). `batch_size`: requests a replica runs together per call (default:
    4 * max_num_seqs, fewer when that would leave a replica without work). `progress`:
    Ray Data's progress bars."""
    config = EngineConfig(**engine_settings)  # bad settings fail here, not in each actor
    model_name = DEFAULT_MODEL.name if model is None else str(model)  # as `serve` names it
    model = DEFAULT_MODEL if model is None else model
    _check(num_replicas, batch_size, accelerator, model, ray_address)
    check_paths(input_path, output_path)
    done = finished(output_path, retry_errors=retry_errors)
    requests = read_requests(input_path, done.ids, done.lines)  # duplicate ids raise here
    check_formats(input_path, done, requests)
    started_ray = _connect(ray_address)
    try:
        accelerator = accelerator or _cluster_accelerator()
        ray.data.DataContext.get_current().enable_progress_bars = progress
        _drop_retried(done, output_path)
        size = batch_size or max(1, min(4 * config.max_num_seqs,
                                        math.ceil(len(requests.pending) / num_replicas)))
        replica_args = dict(engine_settings, model=str(model), model_name=model_name,
                            platform="cpu" if accelerator == "cpu" else None)
        resources = _resources(accelerator, config, num_cpus_per_replica)
        started = time.perf_counter()
        counts = _initial_counts(done, requests)
        engines: dict[str, dict] = {}
        with open(output_path, "a", encoding="utf-8") as out:
            for record in requests.errors:
                write(out, record)
                tally(counts, record)
            if requests.pending:
                rows = _dataset(requests.pending, replica_args, num_replicas, size,
                                resources).iter_rows()
                first = _write_results(rows, out, counts, engines,
                                       {r.id for r in requests.pending})
                counts["first_result_s"] = round(first - started, 2)
        elapsed = time.perf_counter() - started
    finally:
        if started_ray:
            ray.shutdown()
    return {**counts, "seconds": round(elapsed, 2),
            "generated_tokens_per_s": round(counts["completion_tokens"] / max(elapsed, 1e-9),
                                            1),
            "replicas": num_replicas, "batch_size": size, "accelerator": accelerator,
            "engine": engines}


def _check(num_replicas: int, batch_size: int | None, accelerator: str | None,
           model: str | os.PathLike, ray_address: str | None) -> None:
    if num_replicas < 1:
        raise ValueError(f"num_replicas={num_replicas} must be >= 1")
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    if accelerator not in (None, *ACCELERATORS):
        raise ValueError(f"accelerator={accelerator!r} must be one of {ACCELERATORS}")
    # A local cluster's actors see this machine's files; a remote one's may not.
    if ray_address is None and not pathlib.Path(model).is_dir():
        raise ValueError(f"model={str(model)!r} is not a directory")


def _write_results(rows: object, out: object, counts: dict, engines: dict,
                   pending: set[str]) -> float:
    """Write each record as its row comes back, each pending id once; counts the pending
    ids that got no record (a re-run runs them) as `missing`. Returns when the first
    record came back (time.perf_counter)."""
    first = 0.0
    for row in rows:
        record = json.loads(row["record"])
        key = record_key(record)
        if key not in pending:  # a batch that came back twice: written already
            log.warning("id %r came back again; its first record is kept", key)
            continue
        pending.discard(key)
        first = first or time.perf_counter()
        write(out, record)
        tally(counts, record)
        engines[row["replica"]] = json.loads(row["metrics"])
    if pending:
        log.error("%d requests got no result (a re-run runs them): %s", len(pending),
                  sorted(pending)[:5])
    counts["missing"] = len(pending)
    return first or time.perf_counter()


def _dataset(pending: list[Request], replica_args: dict, num_replicas: int,
             batch_size: int, resources: dict) -> ray.data.Dataset:
    """The pending rows through a pool of `num_replicas` Replica actors. Ray Data gives
    its actors `max_restarts=-1` and `max_task_retries=-1` by default (ray 2.60,
    ActorPoolMapOperator): a dead actor is restarted and the batches it held run again.
    One batch in flight per actor: a replica still warming up does not get batches
    queued behind it, and a dead one holds one batch."""
    rows = [{"id": r.id, "line": r.line, "request": json.dumps(r.record, ensure_ascii=False)}
            for r in pending]
    actors = min(num_replicas, math.ceil(len(rows) / batch_size))  # none without work
    pool = ray.data.ActorPoolStrategy(size=actors, max_tasks_in_flight_per_actor=1)
    return ray.data.from_items(rows).map_batches(
        Replica, batch_size=batch_size, batch_format="numpy", compute=pool,
        fn_constructor_kwargs=replica_args, **resources)


def _resources(accelerator: str, config: EngineConfig, num_cpus: float) -> dict:
    """What one Ray replica asks Ray for: its devices (data_parallel_size x
    tensor_parallel_size: a Ray replica may hold data-parallel replicas), or CPUs."""
    devices = config.data_parallel_size * config.tensor_parallel_size
    if accelerator == "gpu":
        return {"num_gpus": devices, "num_cpus": num_cpus}
    if accelerator == "tpu":
        return {"resources": {"TPU": devices}, "num_cpus": num_cpus}
    return {"num_cpus": num_cpus}


def _cluster_accelerator() -> str:
    resources = ray.cluster_resources()
    return "gpu" if resources.get("GPU") else "tpu" if resources.get("TPU") else "cpu"


def _connect(address: str | None) -> bool:
    """Join the cluster at `address` (or the one already joined, or a new local one);
    whether this call started the connection (then `run_ray` ends it)."""
    if ray.is_initialized():
        return False
    ray.init(address=address)
    return True
