"""The Ray steps' dry runs (ray_up, ray_job, ray_down): every printed command, flag by flag,
on a v5e/v6e slice, two GPU VMs and a one-host TPU VM, and the splits the scripts refuse."""

from __future__ import annotations

import json
import pathlib
import shlex
import subprocess
import sys

import pytest
from dryrun import JAX_PIN, dry_run, find, flag, jaxinfer_runs, remote, run_script

MODEL = "--model=gs://bucket/models/Llama-3.1-8B"


def parts(cmd: list[str]) -> list[str]:
    """The `; `-separated shell commands of an ssh --command."""
    return remote(cmd).split("; ")


def argv_of(cmd: list[str], words: str) -> list[str]:
    """The argv of the one part of cmd's --command that starts with `words`."""
    (part,) = [p for p in parts(cmd) if p.startswith(words)]
    return shlex.split(part)


def running(cmds: list[list[str]], words: str) -> list[list[str]]:
    """The ssh commands one of whose --command parts starts with `words`."""
    return [cmd for cmd in cmds if flag(cmd, "--command")
            and any(p.startswith(words) for p in parts(cmd))]


def ray_start_flags(cmd: list[str]) -> list[str]:
    argv = argv_of(cmd, "jaxinfer-venv/bin/ray start")
    assert argv[:2] == ["jaxinfer-venv/bin/ray", "start"]
    return argv[2:]


def tpu_resources(flags: list[str]) -> dict:
    (resources,) = [f.split("=", 1)[1] for f in flags if f.startswith("--resources=")]
    return json.loads(resources)


def check_code(cmd: list[str]) -> str:
    argv = argv_of(cmd, "jaxinfer-venv/bin/python -c")
    compile(argv[2], "<ray check>", "exec")  # the code the head runs is valid Python
    return argv[2]


def install_lines(cmds: list[list[str]]) -> list[list[str]]:
    return [shlex.split(p) for cmd in running(cmds, "jaxinfer-venv/bin/python -m pip install")
            for p in parts(cmd) if "-m pip install" in p and " -e " in p]


@pytest.mark.parametrize(("accelerator", "workers"), [("v5litepod-16", 4), ("v6e-32", 8)])
def test_ray_cluster_on_a_tpu_slice(fake_path, accelerator, workers):
    cmds, out = dry_run(fake_path, "tpu_slice", "ray_all", "ray_down",
                        f"--accelerator_type={accelerator}", "--zone=us-west4-a", MODEL,
                        "--input=requests.jsonl", "--output=out/results.jsonl")
    on_hosts = find(cmds, "gcloud", "compute", "tpus", "tpu-vm")
    for line in install_lines(cmds):
        assert line[-4:] == [f"jax[tpu]=={JAX_PIN}", "libtpu==0.0.42.1", "-e",
                             "./jaxinfer[ray]"]
    (prepare,) = running(cmds, "test -x jaxinfer-venv/bin/ray")
    assert flag(prepare, "--worker") == "all" and "jaxinfer-venv/bin/ray stop" in parts(prepare)
    (token,) = [cmd for cmd in on_hosts if cmd[6:7] == ["jaxinfer-slice:.ray/auth_token"]]
    assert token[5].endswith("jaxinfer-ray-auth-token") and flag(token, "--worker") == "all"

    head, joins = running(cmds, "jaxinfer-venv/bin/ray start")
    assert flag(head, "--worker") == "0" and flag(joins, "--worker") == f"1-{workers - 1}"
    for cmd in (head, joins):
        assert "export RAY_AUTH_MODE=token" in parts(cmd)
        assert "export TPU_HOST_BOUNDS=1,1,1 TPU_CHIPS_PER_HOST_BOUNDS=2,2,1" in parts(cmd)
        assert tpu_resources(ray_start_flags(cmd)) == {"TPU": 4}
        assert "--disable-usage-stats" in ray_start_flags(cmd)
    assert {"--head", "--port=6379", "--include-dashboard=false"} <= set(ray_start_flags(head))
    assert "--address=WORKER_0_IP:6379" in ray_start_flags(joins)
    assert "--head" not in ray_start_flags(joins)
    (describe,) = find(cmds, "gcloud", "compute", "tpus", "tpu-vm", "describe")
    assert describe[5] == "jaxinfer-slice" and flag(describe, "--zone") == "us-west4-a"
    assert flag(describe, "--format") == "value(networkEndpoints[0].ipAddress)"
    assert "what this prints replaces WORKER_0_IP" in out
    (check,) = running(cmds, "jaxinfer-venv/bin/python -c")
    assert flag(check, "--worker") == "0" and f"n=={workers} " in check_code(check)

    (copy,) = [cmd for cmd in on_hosts if cmd[5:7] == ["requests.jsonl",
                                                       "jaxinfer-slice:jaxinfer-io/input.jsonl"]]
    assert flag(copy, "--worker") == "0"  # the driver alone reads the input
    (driver,) = running(cmds, "jaxinfer-venv/bin/python -m jaxinfer batch")
    assert flag(driver, "--worker") == "0" and "export RAY_AUTH_MODE=token" in parts(driver)
    (run,) = jaxinfer_runs(cmds)
    assert run[:6] == ["jaxinfer-venv/bin/python", "-m", "jaxinfer", "batch", "--ray",
                       "--ray_address=auto"]
    assert f"--num_replicas={workers}" in run and "--tensor_parallel_size=4" in run
    assert "--model=$HOME/models/Llama-3.1-8B" in run  # "$HOME" expands on the host
    assert "--input=jaxinfer-io/input.jsonl" in run and "--output=jaxinfer-io/results.jsonl" in run
    assert not [a for a in run if a.startswith(("--coordinator_address", "--detect_distributed"))]
    fetch = find(cmds, "gcloud", "compute", "tpus", "tpu-vm", "scp")[-1]
    assert fetch[5:7] == ["jaxinfer-slice:jaxinfer-io/results.jsonl", "out/results.jsonl"]
    assert flag(fetch, "--worker") == "0"
    down = cmds[-1]
    assert flag(down, "--worker") == "all" and parts(down)[-1] == "jaxinfer-venv/bin/ray stop"
    order = [cmds.index(c) for c in (prepare, token, head, describe, joins, check, copy, driver,
                                     fetch, down)]
    assert order == sorted(order)


