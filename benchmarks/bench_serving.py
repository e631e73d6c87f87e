"""Online serving under Poisson load, the shape of vLLM's benchmark_serving.py: latency
and throughput of `python -m jaxinfer serve`, against offline `LLM.generate`.

Workload (fixed `--seed`): `--num_prompts` prompts, random slices (`--input_len_range`
characters, from a line start) of Python standard-library files (the demo model's
domain), output lengths uniform in `--output_len_range` sent as `max_tokens` with
`ignore_eos`, temperature 0. For each of `--request_rates` (requests/s; inf: all at
once) the same requests arrive as a Poisson process (one seeded pattern, scaled) and
stream from /v1/completions through the `openai` async client, every chunk timed, after
one untimed pass of the whole workload at once (warm-up). Per rate: request, output and
total token throughput (tokens from the usage chunk); TTFT, TPOT ((e2e - ttft) / (output
tokens - 1)), ITL (gaps between chunks) and e2e latency as mean/p50/p90/p99 ms;
failures; deltas of the server's `jaxinfer:*_total` counters.

Baseline, same run: `LLM.generate` of the same workload with the same engine flags and
the server's sampling parameters, in this process, before the server starts (one untimed
pass, then a timed one); `vs_offline` is each rate's output tok/s over it
(`--no_offline_baseline` skips it). By default the server is started here on a free
port with the engine flags given (any EngineConfig field but seed), awaited on /health
and stopped with SIGTERM (exit code reported). `--base_url` attaches to a running server
(the engine flags then only shape the baseline). Client and server share the host's
CPUs. Prints one JSON object; `--plot` gets TTFT/TPOT p50/p99 and tok/s against rate.

    python benchmarks/bench_serving.py --num_prompts=32 --request_rates=2,8,inf \\
        --max_num_seqs=16 --max_num_batched_tokens=64 --max_model_len=512
    python benchmarks/bench_serving.py --base_url=http://127.0.0.1:8000/v1 --no_offline_baseline
"""
from __future__ import annotations

import asyncio
import dataclasses
import gc
import json
import logging
import math
import os
import pathlib
import random
import socket
import subprocess
import sys
import tempfile
import time
import typing
import urllib.request

import numpy as np
import openai
from absl import app, flags
from prometheus_client.parser import text_string_to_metric_families
from server_process import stop_server, tail

from jaxinfer.config import EngineConfig

FLAGS = flags.FLAGS
ENGINE_FLAGS = tuple(f.name for f in dataclasses.fields(EngineConfig)
                     if f.name not in ("seed", "skip_tokenizer_init"))
COUNTERS = ("generation_tokens_total", "prompt_tokens_total", "num_preemptions_total",
            "engine_steps_total", "scheduled_requests_total")
PERCENTILES = (50, 90, 99)
REPO = pathlib.Path(__file__).resolve().parents[1]


def define_flags() -> None:
    """The CLI (defined on demand, so that tests can import the pure functions)."""
    flags.DEFINE_string("model", "checkpoints/demo", "model directory")
    flags.DEFINE_string("base_url", None, "attach to this server (…/v1); default: start one")
    flags.DEFINE_string("api_key", None, "API key (also given to a started server)")
    flags.DEFINE_string("served_model_name", None, "given to a started server")
    flags.DEFINE_integer("num_prompts", 64, "requests per rate")
    flags.DEFINE_list("input_len_range", ["200", "800"], "prompt length, characters")
    flags.DEFINE_list("output_len_range", ["16", "128"], "max_tokens, uniform")
    flags.DEFINE_list("request_rates", ["1", "2", "4", "inf"], "requests/s; inf: at once")
    flags.DEFINE_integer("seed", 0, "workload and arrival seed")
    flags.DEFINE_boolean("no_offline_baseline", False, "skip the LLM.generate baseline")
    flags.DEFINE_string("plot", "bench_serving.png", "PNG path")
    flags.DEFINE_integer("startup_timeout", 900, "seconds to wait for /health")
    hints = typing.get_type_hints(EngineConfig)
    for field in (f for f in dataclasses.fields(EngineConfig) if f.name in ENGINE_FLAGS):
        kinds = set(typing.get_args(hints[field.name])) - {type(None)} or {hints[field.name]}
        text = "engine: " + field.metadata["help"] + " (default: the engine's)"
        if field.metadata["choices"]:
            flags.DEFINE_enum(field.name, None, list(field.metadata["choices"]), text)
        else:
            define = {bool: flags.DEFINE_boolean, int: flags.DEFINE_integer}
            define.get(kinds.pop(), flags.DEFINE_string)(field.name, None, text)


