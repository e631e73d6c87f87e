"""What every deploy script shares: printing and running commands, the pinned versions,
the shell snippets run on the VMs, and the flags common to all three scripts.

`run(cmd, dry_run)` prints `$ <shell-quoted command>` and runs it only when `dry_run` is
false, so a dry run prints exactly what a real run would execute, in order. Lines starting
with `#` are notes (what a command waits for, what runs in parallel). Standard library only.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
# Paths on the VM, relative to the login user's home directory (every remote command starts
# with `cd "$HOME"`, so jaxinfer flags can be plain, shell-quoted relative paths).
REMOTE_TARBALL = "jaxinfer-src.tar.gz"
REMOTE_SRC = "jaxinfer"
REMOTE_VENV = "jaxinfer-venv"
REMOTE_PYTHON = f"{REMOTE_VENV}/bin/python"
REMOTE_MODELS = "models"
REMOTE_IO = "jaxinfer-io"
REMOTE_INPUT = f"{REMOTE_IO}/input.jsonl"
REMOTE_RESULTS = f"{REMOTE_IO}/results.jsonl"
REMOTE_SERVE_PID = f"{REMOTE_IO}/serve.pid"  # the run step's server, for the stop step
PYTHON_VERSION = "3.11"  # pyproject: requires-python >=3.11,<3.12; jax 0.10.2 needs >=3.11
RAY_STEPS = ("ray_up", "ray_job", "ray_down")  # deploy/ray_cluster.py
STEPS = ("create", "install", "model", "run", "stop", "fetch", "delete", *RAY_STEPS)
# Shorthands; neither deletes (delete explicitly) nor stops Ray.
COMPOSITE_STEPS = {"all": ("create", "install", "model", "run", "fetch"),
                   "ray_all": ("create", "install", "model", "ray_up", "ray_job", "fetch")}


class DeployError(Exception):
    """A mistake the user can fix (a missing flag, a missing file, gcloud not installed)."""


def note(text: str) -> None:
    """Print a `# text` line: context for the commands around it, never executed."""
    print(f"# {text}", flush=True)


def show(cmd: Sequence[str]) -> None:
    print(f"$ {shlex.join(cmd)}", flush=True)


def check_tools(dry_run: bool, steps: Sequence[str]) -> None:
    """Fail before doing anything if gcloud (or git, to install) is missing; a dry run needs
    neither."""
    if dry_run:
        return
    tools = ["gcloud"] + (["git"] if "install" in steps else [])
    missing = [tool for tool in tools if shutil.which(tool) is None]
    if missing:
        raise DeployError(f"not on PATH: {', '.join(missing)} (install the Google Cloud CLI: "
                          "https://cloud.google.com/sdk/docs/install)")


def run(cmd: Sequence[str], dry_run: bool) -> None:
    """Print `cmd`, then run it unless `dry_run`; a non-zero exit raises CalledProcessError."""
    show(cmd)
    if not dry_run:
        subprocess.run(list(cmd), check=True)


def run_parallel(cmds: Sequence[Sequence[str]], dry_run: bool) -> None:
    """Start every command at once (one process per host), then wait for all of them."""
    if len(cmds) == 1:
        run(cmds[0], dry_run)
        return
    note(f"the next {len(cmds)} commands run at the same time; the step waits for all of them")
    for cmd in cmds:
        show(cmd)
    if dry_run:
        return
    procs = [subprocess.Popen(list(cmd)) for cmd in cmds]
    codes = [proc.wait() for proc in procs]
    failed = [i for i, code in enumerate(codes) if code != 0]
    if failed:
        raise DeployError(f"host(s) {failed} exited non-zero: {[codes[i] for i in failed]}")


def wait_until(cmd: Sequence[str], expect: str | None, dry_run: bool, *, what: str,
               timeout_s: float = 3600, interval_s: float = 30) -> None:
    """Repeat `cmd` until it succeeds (and prints `expect`, if given) or `timeout_s` passes."""
    want = f" and prints {expect}" if expect else ""
    note(f"repeated every {interval_s:.0f} s until it succeeds{want} ({what}; "
         f"gives up after {timeout_s / 60:.0f} min)")
    show(cmd)
    if dry_run:
        return
    deadline = time.monotonic() + timeout_s
    while True:
        proc = subprocess.run(list(cmd), capture_output=True, text=True)
        if proc.returncode == 0 and (expect is None or expect in proc.stdout.split()):
            return
        if time.monotonic() > deadline:
            raise DeployError(f"timed out waiting for {what}; last output: "
                              f"{(proc.stdout + proc.stderr).strip()[-500:]}")
        time.sleep(interval_s)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Pins:
    """The versions pyproject.toml pins: jax (and jaxlib) and the libtpu the AOT checks use."""

    jax: str
    libtpu: str

    def tpu_requirements(self) -> list[str]:
        return [f"jax[tpu]=={self.jax}", f"libtpu=={self.libtpu}"]

    def cuda_requirements(self, cuda: str) -> list[str]:
        return [f"jax[cuda{cuda}]=={self.jax}"]


def read_pins(pyproject: pathlib.Path = REPO_ROOT / "pyproject.toml") -> Pins:
    """Pins from pyproject.toml (a regex, not tomllib, so Python < 3.11 laptops work too)."""
    text = pyproject.read_text()
    jax = re.search(r'"jax==([^"]+)"', text)
    libtpu = re.search(r'"libtpu==([^"]+)"', text)
    if not (jax and libtpu):
        raise DeployError(f"{pyproject}: no \"jax==...\" / \"libtpu==...\" pin found")
    return Pins(jax=jax.group(1), libtpu=libtpu.group(1))


def remote(*lines: str) -> str:
    """One `--command` string: bash, stop at the first error, run from the home directory."""
    return "; ".join(("set -euo pipefail", 'cd "$HOME"', *lines))


def tarball_path() -> str:
    return os.path.join(tempfile.gettempdir(), "jaxinfer-src.tar.gz")


def pack_source(dry_run: bool) -> str:
    """`git archive` of HEAD (committed files only) into a tarball to copy to the VMs."""
    path = tarball_path()
    run(["git", "-C", str(REPO_ROOT), "archive", "--format=tar.gz", f"--prefix={REMOTE_SRC}/",
         "-o", path, "HEAD"], dry_run)
    return path


# GPU images install the NVIDIA driver at first boot: wait for it (10 min at most).
WAIT_FOR_NVIDIA_DRIVER = ("for i in $(seq 60); do nvidia-smi >/dev/null 2>&1 && break; "
                          "sleep 10; done", "nvidia-smi")


def install_script(requirements: Sequence[str], *, list_devices: bool,
                   prelude: Sequence[str] = (), extras: Sequence[str] = ()) -> str:
    """Python 3.11 venv (via uv: the TPU images ship 3.10), pinned JAX, jaxinfer -e.

    jaxinfer is installed editable from the unpacked checkout because the demo model
    (checkpoints/) is found relative to the source tree (the presets are package data).
    `extras`: jaxinfer's optional extras, e.g. ("ray",).
    """
    source = f"./{REMOTE_SRC}" + (f"[{','.join(extras)}]" if extras else "")
    pip = f"{REMOTE_PYTHON} -m pip install"
    lines = [
        *prelude,
        'export PATH="$HOME/.local/bin:$PATH"',
        "command -v uv >/dev/null || curl -LsSf https://astral.sh/uv/install.sh | sh",
        f"rm -rf {REMOTE_SRC}",
        f"tar -xzf {REMOTE_TARBALL}",
        f"test -x {REMOTE_PYTHON} || uv venv --seed --python {PYTHON_VERSION} {REMOTE_VENV}",
        f"{pip} --upgrade pip",
        f"{pip} {shlex.join(requirements)} -e {shlex.quote(source)}",
        f"{REMOTE_PYTHON} -m jaxinfer --help >/dev/null",
    ]
    if list_devices:  # single host only: on a slice, backend start-up waits for every host
        lines.append(f'{REMOTE_PYTHON} -c "import jax; print(jax.devices())"')
    return remote(*lines)


def model_dir(model: str) -> str:
    """Where a model given as gs://bucket/path/NAME or /local/path/NAME lands on the VM."""
    name = model.rstrip("/").rsplit("/", 1)[-1]
    if not name:
        raise DeployError(f"--model={model!r}: no directory name at its end")
    return f"{REMOTE_MODELS}/{name}"


