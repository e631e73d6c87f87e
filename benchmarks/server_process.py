"""A benchmark's server process: the end of its log, and a stop that reports a
non-zero exit (bench_serving.py, bench_api_routes.py).
"""

from __future__ import annotations

import pathlib
import signal
import subprocess
import sys
import typing


def tail(log: typing.IO | None) -> str:
    """The end of the server's log, read by path (the server moves the handle's offset)."""
    return pathlib.Path(log.name).read_bytes().decode(errors="replace")[-3000:] if log else ""


def stop_server(process: subprocess.Popen, log: typing.IO) -> int:
    """SIGTERM, then the exit code (killed after 120 s); the log's end when non-zero."""
    process.send_signal(signal.SIGTERM)
    try:
        code = process.wait(timeout=120)
    except subprocess.TimeoutExpired:
        process.kill()
        code = process.wait()
    print(f"the server exited with {code}:\n{tail(log)}" * (code != 0), file=sys.stderr)
    return code
