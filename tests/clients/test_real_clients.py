"""Real OpenAI clients against a real server (slow): tools/clients/check_*.py, each run
by its own virtual environment's Python against one demo server; skipped, with the
commands that make the environment, where it does not exist."""

from __future__ import annotations

import json
import pathlib
import subprocess

import pytest
from serving import start_server

REPO = pathlib.Path(__file__).resolve().parents[2]
CLIENTS = REPO / "tools" / "clients"
VENVS = {"guidellm": pathlib.Path("/work/venv-guidellm"),
         "litellm": pathlib.Path("/work/venv-litellm"),
         "langchain": pathlib.Path("/work/venv-langchain")}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server():
    s = start_server()
    yield s
    s.stop()


@pytest.mark.parametrize("client", sorted(VENVS))
def test_real_client_works_unchanged(server, client):
    python = VENVS[client] / "bin" / "python"
    requirements = CLIENTS / f"requirements-{client}.txt"
    if not python.exists():
        pytest.skip(f"no {VENVS[client]}: python3 -m venv {VENVS[client]} && "
                    f"{python.parent}/pip install -r {requirements.relative_to(REPO)}")
    run = subprocess.run([str(python), str(CLIENTS / f"check_{client}.py"),
                          f"--url={server.url}", f"--model={server.model}"],
                         capture_output=True, text=True, timeout=900, cwd=REPO)
    report = json.loads(run.stdout)
    failed = {name: check for name, check in report["checks"].items() if not check["ok"]}
    assert not failed, json.dumps(failed, indent=1)
    assert report["checks"] and report["ok"]