def engine_settings() -> dict[str, object]:
    """The engine flags given (the rest stay the engine's defaults, server and offline)."""
    return {name: FLAGS[name].value for name in ENGINE_FLAGS if FLAGS[name].value is not None}


def make_workload(num_prompts: int, input_len: tuple[int, int], output_len: tuple[int, int],
                  seed: int) -> tuple[list[str], list[int]]:
    """Prompts (slices of stdlib .py files, starting at a line) and output lengths."""
    rng = random.Random(seed)
    stdlib = pathlib.Path(os.__file__).parent
    sources = [p.read_text(encoding="utf-8", errors="replace") for p in sorted(stdlib.glob("*.py"))]
    sources = [s for s in sources if len(s) > 2 * input_len[1]]
    prompts, lengths = [], []
    for _ in range(num_prompts):
        text = rng.choice(sources)
        start = text.find("\n", rng.randrange(len(text) - 2 * input_len[1])) + 1
        prompts.append(text[start:start + rng.randint(*input_len)])
        lengths.append(rng.randint(*output_len))
    return prompts, lengths


def arrival_offsets(num_requests: int, rate: float, seed: int) -> np.ndarray:
    """Send times in seconds from the start: a Poisson process of `rate` requests/s (the
    first at 0), or all at 0 for an infinite rate."""
    if math.isinf(rate):
        return np.zeros(num_requests)
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=num_requests)
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])])


@dataclasses.dataclass(frozen=True, kw_only=True)
class RequestResult:
    """One streamed request, times in seconds from its send."""

    ok: bool
    error: str = ""
    requested_tokens: int = 0  # max_tokens
    prompt_tokens: int = 0  # from the usage chunk, as output_tokens
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0  # to the stream's end
    itl: tuple[float, ...] = ()  # gaps between chunks


def request_result(started: float, chunk_times: list[float], ended: float, *,
                   usage: object, requested_tokens: int) -> RequestResult:
    """A result from the send time, the arrival time of each chunk that carried choices,
    the end of the stream and the usage chunk."""
    if usage is None or not chunk_times:
        return RequestResult(ok=False, error="no usage chunk" if chunk_times else "no tokens",
                             requested_tokens=requested_tokens, e2e=ended - started)
    return RequestResult(ok=True, requested_tokens=requested_tokens,
                         prompt_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens,
                         ttft=chunk_times[0] - started, e2e=ended - started,
                         itl=tuple(np.diff(chunk_times).tolist()))


async def send(client: openai.AsyncOpenAI, model: str, prompt: str,
               max_tokens: int) -> RequestResult:
    started, chunk_times, usage = time.perf_counter(), [], None
    try:
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.choices:
                chunk_times.append(time.perf_counter())
            if chunk.usage is not None:
                usage = chunk.usage
    except Exception as e:  # a failed request is counted, not fatal
        return RequestResult(ok=False, error=f"{type(e).__name__}: {e}"[:300],
                             requested_tokens=max_tokens, e2e=time.perf_counter() - started)
    return request_result(started, chunk_times, time.perf_counter(), usage=usage,
                          requested_tokens=max_tokens)


async def run_rate(client: openai.AsyncOpenAI, model: str, prompts: list[str],
                   lengths: list[int], offsets: np.ndarray) -> tuple[list[RequestResult], float]:
    """Every request at its offset; the results and the seconds until the last ends."""
    started = time.perf_counter()

    async def launch(i: int) -> RequestResult:
        await asyncio.sleep(max(0.0, started + offsets[i] - time.perf_counter()))
        return await send(client, model, prompts[i], lengths[i])

    results = await asyncio.gather(*(launch(i) for i in range(len(prompts))))
    return list(results), time.perf_counter() - started


def stats_ms(values: list[float]) -> dict[str, float | None]:
    """Mean and percentiles of seconds, in ms (None when there are none)."""
    if not values:
        return {"mean": None, **{f"p{q}": None for q in PERCENTILES}}
    ms = np.asarray(values) * 1e3
    return {"mean": round(float(ms.mean()), 2),
            **{f"p{q}": round(float(np.percentile(ms, q)), 2) for q in PERCENTILES}}


