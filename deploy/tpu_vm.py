"""A single-host TPU VM (v5e or v6e, 1 to 8 chips) running jaxinfer with tensor parallelism.

    python -m deploy.tpu_vm all --accelerator_type=v6e-8 --zone=us-east5-b \\
        --model=gs://BUCKET/models/Qwen3-8B --dry_run

v6e is created as a Compute Engine instance (`gcloud compute instances create
--machine-type=ct6e-standard-8t`, image family ubuntu-accel-2204-amd64-tpu-v5e-v5p-v6e);
v5e, which has no Compute Engine path, through the Cloud TPU API's queued resources
(runtime v2-alpha-tpuv5-lite). `--api=tpu` sends v6e through queued resources too (runtime
v2-alpha-tpuv6e). Steps: create install model run fetch delete (`all` = all but delete),
and ray_up ray_job ray_down for a one-node Ray cluster (deploy/ray_cluster.py).
See deploy/README.md. Standard library only.
"""

from __future__ import annotations

import argparse
import dataclasses

from deploy import common, ray_cluster, steps
from deploy.targets import ComputeTarget, TpuApiTarget


@dataclasses.dataclass(frozen=True, kw_only=True)
class SingleHost:
    generation: str  # "v5e" or "v6e"
    chips: int
    runtime_version: str  # Cloud TPU API software version
    machine_type: str | None  # Compute Engine machine type; None: no Compute Engine path


RUNTIMES = {"v5e": "v2-alpha-tpuv5-lite", "v6e": "v2-alpha-tpuv6e"}
SINGLE_HOST = {
    **{f"v5litepod-{n}": SingleHost(generation="v5e", chips=n, runtime_version=RUNTIMES["v5e"],
                                    machine_type=None) for n in (1, 4, 8)},
    **{f"v6e-{n}": SingleHost(generation="v6e", chips=n, runtime_version=RUNTIMES["v6e"],
                              machine_type=f"ct6e-standard-{n}t") for n in (1, 4, 8)},
}
ALIASES = {f"v5e-{n}": f"v5litepod-{n}" for n in (1, 4, 8)}
IMAGE_FAMILY = "ubuntu-accel-2204-amd64-tpu-v5e-v5p-v6e"
IMAGE_PROJECT = "ubuntu-os-accelerator-images"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m deploy.tpu_vm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_common_flags(parser, default_name="jaxinfer-tpu")
    ray_cluster.add_flags(parser)
    parser.add_argument("--accelerator_type", default="v6e-8",
                        choices=sorted(SINGLE_HOST) + sorted(ALIASES),
                        help="single-host slice (multi-host: deploy.tpu_slice)")
    parser.add_argument("--api", choices=("auto", "compute", "tpu"), default="auto",
                        help="auto: Compute Engine for v6e, Cloud TPU API for v5e")
    parser.add_argument("--runtime_version", help="Cloud TPU API software version "
                        "(default: v2-alpha-tpuv5-lite for v5e, v2-alpha-tpuv6e for v6e)")
    parser.add_argument("--image_family", default=IMAGE_FAMILY, help="Compute Engine image")
    parser.add_argument("--image_project", default=IMAGE_PROJECT)
    parser.add_argument("--boot_disk_size", default="200GB", help="Compute Engine boot disk")
    return parser.parse_args(argv)


def target_for(args: argparse.Namespace, tpu: SingleHost) -> TpuApiTarget | ComputeTarget:
    api = args.api if args.api != "auto" else ("compute" if tpu.machine_type else "tpu")
    if api == "tpu":
        return TpuApiTarget(name=args.name, zone=args.zone, project=args.project,
                            accelerator_type=ALIASES.get(args.accelerator_type,
                                                         args.accelerator_type),
                            runtime_version=args.runtime_version or tpu.runtime_version,
                            workers=1, spot=args.spot)
    if tpu.machine_type is None:
        raise common.DeployError(f"{args.accelerator_type}: Compute Engine has no {tpu.generation}"
                                 " machine type; use --api=tpu (queued resources)")
    flags = common.compute_create_flags(
        machine_type=tpu.machine_type, image_family=args.image_family,
        image_project=args.image_project, boot_disk_size=args.boot_disk_size, spot=args.spot)
    return ComputeTarget(names=(args.name,), zone=args.zone, project=args.project,
                         create_flags=flags)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    todo = common.steps_to_run(args)
    tpu = SINGLE_HOST[ALIASES.get(args.accelerator_type, args.accelerator_type)]
    target = target_for(args, tpu)
    ray = ray_cluster.plan(args, todo, hosts=1, chips_per_host=tpu.chips, accelerator="TPU")
    tensor_parallel_size = args.tensor_parallel_size or tpu.chips
    common.note(f"{args.accelerator_type}: {tpu.chips} chip(s) on one host; "
                f"{target.kind}; jaxinfer --tensor_parallel_size="
                f"{tensor_parallel_size}")
    steps.execute(todo, args, target, requirements=common.read_pins().tpu_requirements(),
                  tensor_parallel_size=tensor_parallel_size, ray=ray)


if __name__ == "__main__":
    common.main_guard(main)