@pytest.mark.parametrize(("tp", "replicas"), [("1", 16), ("2", 8), ("4", 4)])
def test_replicas_default_to_what_fits(fake_path, tp, replicas):
    cmds, out = dry_run(fake_path, "tpu_slice", "ray_job", "--accelerator_type=v6e-16",
                        "--zone=us-east5-b", MODEL, "--input=gs://b/in.jsonl",
                        f"--tensor_parallel_size={tp}")
    (run,) = jaxinfer_runs(cmds)
    assert f"--num_replicas={replicas}" in run and f"--tensor_parallel_size={tp}" in run
    assert f"{replicas} replica(s) of --tensor_parallel_size={tp}" in out
    (copy,) = running(cmds, "mkdir -p jaxinfer-io")
    assert flag(copy, "--worker") == "0"
    assert parts(copy)[-1] == "gcloud storage cp gs://b/in.jsonl jaxinfer-io/input.jsonl"
    cmds, _ = dry_run(fake_path, "tpu_slice", "ray_job", "--accelerator_type=v6e-16",
                      "--zone=us-east5-b", MODEL, "--input=in.jsonl", "--num_replicas=3")
    assert "--num_replicas=3" in jaxinfer_runs(cmds)[0]


def test_ray_cluster_on_two_gpu_vms(fake_path):
    cmds, out = dry_run(fake_path, "gpu_vm", "ray_all", "ray_down", "--num_nodes=2",
                        "--machine_type=a3-highgpu-8g", "--zone=us-central1-a", MODEL,
                        "--input=in.jsonl", "--tensor_parallel_size=2")
    (create,) = find(cmds, "gcloud", "compute", "instances", "create")
    assert create[4:6] == ["jaxinfer-gpu-0", "jaxinfer-gpu-1"]
    lines = install_lines(cmds)
    assert len(lines) == 2 and all(line[-3:] == [f"jax[cuda12]=={JAX_PIN}", "-e",
                                                 "./jaxinfer[ray]"] for line in lines)
    prepare = running(cmds, "test -x jaxinfer-venv/bin/ray")
    assert [cmd[3] for cmd in prepare] == ["jaxinfer-gpu-0", "jaxinfer-gpu-1"]
    tokens = [cmd for cmd in find(cmds, "gcloud", "compute", "scp")
              if cmd[4].endswith(":.ray/auth_token")]
    assert [cmd[4] for cmd in tokens] == ["jaxinfer-gpu-0:.ray/auth_token",
                                          "jaxinfer-gpu-1:.ray/auth_token"]
    head, join = running(cmds, "jaxinfer-venv/bin/ray start")
    assert head[3] == "jaxinfer-gpu-0" and join[3] == "jaxinfer-gpu-1"
    for cmd in (head, join):
        assert "--num-gpus=8" in ray_start_flags(cmd)
        assert not [f for f in ray_start_flags(cmd) if f.startswith("--resources")]
        assert not [p for p in parts(cmd) if "TPU_HOST_BOUNDS" in p]
    assert "--head" in ray_start_flags(head)
    assert "--address=WORKER_0_IP:6379" in ray_start_flags(join)
    (describe,) = find(cmds, "gcloud", "compute", "instances", "describe")
    assert describe[4] == "jaxinfer-gpu-0"
    assert flag(describe, "--format") == "value(networkInterfaces[0].networkIP)"
    assert cmds.index(head) < cmds.index(describe) < cmds.index(join)
    (check,) = running(cmds, "jaxinfer-venv/bin/python -c")
    assert check[3] == "jaxinfer-gpu-0" and "n==2 " in check_code(check)
    (copy,) = [cmd for cmd in find(cmds, "gcloud", "compute", "scp") if cmd[3] == "in.jsonl"]
    assert copy[4] == "jaxinfer-gpu-0:jaxinfer-io/input.jsonl"
    (driver,) = running(cmds, "jaxinfer-venv/bin/python -m jaxinfer batch")
    assert driver[3] == "jaxinfer-gpu-0"
    (run,) = jaxinfer_runs(cmds)
    assert "--num_replicas=8" in run and "--tensor_parallel_size=2" in run  # 2 x 8 GPUs / 2
    assert not [a for a in run if a.startswith(("--coordinator_address", "--process_id"))]
    downs = running(cmds, "jaxinfer-venv/bin/ray stop")  # ray_up's first command stops too
    assert [cmd[3] for cmd in downs[-2:]] == ["jaxinfer-gpu-0", "jaxinfer-gpu-1"]
    assert all(parts(cmd) == ['set -euo pipefail', 'cd "$HOME"', "jaxinfer-venv/bin/ray stop"]
               for cmd in downs[-2:])
    assert "the next 2 commands run at the same time" in out


