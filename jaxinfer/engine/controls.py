"""The controls a trainer drives between rollouts, as `Engine` methods: vLLM's sleep
mode (engine/sleep.py, runner/memory.py) and weight updates with pause and resume
(engine/weights_update.py). See docs/rl.md.
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxinfer.engine import sleep as sleep_mode
from jaxinfer.engine import weights_update


class RolloutControls:
    """Mixed into `Engine`: each method hands the engine to its feature's module."""

    # ---- sleep mode (docs/rl.md#sleeping-and-waking; engine/sleep.py) -----------------

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache and move the weights to host memory (level 1) or drop them
        (level 2); no request may be unfinished."""
        sleep_mode.put_to_sleep(self, level)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Bring back `tags` ("weights", "kv_cache"; None: both), as vLLM's."""
        self.sleeper.wake_up(tags)

    def is_sleeping(self) -> bool:
        return bool(self.sleeper.level)

    # ---- weight updates (docs/rl.md#updating-weights; engine/weights_update.py) -------

    def update_weights(self, weights: object, policy: str = "abort") -> dict:
        """New weights (a params pytree, HF-named arrays or a checkpoint directory);
        in-flight requests per `policy` ("abort", "wait", "keep"); the prefix cache reset."""
        return weights_update.update(self, weights, policy)

    def pause_generation(self, mode: str = "abort", clear_cache: bool = True) -> int:
        return weights_update.pause(self, mode, clear_cache)

    def resume_generation(self) -> None:
        weights_update.resume(self)

    def reset_prefix_cache(self) -> int:
        return weights_update.reset_prefix_cache(self)
