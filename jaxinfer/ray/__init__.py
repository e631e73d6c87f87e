"""Offline batch over Ray Data: one engine per Ray actor, the driver writing one JSONL.

`run_ray(input_path, output_path, num_replicas=N, **engine settings)` is the batch
runner (jaxinfer/batch/) spread over `N` replicas; `Replica` is the callable class it
hands to `ray.data.Dataset.map_batches`, usable in a user's own pipeline. Ray is an
optional dependency (`pip install 'jaxinfer[ray]'`); nothing else in jaxinfer imports
it, and `import jaxinfer` does not import this package. docs/batch.md.
"""

from __future__ import annotations

try:
    import ray  # noqa: F401  (the check that Ray is installed)
except ImportError as e:
    raise ImportError("jaxinfer.ray needs Ray: pip install 'jaxinfer[ray]'") from e

from jaxinfer.ray.driver import run_ray
from jaxinfer.ray.replica import Replica

__all__ = ["Replica", "run_ray"]