def summarize(results: list[RequestResult], duration: float) -> dict:
    done = [r for r in results if r.ok]
    output = sum(r.output_tokens for r in done)
    total = output + sum(r.prompt_tokens for r in done)
    errors = sorted({r.error for r in results if not r.ok})
    return {
        "completed": len(done), "failed": len(results) - len(done), "errors": errors[:3],
        "duration_s": round(duration, 3),
        "request_throughput": round(len(done) / duration, 3),
        "output_throughput": round(output / duration, 2),
        "total_token_throughput": round(total / duration, 2),
        "prompt_tokens": total - output, "output_tokens": output,
        "output_len_mismatches": sum(r.output_tokens != r.requested_tokens for r in done),
        "ttft_ms": stats_ms([r.ttft for r in done]),
        "tpot_ms": stats_ms([(r.e2e - r.ttft) / (r.output_tokens - 1)
                             for r in done if r.output_tokens > 1]),
        "itl_ms": stats_ms([gap for r in done for gap in r.itl]),
        "e2e_ms": stats_ms([r.e2e for r in done])}


def counters(text: str) -> dict[str, float]:
    """The `jaxinfer:` counters of a /metrics page (label sets summed), by sample name
    without the prefix."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name.removeprefix("jaxinfer:")
            if sample.name.startswith("jaxinfer:") and name in COUNTERS:
                out[name] = out.get(name, 0.0) + sample.value
    return out


def counter_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    deltas = {k: after[k] - before[k] for k in COUNTERS if k in before and k in after}
    if deltas.get("engine_steps_total"):
        deltas["mean_batch_size"] = round(
            deltas.get("scheduled_requests_total", 0.0) / deltas["engine_steps_total"], 2)
    return deltas


def build_report(settings: dict, server: dict, baseline: dict | None, runs: list[dict]) -> dict:
    """The JSON document: each run gets `vs_offline`, its output tok/s over the
    baseline's (None without one)."""
    base = baseline["output_throughput"] if baseline else None
    for run in runs:
        run["vs_offline"] = round(run["output_throughput"] / base, 3) if base else None
    return {"settings": settings, "server": server, "offline_baseline": baseline, "rates": runs}


def offline_baseline(prompts: list[str], lengths: list[int]) -> dict:
    """`LLM.generate` of the whole workload at once, after warm-up, in this process."""
    from jaxinfer import LLM

    started = time.perf_counter()
    llm = LLM(FLAGS.model, **engine_settings())
    warm = time.perf_counter() - started
    # The server's parameters: the checkpoint's defaults under the request's fields.
    params = [dataclasses.replace(llm.engine.default_params, temperature=0.0, max_tokens=n,
                                  ignore_eos=True) for n in lengths]
    llm.generate(prompts, params)  # first runs of each executable, outside the timing
    started = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - started
    output = sum(len(o.token_ids) for o in outs)
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    del llm, outs
    gc.collect()
    return {"warmup_s": round(warm, 1), "duration_s": round(seconds, 3), "request_throughput":
            round(len(prompts) / seconds, 3), "output_throughput": round(output / seconds, 2),
            "total_token_throughput": round((output + prompt) / seconds, 2),
            "prompt_tokens": prompt, "output_tokens": output}


def start_server(port: int, log: typing.IO) -> subprocess.Popen:
    given = engine_settings() | {k: FLAGS[k].value for k in ("api_key", "served_model_name")
                                 if FLAGS[k].value is not None}
    command = [sys.executable, "-m", "jaxinfer", "serve", f"--model={FLAGS.model}",
               "--host=127.0.0.1", f"--port={port}", *(f"--{k}={v}" for k, v in given.items())]
    env = os.environ | {"PYTHONPATH": os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    print("starting:", " ".join(command), file=sys.stderr)
    return subprocess.Popen(command, stdout=log, stderr=log, env=env)


def get(url: str, timeout: float = 30) -> str:
    headers = {"Authorization": f"Bearer {FLAGS.api_key}"} if FLAGS.api_key else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers),
                                timeout=timeout) as response:
        return response.read().decode()


def wait_ready(root: str, process: subprocess.Popen | None, log: typing.IO | None) -> float:
    """Seconds until GET /health answers 200; raises if the server exits or times out."""
    started = time.perf_counter()
    while time.perf_counter() - started < FLAGS.startup_timeout:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}:\n{tail(log)}")
        try:
            get(root + "/health", timeout=5)
            return time.perf_counter() - started
        except OSError:
            time.sleep(1.0)
    raise TimeoutError(f"no /health after {FLAGS.startup_timeout} s:\n{tail(log)}")


