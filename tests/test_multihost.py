"""Multi-host on one machine: two processes joined by `jax.distributed` on 127.0.0.1,
4 CPU devices each, with tensor parallelism over all 8 or pipeline parallelism of 2
stages x tensor parallelism of 4 (stage 0 on process 0's devices, stage 1 on process
1's, activations handed between the processes), write exactly what one process with 8
CPU devices and the same flags writes; only process 0 writes; processes given different
settings refuse to start; a process killed mid-run stops the other with an error.

The processes are CLI subprocesses; the test harness (never the package) sets their
device count through JAX's own JAX_NUM_CPU_DEVICES.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from jaxinfer import distributed, testing
from jaxinfer.config import DistributedConfig

ROOT = pathlib.Path(__file__).resolve().parent.parent
TIMEOUT_S = 300  # a hang fails the test instead of the CI job
ENGINE = ["--max_num_seqs=2", "--max_num_batched_tokens=16", "--max_model_len=64",
          "--compilation_cache_dir="]
# how the 8 devices split the model: tensor parallel over all, or 2 pipeline stages (one
# a process) of 4
LAYOUTS = {"tp8": ["--tensor_parallel_size=8"],
           "pp2-tp4": ["--pipeline_parallel_size=2", "--tensor_parallel_size=4"]}
REQUESTS = [
    {"id": "greedy", "prompt": "def read(path):", "max_tokens": 12, "temperature": 0.0},
    {"id": "seeded", "prompt": "import os", "max_tokens": 12, "temperature": 0.8, "seed": 3},
    {"id": "unseeded", "prompt": [5, 6, 7, 8], "max_tokens": 10, "temperature": 1.0,
     "top_k": 20},  # its seed comes from EngineConfig.seed: the same on every process
    {"id": "two", "prompt": "x = ", "max_tokens": 6, "temperature": 0.7, "n": 2},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("tp8-llama")
    testing.make_hf_model(path, "llama", num_attention_heads=8, num_key_value_heads=2)
    return path


def _write_jsonl(path: pathlib.Path, records: list[dict]) -> pathlib.Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _batch(model: pathlib.Path, inp: pathlib.Path, out: pathlib.Path, *extra: str,
           layout: str = "tp8") -> list[str]:
    return [sys.executable, "-m", "jaxinfer", "batch", f"--model={model}", f"--input={inp}",
            f"--output={out}", "--format=json", *ENGINE, *LAYOUTS[layout], *extra]


def _env(num_devices: int) -> dict[str, str]:
    return dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(num_devices))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_pair(commands: list[list[str]], *extra: str) -> list[subprocess.Popen]:
    """Start the commands as processes 0, 1, ... of one job on 127.0.0.1, 4 devices each."""
    job = [f"--coordinator_address=127.0.0.1:{_free_port()}",
           f"--num_processes={len(commands)}", *extra]
    return [subprocess.Popen([*command, *job, f"--process_id={i}"], cwd=ROOT, env=_env(4),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for i, command in enumerate(commands)]


def _finish(procs: list[subprocess.Popen]) -> list[tuple[int, str]]:
    """(exit code, stderr) of each process; kills them all if one outlives TIMEOUT_S."""
    try:
        stderrs = [p.communicate(timeout=TIMEOUT_S)[1] for p in procs]
        return [(p.returncode, stderr) for p, stderr in zip(procs, stderrs, strict=True)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_processes_write_what_one_process_writes(model_dir, tmp_path, layout):
    inp = _write_jsonl(tmp_path / "in.jsonl", REQUESTS)
    ref = subprocess.run(_batch(model_dir, inp, tmp_path / "ref.jsonl", layout=layout),
                         cwd=ROOT, env=_env(8), capture_output=True, text=True,
                         timeout=TIMEOUT_S)
    assert ref.returncode == 0, ref.stderr
    outs = [tmp_path / f"out{i}.jsonl" for i in range(2)]
    results = _finish(_start_pair([_batch(model_dir, inp, out, layout=layout)
                                   for out in outs]))
    for i, (code, stderr) in enumerate(results):
        assert code == 0, f"process {i}: {stderr}"
    want = (tmp_path / "ref.jsonl").read_text().splitlines()
    assert [json.loads(line)["id"] for line in want] != []
    assert outs[0].read_text().splitlines() == want  # tokens, text, in the same order
    assert not outs[1].exists()  # only process 0 writes
    assert '"done": 4' in results[0][1] and '"done"' not in results[1][1]


def test_two_processes_keep_their_host_tiers_in_step(model_dir, tmp_path):
    """Four 3-page preambles asked twice, round-robin, through a pool of 11 pages (two
    requests in flight take 8): the repeats hit pages restored from each process's own
    host tier (its devices' shards), and the outputs are one process's."""
    preambles = [f"# module {i}: " + "abcdefgh"[i] * 36 for i in range(4)]
    records = [{"id": f"p{p}q{q}", "prompt": preamble + f" q{q}", "max_tokens": 4,
                "temperature": 0.0} for q in range(2) for p, preamble in enumerate(preambles)]
    inp = _write_jsonl(tmp_path / "in.jsonl", records)
    offload = ["--dtype=float32", f"--kv_cache_memory_bytes={12 * 16 * 2048}",
               "--kv_offloading_size=0.01"]  # 2,048 K/V bytes a token over the 8 devices
    ref = subprocess.run(_batch(model_dir, inp, tmp_path / "ref.jsonl", *offload),
                         cwd=ROOT, env=_env(8), capture_output=True, text=True,
                         timeout=TIMEOUT_S)
    assert ref.returncode == 0, ref.stderr
    outs = [tmp_path / f"out{i}.jsonl" for i in range(2)]
    results = _finish(_start_pair([_batch(model_dir, inp, out, *offload) for out in outs]))
    for i, (code, stderr) in enumerate(results):
        assert code == 0, f"process {i}: {stderr}"
    assert outs[0].read_text() == (tmp_path / "ref.jsonl").read_text()
    hits = re.findall(r'"prefix_cache_host_hit_tokens": (\d+)', results[0][1] + ref.stderr)
    assert len(hits) == 2 and hits[0] == hits[1] and int(hits[0]) >= 4 * 16


def test_generate_across_two_stages_prints_what_one_process_prints(model_dir):
    """`generate` with a pipeline stage on each process: process 0 prints one process's
    completion (greedy), process 1 nothing."""
    command = [sys.executable, "-m", "jaxinfer", "generate", f"--model={model_dir}",
               "--prompt=def read(path):", "--max_tokens=12", "--temperature=0", *ENGINE,
               *LAYOUTS["pp2-tp4"]]
    ref = subprocess.run(command, cwd=ROOT, env=_env(8), capture_output=True, text=True,
                         timeout=TIMEOUT_S)
    assert ref.returncode == 0, ref.stderr
    procs = _start_pair([command] * 2)
    try:
        outputs = [p.communicate(timeout=TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for i, (p, (_, stderr)) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0, f"process {i}: {stderr}"
    # Gloo's connection lines go to stdout too (its C++ logging, from several threads,
    # cut anywhere), all written while the processes join, before the completion
    assert ref.stdout.startswith("def read(path):")
    assert outputs[0][0].endswith(ref.stdout)
    assert "def read(path):" not in outputs[1][0]


def test_processes_given_different_settings_refuse_to_start(model_dir, tmp_path):
    inp = _write_jsonl(tmp_path / "in.jsonl", REQUESTS[:1])
    results = _finish(_start_pair([_batch(model_dir, inp, tmp_path / "out.jsonl", "--seed=1"),
                                   _batch(model_dir, inp, tmp_path / "out.jsonl", "--seed=2")]))
    for code, stderr in results:
        assert code == 1, stderr
        assert "differ between processes: process(es) [1] disagree with process 0" in stderr


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_killed_process_stops_the_other_with_an_error(model_dir, tmp_path, layout):
    requests = [{"id": str(i), "prompt": "x" * (1 + i % 5), "max_tokens": 50,
                 "temperature": 0.0} for i in range(40)]
    inp = _write_jsonl(tmp_path / "in.jsonl", requests)
    out = tmp_path / "out.jsonl"
    procs = _start_pair([_batch(model_dir, inp, out, layout=layout)] * 2,
                        "--heartbeat_timeout_s=10")
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline and not (out.exists() and out.read_text()):
        time.sleep(0.1)  # until steps run and results come
    procs[1].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    (code, stderr), _ = _finish(procs)
    assert code != 0 and time.monotonic() - killed < 60
    assert len(out.read_text().splitlines()) < len(requests)  # it stopped mid-run
    assert "Gloo" in stderr or "distributed service" in stderr


def test_single_process_needs_no_job():
    assert not distributed.initialize(DistributedConfig())
    assert distributed.is_primary()
    distributed.check_same("anything", "this process's own")
    assert distributed.broadcast_from_primary("kept") == "kept"


@pytest.mark.parametrize(("settings", "message"), [
    (dict(coordinator_address="h:1"), "give all of"),
    (dict(num_processes=2, process_id=0), "give all of"),
    (dict(coordinator_address="h:1", num_processes=2, process_id=0, detect_distributed=True),
     "not both"),
    (dict(coordinator_address="h:1", num_processes=2, process_id=2), "process_id"),
    (dict(coordinator_address="h:1", num_processes=0, process_id=0), "num_processes"),
    (dict(coordinator_address="nohost", num_processes=2, process_id=0), "host:port"),
    (dict(heartbeat_timeout_s=0), "heartbeat_timeout_s"),
])
def test_distributed_config_rejects(settings, message):
    with pytest.raises(ValueError, match=message):
        DistributedConfig(**settings)


def test_distributed_config_enabled():
    assert not DistributedConfig().enabled
    assert DistributedConfig(detect_distributed=True).enabled
    assert DistributedConfig(coordinator_address="10.0.0.1:1234", num_processes=2,
                             process_id=1).enabled
