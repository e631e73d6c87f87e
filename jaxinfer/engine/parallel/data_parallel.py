"""Data parallelism: `data_parallel_size` replicas of the model behind the Engine's face
(`DataParallelEngine`), replica r a whole `Engine` on row r of the ("data", "model")
mesh. The `Router` (routing.py) puts each request on one replica; `step()` steps every
replica with work in turn; seeds are drawn here in add order, as one engine draws them.
See docs/parallelism.md#data-parallelism and
docs/architecture.md#data-parallelism-one-engine-per-replica.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
from collections.abc import Sequence

from jaxinfer.config import EngineConfig
from jaxinfer.engine import loading
from jaxinfer.engine import sleep as sleep_mode
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.metrics.merge import ReplicaMetrics
from jaxinfer.engine.parallel.routing import Router
from jaxinfer.engine.request import PreparedRequest, RequestOutput, SamplingParams

log = logging.getLogger(__name__)


def make_engine(model: str | os.PathLike, config: EngineConfig, *,
                warm_up: bool = True) -> Engine | DataParallelEngine:
    """An Engine, or with data_parallel_size > 1 a DataParallelEngine."""
    if config.data_parallel_size == 1:
        return Engine(model, config, warm_up=warm_up)
    return DataParallelEngine(model, config, warm_up=warm_up)


class DataParallelEngine:
    """`data_parallel_size` Engines with the Engine's methods; requests routed to one."""

    def __init__(self, model: str | os.PathLike, config: EngineConfig, *,
                 warm_up: bool = True) -> None:
        loading.check_data_parallel(config)
        config = loading.with_served_dtype(model, config)
        first = Engine(model, config, warm_up=False)
        self.replicas = [first] + [
            Engine(model, config, warm_up=False, replica=r, params_from=first.runner.params)
            for r in range(1, config.data_parallel_size)]
        self.config = config
        for name in ("model_dir", "model_config", "tokenizer", "eos_token_ids",
                     "default_params", "max_model_len", "memory_plan"):
            setattr(self, name, getattr(first, name))  # the same for every replica
        self.router = Router(len(self.replicas), page_size=config.page_size,
                             method=config.load_balance_method,
                             balance_threshold=config.max_num_seqs,
                             max_pages=first.memory_plan.num_pages)
        self.metrics = ReplicaMetrics([engine.metrics for engine in self.replicas])
        self._rng = random.Random(config.seed)
        self._owner: dict[str, int] = {}  # request id -> its replica
        if warm_up:
            self.warm_up()

    def warm_up(self) -> None:
        """Compile every replica's buckets (each replica's devices need their own)."""
        for index, engine in enumerate(self.replicas):
            log.info("warming up replica %d of %d", index + 1, len(self.replicas))
            engine.warm_up()

    # ---- requests: checked by replica 0 (all check alike), run on the routed one ------

    def prompt_token_ids(self, prompt: str | Sequence[int] | None = None,
                         messages: list[dict] | None = None, *,
                         add_generation_prompt: bool = True, **options: object) -> list[int]:
        return self.replicas[0].prompt_token_ids(
            prompt, messages, add_generation_prompt=add_generation_prompt, **options)

    def check_params(self, params: SamplingParams) -> None:
        self.replicas[0].check_params(params)

    def prepare(self, prompt: str | Sequence[int] | None = None,
                params: SamplingParams | None = None, *, messages: list[dict] | None = None,
                prompt_token_ids: list[int] | None = None,
                lora_request: object = None) -> PreparedRequest:
        return self.replicas[0].prepare(prompt, params, messages=messages,
                                        prompt_token_ids=prompt_token_ids,
                                        lora_request=lora_request)

    def add_request(self, request_id: str, prompt: str | Sequence[int] | None = None,
                    params: SamplingParams | None = None, *, messages: list[dict] | None = None,
                    priority: int = 0, prompt_token_ids: list[int] | None = None,
                    lora_request: object = None) -> None:
        self.add_prepared(request_id, self.prepare(prompt, params, messages=messages,
                                                   prompt_token_ids=prompt_token_ids,
                                                   lora_request=lora_request),
                          priority=priority)

    def add_prepared(self, request_id: str, prepared: PreparedRequest, *,
                     priority: int = 0) -> None:
        if request_id in self._owner:
            raise ValueError(f"request id {request_id!r} is already in use")
        params = prepared.params
        if params.seed is None:
            params = dataclasses.replace(params, seed=self._rng.randrange(2**31))
            prepared = dataclasses.replace(prepared, params=params)
        replica = self.router.pick(prepared.prompt_token_ids, self.loads())
        self.replicas[replica].add_prepared(request_id, prepared, priority=priority)
        self._owner[request_id] = replica

    def replica_of(self, request_id: str) -> int:
        return self._owner[request_id]

    def loads(self) -> list[int]:
        """Completions waiting or running on each replica."""
        return [waiting + running for waiting, running, _ in
                (engine.counts() for engine in self.replicas)]

    def counts(self) -> tuple[int, int, int]:
        """(waiting, running, slots) summed over the replicas."""
        waiting, running, slots = zip(*(e.counts() for e in self.replicas), strict=True)
        return sum(waiting), sum(running), sum(slots)

    def abort(self, request_id: str) -> None:
        if request_id in self._owner:
            self.replicas[self._owner[request_id]].abort(request_id)

    def has_unfinished(self) -> bool:
        return any(engine.has_unfinished() for engine in self.replicas)

    def output(self, request_id: str) -> RequestOutput:
        return self.replicas[self._owner[request_id]].output(request_id)

    def release(self, request_id: str) -> RequestOutput:
        return self.replicas[self._owner.pop(request_id)].release(request_id)

    def add_lora(self, lora_request: object) -> bool:
        """Read an adapter on every replica (docs/lora.md); False if all had it."""
        return any([engine.add_lora(lora_request) for engine in self.replicas])

    def remove_lora(self, lora_id: int) -> bool:
        return any([engine.remove_lora(lora_id) for engine in self.replicas])

    def list_loras(self) -> set[int]:
        return set().union(*(engine.list_loras() for engine in self.replicas))

    def pin_lora(self, lora_id: int) -> bool:
        return all([engine.pin_lora(lora_id) for engine in self.replicas])

    def sleep(self, level: int = 1) -> None:
        """Every replica sleeps (each checks first, so none sleeps if one refuses)."""
        for engine in self.replicas:
            if not engine.is_sleeping():
                sleep_mode.check_can_sleep(engine, level)
        for engine in self.replicas:
            engine.sleep(level)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        for engine in self.replicas:
            engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        return any(engine.is_sleeping() for engine in self.replicas)

    def device_memory_bytes(self) -> int:
        return sum(engine.device_memory_bytes() for engine in self.replicas)

    def step(self) -> list[RequestOutput]:
        """One step of every replica that has work; their outputs together."""
        outputs = []
        for engine in self.replicas:
            if engine.has_unfinished():
                outputs.extend(engine.step())
        return outputs
