"""The two kinds of machines the scripts drive, behind one small interface.

`TpuApiTarget`: a TPU slice from the Cloud TPU API's queued resources (`gcloud compute tpus
queued-resources create`), reached with `gcloud compute tpus tpu-vm ssh|scp --worker=...`;
one command with `--worker=all` starts it on every host of the slice at once.
`ComputeTarget`: Compute Engine instances (`gcloud compute instances create`: v6e TPU VMs,
GPU VMs), reached with `gcloud compute ssh|scp`; several instances are driven with one
process per instance, started together. Standard library only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from deploy.common import run, run_parallel, wait_until

CLOUD_PLATFORM_SCOPE = "https://www.googleapis.com/auth/cloud-platform"


def _where(zone: str, project: str | None) -> list[str]:
    return [f"--zone={zone}"] + ([f"--project={project}"] if project else [])


@dataclasses.dataclass(frozen=True, kw_only=True)
class TpuApiTarget:
    """A queued resource `<name>-qr` holding one TPU node `<name>` of `workers` hosts."""

    name: str
    zone: str
    project: str | None
    accelerator_type: str
    runtime_version: str
    workers: int
    spot: bool = False

    @property
    def queued_resource(self) -> str:
        return f"{self.name}-qr"

    @property
    def kind(self) -> str:
        return f"Cloud TPU API queued resource {self.queued_resource}, node {self.name}"

    def _gcloud(self, *words: str) -> list[str]:
        return ["gcloud", "compute", "tpus", *words]

    def create(self, dry_run: bool) -> None:
        cmd = self._gcloud("queued-resources", "create", self.queued_resource,
                           f"--node-id={self.name}", f"--accelerator-type={self.accelerator_type}",
                           f"--runtime-version={self.runtime_version}",
                           f"--scopes={CLOUD_PLATFORM_SCOPE}")
        run(cmd + (["--spot"] if self.spot else []) + _where(self.zone, self.project), dry_run)
        describe = self._gcloud("queued-resources", "describe", self.queued_resource,
                                "--format=value(state.state)", *_where(self.zone, self.project))
        wait_until(describe, "ACTIVE", dry_run, what="the queued resource to be ACTIVE")
        wait_until(self._gcloud("tpu-vm", "ssh", self.name, "--worker=all", "--command=true",
                                "--quiet", *_where(self.zone, self.project)),
                   None, dry_run, interval_s=20, timeout_s=900, what="every host to accept SSH")

    def delete(self, dry_run: bool) -> None:
        run(self._gcloud("queued-resources", "delete", self.queued_resource, "--force",
                         "--quiet", *_where(self.zone, self.project)), dry_run)

    def ssh_all(self, command: str, dry_run: bool) -> None:
        """Run `command` on every host of the slice at once (one gcloud call)."""
        run(self._gcloud("tpu-vm", "ssh", self.name, "--worker=all", f"--command={command}",
                         "--quiet", *_where(self.zone, self.project)), dry_run)

    def ssh_first(self, command: str, dry_run: bool) -> None:
        run(self._gcloud("tpu-vm", "ssh", self.name, "--worker=0", f"--command={command}",
                         "--quiet", *_where(self.zone, self.project)), dry_run)

    def ssh_rest(self, command: str, dry_run: bool) -> None:
        """Run `command` on every host but worker 0 at once (a range: `--worker=1-N`)."""
        workers = "1" if self.workers == 2 else f"1-{self.workers - 1}"
        run(self._gcloud("tpu-vm", "ssh", self.name, f"--worker={workers}",
                         f"--command={command}", "--quiet", *_where(self.zone, self.project)),
            dry_run)

    def internal_ip_command(self) -> list[str]:
        """Prints worker 0's internal IP (gcloud's ssh --worker=i uses networkEndpoints[i])."""
        return self._gcloud("tpu-vm", "describe", self.name,
                            "--format=value(networkEndpoints[0].ipAddress)",
                            *_where(self.zone, self.project))

    def scp_to_all(self, local: str, remote: str, dry_run: bool, *, recurse: bool = False) -> None:
        flags = ["--recurse"] if recurse else []
        run(self._gcloud("tpu-vm", "scp", *flags, local, f"{self.name}:{remote}", "--worker=all",
                         "--quiet", *_where(self.zone, self.project)), dry_run)

    def scp_to_first(self, local: str, remote: str, dry_run: bool) -> None:
        run(self._gcloud("tpu-vm", "scp", local, f"{self.name}:{remote}", "--worker=0",
                         "--quiet", *_where(self.zone, self.project)), dry_run)

    def scp_from_first(self, remote: str, local: str, dry_run: bool) -> None:
        run(self._gcloud("tpu-vm", "scp", f"{self.name}:{remote}", local, "--worker=0", "--quiet",
                         *_where(self.zone, self.project)), dry_run)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ComputeTarget:
    """Compute Engine instances `names`, created with the same `create_flags`."""

    names: tuple[str, ...]
    zone: str
    project: str | None
    create_flags: tuple[str, ...]

    @property
    def workers(self) -> int:
        return len(self.names)

    @property
    def kind(self) -> str:
        return f"Compute Engine instance(s) {', '.join(self.names)}"

    def _ssh(self, name: str, command: str) -> list[str]:
        return ["gcloud", "compute", "ssh", name, f"--command={command}", "--quiet",
                *_where(self.zone, self.project)]

    def create(self, dry_run: bool) -> None:
        run(["gcloud", "compute", "instances", "create", *self.names, *self.create_flags,
             *_where(self.zone, self.project)], dry_run)
        for name in self.names:
            wait_until(self._ssh(name, "true"), None, dry_run, interval_s=20, timeout_s=900,
                       what=f"{name} to accept SSH")

    def delete(self, dry_run: bool) -> None:
        run(["gcloud", "compute", "instances", "delete", *self.names, "--quiet",
             *_where(self.zone, self.project)], dry_run)

    def ssh_all(self, command: str | Sequence[str], dry_run: bool) -> None:
        """Run on every instance at once: one command for all, or one per instance."""
        commands = [command] * len(self.names) if isinstance(command, str) else list(command)
        if len(commands) != len(self.names):
            raise ValueError(f"{len(commands)} commands for {len(self.names)} instances")
        pairs = zip(self.names, commands, strict=True)
        run_parallel([self._ssh(name, cmd) for name, cmd in pairs], dry_run)

    def ssh_first(self, command: str, dry_run: bool) -> None:
        run(self._ssh(self.names[0], command), dry_run)

    def ssh_rest(self, command: str, dry_run: bool) -> None:
        """Run `command` on every instance but the first, at once."""
        run_parallel([self._ssh(name, command) for name in self.names[1:]], dry_run)

    def internal_ip_command(self) -> list[str]:
        """Prints the first instance's internal IP."""
        return ["gcloud", "compute", "instances", "describe", self.names[0],
                "--format=value(networkInterfaces[0].networkIP)",
                *_where(self.zone, self.project)]

    def scp_to_all(self, local: str, remote: str, dry_run: bool, *, recurse: bool = False) -> None:
        flags = ["--recurse"] if recurse else []
        for name in self.names:
            run(["gcloud", "compute", "scp", *flags, local, f"{name}:{remote}", "--quiet",
                 *_where(self.zone, self.project)], dry_run)

    def scp_to_first(self, local: str, remote: str, dry_run: bool) -> None:
        run(["gcloud", "compute", "scp", local, f"{self.names[0]}:{remote}", "--quiet",
             *_where(self.zone, self.project)], dry_run)

    def scp_from_first(self, remote: str, local: str, dry_run: bool) -> None:
        run(["gcloud", "compute", "scp", f"{self.names[0]}:{remote}", local, "--quiet",
             *_where(self.zone, self.project)], dry_run)