@pytest.mark.parametrize(("args", "tp", "replicas"), [
    (("--accelerator_type=v5litepod-8",), 8, 1),
    (("--accelerator_type=v5litepod-8", "--tensor_parallel_size=2"), 2, 4),
    (("--accelerator_type=v6e-8",), 8, 1),
])
def test_one_tpu_vm_is_a_one_node_cluster(fake_path, args, tp, replicas):
    cmds, _ = dry_run(fake_path, "tpu_vm", "ray_up", "ray_job", "--zone=us-west4-a", MODEL,
                      "--input=in.jsonl", *args)
    (head,) = running(cmds, "jaxinfer-venv/bin/ray start")
    assert "--head" in ray_start_flags(head) and tpu_resources(ray_start_flags(head)) == {"TPU": 8}
    assert not [p for p in parts(head) if "TPU_HOST_BOUNDS" in p]  # a whole host already
    assert not [cmd for cmd in cmds if "describe" in cmd]  # no other host to join
    assert "n==1 " in check_code(running(cmds, "jaxinfer-venv/bin/python -c")[0])
    (run,) = jaxinfer_runs(cmds)
    assert f"--num_replicas={replicas}" in run and f"--tensor_parallel_size={tp}" in run


def test_ray_flag_adds_the_extra_and_makes_fetch_a_batch_fetch(fake_path):
    cmds, _ = dry_run(fake_path, "tpu_slice", "install", "fetch", "--ray", "--zone=us-west4-a")
    (line,) = {tuple(line) for line in install_lines(cmds)}
    assert line[-2:] == ("-e", "./jaxinfer[ray]")
    assert find(cmds, "gcloud", "compute", "tpus", "tpu-vm", "scp")[-1][5:7] == [
        "jaxinfer-slice:jaxinfer-io/results.jsonl", "results.jsonl"]
    cmds, _ = dry_run(fake_path, "tpu_slice", "install", "--zone=us-west4-a")
    assert install_lines(cmds)[0][-2:] == ["-e", "./jaxinfer"]


@pytest.mark.parametrize(("script", "args", "message"), [
    ("tpu_slice", ("--tensor_parallel_size=3",),
     "--tensor_parallel_size=3 does not divide the 4 chips of a host"),
    ("tpu_slice", ("--tensor_parallel_size=8",),
     "a Ray replica is one process on one host, which has 4 chips"),
    ("tpu_vm", ("--accelerator_type=v6e-8", "--tensor_parallel_size=3"),
     "does not divide the 8 chips of a host: every host would leave 2 idle; use one of "
     "[1, 2, 4, 8]"),
    ("gpu_vm", ("--machine_type=g2-standard-48", "--tensor_parallel_size=3"),
     "does not divide the 4 GPUs of a host"),
    ("gpu_vm", ("--num_nodes=2", "--tensor_parallel_size=8", "--num_replicas=3"),
     "--num_replicas=3: 2 host(s) x 8 GPUs hold 1 to 2 replicas"),
    ("gpu_vm", ("--num_replicas=0",), "--num_replicas=0"),
    ("tpu_slice", ("--task=generate",), "--task=generate does not apply"),
])
def test_bad_ray_splits_are_refused_before_any_command(fake_path, script, args, message):
    proc = run_script(script, "ray_all", "--zone=us-west4-a", MODEL, "--input=in.jsonl", *args,
                      path=fake_path[0])
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert "$ " not in proc.stdout


