"""What the client checks share (standard library only: each check runs in its client's
own virtual environment): a `python -m jaxinfer serve` on the bundled demo model started
and stopped around the checks, or a server already running (--url), and the JSON report
of pass/fail per check."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

REPO = pathlib.Path(__file__).resolve().parents[2]
READY = re.compile(r"serving '(?P<name>[^']*)' at (?P<url>http://\S+)/v1")
# Small buckets: warm-up in ~20 s on a CPU (the tests' settings)
ENGINE_FLAGS = ("--max_num_seqs=16", "--max_num_batched_tokens=64", "--max_model_len=512")


def arguments(description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--url", help="a running server's base URL (http://HOST:PORT); "
                        "default: start one on the demo model and stop it after")
    parser.add_argument("--model", default="demo", help="the served model name (with --url)")
    parser.add_argument("--jaxinfer_python", default=str(REPO / ".venv" / "bin" / "python"),
                        help="the Python that runs `-m jaxinfer serve`")
    return parser.parse_args()


@contextlib.contextmanager
def server(args: argparse.Namespace, *flags: str) -> Iterator[tuple[str, str]]:
    """(base URL without /v1, model name): args.url's, or a demo server's for the block."""
    if args.url:
        yield args.url.rstrip("/").removesuffix("/v1"), args.model
        return
    command = [args.jaxinfer_python, "-m", "jaxinfer", "serve", "--port=0", *ENGINE_FLAGS,
               *flags]
    env = os.environ | {"PYTHONPATH": str(REPO)}
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
    found: dict[str, str] = {}
    ready = threading.Event()

    def read() -> None:  # keeps draining stderr so the server never blocks on it
        for line in process.stderr:
            match = READY.search(line)
            if match and not ready.is_set():
                found.update(match.groupdict())
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        ready.wait(300)
        if not found:
            raise RuntimeError(f"the server did not start: {' '.join(command)}")
        yield found["url"], found["name"]
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()


class Report:
    """Checks run one by one, each passing or failing with its detail; printed as JSON."""

    def __init__(self, client: str, version: str) -> None:
        self.out: dict[str, Any] = {"client": client, "version": version, "checks": {}}

    def check(self, name: str, run: Callable[[], Any]) -> None:
        began = time.monotonic()
        try:
            detail = run()
            result = {"ok": True, "detail": detail}
        except Exception as e:  # a failing check is reported, the others still run
            result = {"ok": False, "error": f"{type(e).__name__}: {e}",
                      "trace": traceback.format_exc(limit=3)}
        result["seconds"] = round(time.monotonic() - began, 2)
        self.out["checks"][name] = result

    def finish(self) -> None:
        self.out["ok"] = bool(self.out["checks"]) and all(
            c["ok"] for c in self.out["checks"].values())
        print(json.dumps(self.out, indent=2, default=str))
        sys.exit(0 if self.out["ok"] else 1)


def expect(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)
