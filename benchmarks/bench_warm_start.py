"""Start-up time of the demo model as a user meets it: `make run`'s command
(`python -m jaxinfer generate --max_tokens=64`) to exit, and `serve` to its first
healthy /health, each from an empty compilation cache (cold) and again from the cache
that run filled (warm), plus the warm runs' own warm-up figure from their log. Prints
JSON; `benchmarks/compare_commits.sh BASE` with `BENCH=benchmarks/bench_warm_start.py`
gives before and after on the same machine. See docs/benchmarks.md#warm-start.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

from absl import app, flags

import jaxinfer

FLAGS = flags.DEFINE_integer("repeats", 2, "warm runs of each command (the median is kept)")
WARMUP = re.compile(r"warm-up: .*? in ([0-9.]+)s")
# The checkout whose package this script imported (compare_commits.sh sets PYTHONPATH):
# `python -m` puts the working directory first on the path, so commands run there.
CHECKOUT = pathlib.Path(jaxinfer.__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # each run names its own directory
    return env


def generate(cache: str) -> dict[str, float]:
    began = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "jaxinfer", "generate", "--max_tokens=64",
                             f"--compilation_cache_dir={cache}"], capture_output=True,
                            text=True, env=_env(), timeout=1200, cwd=CHECKOUT)
    seconds = time.perf_counter() - began
    if result.returncode != 0:
        raise RuntimeError(result.stderr[-2000:])
    found = WARMUP.search(result.stderr)
    return {"seconds": round(seconds, 2), "warmup_s": float(found[1]) if found else -1.0}


def serve(cache: str) -> dict[str, float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    began = time.perf_counter()
    server = subprocess.Popen([sys.executable, "-m", "jaxinfer", "serve", f"--port={port}",
                               "--host=127.0.0.1", f"--compilation_cache_dir={cache}"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              env=_env(), cwd=CHECKOUT)
    try:
        seconds = _wait_healthy(port, server, began)
    finally:
        server.terminate()
        _, stderr = server.communicate(timeout=60)
    found = WARMUP.search(stderr)
    return {"seconds": round(seconds, 2), "warmup_s": float(found[1]) if found else -1.0}


def _wait_healthy(port: int, server: subprocess.Popen, began: float) -> float:
    while time.perf_counter() - began < 1200:
        if server.poll() is not None:
            raise RuntimeError(f"serve exited {server.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return time.perf_counter() - began
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("serve was not healthy within 1200 s")


def _median(runs: list[dict[str, float]]) -> dict[str, float]:
    return {key: sorted(r[key] for r in runs)[len(runs) // 2] for key in runs[0]}


def main(argv: list[str]) -> None:
    del argv
    out = {}
    for name, command in (("generate", generate), ("serve", serve)):
        with tempfile.TemporaryDirectory() as cache:
            cold = command(cache)
            warm = _median([command(cache) for _ in range(FLAGS.value)])
        out[name] = {"cold": cold, "warm": warm}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    app.run(main)
