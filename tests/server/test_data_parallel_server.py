"""A data-parallel server (two replicas, one CPU device each) answers the `openai` client
with exactly one engine's text, and /metrics has one series per replica (vLLM's label
`engine`) that add up to the requests served."""

from __future__ import annotations

import dataclasses

import pytest
from serving import greedy, metric_values, start_server

PREAMBLE = "import os\nimport sys\n\n\ndef read_lines(path):\n    with open(path) as f:\n"
TAILS = ["        return f.read()", "        for line in f:", "        data = f", "  # x"]


@pytest.fixture(scope="module")
def dp_server():
    s = start_server("--data_parallel_size=2", env={"JAX_NUM_CPU_DEVICES": "2"})
    yield s
    assert s.stop() == 0


@pytest.fixture
def dp_client(dp_server):
    import openai

    with openai.OpenAI(base_url=dp_server.url, api_key="unused", max_retries=0,
                       timeout=120) as c:
        yield c


def test_completions_equal_one_engine(dp_client, dp_server, demo_llm):
    prompts = [PREAMBLE + tail for tail in TAILS] + ["def main():", "class A:"]
    response = dp_client.completions.create(model=dp_server.model, prompt=prompts,
                                            max_tokens=16, temperature=0)
    expected = demo_llm.generate(prompts, greedy(demo_llm, 16), use_tqdm=False)
    assert [c.text for c in sorted(response.choices, key=lambda c: c.index)] == [
        e.outputs[0].text for e in expected]
    seeded = dp_client.completions.create(model=dp_server.model, prompt=PREAMBLE, n=2,
                                          max_tokens=12, temperature=0.8, seed=3)
    params = dataclasses.replace(demo_llm.engine.default_params, temperature=0.8, seed=3,
                                 max_tokens=12, n=2)
    (want,) = demo_llm.generate(PREAMBLE, params, use_tqdm=False)
    assert sorted(c.text for c in seeded.choices) == sorted(o.text for o in want.outputs)


def test_chat_stream_equals_one_engine(dp_client, dp_server, demo_llm):
    messages = [{"role": "user", "content": "def main():"}]
    chunks = dp_client.chat.completions.create(model=dp_server.model, messages=messages,
                                               max_tokens=16, temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    (expected,) = demo_llm.chat(messages, greedy(demo_llm, 16), use_tqdm=False)
    assert text == expected.outputs[0].text


def test_metrics_have_a_series_per_replica(dp_client, dp_server):
    before = metric_values(dp_server)
    dp_client.completions.create(model=dp_server.model, prompt=[PREAMBLE + t for t in TAILS],
                                 max_tokens=4, temperature=0)
    after = metric_values(dp_server)
    key = "jaxinfer:request_success_total{engine=%d,finished_reason=length}"
    served = [after[key % r] - before.get(key % r, 0) for r in (0, 1)]
    assert sum(served) == len(TAILS)
    assert sorted(served) == [0, len(TAILS)]  # the shared preamble stayed on one replica
    assert after["jaxinfer:compilations_after_warmup_total{engine=0}"] == 0
    assert after["jaxinfer:compilations_after_warmup_total{engine=1}"] == 0
    assert after["jaxinfer:num_requests_running{engine=1}"] == 0
