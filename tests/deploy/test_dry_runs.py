"""The deploy scripts' dry runs: every printed command, checked flag by flag.

Each test runs a script in a subprocess with `--dry_run` and a PATH whose only `gcloud`,
`git`, `ssh`, `scp` and `curl` are fakes that record any call, then parses the `$ ...` lines
with shlex. Nothing here talks to Google Cloud; the gcloud syntax itself is checked against
an installed Cloud SDK's `--help` only in the slow test at the end.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys

import pytest
from dryrun import (
    ALL,
    JAX_PIN,
    LIBTPU_PIN,
    REPO,
    V6E,
    dry_run,
    find,
    flag,
    install_line,
    jaxinfer_runs,
    remote,
    run_script,
)


def test_tpu_vm_v6e_is_a_compute_engine_instance(fake_path):
    cmds, _ = dry_run(fake_path, "tpu_vm", *ALL, *V6E)
    (create,) = find(cmds, "gcloud", "compute", "instances", "create")
    assert create[4] == "jaxinfer-tpu"
    assert flag(create, "--machine-type") == "ct6e-standard-8t"
    assert flag(create, "--image-family") == "ubuntu-accel-2204-amd64-tpu-v5e-v5p-v6e"
    assert flag(create, "--image-project") == "ubuntu-os-accelerator-images"
    assert flag(create, "--maintenance-policy") == "TERMINATE"
    assert flag(create, "--zone") == "us-east5-b" and flag(create, "--project") == "my-project"
    assert not find(cmds, "gcloud", "compute", "tpus")  # not the Cloud TPU API
    assert install_line(cmds)[-4:] == [f"jax[tpu]=={JAX_PIN}", f"libtpu=={LIBTPU_PIN}", "-e",
                                       "./jaxinfer"]
    (run,) = jaxinfer_runs(cmds)
    assert run[:4] == ["jaxinfer-venv/bin/python", "-m", "jaxinfer", "generate"]
    assert "--tensor_parallel_size=8" in run and "--model=models/Qwen3-8B" in run
    assert "--detect_distributed" not in run  # one host, one process
    assert cmds[0] == create and find(cmds, "gcloud", "compute", "instances", "delete") == [
        cmds[-1]]
    assert "--quiet" in cmds[-1]


def test_pins_are_the_ones_asked_for():
    assert JAX_PIN == "0.10.2" and LIBTPU_PIN == "0.0.42.1"


def test_tpu_vm_v6e_4_defaults_to_four_chips_and_takes_an_override(fake_path):
    cmds, _ = dry_run(fake_path, "tpu_vm", "create", "run", "--accelerator_type=v6e-4", *V6E)
    assert flag(find(cmds, "gcloud", "compute", "instances", "create")[0],
                "--machine-type") == "ct6e-standard-4t"
    assert "--tensor_parallel_size=4" in jaxinfer_runs(cmds)[0]
    cmds, _ = dry_run(fake_path, "tpu_vm", "run", "--tensor_parallel_size=2", *V6E)
    assert "--tensor_parallel_size=2" in jaxinfer_runs(cmds)[0]


def test_tpu_vm_v5e_goes_through_queued_resources(fake_path):
    cmds, out = dry_run(fake_path, "tpu_vm", *ALL, "--accelerator_type=v5litepod-8", "--spot",
                        "--zone=us-west4-a", "--model=/data/models/Llama-3.1-8B")
    (create,) = find(cmds, "gcloud", "compute", "tpus", "queued-resources", "create")
    assert create[5] == "jaxinfer-tpu-qr" and flag(create, "--node-id") == "jaxinfer-tpu"
    assert flag(create, "--accelerator-type") == "v5litepod-8"
    assert flag(create, "--runtime-version") == "v2-alpha-tpuv5-lite"
    assert "--spot" in create
    (describe,) = find(cmds, "gcloud", "compute", "tpus", "queued-resources", "describe")
    assert flag(describe, "--format") == "value(state.state)" and "ACTIVE" in out
    (scp_model,) = [cmd for cmd in find(cmds, "gcloud", "compute", "tpus", "tpu-vm", "scp")
                    if "--recurse" in cmd]
    assert "/data/models/Llama-3.1-8B" in scp_model and "jaxinfer-tpu:models/" in scp_model
    assert "--tensor_parallel_size=8" in jaxinfer_runs(cmds)[0]
    (delete,) = find(cmds, "gcloud", "compute", "tpus", "queued-resources", "delete")
    assert delete[5] == "jaxinfer-tpu-qr" and "--force" in delete and cmds[-1] == delete


def test_tpu_vm_v6e_through_the_tpu_api_uses_its_runtime(fake_path):
    cmds, _ = dry_run(fake_path, "tpu_vm", "create", "--api=tpu", *V6E)
    (create,) = find(cmds, "gcloud", "compute", "tpus", "queued-resources", "create")
    assert flag(create, "--accelerator-type") == "v6e-8"
    assert flag(create, "--runtime-version") == "v2-alpha-tpuv6e"


def test_tpu_vm_refuses_v5e_on_compute_engine(fake_path):
    proc = run_script("tpu_vm", "create", "--api=compute", "--accelerator_type=v5litepod-8",
                      "--zone=us-west4-a", path=fake_path[0])
    assert proc.returncode == 2 and "no v5e machine type" in proc.stderr
    assert "$ " not in proc.stdout


@pytest.mark.parametrize(("accelerator", "chips", "workers", "runtime"), [
    ("v5litepod-16", 16, 4, "v2-alpha-tpuv5-lite"),
    ("v6e-32", 32, 8, "v2-alpha-tpuv6e"),
])
def test_tpu_slice_starts_one_process_per_worker(fake_path, accelerator, chips, workers, runtime):
    cmds, out = dry_run(fake_path, "tpu_slice", *ALL, f"--accelerator_type={accelerator}",
                        "--zone=us-central2-b", "--model=gs://bucket/models/Llama-3.1-70B",
                        "--task=batch", "--input=requests.jsonl", "--output=out/results.jsonl")
    (create,) = find(cmds, "gcloud", "compute", "tpus", "queued-resources", "create")
    assert flag(create, "--accelerator-type") == accelerator
    assert flag(create, "--runtime-version") == runtime
    assert f"{chips} chips on {workers} workers" in out
    on_hosts = find(cmds, "gcloud", "compute", "tpus", "tpu-vm")
    fetch = find(cmds, "gcloud", "compute", "tpus", "tpu-vm", "scp")[-1]
    assert fetch[5:7] == ["jaxinfer-slice:jaxinfer-io/results.jsonl", "out/results.jsonl"]
    assert flag(fetch, "--worker") == "0"  # only process 0 writes results
    assert all(flag(cmd, "--worker") == "all" for cmd in on_hosts if cmd is not fetch)
    (run,) = jaxinfer_runs(cmds)
    assert run[3] == "batch" and f"--tensor_parallel_size={chips}" in run
    assert "--input=jaxinfer-io/input.jsonl" in run and "--output=jaxinfer-io/results.jsonl" in run
    assert not [arg for arg in run if arg.startswith(("--coordinator_address", "--num_processes",
                                                      "--process_id"))]
    assert "--detect_distributed" in run  # jaxinfer joins a multi-host job only when asked
    assert len(install_line(cmds)) and "import jax" not in out  # no device probe on a slice


@pytest.mark.parametrize(("cuda", "image_family"), [
    ("12", "common-cu128-ubuntu-2204-nvidia-570"),
    ("13", "common-cu129-ubuntu-2204-nvidia-580"),
])
def test_gpu_vm_installs_the_cuda_extra_of_the_pinned_jax(fake_path, cuda, image_family):
    cmds, _ = dry_run(fake_path, "gpu_vm", *ALL, f"--cuda={cuda}", "--zone=us-central1-a",
                      "--model=gs://bucket/models/Llama-3.1-70B")
    (create,) = find(cmds, "gcloud", "compute", "instances", "create")
    assert flag(create, "--machine-type") == "a3-highgpu-8g"
    assert flag(create, "--image-family") == image_family
    assert flag(create, "--image-project") == "deeplearning-platform-release"
    assert flag(create, "--metadata") == "install-nvidia-driver=True"
    assert flag(create, "--accelerator") is None  # A3/A2/G2 come with their GPUs
    assert install_line(cmds)[-3:] == [f"jax[cuda{cuda}]=={JAX_PIN}", "-e", "./jaxinfer"]
    installs = [remote(cmd) for cmd in cmds if flag(cmd, "--command") and "pip install" in
                remote(cmd)]
    assert installs[0].index("nvidia-smi") < installs[0].index("pip install")  # driver first
    assert "--tensor_parallel_size=8" in jaxinfer_runs(cmds)[0]


@pytest.mark.parametrize(("machine", "gpus"), [("g2-standard-24", 2), ("a2-ultragpu-4g", 4),
                                               ("g2-standard-8", 1)])
def test_gpu_vm_tensor_parallel_size_is_the_gpu_count(fake_path, machine, gpus):
    cmds, _ = dry_run(fake_path, "gpu_vm", "run", f"--machine_type={machine}",
                      "--zone=us-central1-a", "--model=gs://bucket/models/Qwen3-8B")
    assert f"--tensor_parallel_size={gpus}" in jaxinfer_runs(cmds)[0]


def test_tpu_slice_serves_from_every_worker_and_stops_them_all(fake_path):
    cmds, out = dry_run(fake_path, "tpu_slice", "run", "stop", "fetch", "--task=serve",
                        "--port=8080", "--accelerator_type=v5litepod-16",
                        "--zone=us-west4-a", "--model=gs://bucket/models/Llama-3.1-70B")
    ssh = find(cmds, "gcloud", "compute", "tpus", "tpu-vm", "ssh")
    run_ssh, stop_ssh = ssh[-2:]
    assert all(flag(cmd, "--worker") == "all" for cmd in ssh)
    (run,) = jaxinfer_runs([run_ssh])
    assert run[:4] == ["jaxinfer-venv/bin/python", "-m", "jaxinfer", "serve"]
    assert "--detect_distributed" in run and "--tensor_parallel_size=16" in run
    assert "--host=0.0.0.0" in run and "--port=8080" in run
    assert not [a for a in run if a.split("=")[0] in ("--coordinator_address",
                                                      "--num_processes", "--process_id")]
    parts = remote(run_ssh).split("; ")
    assert parts[-2] == "echo $$ > jaxinfer-io/serve.pid" and parts[-1].startswith("exec ")
    assert "kill -TERM $(cat jaxinfer-io/serve.pid)" in remote(stop_ssh).split("; ")
    assert "process 0 (the first host) answers HTTP on 0.0.0.0:8080" in out
    assert "--worker=0 --zone=us-west4-a -- -N -L 8080:localhost:8080" in out
    assert not find(cmds, "gcloud", "compute", "tpus", "tpu-vm", "scp")  # nothing fetched


@pytest.mark.parametrize(("args", "message"), [
    (("stop",), "needs --task=serve"),
    (("ray_job", "--task=serve", "--input=in.jsonl"), "--task=serve does not apply"),
    (("run", "--task=serve", "--port=70000"), "--port=70000"),
])
def test_serving_mistakes_are_refused(fake_path, args, message):
    proc = run_script("tpu_slice", *args, *V6E, path=fake_path[0])
    assert proc.returncode == 2 and message in proc.stderr
    assert "$ " not in proc.stdout


def test_gpu_multinode_passes_the_distributed_flags(fake_path):
    cmds, out = dry_run(fake_path, "gpu_vm", "create", "run", "--num_nodes=2",
                        "--zone=us-central1-a", "--model=gs://bucket/models/Llama-3.1-70B")
    (create,) = find(cmds, "gcloud", "compute", "instances", "create")
    assert create[4:6] == ["jaxinfer-gpu-0", "jaxinfer-gpu-1"]
    runs = jaxinfer_runs(cmds)
    assert len(runs) == 2 and "the next 2 commands run at the same time" in out
    for i, run in enumerate(runs):
        assert "--tensor_parallel_size=16" in run
        assert "--coordinator_address=jaxinfer-gpu-0:8476" in run
        assert "--num_processes=2" in run and f"--process_id={i}" in run


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_every_remote_command_is_valid_bash(fake_path):
    """`bash -n` (parse only) on each --command string the scripts send to a VM."""
    commands = set()
    for script, *args in [("tpu_vm", "--task=batch", "--input=in.jsonl", *V6E),
                          ("tpu_slice", "--task=batch", "--input=gs://b/in.jsonl",
                           "--output=gs://b/out.jsonl", *V6E),
                          ("gpu_vm", "--num_nodes=2", *V6E, "--model=/local/dir/M"),
                          ("tpu_slice", "--task=serve", *V6E)]:
        steps = (*ALL, "stop") if "--task=serve" in args else ALL
        commands |= {remote(cmd) for cmd in dry_run(fake_path, script, *steps, *args)[0]
                     if flag(cmd, "--command")}
    assert len(commands) >= 10
    for command in commands:
        proc = subprocess.run(["bash", "-n", "-c", command], capture_output=True, text=True)
        assert proc.returncode == 0, (command, proc.stderr)


def test_jaxinfer_flags_the_scripts_pass_exist(fake_path):
    """Every flag of every emitted `python -m jaxinfer` run is in that command's --help."""
    emitted: dict[str, set[str]] = {}
    for script, step, *args in [("tpu_vm", "run", *V6E), ("gpu_vm", "run", "--num_nodes=2", *V6E),
                                ("tpu_slice", "run", "--task=batch", "--input=in.jsonl", *V6E),
                                ("tpu_slice", "ray_job", "--input=in.jsonl", *V6E),
                                ("tpu_slice", "run", "--task=serve", *V6E)]:
        for run in jaxinfer_runs(dry_run(fake_path, script, step, *args)[0]):
            emitted.setdefault(run[3], set()).update(a.split("=", 1)[0] for a in run[4:])
    assert set(emitted) == {"generate", "batch", "serve"}
    for task, flags in emitted.items():
        help_text = subprocess.run([sys.executable, "-m", "jaxinfer", task, "--help"], cwd=REPO,
                                   capture_output=True, text=True, timeout=60).stdout
        known = {line.split()[0] for line in help_text.splitlines() if line.startswith("  --")}
        assert flags <= known, (task, flags - known)