def jaxinfer_command(args: argparse.Namespace, *, tensor_parallel_size: int,
                     multihost: Sequence[str] = ()) -> str:
    """`python -m jaxinfer generate|batch|serve ...` as run on a host (from its home
    directory). serve: every host runs the same command; process 0 (worker 0) listens on
    0.0.0.0:--port, the others follow it. The shell's pid is written first and the
    server `exec`s in its place, so the stop step signals exactly it."""
    cmd = [REMOTE_PYTHON, "-m", "jaxinfer", args.task, f"--model={model_dir(args.model)}"]
    if args.task == "generate":
        cmd += [f"--prompt={args.prompt}", f"--max_tokens={args.max_tokens}"]
    elif args.task == "batch":
        cmd += [f"--input={REMOTE_INPUT}", f"--output={REMOTE_RESULTS}"]
    else:
        cmd += ["--host=0.0.0.0", f"--port={args.port}"]
    cmd += [f"--dtype={args.dtype}", f"--tensor_parallel_size={tensor_parallel_size}",
            *multihost, *shlex.split(args.extra)]
    if args.task != "serve":
        return remote(shlex.join(cmd))
    return remote(f"mkdir -p {REMOTE_IO}", f"echo $$ > {REMOTE_SERVE_PID}",
                  "exec " + shlex.join(cmd))


