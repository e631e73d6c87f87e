"""`Replica`: one engine per Ray actor, for `ray.data.Dataset.map_batches`: rows of
request JSON in, one record per row out, made as the single-process runner makes them.
See docs/batch.md#ray-data.
"""

from __future__ import annotations

import json
import os
import socket

import jax
import numpy as np

from jaxinfer.batch import Request, complete, engine_metrics


class Replica:
    """A callable class for `Dataset.map_batches`: one LLM made from `model` and
    `engine_settings` (EngineConfig fields) in each actor.

    `platform="cpu"` keeps JAX on the CPU (an actor given no accelerator on a machine
    that has some), with `tensor_parallel_size` virtual CPU devices. `model_name`: what an
    OpenAI-format line's body.model must name (default: the model directory's name)."""

    def __init__(self, model: str | os.PathLike | None = None, *, platform: str | None = None,
                 model_name: str | None = None, **engine_settings: object) -> None:
        from jaxinfer.api import LLM

        if platform == "cpu":  # before anything starts JAX's backend in this process
            jax.config.update("jax_platforms", "cpu")
            jax.config.update("jax_num_cpu_devices",
                              int(engine_settings.get("tensor_parallel_size") or 1))
        self.llm = LLM(**({} if model is None else {"model": model}), **engine_settings)
        self.name = f"{socket.gethostname()}:{os.getpid()}"
        self.model_name = model_name

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        requests = [Request(int(line), str(user_id), json.loads(text)) for user_id, line, text
                    in zip(batch["id"], batch["line"], batch["request"], strict=True)]
        records: list[dict] = []
        complete(self.llm, requests, records.append, model_name=self.model_name)
        metrics = json.dumps(engine_metrics(self.llm))  # the engine's totals so far
        rows = len(records)
        return {"record": np.array([json.dumps(r, ensure_ascii=False) for r in records],
                                   dtype=object),
                "replica": np.array([self.name] * rows, dtype=object),
                "metrics": np.array([metrics] * rows, dtype=object)}
