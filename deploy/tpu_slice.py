"""A multi-host TPU slice (v5e or v6e, 16 to 256 chips): one jaxinfer process per host.

    python -m deploy.tpu_slice all --accelerator_type=v5litepod-16 --zone=us-west4-a \\
        --model=gs://BUCKET/models/Llama-3.1-70B --task=batch --input=requests.jsonl --dry_run

The slice comes from the Cloud TPU API's queued resources (`gcloud compute tpus
queued-resources create`, runtime v2-alpha-tpuv5-lite / v2-alpha-tpuv6e). Multi-host slices
are built from 4-chip hosts, so v5litepod-16 has 4 workers. Every step reaches all of them at
once with `gcloud compute tpus tpu-vm ssh|scp --worker=all`; the run step starts `python -m
jaxinfer batch|generate|serve --tensor_parallel_size=<all chips of the slice> --detect_distributed`
on every host: JAX finds the coordinator, the process count and each process id by itself on
a TPU slice, so no --coordinator_address/--num_processes/--process_id flags are passed
(jaxinfer joins a multi-host job only when asked, hence --detect_distributed). Only
process 0 writes results; fetch copies them from worker 0. ray_up/ray_job/ray_down instead
make the hosts one Ray cluster running replicas of at most one host each
(deploy/ray_cluster.py). `--task=serve` starts `python -m jaxinfer serve` on every host the
same way: process 0 (worker 0) answers HTTP on 0.0.0.0:--port, the others follow its engine;
the stop step sends SIGTERM to every host's server. See deploy/README.md. Standard library
only.
"""

from __future__ import annotations

import argparse
import dataclasses

from deploy import common, ray_cluster, steps
from deploy.targets import TpuApiTarget

CHIPS_PER_HOST = 4  # multi-host v5e and v6e slices are made of 4-chip VMs
RUNTIMES = {"v5litepod": "v2-alpha-tpuv5-lite", "v6e": "v2-alpha-tpuv6e"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Slice:
    chips: int
    runtime_version: str

    @property
    def workers(self) -> int:
        return self.chips // CHIPS_PER_HOST


SLICES = {f"{prefix}-{n}": Slice(chips=n, runtime_version=runtime)
          for prefix, runtime in RUNTIMES.items() for n in (16, 32, 64, 128, 256)}
ALIASES = {f"v5e-{n}": f"v5litepod-{n}" for n in (16, 32, 64, 128, 256)}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m deploy.tpu_slice", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_common_flags(parser, default_name="jaxinfer-slice")
    ray_cluster.add_flags(parser)
    parser.add_argument("--accelerator_type", default="v5litepod-16",
                        choices=sorted(SLICES) + sorted(ALIASES),
                        help="multi-host slice (single host: deploy.tpu_vm)")
    parser.add_argument("--runtime_version", help="Cloud TPU API software version "
                        "(default: v2-alpha-tpuv5-lite for v5e, v2-alpha-tpuv6e for v6e)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    todo = common.steps_to_run(args)
    accelerator_type = ALIASES.get(args.accelerator_type, args.accelerator_type)
    tpu = SLICES[accelerator_type]
    target = TpuApiTarget(name=args.name, zone=args.zone, project=args.project,
                          accelerator_type=accelerator_type,
                          runtime_version=args.runtime_version or tpu.runtime_version,
                          workers=tpu.workers, spot=args.spot)
    ray = ray_cluster.plan(args, todo, hosts=tpu.workers, chips_per_host=CHIPS_PER_HOST,
                           accelerator="TPU", slice_hosts=True)
    tensor_parallel_size = args.tensor_parallel_size or tpu.chips
    common.note(f"{accelerator_type}: {tpu.chips} chips on {tpu.workers} workers "
                f"({CHIPS_PER_HOST} chips each); {target.kind}; --worker=all starts one "
                f"process per worker; jaxinfer --tensor_parallel_size={tensor_parallel_size}")
    if "run" in todo:
        common.note("run: --detect_distributed, no --coordinator_address/--num_processes/"
                    "--process_id: JAX detects them on a TPU slice")
    steps.execute(todo, args, target, requirements=common.read_pins().tpu_requirements(),
                  tensor_parallel_size=tensor_parallel_size, run_flags=["--detect_distributed"],
                  ray=ray)


if __name__ == "__main__":
    common.main_guard(main)
