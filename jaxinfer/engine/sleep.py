"""The engine's side of sleep mode (vLLM's `sleep`/`wake_up`/`is_sleeping`): what may
sleep (no unfinished request, no draft model's runner), the prefix cache dropped with
the KV cache it indexes, and requests refused while asleep. The device side is
runner/memory.py. See docs/rl.md#sleeping-and-waking.
"""

from __future__ import annotations

import typing

from jaxinfer.engine.core.scheduler import Scheduler


def put_to_sleep(engine: typing.Any, level: int) -> None:
    """`Engine.sleep`: checked, the prefix cache dropped, then the runner's memory
    freed. Asleep already: nothing happens (vLLM's)."""
    if engine.sleeper.level:
        return
    check_can_sleep(engine, level)
    stages = engine.config.pipeline_parallel_size
    if level == 2 and stages > 1:
        raise NotImplementedError(f"sleep(level=2) with pipeline_parallel_size={stages}: "
                                  "new weights come by update_weights, not supported with "
                                  "pipeline stages yet; sleep(level=1) keeps them")
    drop_prefix_cache(engine.scheduler)
    engine.sleeper.sleep(level)


def check_can_sleep(engine: typing.Any, level: int) -> None:
    """ValueError for a level other than 1 or 2; RuntimeError naming the requests still
    unfinished (their KV cache would be lost: finish or abort them first), or the
    speculative method whose runner holds its own device state."""
    if level not in (1, 2):
        raise ValueError(f"sleep level {level!r}: 1 (weights to host memory, KV cache "
                         "freed) or 2 (weights and KV cache dropped)")
    unfinished = [r.request_id for r in (*engine.scheduler.running,
                                         *engine.scheduler.waiting)]
    if unfinished or engine.has_unfinished():
        raise RuntimeError(
            f"cannot sleep with {len(unfinished)} unfinished request(s) "
            f"({', '.join(unfinished[:5])}{', ...' if len(unfinished) > 5 else ''}): "
            "finish or abort them first (vLLM's rule: no request is processed while "
            "the engine sleeps)")
    speculation = engine.speculation
    if speculation is not None and speculation.draft_model:
        raise NotImplementedError(
            f"sleep with speculative decoding method "
            f"{engine.config.speculative_config.method!r}: its proposer's runner holds "
            "its own weights and KV cache, which sleep does not free yet; serve without "
            "a draft model or head (method 'ngram' sleeps)")


def refuse_if_asleep(engine: typing.Any, what: str) -> None:
    """RuntimeError when the engine sleeps (or is half awake): `what` cannot run."""
    sleeper = engine.sleeper
    if sleeper.level:
        raise RuntimeError(
            f"{what}: the engine is asleep (sleep(level={sleeper.level})); call "
            f"wake_up() first (still asleep: {sorted(sleeper.asleep)})")


def drop_prefix_cache(scheduler: Scheduler) -> int:
    """Forget every cached page of every page group (their KV is freed with the cache);
    returns how many. Only pages no request holds are cached-and-free, and a sleeping
    engine has no request."""
    dropped = 0
    for group in scheduler.pages.groups:
        dropped += group.pool.forget_cached()
    return dropped