async def bench_server(base_url: str, prompts: list[str], lengths: list[int]) -> list[dict]:
    root = base_url.rstrip("/").removesuffix("/v1")
    client = openai.AsyncOpenAI(base_url=base_url, api_key=FLAGS.api_key or "EMPTY",
                                max_retries=0, timeout=3600)
    model = (await client.models.list()).data[0].id
    # Warm-up as offline: the workload once, untimed (first runs of executables are slow).
    await run_rate(client, model, prompts, lengths, np.zeros(len(prompts)))
    runs = []
    for rate in (float(v) for v in FLAGS.request_rates):  # float("inf") is inf
        before = counters(get(root + "/metrics"))
        results, duration = await run_rate(client, model, prompts, lengths,
                                           arrival_offsets(len(prompts), rate, FLAGS.seed))
        after = counters(get(root + "/metrics"))
        runs.append({"request_rate": "inf" if math.isinf(rate) else rate,
                     **summarize(results, duration),
                     "metrics_delta": counter_deltas(before, after)})
        print(json.dumps(runs[-1]), file=sys.stderr)
    await client.close()
    return runs


def serve_and_bench(prompts: list[str], lengths: list[int]) -> tuple[dict, list[dict]]:
    if FLAGS.base_url:
        wait_ready(FLAGS.base_url.rstrip("/").removesuffix("/v1"), None, None)
        return ({"mode": "attached", "base_url": FLAGS.base_url},
                asyncio.run(bench_server(FLAGS.base_url, prompts, lengths)))
    with socket.socket() as sock:  # a free port
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.NamedTemporaryFile(prefix="bench_serving_", suffix=".log") as log:
        process = start_server(port, log)
        try:
            ready = wait_ready(f"http://127.0.0.1:{port}", process, log)
            runs = asyncio.run(bench_server(f"http://127.0.0.1:{port}/v1", prompts, lengths))
        finally:
            code = stop_server(process, log) if process.poll() is None else process.returncode
    return {"mode": "started", "port": port, "startup_s": round(ready, 1),
            "exit_code": code}, runs


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    runs = report["rates"]
    x = range(len(runs))
    fig, (latency, speed) = plt.subplots(1, 2, figsize=(11, 4))
    for metric, color in (("ttft_ms", "C0"), ("tpot_ms", "C1")):
        for q, style in (("p50", "o-"), ("p99", "s--")):
            ys = [np.nan if r[metric][q] is None else r[metric][q] for r in runs]
            latency.plot(x, ys, style, color=color,
                         label=f"{metric.removesuffix('_ms').upper()} {q}")
    latency.set(ylabel="ms", yscale="log", title="latency")
    speed.plot(x, [r["output_throughput"] for r in runs], "o-", label="server")
    if report["offline_baseline"]:
        speed.axhline(report["offline_baseline"]["output_throughput"], color="gray",
                      linestyle=":", label="offline LLM.generate")
    speed.set(ylabel="output tokens/s", title="throughput", ylim=(0, None))
    for axes in (latency, speed):
        axes.set_xticks(list(x), [str(r["request_rate"]) for r in runs])
        axes.set_xlabel("request rate (requests/s)")
        axes.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str]) -> None:
    del argv
    for name in ("httpx2", "openai"):  # a line per request otherwise
        logging.getLogger(name).setLevel(logging.WARNING)
    input_len = tuple(int(v) for v in FLAGS.input_len_range)
    output_len = tuple(int(v) for v in FLAGS.output_len_range)
    prompts, lengths = make_workload(FLAGS.num_prompts, input_len, output_len, FLAGS.seed)
    baseline = None if FLAGS.no_offline_baseline else offline_baseline(prompts, lengths)
    print(json.dumps({"offline_baseline": baseline}), file=sys.stderr)
    server, runs = serve_and_bench(prompts, lengths)
    settings = {"model": FLAGS.model, "num_prompts": FLAGS.num_prompts, "seed": FLAGS.seed,
                "input_len_range_chars": input_len, "output_len_range": output_len,
                "request_rates": FLAGS.request_rates, "engine": engine_settings(),
                "requested_output_tokens": sum(lengths)}
    report = build_report(settings, server, baseline, runs)
    report["plot"] = str(pathlib.Path(FLAGS.plot).resolve())
    plot(report, FLAGS.plot)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    define_flags()
    app.run(main)