@pytest.mark.parametrize(("steps", "args", "message"), [
    (("run", "ray_job"), (MODEL, "--input=in.jsonl"), "ask for one of them"),
    (("ray_job",), (MODEL,), "needs --input"),
    (("ray_job",), ("--input=in.jsonl",), "need --model"),
])
def test_ray_job_needs_its_flags(fake_path, steps, args, message):
    proc = run_script("tpu_slice", *steps, "--zone=us-west4-a", *args, path=fake_path[0])
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert "$ " not in proc.stdout


def test_ray_commands_are_valid_bash(fake_path):
    commands = set()
    for script, *args in [("tpu_slice", "--input=gs://b/in.jsonl"), ("tpu_vm", "--input=in"),
                          ("gpu_vm", "--num_nodes=3", "--input=in.jsonl")]:
        cmds, _ = dry_run(fake_path, script, "ray_all", "ray_down", "--zone=us-west4-a", MODEL,
                          *args)
        commands |= {remote(cmd) for cmd in cmds if flag(cmd, "--command")}
    assert len(commands) >= 15
    for command in commands:
        proc = subprocess.run(["bash", "-n", "-c", command], capture_output=True, text=True)
        assert proc.returncode == 0, (command, proc.stderr)


RAY = pathlib.Path(sys.executable).parent / "ray"


@pytest.mark.skipif(not RAY.exists(), reason="no ray next to this Python (the [ray] extra)")
def test_ray_start_flags_exist_in_the_installed_ray(fake_path):
    """Every flag the scripts give `ray start` is in `ray start --help` of the installed Ray."""
    used = set()
    for script, *args in [("tpu_slice",), ("gpu_vm", "--num_nodes=2")]:
        cmds, _ = dry_run(fake_path, script, "ray_up", "--zone=us-west4-a", *args)
        for cmd in running(cmds, "jaxinfer-venv/bin/ray start"):
            used |= {f.split("=", 1)[0] for f in ray_start_flags(cmd)}
    assert len(used) == 7, used
    help_text = subprocess.run([str(RAY), "start", "--help"], capture_output=True, text=True,
                               timeout=120).stdout
    known = {word for line in help_text.splitlines() for word in line.split()
             if word.startswith("--")}
    assert used <= known, used - known


def fake_gcloud_printing(tmp_path: pathlib.Path, ip: str) -> tuple[str, pathlib.Path]:
    """A PATH whose gcloud records every call (one line, arguments ending in \\x1f) and
    prints `ip` for `describe`."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    gcloud = bin_dir / "gcloud"
    gcloud.write_text(f"#!/bin/sh\nfor a in gcloud \"$@\"; do printf '%s\\037' \"$a\"; done "
                      f'>> {calls}\necho >> {calls}\n'
                      f'case "$*" in *describe*) echo "{ip}";; esac\nexit 0\n')
    gcloud.chmod(0o755)
    return str(bin_dir), calls


def test_a_real_ray_up_substitutes_worker_0_ip(tmp_path):
    """Not a dry run: gcloud is a fake whose describe prints an IP; the joins get it."""
    path, calls = fake_gcloud_printing(tmp_path, "10.128.0.7")
    proc = run_script("tpu_slice", "ray_up", "--zone=us-west4-a", path=path, dry_run=False)
    assert proc.returncode == 0, proc.stderr
    called = [line.split("\x1f")[:-1] for line in calls.read_text().splitlines()]
    (join,) = [c for c in called if flag(c, "--worker") == "1-3"]
    assert "--address=10.128.0.7:6379" in ray_start_flags(join)
    (token,) = [c for c in called if c[6:7] == ["jaxinfer-slice:.ray/auth_token"]]
    assert not pathlib.Path(token[5]).exists()  # the local copy of the token is deleted


def test_a_describe_that_prints_no_ip_stops_ray_up(tmp_path):
    path, calls = fake_gcloud_printing(tmp_path, "")
    proc = run_script("gpu_vm", "ray_up", "--num_nodes=2", "--zone=us-central1-a", path=path,
                      dry_run=False)
    assert proc.returncode == 2 and "not an IPv4 address" in proc.stderr
    assert "--address=" not in calls.read_text()  # no host was asked to join