def test_extras_offered_by_the_pinned_jax():
    if importlib.metadata.version("jax") != JAX_PIN:
        pytest.skip("the installed jax is not the pinned one")
    extras = set(importlib.metadata.metadata("jax").get_all("Provides-Extra"))
    assert {"tpu", "cuda12", "cuda13"} <= extras


def test_batch_without_input_is_refused(fake_path):
    proc = run_script("tpu_vm", "run", "--task=batch", *V6E, path=fake_path[0])
    assert proc.returncode == 2 and "--input" in proc.stderr and "$ " not in proc.stdout


def test_run_without_model_is_refused(fake_path):
    proc = run_script("gpu_vm", "run", "--zone=us-central1-a", path=fake_path[0])
    assert proc.returncode == 2 and "--model" in proc.stderr


@pytest.mark.parametrize("script", ["tpu_vm", "tpu_slice", "gpu_vm"])
def test_a_real_run_without_gcloud_stops_before_any_command(tmp_path, script):
    proc = run_script(script, "create", "--zone=us-east5-b", path=str(tmp_path), dry_run=False)
    assert proc.returncode == 2 and "not on PATH: gcloud" in proc.stderr
    assert "$ " not in proc.stdout


@pytest.mark.parametrize("script", ["tpu_vm", "tpu_slice", "gpu_vm"])
def test_a_dry_run_needs_nothing_on_path(tmp_path, script):
    proc = run_script(script, *ALL, "--zone=us-east5-b", "--model=gs://b/m/x",
                      path=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("\n$ gcloud ") >= 6


# Every command path the scripts print, for the --help check below.
GCLOUD_PATHS = [
    ("compute", "instances", "create"), ("compute", "instances", "delete"),
    ("compute", "instances", "describe"), ("compute", "tpus", "tpu-vm", "describe"),
    ("compute", "ssh"), ("compute", "scp"),
    ("compute", "tpus", "queued-resources", "create"),
    ("compute", "tpus", "queued-resources", "describe"),
    ("compute", "tpus", "queued-resources", "delete"),
    ("compute", "tpus", "tpu-vm", "ssh"), ("compute", "tpus", "tpu-vm", "scp"),
]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("gcloud") is None, reason="no Google Cloud SDK installed")
def test_every_printed_gcloud_flag_exists_in_the_installed_sdk(fake_path, tmp_path):
    """Each flag of each printed gcloud command appears in `gcloud <command> --help` (offline)."""
    ray = ("ray_all", "ray_down", "--input=in.jsonl")
    runs = [("tpu_vm", *ALL, *V6E), ("tpu_vm", *ALL, "--accelerator_type=v5litepod-8", "--spot",
                                      *V6E),
            ("tpu_slice", *ALL, "--task=batch", "--input=gs://b/in.jsonl", *V6E),
            ("gpu_vm", *ALL, "--num_nodes=2", "--spot", "--task=batch", "--input=in.jsonl", *V6E),
            ("tpu_slice", *ray, *V6E), ("gpu_vm", *ray, "--num_nodes=2", *V6E)]
    used: dict[tuple[str, ...], set[str]] = {}
    for script, *args in runs:
        for cmd in dry_run(fake_path, script, *args)[0]:
            if cmd[0] != "gcloud":
                continue
            (path,) = [p for p in GCLOUD_PATHS if tuple(cmd[1:1 + len(p)]) == p]
            used.setdefault(path, set()).update(
                arg.split("=", 1)[0] for arg in cmd if arg.startswith("--"))
    env = {**os.environ, "CLOUDSDK_CONFIG": str(tmp_path / "gcloud"), "PAGER": "cat",
           "CLOUDSDK_CORE_DISABLE_PROMPTS": "1", "CLOUDSDK_CORE_DISABLE_USAGE_REPORTING": "true",
           "CLOUDSDK_COMPONENT_MANAGER_DISABLE_UPDATE_CHECK": "true"}
    for path, flags in used.items():
        help_text = subprocess.run(["gcloud", *path, "--help"], env=env, capture_output=True,
                                   text=True, timeout=120).stdout
        help_text = "".join(ch for ch in help_text if ch.isprintable() or ch == "\n")
        missing = sorted(f for f in flags if f not in help_text)
        assert not missing, f"gcloud {' '.join(path)}: {missing}"
