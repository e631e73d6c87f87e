"""device.py: the persistent compilation cache, set once per process by the faces, makes
a second start load every bucket from disk; a second directory is refused. Each start
runs in its own process, as JAX's cache setting is process-wide."""

from __future__ import annotations

import json
import os
import subprocess
import sys

START = """
import json, sys
import jax
events = []
jax.monitoring.register_event_listener(lambda event, **kw: events.append(event))
from jaxinfer import LLM
from jaxinfer.engine import runner
model, cache = sys.argv[1:]
llm = LLM(model, compilation_cache_dir=cache, page_size=8, max_model_len=64, max_num_seqs=2,
          max_num_batched_tokens=32)
assert runner.use_compilation_cache(cache) == cache  # asking again: a no-op
try:
    runner.use_compilation_cache(cache + "-other")
    error = None
except ValueError as e:
    error = str(e)
count = lambda name: events.count("/jax/compilation_cache/" + name)
metrics = llm.metrics()
print(json.dumps({"hits": count("cache_hits"), "misses": count("cache_misses"),
                  "buckets": metrics["buckets"], "compiled": metrics["warmup_compiled"],
                  "loaded": metrics["warmup_loaded"], "error": error}))
"""


def _env_without_cache() -> dict[str, str]:
    """The run's environment less its compilation cache (tests/conftest.py): each start
    here names its own."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    return env


def _start(model_dir, cache_dir):
    result = subprocess.run([sys.executable, "-c", START, str(model_dir), str(cache_dir)],
                            capture_output=True, text=True, timeout=600,
                            env=_env_without_cache())
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


def test_second_start_loads_every_bucket_from_the_compilation_cache(hf_model_dirs, tmp_path):
    cache = tmp_path / "xla"
    first = _start(hf_model_dirs["qwen2"], cache)
    assert first["misses"] >= first["buckets"] > 2  # compiled, written to the cache
    assert first["compiled"] >= first["buckets"] and first["loaded"] == 0
    second = _start(hf_model_dirs["qwen2"], cache)
    assert second["misses"] == 0  # compiled nothing: every executable came from disk
    assert second["hits"] >= second["buckets"] == first["buckets"]
    assert second["compiled"] == 0 and second["loaded"] >= second["buckets"]  # the log says
    assert "this process already caches compilations in" in second["error"]
