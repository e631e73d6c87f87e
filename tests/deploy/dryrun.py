"""Helpers for the deploy scripts' dry-run tests: run a script with `--dry_run` on a PATH of
recording fakes (see conftest.py's fake_path), parse the printed `$ ...` commands.
"""

from __future__ import annotations

import os
import pathlib
import shlex
import subprocess
import sys
import tomllib

REPO = pathlib.Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
JAX_PIN = next(dep.split("==")[1] for dep in PYPROJECT["project"]["dependencies"]
               if dep.startswith("jax=="))
LIBTPU_PIN = next(dep.split("==")[1] for dep in PYPROJECT["project"]["optional-dependencies"]
                  ["tpu-aot"] if dep.startswith("libtpu=="))
FAKE_TOOLS = ("gcloud", "git", "ssh", "scp", "curl")


def make_fakes(tmp_path: pathlib.Path) -> tuple[str, pathlib.Path]:
    """A PATH of recording fakes, and the file any call to one of them would write."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    for tool in FAKE_TOOLS:
        fake = bin_dir / tool
        fake.write_text(f'#!/bin/sh\necho "{tool} $*" >> {calls}\nexit 0\n')
        fake.chmod(0o755)
    return str(bin_dir), calls


def run_script(script: str, *args: str, path: str, dry_run: bool = True
               ) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", f"deploy.{script}", *args] + (["--dry_run"] if dry_run else [])
    env = {"PATH": path, "HOME": os.environ.get("HOME", "/tmp"), "PYTHONPATH": str(REPO)}
    return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)


def dry_run(fake_path: tuple[str, pathlib.Path], script: str, *args: str
            ) -> tuple[list[list[str]], str]:
    """The printed commands (argv lists) and the whole stdout; asserts nothing was executed."""
    path, calls = fake_path
    proc = run_script(script, *args, path=path)
    assert proc.returncode == 0, proc.stderr
    assert not calls.exists(), f"a dry run executed: {calls.read_text()}"
    cmds = [shlex.split(line[2:]) for line in proc.stdout.splitlines() if line.startswith("$ ")]
    assert cmds, proc.stdout
    return cmds, proc.stdout


def find(cmds: list[list[str]], *words: str) -> list[list[str]]:
    """The commands that start with `words` (e.g. "gcloud", "compute", "instances", "create")."""
    return [cmd for cmd in cmds if tuple(cmd[:len(words)]) == words]


def flag(cmd: list[str], name: str) -> str | None:
    values = [arg.split("=", 1)[1] for arg in cmd if arg.startswith(f"{name}=")]
    assert len(values) <= 1, cmd
    return values[0] if values else None


def remote(cmd: list[str]) -> str:
    command = flag(cmd, "--command")
    assert command is not None, cmd
    return command


def jaxinfer_runs(cmds: list[list[str]]) -> list[list[str]]:
    """argv of every `python -m jaxinfer generate|batch|serve` inside an ssh --command (a
    leading `exec` dropped)."""
    runs = []
    for cmd in cmds:
        for part in (remote(cmd).split("; ") if flag(cmd, "--command") else []):
            if any(f"-m jaxinfer {task}" in part for task in ("generate", "batch", "serve")):
                runs.append(shlex.split(part.removeprefix("exec ")))
    return runs


def install_line(cmds: list[list[str]]) -> list[str]:
    lines = [shlex.split(part) for cmd in cmds if flag(cmd, "--command")
             for part in remote(cmd).split("; ") if "-m pip install" in part and " -e " in part]
    assert len(lines) == 1, lines
    return lines[0]


ALL = ("all", "delete")
V6E = ("--zone=us-east5-b", "--model=gs://bucket/models/Qwen3-8B", "--project=my-project")
