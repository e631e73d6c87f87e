"""The steps every script runs, in the order given: create, install, model, run, stop (a
server), fetch, delete, and the Ray steps ray_up, ray_job, ray_down (deploy/ray_cluster.py).

Each step is a few gcloud commands against a target (`deploy.targets`); the scripts only
choose the target, the pip requirements and the tensor-parallel size. Standard library only.
"""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Callable, Sequence

from deploy import common, ray_cluster
from deploy.targets import ComputeTarget, TpuApiTarget

Target = TpuApiTarget | ComputeTarget


def copy_to_hosts(target: Target, src: str, dest: str, dry_run: bool, *, is_dir: bool) -> None:
    """Put `src` (gs://... or a local path) at `dest` (relative to home) on every host."""
    parent = dest.rsplit("/", 1)[0]
    clear = [f"mkdir -p {parent}"] + ([f"rm -rf {dest}"] if is_dir else [])
    if src.startswith("gs://"):
        recursive = ["--recursive"] if is_dir else []
        to = f"{parent}/" if is_dir else dest
        copy = shlex.join(["gcloud", "storage", "cp", *recursive, src.rstrip("/"), to])
        target.ssh_all(common.remote(*clear, copy), dry_run)
        return
    target.ssh_all(common.remote(*clear), dry_run)
    if is_dir:
        target.scp_to_all(src.rstrip("/"), f"{parent}/", dry_run, recurse=True)
    else:
        target.scp_to_all(src, dest, dry_run)


def run_jaxinfer(target: Target, args: argparse.Namespace, tensor_parallel_size: int,
                 multihost_flags: Callable[[int], list[str]] | None,
                 run_flags: Sequence[str] = ()) -> None:
    if args.task == "batch":
        copy_to_hosts(target, args.input, common.REMOTE_INPUT, args.dry_run, is_dir=False)
    common.note(f"python -m jaxinfer {args.task} on {target.workers} host(s), "
                f"--tensor_parallel_size={tensor_parallel_size}")
    if args.task == "serve":
        _note_serving(target, args)
    elif target.workers > 1:
        written = (f"{common.REMOTE_RESULTS}, fetched from the first host" if args.task == "batch"
                   else "the completion")
        common.note("every host runs the same command on the same input; only process 0 "
                    f"writes outputs ({written})")
    if multihost_flags is None:
        target.ssh_all(common.jaxinfer_command(args, tensor_parallel_size=tensor_parallel_size,
                                               multihost=run_flags), args.dry_run)
        return
    assert isinstance(target, ComputeTarget), "per-host flags need one ssh per host"
    target.ssh_all([common.jaxinfer_command(args, tensor_parallel_size=tensor_parallel_size,
                                            multihost=multihost_flags(i))
                    for i in range(target.workers)], args.dry_run)


def _note_serving(target: Target, args: argparse.Namespace) -> None:
    if target.workers > 1:
        common.note("every host runs the same serve command; process 0 (the first host) "
                    f"answers HTTP on 0.0.0.0:{args.port}, the others follow its engine step "
                    "by step and open no port")
    common.note("the run step lasts as long as the server; from another shell, the stop step "
                "sends SIGTERM to every host's server (process 0 drains, then all exit 0)")
    ssh = (f"gcloud compute tpus tpu-vm ssh {target.name} --worker=0"
           if isinstance(target, TpuApiTarget) else f"gcloud compute ssh {target.names[0]}")
    common.note(f"reach it inside the VPC at the first host's internal IP, port {args.port}, or "
                f"tunnel it here: {ssh} --zone={args.zone} -- -N -L "
                f"{args.port}:localhost:{args.port}; from the internet it needs a firewall "
                "rule (not scripted) and --extra=--api_key=KEY")


def fetch(target: Target, args: argparse.Namespace) -> None:
    if args.task == "serve":
        common.note("serve writes no results: nothing to fetch")
        return
    if args.task != "batch":
        common.note("generate prints its completion in the run step's output: nothing to fetch")
        return
    if args.output.startswith("gs://"):
        copy = shlex.join(["gcloud", "storage", "cp", common.REMOTE_RESULTS, args.output])
        target.ssh_first(common.remote(copy), args.dry_run)
    else:
        target.scp_from_first(common.REMOTE_RESULTS, args.output, args.dry_run)


def execute(steps: Sequence[str], args: argparse.Namespace, target: Target, *,
            requirements: Sequence[str], tensor_parallel_size: int,
            multihost_flags: Callable[[int], list[str]] | None = None,
            install_prelude: Sequence[str] = (), run_flags: Sequence[str] = (),
            ray: ray_cluster.RayCluster | None = None) -> None:
    """Run `steps` in order against `target`. `multihost_flags(i)`: host i's jaxinfer flags;
    `run_flags`: the same for every host; `ray`: the cluster ray_up and ray_job need
    (ray_cluster.plan, checked before the first step)."""
    extras = ("ray",) if args.ray or set(common.RAY_STEPS) & set(steps) else ()
    for step in steps:
        common.note(f"step: {step}")
        if step == "create":
            target.create(args.dry_run)
        elif step == "install":
            tarball = common.pack_source(args.dry_run)
            target.scp_to_all(tarball, common.REMOTE_TARBALL, args.dry_run)
            script = common.install_script(requirements, list_devices=target.workers == 1,
                                           prelude=install_prelude, extras=extras)
            target.ssh_all(script, args.dry_run)
        elif step == "model":
            copy_to_hosts(target, args.model, common.model_dir(args.model), args.dry_run,
                          is_dir=True)
        elif step == "run":
            run_jaxinfer(target, args, tensor_parallel_size, multihost_flags, run_flags)
        elif step == "stop":
            target.ssh_all(common.stop_command(), args.dry_run)
        elif step == "fetch":
            fetch(target, args)
        elif step == "delete":
            target.delete(args.dry_run)
        elif step in ("ray_up", "ray_job"):
            assert ray is not None, f"{step} needs ray_cluster.plan's cluster"
            if step == "ray_up":
                ray_cluster.up(target, ray, args.dry_run)
            else:
                ray_cluster.job(target, args, ray)
        elif step == "ray_down":
            ray_cluster.down(target, args.dry_run)
        else:
            raise ValueError(f"unknown step {step!r}")
