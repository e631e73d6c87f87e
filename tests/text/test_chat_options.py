"""The chat template's request options (vLLM's): template variables such as Qwen3's
enable_thinking and gpt-oss's reasoning_effort, and continue_final_message, through
`Tokenizer.prompt_ids`, the path LLM.chat and the server take."""

from __future__ import annotations

import json
import shutil

import pytest

from jaxinfer.text.tokenizer import Tokenizer

# The generation prompt of Qwen3's chat template (Qwen/Qwen3-*'s tokenizer_config.json),
# after a minimal rendering of the turns.
QWEN3_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + "
    "message.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}")
MESSAGES = [{"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module")
def qwen3(gemma, tmp_path_factory):
    """gemma's tokenizer files with Qwen3's generation prompt as the template."""
    path = tmp_path_factory.mktemp("qwen3")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(gemma / name, path / name)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = QWEN3_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return Tokenizer.from_dir(path)


def _text(tokenizer: Tokenizer, **options) -> str:
    return tokenizer.decode(tokenizer.prompt_ids(None, MESSAGES, **options),
                            skip_special_tokens=False)


def test_enable_thinking_false_closes_the_think_block(qwen3):
    assert not _text(qwen3).endswith("</think>\n\n")
    off = _text(qwen3, template_kwargs={"enable_thinking": False})
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_reasoning_effort_reaches_gpt_oss_template(gpt_oss):
    tokenizer = Tokenizer.from_dir(gpt_oss)
    assert "Reasoning: medium" in _text(tokenizer)  # the template's default
    assert "Reasoning: high" in _text(tokenizer,
                                      template_kwargs={"reasoning_effort": "high"})


def test_continue_final_message_ends_inside_the_last_message(qwen3):
    messages = MESSAGES + [{"role": "assistant", "content": "It is"}]
    ids = qwen3.prompt_ids(None, messages, add_generation_prompt=False,
                           continue_final_message=True)
    assert qwen3.decode(ids, skip_special_tokens=False).endswith("<|im_start|>assistant\nIt is")
    with pytest.raises(ValueError, match="continue_final_message continues the last message"):
        qwen3.prompt_ids(None, messages, continue_final_message=True)