def stop_command() -> str:
    """SIGTERM to the server the run step started on a host: process 0 drains its
    requests in flight, then every process exits 0."""
    return remote(f"kill -TERM $(cat {REMOTE_SERVE_PID})", f"rm -f {REMOTE_SERVE_PID}")


def compute_create_flags(*, machine_type: str, image_family: str, image_project: str,
                         boot_disk_size: str, spot: bool, extra: Sequence[str] = ()
                         ) -> tuple[str, ...]:
    """`gcloud compute instances create` flags shared by TPU and GPU instances."""
    flags = [f"--machine-type={machine_type}", f"--image-family={image_family}",
             f"--image-project={image_project}", "--maintenance-policy=TERMINATE",
             f"--boot-disk-size={boot_disk_size}", "--scopes=cloud-platform", *extra]
    if spot:
        flags += ["--provisioning-model=SPOT", "--instance-termination-action=DELETE"]
    return tuple(flags)


def add_common_flags(parser: argparse.ArgumentParser, *, default_name: str) -> None:
    """Flags shared by the three scripts (steps, where, what to run, --dry_run)."""
    parser.add_argument("steps", nargs="+", choices=(*STEPS, *COMPOSITE_STEPS),
                        help="steps in order; all = create install model run fetch; "
                        "ray_all = create install model ray_up ray_job fetch")
    parser.add_argument("--dry_run", action="store_true",
                        help="print every command, run none (needs no gcloud, no credentials)")
    parser.add_argument("--project", help="GCP project (default: gcloud's configured one)")
    parser.add_argument("--zone", required=True, help="zone, e.g. us-east5-b")
    parser.add_argument("--name", default=default_name, help="VM / TPU name")
    parser.add_argument("--spot", action="store_true", help="Spot capacity (can be preempted)")
    parser.add_argument("--model", help="model directory: gs://bucket/path/NAME (copied on "
                        "the VM with gcloud storage) or a local directory (copied with scp)")
    parser.add_argument("--tensor_parallel_size", type=int,
                        help="default: every chip / GPU of the VM(s)")
    parser.add_argument("--task", choices=("generate", "batch", "serve"),
                        help="python -m jaxinfer generate (one prompt), batch (a JSONL "
                        "file) or serve (the HTTP server, on process 0 at --port; the stop "
                        "step ends it); default: generate, batch with ray_job or --ray")
    parser.add_argument("--port", type=int, default=8000,
                        help="serve: the HTTP port on the first host (0.0.0.0)")
    parser.add_argument("--prompt", default="def fibonacci(n):", help="generate: the prompt")
    parser.add_argument("--max_tokens", type=int, default=64, help="generate: tokens")
    parser.add_argument("--input", help="batch: requests JSONL, local path or gs://")
    parser.add_argument("--output", default="results.jsonl",
                        help="batch: where fetch puts the results (local path or gs://)")
    parser.add_argument("--dtype", default="bfloat16", help="jaxinfer --dtype")
    parser.add_argument("--extra", default="", help="more jaxinfer flags, e.g. "
                        "'--max_model_len=8192 --max_num_seqs=64'")


