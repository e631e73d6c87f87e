"""A server whose output parsers read text refuses to start without a tokenizer, naming
the flag, instead of failing each request later."""

from __future__ import annotations

import pytest

from jaxinfer import LLM, server
from jaxinfer.config import DEFAULT_MODEL, ServerConfig


@pytest.mark.parametrize("flags", [{"reasoning_parser": "qwen3"},
                                   {"tool_call_parser": "hermes",
                                    "enable_auto_tool_choice": True}])
def test_a_text_parser_without_a_tokenizer_is_refused_at_start(flags):
    llm = LLM(DEFAULT_MODEL, warm_up=False, skip_tokenizer_init=True, max_num_seqs=2,
              max_num_batched_tokens=16, max_model_len=64)
    (flag, value), *_ = flags.items()

    def started(url: str) -> None:  # the guard is gone: fail instead of serving forever
        raise AssertionError(f"the server started at {url}")

    with pytest.raises(ValueError, match=f"--{flag}={value} reads the generated text: it "
                                         "needs the model's tokenizer"):
        server.serve(llm, ServerConfig(port=0, **flags), model_name="demo", ready=started)
