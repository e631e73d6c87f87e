"""The host loop: synchronous vs asynchronous scheduling, and host time at long context.

`--mode=loop` (default): per model (the tiny test model, whose steps take a few ms
so host time shows, and a random model of `--preset`'s shape), one engine runs a mixed
workload `--rounds` times with `async_scheduling` off and on (alternating which goes
first; the same compiled programs). For each pass: wall seconds, steps, generated
tokens/s, the engine's own host-loop metrics, and the gap: wall time per step minus
the device time per step of the same compiled calls replayed back to back on
device-resident inputs (every call the pass made, recorded, its inputs put on the
device first, run in order, timed to the last result). Prints the medians over the
rounds and the ratios async/sync of the gap and of the throughput, and the overlap
bound: the replay with the host thread busy for the pass's host time per step after
each dispatch (what a loop with that much host work gets from perfect overlap). On a
CPU the "device" is XLA:CPU on the host's own cores; by default (`--host_core=0`) its
threads run on the other cores and the host thread on core 0, as with an accelerator.
`--host_core=-1` lets them share every core: host work then slows the step it
overlaps, and the gap that is left is that contention, not idle device time.

`--mode=long_context`: 16 requests with 8k-token prompts, `max_model_len` 16k, the
tiny model; after every prompt is prefilled, times `--decode_steps` decode steps:
host time per step = the step's wall time less its compiled calls' time, each call
waited for; the runner's host time = the time in the engine's calls into the runner
less the same (wrapping the calls, so an older commit measures the same way:
`BENCH=benchmarks/bench_host_loop.py benchmarks/compare_commits.sh BASE
--mode=long_context`).

    python benchmarks/bench_host_loop.py [--mode=loop] [--preset=smollm-135m]
    python benchmarks/bench_host_loop.py --mode=long_context
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import tempfile
import threading
import time

import jax
import numpy as np
from absl import app, flags

from jaxinfer import SamplingParams, testing
from jaxinfer.config import EngineConfig
from jaxinfer.engine.engine import Engine

flags.DEFINE_enum("mode", "loop", ["loop", "long_context"], "what to measure")
flags.DEFINE_string("preset", "smollm-135m", "second model's shape (random weights); "
                    "empty: the tiny model only")
flags.DEFINE_integer("num_requests", 64, "loop: requests in the mixed workload")
flags.DEFINE_integer("max_num_seqs", 16, "loop: requests in flight")
flags.DEFINE_integer("decode_steps", 64, "long_context: decode steps timed")
flags.DEFINE_integer("seed", 0, "workload seed")
flags.DEFINE_integer("rounds", 3, "loop: sync and async passes per model (medians given)")
flags.DEFINE_integer("replays", 1, "loop: replays of a pass's calls (the fastest counts)")
flags.DEFINE_integer("host_core", 0, "run the host thread on this CPU core and XLA:CPU's "
                     "threads (the 'device') on the others, as with an accelerator; "
                     "-1: no pinning (host and device share every core)")
FLAGS = flags.FLAGS
_CALLS: list | None = None  # (compiled, args) of every compiled call, while recording
_WAIT = [False, 0.0]  # long_context: wait for each compiled call; seconds spent in them
_RUNNER = [0, 0.0]  # long_context: call depth inside the runner; seconds spent there


def _patch_runner_calls() -> None:
    """Time the engine's calls into the runner: `execute` (an older commit's engine) or
    `dispatch` and `collect` (asynchronous scheduling's halves), outermost calls only."""
    from jaxinfer.engine import runner as runner_pkg

    cls = runner_pkg.Runner
    for name in ("execute", "dispatch", "collect"):
        if not hasattr(cls, name):
            continue
        original = getattr(cls, name)

        def timed(self, *args, _original=original, **kwargs):
            _RUNNER[0] += 1
            began = time.perf_counter()
            try:
                return _original(self, *args, **kwargs)
            finally:
                _RUNNER[0] -= 1
                if _RUNNER[0] == 0:
                    _RUNNER[1] += time.perf_counter() - began

        setattr(cls, name, timed)


def _patch_compiled_calls() -> None:
    """Record (loop) or time (long_context) every compiled call the engine makes."""
    original = jax.stages.Compiled.__call__

    def call(self, *args):
        if _CALLS is not None:  # keep the host inputs only: the rest is the device state
            _CALLS.append((self, [a for a in args if not _on_device(a)], len(args)))
        began = time.perf_counter()
        out = original(self, *args)
        if _WAIT[0]:
            jax.block_until_ready(out)
            _WAIT[1] += time.perf_counter() - began
        return out

    jax.stages.Compiled.__call__ = call


def _on_device(tree: object) -> bool:
    return any(isinstance(x, jax.Array) for x in jax.tree.leaves(tree))


def _make_model(path: str, preset: str | None) -> str:
    if preset:
        testing.make_random_model(path, preset, seed=0)
    else:
        testing.make_hf_model(path, "llama", max_position_embeddings=32768)
    return path


def _workload(n: int, vocab: int, seed: int) -> list[tuple[list[int], SamplingParams]]:
    """Prompts of 16..256 tokens, outputs of 16..128, greedy and sampled alike."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        prompt = rng.integers(0, min(vocab, 256), int(rng.integers(16, 257))).tolist()
        out.append((prompt, SamplingParams(max_tokens=int(rng.integers(16, 129)),
                                           temperature=0.0 if i % 2 else 0.8, seed=i,
                                           ignore_eos=True)))
    return out


_COUNTERS = ("steps", "generated_tokens", "host_seconds", "device_idle_seconds",
             "host_to_device_bytes", "discarded_tokens")


def _run_loop(engine: Engine, async_scheduling: bool, work: list) -> dict:
    """One pass of the workload with the engine's loop set to sync or async (the same
    compiled programs either way), and its replay."""
    global _CALLS
    engine.async_scheduling = async_scheduling
    before = {k: getattr(engine.metrics, k) for k in _COUNTERS}
    for i, (prompt, params) in enumerate(work):
        engine.add_request(f"{async_scheduling}-{i}", prompt, params)
    _CALLS = []
    began = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                engine.release(out.request_id)
    wall = time.perf_counter() - began
    calls, _CALLS = _CALLS, None
    m = {k: getattr(engine.metrics, k) - before[k] for k in _COUNTERS}
    device = _replay(engine.runner, calls, FLAGS.replays)
    steps = m["steps"]
    host_s = m["host_seconds"] / steps
    overlapped = _replay(engine.runner, calls, FLAGS.replays, spin_s=host_s)
    return {"wall_s": round(wall, 3), "steps": steps,
            "generated_tokens_per_s": round(m["generated_tokens"] / wall, 1),
            "wall_ms_per_step": round(1e3 * wall / steps, 3),
            "device_ms_per_step": round(1e3 * device / steps, 3),
            "gap_ms_per_step": round(1e3 * (wall - device) / steps, 3),
            "overlap_bound_ms_per_step": round(1e3 * overlapped / steps, 3),
            "host_ms_per_step": round(1e3 * m["host_seconds"] / steps, 3),
            "device_idle_ms_per_step": round(1e3 * m["device_idle_seconds"] / steps, 3),
            "host_to_device_bytes_per_step": round(m["host_to_device_bytes"] / steps, 1),
            "discarded_tokens": m["discarded_tokens"]}


def _replay(runner: object, calls: list, repeats: int, spin_s: float = 0.0) -> float:
    """Seconds of the recorded calls run back to back on device-resident inputs (the
    fastest of `repeats` replays). With `spin_s`, the host thread busy-waits that long
    after dispatching each step, while the step runs: the best a loop whose host work
    takes `spin_s` per step can do when it overlaps the device perfectly."""
    placed = [(c, jax.device_put(host), n) for c, host, n in calls]
    jax.block_until_ready([h for _, h, _ in placed])
    params, kv, state = runner.params, runner.kv_cache, runner.state
    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        for compiled, host, n in placed:
            if n == 2:  # the admission program: (state, admission) -> state
                state = compiled(state, *host)
            else:  # a step: (params, kv, state, delta, ...) -> (kv, state, packed, ...)
                kv, state, *_ = compiled(params, kv, state, *host)
                _spin(spin_s)
        jax.block_until_ready((kv, state))
        best = min(best, time.perf_counter() - began)
    runner.kv_cache, runner.state = kv, state
    return best


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def loop() -> dict:
    """Per model: `--rounds` rounds of a sync pass and an async pass (alternating which
    goes first) on one engine; the median of each figure over the rounds."""
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        models = {"tiny": _make_model(f"{tmp}/tiny", None)}
        if FLAGS.preset:
            models[FLAGS.preset] = _make_model(f"{tmp}/preset", FLAGS.preset)
        work = _workload(FLAGS.num_requests, 256, FLAGS.seed)
        for name, path in models.items():
            engine = Engine(path, EngineConfig(
                max_num_seqs=FLAGS.max_num_seqs, max_num_batched_tokens=256,
                max_model_len=512, compilation_cache_dir=""))
            runs: dict[bool, list[dict]] = {False: [], True: []}
            for r in range(FLAGS.rounds):
                for flag in (False, True) if r % 2 == 0 else (True, False):
                    runs[flag].append(_run_loop(engine, flag, work))
            sync, async_ = (_medians(runs[flag]) for flag in (False, True))
            out[name] = {"rounds": FLAGS.rounds, "sync": sync, "async": async_,
                         "gap_async_over_sync": round(
                             async_["gap_ms_per_step"] / sync["gap_ms_per_step"], 3),
                         "throughput_async_over_sync": round(
                             async_["generated_tokens_per_s"] / sync["generated_tokens_per_s"],
                             3)}
            del engine
            gc.collect()
    return out


def _medians(runs: list[dict]) -> dict:
    return {key: float(np.median([run[key] for run in runs])) for key in runs[0]}


def long_context() -> dict:
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    extra = {"async_scheduling": True} if "async_scheduling" in fields else {}
    with tempfile.TemporaryDirectory() as tmp:
        model = _make_model(f"{tmp}/tiny", None)
        engine = Engine(model, EngineConfig(
            max_num_seqs=16, max_num_batched_tokens=2048, max_model_len=16384,
            compilation_cache_dir="", **extra))
        rng = np.random.default_rng(FLAGS.seed)
        for i in range(16):
            engine.add_request(str(i), rng.integers(0, 256, 8192).tolist(),
                               SamplingParams(max_tokens=FLAGS.decode_steps + 8,
                                              temperature=0.0, ignore_eos=True))
        while any(not engine.output(str(i)).token_ids for i in range(16)):
            engine.step()
        for _ in range(2):
            engine.step()
        _WAIT[0], _WAIT[1], _RUNNER[1] = True, 0.0, 0.0
        began = time.perf_counter()
        for _ in range(FLAGS.decode_steps):
            engine.step()
        wall = time.perf_counter() - began
        device, _WAIT[0] = _WAIT[1], False
    steps = FLAGS.decode_steps
    return {"decode_steps": steps, "requests": 16, "context": 8192,
            "wall_ms_per_step": round(1e3 * wall / steps, 3),
            "device_ms_per_step": round(1e3 * device / steps, 3),
            "host_ms_per_step": round(1e3 * (wall - device) / steps, 3),
            "runner_host_ms_per_step": round(1e3 * (_RUNNER[1] - device) / steps, 3)}


def _pin_host(core: int) -> dict:
    """Put XLA:CPU's threads, made when the backend starts, on every core but `core`,
    then the calling (host) thread on `core`. Linux only; needs two cores or more."""
    cores = sorted(os.sched_getaffinity(0))
    if core < 0 or len(cores) < 2 or core not in cores:
        return {"host_core": None, "device_cores": cores}
    device = [c for c in cores if c != core]
    os.sched_setaffinity(0, device)
    jax.block_until_ready(jax.numpy.zeros(1))  # the backend and its threads start here
    os.sched_setaffinity(threading.get_native_id(), {core})
    return {"host_core": core, "device_cores": device}


def main(_: list[str]) -> None:
    pinning = _pin_host(FLAGS.host_core)
    _patch_compiled_calls()
    _patch_runner_calls()
    result = {"mode": FLAGS.mode, "jax": jax.__version__, "backend": jax.default_backend(),
              "xla_flags": os.environ.get("XLA_FLAGS", "")} | pinning
    result |= loop() if FLAGS.mode == "loop" else long_context()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    app.run(main)
