"""Fixtures for tests that download from a hub: `fake_hub` (a FakeHub on 127.0.0.1, one
per test), `hub_env` (huggingface_hub pointed at it, in this process and in
subprocesses), `tiny_repo_dir` and `tiny_repo_factory` (small model repos on disk).
Test modules take these as fixtures: `import conftest` may find another directory's."""

from __future__ import annotations

import json
import os
import pathlib
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
from fake_hub import FakeHub

# The caller's settings that would leak in: a token (HF_TOKEN, HUGGING_FACE_HUB_TOKEN and
# HF_OIDC_RESOURCE are read at each request), offline mode or other paths (read when
# huggingface_hub is imported, so only a subprocess would see them).
_UNSET = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
          "HF_OIDC_RESOURCE", "HUGGINGFACE_CO_STAGING", "HUGGINGFACE_HUB_CACHE",
          "HF_HUB_DISABLE_IMPLICIT_TOKEN", "HF_TOKEN_PATH", "HF_XET_CACHE", "HF_ASSETS_CACHE")


@dataclass
class HubEnv:
    """huggingface_hub pointed at a fake hub, with a fresh HF_HOME and cache.

    `vars` are the environment variables set (os.environ has them, so a subprocess
    started with the default env, or with `environ()`, talks to the fake hub too)."""

    endpoint: str
    home: pathlib.Path  # HF_HOME: token file (none), xet cache, agent registry
    cache: pathlib.Path  # HF_HUB_CACHE: where snapshot_download puts repos
    vars: dict[str, str]
    _monkeypatch: pytest.MonkeyPatch

    def offline(self) -> None:
        """HF_HUB_OFFLINE=1, here (the client checks a constant read at import) and for
        subprocesses."""
        from huggingface_hub import constants

        self._monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        self._monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
        self.vars["HF_HUB_OFFLINE"] = "1"

    def environ(self) -> dict[str, str]:
        """An env for a subprocess: this process's, which has `vars`."""
        return dict(os.environ)


def _point_client_at(monkeypatch: pytest.MonkeyPatch, endpoint: str, home: pathlib.Path,
                     cache: pathlib.Path) -> None:
    """Set huggingface_hub.constants' import-time copies of the env: the endpoint (and the
    resolve URL template built from it), the cache and HF_HOME paths (no token file there,
    so no token is sent), telemetry off (otherwise the first request fetches
    {ENDPOINT}/api/agent-harnesses, from the endpoint read at import) and online. The
    module-level functions (huggingface_hub.model_info, ...) belong to one HfApi made when
    hf_api is first imported, which keeps the endpoint of that moment: set it too."""
    from huggingface_hub import constants, hf_api

    monkeypatch.setattr(hf_api.api, "endpoint", endpoint)
    for name, value in {
        "ENDPOINT": endpoint,
        "HUGGINGFACE_CO_URL_TEMPLATE": endpoint + "/{repo_id}/resolve/{revision}/{filename}",
        "HF_HOME": str(home), "HF_HUB_CACHE": str(cache),
        "HF_ASSETS_CACHE": str(home / "assets"), "HF_XET_CACHE": str(home / "xet"),
        "HF_TOKEN_PATH": str(home / "token"), "HF_STORED_TOKENS_PATH": str(home / "stored_tokens"),
        "AGENT_HARNESSES_PATH": str(home / ".agent_harnesses.json"),
        "HF_HUB_DISABLE_TELEMETRY": True, "HF_HUB_OFFLINE": False,
        "HF_HUB_DISABLE_IMPLICIT_TOKEN": False,
    }.items():
        monkeypatch.setattr(constants, name, value)


@pytest.fixture
def fake_hub() -> Iterator[FakeHub]:
    """A running FakeHub with no repos; stopped after the test."""
    with FakeHub() as hub:
        yield hub


@pytest.fixture
def hub_env(fake_hub: FakeHub, tmp_path: pathlib.Path,
            monkeypatch: pytest.MonkeyPatch) -> HubEnv:
    """huggingface_hub (in this process and in subprocesses) talks to `fake_hub` with no
    token, caches under tmp_path, sends no telemetry. Sets HF_ENDPOINT, HF_HOME,
    HF_HUB_CACHE, HF_HUB_DISABLE_TELEMETRY=1 and unsets HF_TOKEN, HF_HUB_OFFLINE and the
    other variables in _UNSET; in this process it also sets the constants that
    huggingface_hub read from them at import (so no endpoint=/cache_dir= is needed)."""
    home, cache = tmp_path / "hf-home", tmp_path / "hf-hub-cache"
    home.mkdir()
    env = {"HF_ENDPOINT": fake_hub.endpoint, "HF_HOME": str(home), "HF_HUB_CACHE": str(cache),
           "HF_HUB_DISABLE_TELEMETRY": "1"}
    for name in _UNSET:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    _point_client_at(monkeypatch, fake_hub.endpoint, home, cache)
    return HubEnv(fake_hub.endpoint, home, cache, env, monkeypatch)


def _safetensors(tensors: dict[str, tuple[list[int], bytes]]) -> bytes:
    """A safetensors file of float32 tensors: name -> (shape, raw bytes)."""
    header, offset = {}, 0
    for name, (shape, data) in tensors.items():
        end = offset + len(data)
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, end]}
        offset += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(d for _, d in tensors.values())


def make_tiny_repo(path: pathlib.Path, seed: int = 0) -> pathlib.Path:
    """A few-KB model repo: config.json, tokenizer.json, model.safetensors (LFS),
    pytorch_model.bin (LFS) and original/params.json (a subfolder); `seed` varies the
    bytes so two repos (or branches) differ."""
    path.mkdir(parents=True, exist_ok=True)
    weights = bytes((seed * 31 + i * 7) % 251 for i in range(32 * 32 * 4))
    files = {
        "config.json": json.dumps({"model_type": "llama", "hidden_size": 32, "seed": seed}),
        "tokenizer.json": json.dumps({"version": "1.0", "model": {"vocab": {"a": seed}}}),
        "original/params.json": json.dumps({"dim": 32, "seed": seed}),
    }
    for name, text in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text)
    (path / "model.safetensors").write_bytes(_safetensors({"w": ([32, 32], weights)}))
    (path / "pytorch_model.bin").write_bytes(b"PK\x03\x04" + weights[:2000])
    return path


@pytest.fixture(scope="session")
def tiny_repo_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """make_tiny_repo(seed=0), built once per session; do not modify it."""
    return make_tiny_repo(tmp_path_factory.mktemp("tiny-repo"))


@pytest.fixture
def tiny_repo_factory(tmp_path_factory: pytest.TempPathFactory
                      ) -> Callable[[int], pathlib.Path]:
    """seed -> a new directory made by make_tiny_repo (yours to modify)."""
    return lambda seed: make_tiny_repo(tmp_path_factory.mktemp(f"tiny-repo-{seed}"), seed)
