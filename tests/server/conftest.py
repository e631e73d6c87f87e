"""A real `python -m jaxinfer serve` on 127.0.0.1 (ephemeral port, bundled demo model),
and an in-process LLM with the same engine settings for the expected outputs; the
server helpers live in serving.py (a module named `conftest` is ambiguous when other
test directories with their own conftest.py are collected in the same run)."""

from __future__ import annotations

import pytest
from serving import ENGINE_FLAGS, SCORING, start_server

from jaxinfer import LLM
from jaxinfer.config import DEFAULT_MODEL


@pytest.fixture(scope="session")
def server():
    """One default server (scoring on) shared by the API, load, fuzz and prompt logprobs
    tests."""
    s = start_server(**SCORING)
    yield s
    s.stop()


@pytest.fixture(scope="session")
def demo_llm() -> LLM:
    """The same model and engine settings in this process: the expected outputs."""
    return LLM(DEFAULT_MODEL, **ENGINE_FLAGS)


@pytest.fixture
def client(server):
    import openai

    with openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0,
                       timeout=120) as c:
        yield c