def steps_to_run(args: argparse.Namespace) -> list[str]:
    """The steps `args` ask for, checked (flags they need, tools on PATH unless dry run)."""
    todo = expand_steps(args.steps)
    args.task = resolve_task(args, todo)
    validate(args, todo)
    check_tools(args.dry_run, todo)
    return todo


def expand_steps(steps: Sequence[str]) -> list[str]:
    out: list[str] = []
    for step in steps:
        out += COMPOSITE_STEPS.get(step, (step,))
    return out


def resolve_task(args: argparse.Namespace, steps: Sequence[str]) -> str:
    """generate unless asked; a Ray deployment runs batch (so a later fetch finds its output)."""
    ray = "ray_job" in steps or getattr(args, "ray", False)
    if "ray_job" in steps and "run" in steps:
        raise DeployError("run and ray_job both start jaxinfer on the same chips and write the "
                          "same results file: ask for one of them")
    if ray and args.task in ("generate", "serve"):
        raise DeployError("ray_job (and --ray) run python -m jaxinfer batch: "
                          f"--task={args.task} does not apply")
    return args.task or ("batch" if ray else "generate")


def validate(args: argparse.Namespace, steps: Sequence[str]) -> None:
    """Check the flags the chosen steps need before any command runs."""
    if ({"model", "run", "ray_job"} & set(steps)) and not args.model:
        raise DeployError("the model, run and ray_job steps need --model")
    if ({"run", "ray_job"} & set(steps)) and args.task == "batch" and not args.input:
        raise DeployError("batch (--task=batch, ray_job) needs --input (a JSONL file, local "
                          "or gs://)")
    if "stop" in steps and args.task != "serve":
        raise DeployError("the stop step ends a server: it needs --task=serve")
    if not 0 < args.port < 65536:
        raise DeployError(f"--port={args.port} must be in [1, 65536)")
    if args.tensor_parallel_size is not None and args.tensor_parallel_size < 1:
        raise DeployError(f"--tensor_parallel_size={args.tensor_parallel_size} must be >= 1")
    if args.dry_run:
        return
    for flag in ("model", "input"):
        path = getattr(args, flag)
        if path and not path.startswith("gs://") and not os.path.exists(path):
            raise DeployError(f"--{flag}={path}: no such file or directory")


def main_guard(main: Callable[[], None]) -> None:
    """Run `main()`; user mistakes and failed commands become one line on stderr."""
    try:
        main()
    except DeployError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except subprocess.CalledProcessError as err:
        print(f"error: {shlex.join(err.cmd)} exited with {err.returncode}", file=sys.stderr)
        sys.exit(1)
