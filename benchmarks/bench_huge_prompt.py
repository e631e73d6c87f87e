"""A client streaming while three megabyte prompts are refused: how long the stream stalls.

Starts `python -m jaxinfer serve` (the demo model, small buckets), streams back-to-back
greedy completions from one client, and once they run sends three bodies of 6-8 MB
(a text prompt, chat messages, 2 M token ids), each far over `max_model_len`. Prints
JSON: the refusals' status and time, the stream's longest gap between events while
they were in flight, against its median gap before them (the baseline, same run),
and the server's memory growth.

    python benchmarks/bench_huge_prompt.py
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import statistics
import subprocess
import sys
import threading
import time

import httpx2 as httpx

FLAGS = ["--max_num_seqs=16", "--max_num_batched_tokens=64", "--max_model_len=512"]
TEXT = "x = 1; " * (7_800_000 // 7)
HUGE = [("/v1/completions", {"prompt": TEXT, "max_tokens": 4}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": TEXT}],
                                  "max_tokens": 4}),
        ("/v1/completions", {"prompt": [1] * 2_000_000, "max_tokens": 4})]
STREAM = {"prompt": "def main():", "max_tokens": 64, "temperature": 0, "ignore_eos": True,
          "stream": True}


def start() -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen([sys.executable, "-m", "jaxinfer", "serve", "--port=0", *FLAGS],
                               stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    for line in process.stderr:
        if match := re.search(r"serving '[^']*' at (http://\S+)/v1", line):
            # Keep reading its log, so that the server never blocks writing it.
            threading.Thread(target=process.stderr.read, daemon=True).start()
            return process, match.group(1)
    raise RuntimeError("the server did not start")


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        return int(next(x for x in status if x.startswith("VmRSS:")).split()[1]) / 1024


async def ticker(client: httpx.AsyncClient, arrivals: list[float], done: asyncio.Event) -> None:
    while not done.is_set():
        async with client.stream("POST", "/v1/completions", json=STREAM) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    arrivals.append(time.monotonic())


async def run(url: str) -> tuple[list[int], float, float, list[float]]:
    arrivals: list[float] = []
    done = asyncio.Event()
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        streaming = asyncio.create_task(ticker(client, arrivals, done))
        while len(arrivals) < 50:
            await asyncio.sleep(0.01)
        sent = time.monotonic()
        responses = await asyncio.gather(*(client.post(p, json=b) for p, b in HUGE))
        answered = time.monotonic()
        await asyncio.sleep(0.3)
        done.set()
        await streaming
    return [r.status_code for r in responses], sent, answered, arrivals


def main() -> None:
    process, url = start()
    try:
        before_mb = rss_mb(process.pid)
        statuses, sent, answered, arrivals = asyncio.run(run(url))
        growth_mb = rss_mb(process.pid) - before_mb
    finally:
        process.terminate()
        process.wait(60)
    pairs = list(itertools.pairwise(arrivals))
    during = max(b - a for a, b in pairs if b > sent and a < answered)
    baseline = statistics.median(b - a for a, b in pairs if b < sent)
    print(json.dumps({"statuses": statuses, "refused_in_s": round(answered - sent, 3),
                      "max_gap_during_s": round(during, 4),
                      "median_gap_before_s": round(baseline, 4),
                      "stall_vs_median_gap": round(during / baseline, 1),
                      "rss_growth_mb": round(growth_mb, 1)}, indent=1))


if __name__ == "__main__":
    main()
