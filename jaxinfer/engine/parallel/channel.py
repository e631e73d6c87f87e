"""The channel of a multi-host server: process 0 publishes, before each engine step, what
it applied to its engine since the previous step (lockstep.py writes and applies the
messages); every other process reads it. Message t is a key of jax.distributed's
coordination-service store, `jaxinfer/lockstep/<t>`, on which a follower blocks; the
oldest are deleted beyond `KEEP`. Why this store, and its measured cost:
docs/serving.md#multi-host-serving ("The channel").
"""

from __future__ import annotations

import jax

PREFIX = "jaxinfer/lockstep/"
KEEP = 64  # messages kept behind the newest: followers are at most a step or two behind
POLL_S = 5.0  # how long one blocking read waits before the follower looks again


class KeyValueChannel:
    """Messages keyed by step index in the coordination service's key-value store."""

    def __init__(self, client: object | None = None, *, prefix: str = PREFIX,
                 keep: int = KEEP) -> None:
        if client is None:
            from jax._src.distributed import global_state  # jax has no public handle

            client = global_state.client
        if client is None:
            raise RuntimeError("the lockstep channel needs a jax.distributed job "
                               "(--num_processes with --coordinator_address and "
                               "--process_id, or --detect_distributed)")
        self._client = client
        self._prefix = prefix
        self._keep = keep

    def publish(self, step: int, message: bytes) -> None:
        """Store message `step` (process 0; once per step index) and drop an old one."""
        self._client.key_value_set_bytes(self._prefix + str(step), message)
        if step >= self._keep:
            self._client.key_value_delete(self._prefix + str(step - self._keep))

    def receive(self, step: int, timeout_s: float = POLL_S) -> bytes | None:
        """Message `step`, or None if it did not come within `timeout_s` (process 0 is
        idle); raises if the coordination service is gone."""
        try:
            return self._client.blocking_key_value_get_bytes(self._prefix + str(step),
                                                             int(timeout_s * 1000))
        except jax.errors.JaxRuntimeError as e:
            if "DEADLINE_EXCEEDED" in str(e):
                return None
            raise
