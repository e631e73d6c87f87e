"""Offline batch over Ray Data (the optional `ray` extra): `run_ray`, the batch runner
spread over replicas, and `Replica`, the `map_batches` class, usable in a pipeline of
your own. See docs/batch.md#ray-data.
"""

from __future__ import annotations

try:
    import ray  # noqa: F401  (the check that Ray is installed)
except ImportError as e:
    raise ImportError("jaxinfer.ray needs Ray: pip install 'jaxinfer[ray]'") from e

from jaxinfer.ray.driver import run_ray
from jaxinfer.ray.replica import Replica

__all__ = ["Replica", "run_ray"]
