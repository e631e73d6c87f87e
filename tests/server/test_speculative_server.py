"""`serve --speculative_config=JSON`: a real server speculating with n-gram lookup gives
`LLM.generate`'s greedy text (no speculation there), and its /metrics carry the
spec_decode_* counters of what it verified."""

from __future__ import annotations

import json

import pytest
from serving import greedy, metric_values, start_server

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}
PROMPTS = ["import os\n\n\ndef read_lines(path):\n", "class Stack:\n    def push(self, x):\n"]


@pytest.fixture(scope="module")
def spec_server():
    server = start_server(f"--speculative_config={json.dumps(SPEC)}")
    yield server
    assert server.stop() == 0


def test_speculating_server_gives_the_plain_greedy_text_and_counts_drafts(spec_server,
                                                                         demo_llm):
    import openai

    with openai.OpenAI(base_url=spec_server.url, api_key="unused", max_retries=0,
                       timeout=120) as client:
        got = [client.completions.create(model=spec_server.model, prompt=p, max_tokens=48,
                                         temperature=0).choices[0].text for p in PROMPTS]
    want = [o.text for o in demo_llm.generate(PROMPTS, greedy(demo_llm, 48))]
    assert got == want
    values = metric_values(spec_server)
    drafts = values["jaxinfer:spec_decode_num_draft_tokens_total"]
    accepted = values["jaxinfer:spec_decode_num_accepted_tokens_total"]
    assert 0 < accepted <= drafts
    assert values["jaxinfer:generation_tokens_total"] == 96
    assert sum(v for k, v in values.items()
               if k.startswith("jaxinfer:spec_decode_num_accepted_tokens_per_pos")) == accepted
