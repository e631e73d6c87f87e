"""`Replica`: one engine per Ray actor, for `ray.data.Dataset.map_batches`.

Ray constructs the class once per actor, on the devices it gave that actor (it sets
CUDA_VISIBLE_DEVICES or TPU_VISIBLE_CHIPS; an actor without accelerators runs JAX on
its CPU), and the engine loads and warms up there once. Each call takes a batch of rows
(`id`, `line`, `request`: the JSON text of an input line), adds all of its requests to
the engine together, steps them to completion (continuous batching inside the actor)
and returns one record per row as JSON text (`record`), with the same functions and
fields as the single-process runner (jaxinfer/batch/), error records included. JSON
text keeps the column's type the same whatever fields a record has.
"""

from __future__ import annotations

import json
import os
import socket

import jax
import numpy as np

from jaxinfer.batch import Request, complete


class Replica:
    """A callable class for `Dataset.map_batches`: one LLM made from `model` and
    `engine_settings` (EngineConfig fields) in each actor.

    `platform="cpu"` keeps JAX on the CPU (an actor given no accelerator on a machine
    that has some), with `tensor_parallel_size` virtual CPU devices."""

    def __init__(self, model: str | os.PathLike | None = None, *, platform: str | None = None,
                 **engine_settings: object) -> None:
        from jaxinfer.api import LLM

        if platform == "cpu":  # before anything starts JAX's backend in this process
            jax.config.update("jax_platforms", "cpu")
            jax.config.update("jax_num_cpu_devices",
                              int(engine_settings.get("tensor_parallel_size") or 1))
        self.llm = LLM(**({} if model is None else {"model": model}), **engine_settings)
        self.name = f"{socket.gethostname()}:{os.getpid()}"

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        requests = [Request(int(line), str(user_id), json.loads(text)) for user_id, line, text
                    in zip(batch["id"], batch["line"], batch["request"], strict=True)]
        records: list[dict] = []
        complete(self.llm, requests, records.append)
        metrics = json.dumps(self.llm.metrics())  # the engine's totals so far
        rows = len(records)
        return {"record": np.array([json.dumps(r, ensure_ascii=False) for r in records],
                                   dtype=object),
                "replica": np.array([self.name] * rows, dtype=object),
                "metrics": np.array([metrics] * rows, dtype=object)}
