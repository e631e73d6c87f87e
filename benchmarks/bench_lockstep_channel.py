"""Per-step latency of the multi-host server's lockstep channel
(jaxinfer/engine/parallel/channel.py) on 127.0.0.1, beside the device-collective alternative.

Starts two processes joined by jax.distributed on 127.0.0.1 (one CPU device each). For
`--steps` steps process 0 publishes a message the size of a step that adds one request
(`--prompt_tokens` token ids and its sampling parameters, JSON) while process 1 waits
for it; a step's latency is from just before process 0's publish to process 1 holding
the bytes (both read the same monotonic clock, one machine). Then the same number of
`multihost_utils.broadcast_one_to_all` calls of the same bytes (a size, then the padded
payload: what a collective channel needs), timed on process 0 per call. Process 0
prints one JSON object: medians and 99th percentiles in milliseconds.

    python benchmarks/bench_lockstep_channel.py [--steps=500] [--prompt_tokens=512]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time


def _percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"p50_ms": round(ordered[len(ordered) // 2] * 1e3, 4),
            "p99_ms": round(ordered[int(len(ordered) * 0.99)] * 1e3, 4),
            "max_ms": round(ordered[-1] * 1e3, 4)}


def _message(prompt_tokens: int) -> bytes:
    from jaxinfer.engine.parallel import lockstep
    from jaxinfer.engine.request import PreparedRequest, SamplingParams

    ids = list(range(1000, 1000 + prompt_tokens))
    params = SamplingParams(temperature=0.7, seed=3, max_tokens=64)
    prepared = PreparedRequest(prompt=None, prompt_token_ids=ids, params=params)
    return lockstep.encode(0, [lockstep.add_op("req-0", prepared, 0)])


def _channel_steps(channel, process: int, steps: int, message: bytes) -> list[float]:
    """Process 0: publish times; process 1: receive times (monotonic seconds)."""
    from jax.experimental import multihost_utils

    times = []
    for step in range(steps):
        multihost_utils.sync_global_devices(f"step{step}")  # the follower is waiting
        if process == 0:
            time.sleep(0.002)  # let the follower enter its blocking read
            times.append(time.monotonic())
            channel.publish(step, message)
        else:
            while channel.receive(step, 10.0) is None:
                pass
            times.append(time.monotonic())
    return times


def _broadcast_steps(steps: int, message: bytes) -> list[float]:
    import numpy as np
    from jax.experimental import multihost_utils

    seconds = []
    data = np.frombuffer(message, np.uint8)
    for _ in range(steps):
        started = time.monotonic()
        size = int(multihost_utils.broadcast_one_to_all(np.array([data.size], np.int32))[0])
        buffer = np.zeros(size, np.uint8)
        buffer[:] = data
        np.asarray(multihost_utils.broadcast_one_to_all(buffer))
        seconds.append(time.monotonic() - started)
    return seconds


def worker(args: argparse.Namespace) -> None:
    import jax

    jax.distributed.initialize(coordinator_address=args.coordinator, num_processes=2,
                               process_id=args.process, cluster_detection_method="deactivate")
    from jax._src.distributed import global_state

    from jaxinfer.engine.parallel.channel import KeyValueChannel

    channel, message = KeyValueChannel(), _message(args.prompt_tokens)
    publish_seconds = []
    if args.process == 0:  # the cost of one publish alone, nobody reading
        for step in range(args.steps):
            started = time.monotonic()
            channel.publish(10**6 + step, message)
            publish_seconds.append(time.monotonic() - started)
    times = _channel_steps(channel, args.process, args.steps, message)
    client = global_state.client
    if args.process == 1:
        client.key_value_set_bytes("bench/received", json.dumps(times).encode())
    broadcast = _broadcast_steps(args.steps, message)
    if args.process != 0:
        return
    received = json.loads(client.blocking_key_value_get_bytes("bench/received", 60_000))
    latency = [r - p for p, r in zip(times, received, strict=True)]
    print(json.dumps({
        "steps": args.steps, "message_bytes": len(message),
        "kv_store_publish": _percentiles(publish_seconds),
        "kv_store_publish_to_follower": _percentiles(latency),
        "broadcast_one_to_all_per_step": _percentiles(broadcast),
    }))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--prompt_tokens", type=int, default=512)
    parser.add_argument("--process", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--coordinator", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.process is not None:
        return worker(args)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="1")
    procs = [subprocess.Popen([sys.executable, __file__, f"--steps={args.steps}",
                               f"--prompt_tokens={args.prompt_tokens}", f"--process={i}",
                               f"--coordinator=127.0.0.1:{port}"], env=env,
                              stdout=subprocess.PIPE if i == 0 else subprocess.DEVNULL)
             for i in range(2)]
    out, _ = procs[0].communicate(timeout=600)
    procs[1].wait(timeout=60)
    sys.stdout.write(out.decode())
    sys.exit(max(p.returncode for p in procs))


if __name__ == "__main__":
    main()
