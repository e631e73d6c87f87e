"""The deploy tests' fixture: a PATH whose gcloud, git, ssh, scp and curl record any call."""

from __future__ import annotations

import pathlib

import pytest
from dryrun import make_fakes


@pytest.fixture
def fake_path(tmp_path: pathlib.Path) -> tuple[str, pathlib.Path]:
    """A PATH of recording fakes, and the file any call to one of them would write."""
    return make_fakes(tmp_path)
