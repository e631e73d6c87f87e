"""Gemma 3's and gpt-oss's chat templates (copies of the checkpoints' own, in templates/)
rendered by our sandbox: the expected texts are written out from each model's documented
prompt format, and transformers renders the same."""

import datetime
import pathlib

import pytest
import transformers

from jaxinfer.text.tokenizer import Tokenizer

CONVERSATION = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4", "reasoning": "Add two and two."},
    {"role": "user", "content": "  And 3+3?\n"},
]


def _theirs(path: pathlib.Path, messages: list[dict], **kwargs) -> str:
    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(path)
    return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


def test_gemma3_folds_the_system_message_into_the_first_user_turn(gemma):
    rendered = Tokenizer.from_dir(gemma).apply_chat_template(CONVERSATION)
    # Gemma's format: <start_of_turn>{user|model}\n...<end_of_turn>\n, no system role;
    # the template trims each turn's text
    assert rendered == (
        "<bos><start_of_turn>user\nAnswer briefly.\n\nWhat is 2+2?<end_of_turn>\n"
        "<start_of_turn>model\n4<end_of_turn>\n"
        "<start_of_turn>user\nAnd 3+3?<end_of_turn>\n"
        "<start_of_turn>model\n")
    assert rendered == _theirs(gemma, CONVERSATION, add_generation_prompt=True)


def test_gemma3_text_parts_and_role_alternation(gemma):
    tokenizer = Tokenizer.from_dir(gemma)
    parts = [{"role": "user", "content": [{"type": "text", "text": " hi "},
                                          {"type": "image"}]}]
    rendered = tokenizer.apply_chat_template(parts, add_generation_prompt=False)
    assert rendered == "<bos><start_of_turn>user\nhi<start_of_image><end_of_turn>\n"
    with pytest.raises(ValueError, match="Conversation roles must alternate"):
        tokenizer.apply_chat_template(CONVERSATION[1:2] * 2)
    ids = tokenizer.encode(tokenizer.apply_chat_template(CONVERSATION),
                           add_special_tokens=False)
    assert tokenizer.vocab()["<start_of_turn>"] in ids  # a template token is one token


def _system(today: str, tools: bool = False, effort: str = "medium") -> str:
    calls = "\nCalls to these tools must go to the commentary channel: 'functions'."
    return ("<|start|>system<|message|>You are ChatGPT, a large language model trained by "
            f"OpenAI.\nKnowledge cutoff: 2024-06\nCurrent date: {today}\n\n"
            f"Reasoning: {effort}\n\n# Valid channels: analysis, commentary, final. Channel "
            f"must be included for every message.{calls if tools else ''}<|end|>")


def test_gpt_oss_harmony_multi_turn(gpt_oss):
    tokenizer = Tokenizer.from_dir(gpt_oss)
    today = datetime.date.today().strftime("%Y-%m-%d")
    rendered = tokenizer.apply_chat_template(CONVERSATION, reasoning_effort="high")
    # harmony: the system message is the model's own; the caller's system message becomes
    # the developer's instructions; earlier turns drop their reasoning and end in <|end|>;
    # the generation prompt opens an assistant message without its channel
    assert rendered == (
        _system(today, effort="high")
        + "<|start|>developer<|message|># Instructions\n\nAnswer briefly.\n\n<|end|>"
        "<|start|>user<|message|>What is 2+2?<|end|>"
        "<|start|>assistant<|channel|>final<|message|>4<|end|>"
        "<|start|>user<|message|>  And 3+3?\n<|end|>"
        "<|start|>assistant")
    assert rendered == _theirs(gpt_oss, CONVERSATION, add_generation_prompt=True,
                               reasoning_effort="high")


@pytest.mark.parametrize("field", ["reasoning", "reasoning_content", "thinking"])
def test_gpt_oss_reads_reasoning_under_any_name_as_thinking(gpt_oss, field):
    """The last assistant turn without a generation prompt (a training example) keeps its
    analysis message: the template reads `thinking`, clients send other names."""
    messages = [{"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4", field: "Add them."}]
    rendered = Tokenizer.from_dir(gpt_oss).apply_chat_template(messages,
                                                               add_generation_prompt=False)
    assert rendered.endswith(
        "<|start|>user<|message|>2+2?<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>Add them.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>4<|return|>")


def test_gpt_oss_tool_call_round_trip(gpt_oss):
    """Tools render as a TypeScript namespace; a call goes to the commentary channel with
    its arguments as JSON; the tool's answer comes back as a JSON string."""
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city",
        "parameters": {"type": "object", "required": ["city"], "properties": {
            "city": {"type": "string", "description": "The city"},
            "unit": {"type": "string", "enum": ["C", "F"]}}}}}]
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning": "Call the tool.", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather",
                                              "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "20C"},
        {"role": "assistant", "content": "It is 20C."},
    ]
    rendered = Tokenizer.from_dir(gpt_oss).apply_chat_template(messages, tools=tools)
    today = datetime.date.today().strftime("%Y-%m-%d")
    assert rendered == (
        _system(today, tools=True)
        + "<|start|>developer<|message|># Tools\n\n## functions\n\nnamespace functions {\n\n"
        "// Weather in a city\ntype get_weather = (_: {\n// The city\ncity: string,\n"
        'unit?: "C" | "F",\n}) => any;\n\n} // namespace functions<|end|>'
        "<|start|>user<|message|>Weather in Paris?<|end|>"
        "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
        '{"city": "Paris"}<|call|>'
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"20C"'
        "<|end|><|start|>assistant<|channel|>final<|message|>It is 20C.<|end|>"
        "<|start|>assistant")
    assert rendered == _theirs(gpt_oss, messages, tools=tools, add_generation_prompt=True)


def test_gpt_oss_refuses_harmony_tags_in_content(gpt_oss):
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "<|channel|>final<|message|>hello"},
                {"role": "user", "content": "again"}]
    with pytest.raises(ValueError, match="containing <\\|channel\\|> tags in the content"):
        Tokenizer.from_dir(gpt_oss).apply_chat_template(messages)


def test_gpt_oss_template_tokens_are_single_ids(gpt_oss):
    tokenizer = Tokenizer.from_dir(gpt_oss)
    text = tokenizer.apply_chat_template(CONVERSATION[1:2])
    ids = tokenizer.encode(text, add_special_tokens=False)
    vocab = tokenizer.vocab()
    for token in ("<|start|>", "<|message|>", "<|end|>"):
        assert ids.count(vocab[token]) == text.count(token) > 0
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
