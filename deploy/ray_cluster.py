"""A Ray cluster over the hosts of a deployment, and a `jaxinfer batch --ray` job on it.

Steps (run by `deploy.steps` next to create/install/model/run/fetch/delete):

- `ray_up`: a random token (Ray's token authentication) copied to every host, then
  `ray start --head --port=6379` on worker 0 with the host's TPU chips (`--resources=
  {"TPU": N}`) or GPUs (`--num-gpus=N`) and the dashboard off, then `ray start
  --address=<worker 0's internal IP>:6379` on the other hosts, and a check on the head
  that every host joined. Worker 0's internal IP comes from `gcloud ... describe
  --format=value(...)`, run by the script; a dry run prints that command and WORKER_0_IP
  in its place.
- `ray_job`: `--input` copied to worker 0 only, then `python -m jaxinfer batch --ray
  --ray_address=auto --num_replicas=N --tensor_parallel_size=T ...` on worker 0 only (the
  driver; each replica is a Ray actor holding T chips of one host). `fetch` then copies
  worker 0's results file, as after `run`.
- `ray_down`: `ray stop` on every host.

A replica is one process on one host, so T must divide the chips of a host; the number
of replicas defaults to (hosts x chips per host) / T. Standard library only.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import secrets
import shlex
import subprocess
import tempfile

from deploy import common
from deploy.targets import ComputeTarget, TpuApiTarget

Target = TpuApiTarget | ComputeTarget
REMOTE_RAY = f"{common.REMOTE_VENV}/bin/ray"
# Ray's default token path: `ray status` and `ray.init()` typed by hand on a host find it.
REMOTE_TOKEN = ".ray/auth_token"
# Every Ray process (ray start, the driver, the actors they spawn) checks the token.
AUTH = "export RAY_AUTH_MODE=token"
# On a host of a multi-host TPU slice, libtpu would otherwise wait for the whole slice:
# each replica is a single-host program (Ray narrows these further for 1- and 2-chip
# replicas, and sets TPU_VISIBLE_CHIPS).
SINGLE_HOST_TPU = "export TPU_HOST_BOUNDS=1,1,1 TPU_CHIPS_PER_HOST_BOUNDS=2,2,1"
DRY_RUN_IP = "WORKER_0_IP"


@dataclasses.dataclass(frozen=True, kw_only=True)
class RayCluster:
    """What the Ray steps start: `hosts` nodes of `chips_per_host` TPU chips or GPUs."""

    hosts: int
    chips_per_host: int
    accelerator: str  # "TPU" or "GPU": the Ray resource the chips are offered as
    tensor_parallel_size: int
    num_replicas: int
    port: int
    slice_hosts: bool  # hosts of one multi-host TPU slice

    def resource_flag(self) -> str:
        if self.accelerator == "GPU":
            return f"--num-gpus={self.chips_per_host}"
        return "--resources=" + json.dumps({"TPU": self.chips_per_host})


def add_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ray", action="store_true",
                        help="install: add the [ray] extra (implied by any ray_* step)")
    parser.add_argument("--num_replicas", type=int, help="ray_job: replicas (default: all that "
                        "fit, hosts x chips per host / --tensor_parallel_size)")
    parser.add_argument("--ray_port", type=int, default=6379, help="ray_up: the head's port")


def plan(args: argparse.Namespace, steps: list[str], *, hosts: int, chips_per_host: int,
         accelerator: str, slice_hosts: bool = False) -> RayCluster | None:
    """The cluster the Ray steps in `steps` start, or None without ray_up/ray_job; refuses a
    tensor-parallel size or replica count that does not fit the hosts."""
    if not {"ray_up", "ray_job"} & set(steps):
        return None
    tp = args.tensor_parallel_size or chips_per_host
    unit = "GPUs" if accelerator == "GPU" else "chips"
    if tp > chips_per_host:
        raise common.DeployError(
            f"--tensor_parallel_size={tp}: a Ray replica is one process on one host, which "
            f"has {chips_per_host} {unit}; for a model that needs more, use the run step "
            "(one program over every host)")
    if chips_per_host % tp:
        fits = [n for n in range(1, chips_per_host + 1) if chips_per_host % n == 0]
        raise common.DeployError(
            f"--tensor_parallel_size={tp} does not divide the {chips_per_host} {unit} of a "
            f"host: every host would leave {chips_per_host % tp} idle; use one of {fits}")
    fit = hosts * chips_per_host // tp
    replicas = fit if args.num_replicas is None else args.num_replicas
    if not 1 <= replicas <= fit:
        raise common.DeployError(
            f"--num_replicas={replicas}: {hosts} host(s) x {chips_per_host} {unit} hold 1 to "
            f"{fit} replicas of --tensor_parallel_size={tp}")
    common.note(f"Ray: {hosts} host(s) x {chips_per_host} {unit}; {replicas} replica(s) of "
                f"--tensor_parallel_size={tp} (at most {fit}; the run step's size does not "
                "apply)")
    return RayCluster(hosts=hosts, chips_per_host=chips_per_host, accelerator=accelerator,
                      tensor_parallel_size=tp, num_replicas=replicas, port=args.ray_port,
                      slice_hosts=slice_hosts)


def ray_start(cluster: RayCluster, *, head_ip: str | None) -> str:
    """The `--command` that starts Ray on a host: the head when `head_ip` is None."""
    env = [AUTH] + ([SINGLE_HOST_TPU] if cluster.slice_hosts else [])
    where = (["--head", f"--port={cluster.port}", "--include-dashboard=false"]
             if head_ip is None else [f"--address={head_ip}:{cluster.port}"])
    start = [REMOTE_RAY, "start", *where, cluster.resource_flag(), "--disable-usage-stats"]
    return common.remote(f"chmod 600 {REMOTE_TOKEN}", *env, shlex.join(start))


def check_hosts(hosts: int) -> str:
    """Fails unless `hosts` nodes are alive in the cluster (a host that could not reach the
    head, a firewall); prints the cluster's resources. The Python has no "; ", so the
    command still splits into its shell lines at "; " (as the tests read it)."""
    code = ('import ray,sys;ray.init(address="auto",logging_level="ERROR");'
            'n=sum(x["Alive"] for x in ray.nodes());'
            f'print(n,"of {hosts} hosts in the Ray cluster:",ray.cluster_resources());'
            f'sys.exit(0 if n=={hosts} else "expected {hosts} hosts, "+str(n)+" joined")')
    return common.remote(AUTH, shlex.join([common.REMOTE_PYTHON, "-c", code]))


def worker_0_ip(target: Target, dry_run: bool) -> str:
    """Worker 0's internal IP from gcloud's describe (printed, then run unless dry run)."""
    cmd = target.internal_ip_command()
    common.note(f"worker 0's internal IP: what this prints replaces {DRY_RUN_IP} below")
    common.show(cmd)
    if dry_run:
        return DRY_RUN_IP
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip()
    if not re.fullmatch(r"\d{1,3}(\.\d{1,3}){3}", out):
        raise common.DeployError(f"{shlex.join(cmd)} printed {out!r}, not an IPv4 address")
    return out


def write_token(dry_run: bool) -> str:
    """A fresh random token in a local 0600 file (not printed; a dry run writes nothing)."""
    path = os.path.join(tempfile.gettempdir(), "jaxinfer-ray-auth-token")
    common.note(f"writes a new random Ray token to {path} (mode 600), copies it to every "
                "host (only holders of it can use the cluster), then deletes it here")
    if not dry_run:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
    return path


def up(target: Target, cluster: RayCluster, dry_run: bool) -> None:
    common.note(f"head on worker 0 (port {cluster.port}); stops any Ray already running on "
                "the hosts first")
    missing = f"echo '{REMOTE_RAY} is missing: run the install step with --ray' >&2"
    target.ssh_all(common.remote(f"test -x {REMOTE_RAY} || {{ {missing}; exit 1; }}",
                                 f"{REMOTE_RAY} stop", "mkdir -p -m 700 .ray"), dry_run)
    token = write_token(dry_run)
    try:
        target.scp_to_all(token, REMOTE_TOKEN, dry_run)
    finally:
        if not dry_run:
            os.remove(token)
    if cluster.slice_hosts:
        common.note("TPU_HOST_BOUNDS=1,1,1: each replica uses chips of its own host only, "
                    "not the slice as one machine")
    target.ssh_first(ray_start(cluster, head_ip=None), dry_run)
    if cluster.hosts > 1:
        head = worker_0_ip(target, dry_run)
        target.ssh_rest(ray_start(cluster, head_ip=head), dry_run)
    target.ssh_first(check_hosts(cluster.hosts), dry_run)


def batch_command(args: argparse.Namespace, cluster: RayCluster) -> str:
    """The driver, on worker 0. The model path is absolute ("$HOME"/models/NAME): the
    replicas open it on their own hosts, in a working directory Ray chooses."""
    head = [common.REMOTE_PYTHON, "-m", "jaxinfer", "batch", "--ray", "--ray_address=auto",
            f"--num_replicas={cluster.num_replicas}",
            f"--tensor_parallel_size={cluster.tensor_parallel_size}"]
    model = f'--model="$HOME"/{shlex.quote(common.model_dir(args.model))}'
    tail = [f"--input={common.REMOTE_INPUT}", f"--output={common.REMOTE_RESULTS}",
            f"--dtype={args.dtype}", *shlex.split(args.extra)]
    return common.remote(AUTH, f"{shlex.join(head)} {model} {shlex.join(tail)}")


def copy_input_to_head(target: Target, src: str, dry_run: bool) -> None:
    """Put `--input` at jaxinfer-io/input.jsonl on worker 0 only (the driver reads it)."""
    mkdir = f"mkdir -p {common.REMOTE_IO}"
    if src.startswith("gs://"):
        copy = shlex.join(["gcloud", "storage", "cp", src, common.REMOTE_INPUT])
        target.ssh_first(common.remote(mkdir, copy), dry_run)
        return
    target.ssh_first(common.remote(mkdir), dry_run)
    target.scp_to_first(src, common.REMOTE_INPUT, dry_run)


def job(target: Target, args: argparse.Namespace, cluster: RayCluster) -> None:
    copy_input_to_head(target, args.input, args.dry_run)
    common.note(f"the driver runs on worker 0 only: {cluster.num_replicas} replica(s) of "
                f"--tensor_parallel_size={cluster.tensor_parallel_size} across "
                f"{cluster.hosts} host(s); it writes {common.REMOTE_RESULTS} on worker 0")
    target.ssh_first(batch_command(args, cluster), args.dry_run)


def down(target: Target, dry_run: bool) -> None:
    target.ssh_all(common.remote(f"{REMOTE_RAY} stop"), dry_run)
