"""A GPU VM (A3 H100, A2 A100, G2 L4) running jaxinfer with tensor parallelism.

    python -m deploy.gpu_vm all --machine_type=a3-highgpu-8g --zone=us-central1-a \\
        --model=gs://BUCKET/models/Llama-3.1-70B --dry_run

`gcloud compute instances create` with an accelerator-optimized machine type (its GPUs come
with it: no --accelerator flag) on a Deep Learning VM image with the NVIDIA driver, then
`pip install "jax[cuda12]==<pinned>"` (or `--cuda=13`: jax[cuda13], which needs a driver
>= 580, hence the nvidia-580 image family). `--num_nodes=N` creates N identical VMs and
starts one process per VM with --coordinator_address=<name>-0:<port> --num_processes=N
--process_id=i (GPUs, unlike TPU slices, have no auto-detection here). ray_up/ray_job/
ray_down instead make the VMs one Ray cluster running replicas of at most one VM each
(deploy/ray_cluster.py). See deploy/README.md. Standard library only.
"""

from __future__ import annotations

import argparse

from deploy import common, ray_cluster, steps
from deploy.targets import ComputeTarget

# machine type -> (GPU, GPUs per VM), as Compute Engine's GPU machine types list them.
GPU_MACHINES = {
    **{f"a3-highgpu-{n}g": ("NVIDIA H100 80GB", n) for n in (1, 2, 4, 8)},
    "a3-megagpu-8g": ("NVIDIA H100 80GB Mega", 8),
    **{f"a2-highgpu-{n}g": ("NVIDIA A100 40GB", n) for n in (1, 2, 4, 8)},
    "a2-megagpu-16g": ("NVIDIA A100 40GB", 16),
    **{f"a2-ultragpu-{n}g": ("NVIDIA A100 80GB", n) for n in (1, 2, 4, 8)},
    **{f"g2-standard-{n}": ("NVIDIA L4", 1) for n in (4, 8, 12, 16, 32)},
    "g2-standard-24": ("NVIDIA L4", 2),
    "g2-standard-48": ("NVIDIA L4", 4),
    "g2-standard-96": ("NVIDIA L4", 8),
}
# Deep Learning VM image families (project deeplearning-platform-release) whose NVIDIA driver
# is new enough for the extra: CUDA 12 wheels need >= 525, CUDA 13 wheels >= 580.
IMAGE_FAMILIES = {"12": "common-cu128-ubuntu-2204-nvidia-570",
                  "13": "common-cu129-ubuntu-2204-nvidia-580"}
IMAGE_PROJECT = "deeplearning-platform-release"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m deploy.gpu_vm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_common_flags(parser, default_name="jaxinfer-gpu")
    ray_cluster.add_flags(parser)
    parser.add_argument("--machine_type", default="a3-highgpu-8g", choices=sorted(GPU_MACHINES))
    parser.add_argument("--cuda", choices=("12", "13"), default="12",
                        help="jax[cuda12] or jax[cuda13] (both offered by the pinned JAX)")
    parser.add_argument("--image_family", help="default: a Deep Learning VM family whose "
                        "driver suits --cuda (common-cu128-ubuntu-2204-nvidia-570 for 12, "
                        "common-cu129-ubuntu-2204-nvidia-580 for 13)")
    parser.add_argument("--image_project", default=IMAGE_PROJECT)
    parser.add_argument("--boot_disk_size", default="500GB")
    parser.add_argument("--num_nodes", type=int, default=1,
                        help="VMs; > 1 runs one process per VM (multi-node, over the network)")
    parser.add_argument("--coordinator_port", type=int, default=8476,
                        help="multi-node: port of jax.distributed's coordinator on VM 0")
    return parser.parse_args(argv)


def make_target(args: argparse.Namespace) -> ComputeTarget:
    if args.num_nodes < 1:
        raise common.DeployError(f"--num_nodes={args.num_nodes} must be >= 1")
    names = ((args.name,) if args.num_nodes == 1
             else tuple(f"{args.name}-{i}" for i in range(args.num_nodes)))
    flags = common.compute_create_flags(
        machine_type=args.machine_type,
        image_family=args.image_family or IMAGE_FAMILIES[args.cuda],
        image_project=args.image_project, boot_disk_size=args.boot_disk_size, spot=args.spot,
        extra=["--metadata=install-nvidia-driver=True"])
    return ComputeTarget(names=names, zone=args.zone, project=args.project,
                         create_flags=flags)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    todo = common.steps_to_run(args)
    target = make_target(args)
    gpu, per_vm = GPU_MACHINES[args.machine_type]
    total = per_vm * args.num_nodes
    ray = ray_cluster.plan(args, todo, hosts=args.num_nodes, chips_per_host=per_vm,
                           accelerator="GPU")
    tensor_parallel_size = args.tensor_parallel_size or total
    common.note(f"{args.machine_type}: {per_vm} x {gpu} per VM, {args.num_nodes} VM(s); "
                f"{target.kind}; jaxinfer --tensor_parallel_size={tensor_parallel_size}")
    multihost = None
    if args.num_nodes > 1:
        coordinator = f"{target.names[0]}:{args.coordinator_port}"

        def multihost(i: int) -> list[str]:
            return [f"--coordinator_address={coordinator}", f"--num_processes={args.num_nodes}",
                    f"--process_id={i}"]

    steps.execute(todo, args, target, requirements=common.read_pins().cuda_requirements(args.cuda),
                  tensor_parallel_size=tensor_parallel_size, multihost_flags=multihost,
                  install_prelude=common.WAIT_FOR_NVIDIA_DRIVER, ray=ray)


if __name__ == "__main__":
    common.main_guard(main)
