"""The engine's side of weight updates for RL rollouts (vLLM's `pause_generation` /
`resume_generation` / `reset_prefix_cache`, SGLang's `update_weights_from_tensor` /
`_from_disk` in one `update_weights`): what happens to requests in flight (`POLICIES`),
the prefix cache dropped, the runner's params swapped (runner/weights.py converts them).
See docs/rl.md (#updating-weights, #pausing-and-what-happens-to-requests-in-flight).
"""

from __future__ import annotations

import typing

from jaxinfer.engine import weight_sources
from jaxinfer.engine.runner import weights as device_weights

# vLLM's pause modes: finish them with reason "abort"; let them finish first (no new
# request starts meanwhile); keep them, continuing on the new weights with their KV
POLICIES = ("abort", "wait", "keep")


def check_policy(policy: str) -> None:
    if policy not in POLICIES:
        raise ValueError(f"in-flight policy {policy!r}: one of {POLICIES}")


def pause(engine: typing.Any, mode: str = "abort", clear_cache: bool = True) -> int:
    """`Engine.pause_generation`: requests in flight handled as `mode` says, then no
    step runs until `resume`; returns how many requests were aborted. Requests added
    while paused wait. `clear_cache`: reset the prefix cache too."""
    check_policy(mode)
    aborted = 0
    if mode == "abort":
        unfinished = {id(r) for r in _unfinished(engine)}
        for prompt_id, requests in list(engine._requests.items()):
            count = sum(id(r) in unfinished for r in requests)
            if count:
                aborted += count
                engine.abort(prompt_id)
    elif mode == "wait":
        engine.paused = False  # paused already, steps would never run
        while engine.has_unfinished():
            engine.step()
    engine.paused = True
    if clear_cache:
        reset_prefix_cache(engine)
    return aborted


def resume(engine: typing.Any) -> None:
    """`Engine.resume_generation`: steps run again."""
    engine.paused = False


def reset_prefix_cache(engine: typing.Any) -> int:
    """Forget every cached page no request holds, in every page group (their KV came
    from the weights in place then); returns how many."""
    dropped = 0
    for group in engine.scheduler.pages.groups:
        dropped += group.pool.forget_cached()
    return dropped


def forget_kept_pages(engine: typing.Any) -> int:
    """Unregister the pages requests kept across an update hold, so that no later
    prompt hits their old-weights KV; returns how many."""
    return sum(group.pool.forget_in_use() for group in engine.scheduler.pages.groups)


def update(engine: typing.Any, weights: object, policy: str = "abort") -> dict:
    """`Engine.update_weights`: converted first (a mismatch raises before anything
    changes), then in-flight requests handled per `policy` (unless already paused),
    the prefix cache reset, the params swapped. Returns what it did: bytes sent from
    host, requests aborted, cached pages dropped."""
    check_policy(policy)
    stages = engine.config.pipeline_parallel_size
    if stages > 1:
        raise NotImplementedError(f"update_weights with pipeline_parallel_size={stages}: "
                                  "the layers are stacked by stage, and updates name them "
                                  "by layer; not supported yet")
    if engine.speculation is not None and engine.speculation.draft_model:
        raise NotImplementedError("update_weights with a draft model: its weights are "
                                  "its own; serve without one (ngram updates)")
    leaves, host_bytes = weight_sources.leaves_of(
        weights, engine.runner.params, engine.model_config,
        expert_parallel=engine.config.enable_expert_parallel)
    leaves = device_weights.converted(engine.runner, leaves)
    was_paused = engine.paused
    aborted = 0 if was_paused else pause(engine, policy, clear_cache=False)
    device_weights.apply(engine.runner, leaves)
    dropped = reset_prefix_cache(engine) + forget_kept_pages(engine)
    if not was_paused:
        resume(engine)
    return {"bytes_from_host": host_bytes, "leaves": len(leaves), "aborted": aborted,
            "prefix_pages_dropped": dropped}


def _unfinished(engine: typing.Any) -> list:
    return [*engine.scheduler.running, *engine.scheduler.waiting]
