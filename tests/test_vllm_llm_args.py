"""vLLM's options jaxinfer's LLM and flags take: chat_template (a file or the template's
text, and per LLM.chat call), generation_config (auto, vllm, a directory) with
override_generation_config, vLLM's LLM keywords (honoured, accepted with no effect, or
refused with the reason) and enforce_eager (no warm-up). One demo LLM without warm-up
serves the tests that generate."""

from __future__ import annotations

import asyncio
import json
import pathlib

import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.batch.in_process import post
from jaxinfer.config import DEFAULT_MODEL, EngineConfig, ServerConfig
from jaxinfer.config.vllm_keywords import ANY, VLLM_KEYWORDS, engine_settings
from jaxinfer.engine import loading
from jaxinfer.text.tokenizer import Tokenizer

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
FILE_TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}>"
SMALL = dict(max_num_seqs=2, max_num_batched_tokens=32, max_model_len=128)
# the demo's generation_config.json: temperature 0.6, top_p 0.95, repetition_penalty 1.1
DEMO_DEFAULTS = SamplingParams(temperature=0.6, top_p=0.95, repetition_penalty=1.1)
# vLLM keywords that change nothing here, at values a vLLM script passes
NO_EFFECT = dict(swap_space=4, served_model_name="demo", disable_log_stats=True,
                 trust_remote_code=False, tokenizer_mode="auto", seed=None,
                 enable_chunked_prefill=True, max_logprobs=20, task="generate")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A generation_config folder and a chat template file."""
    path = tmp_path_factory.mktemp("vllm-args")
    (path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.3, "top_k": 5, "do_sample": True, "eos_token_id": 0}))
    (path / "chat.jinja").write_text(FILE_TEMPLATE)
    return path


@pytest.fixture(scope="module")
def llm(folder):
    """The demo with vLLM's keywords: a chat template file, another folder's generation
    config with an override, enforce_eager, and keywords that change nothing here."""
    return LLM(DEFAULT_MODEL, dtype="float32", **SMALL, enforce_eager=True,
               chat_template=str(folder / "chat.jinja"), generation_config=str(folder),
               override_generation_config={"top_p": 0.5}, **NO_EFFECT)


def _rendered(template: str, messages=MESSAGES) -> str:
    return Tokenizer.from_dir(DEFAULT_MODEL).with_chat_template(template).apply_chat_template(
        messages)


# ---- chat_template --------------------------------------------------------------------

def test_chat_template_file_replaces_the_checkpoints(llm):
    own = Tokenizer.from_dir(DEFAULT_MODEL).apply_chat_template(MESSAGES)
    text = llm.get_tokenizer().apply_chat_template(MESSAGES)
    assert text == "[system] Be brief.\n[user] hi\n>" != own
    assert own.startswith("# system: Be brief.")  # the demo's own template


def test_chat_template_reaches_the_servers_tokenize_route(llm):
    from jaxinfer import server
    from jaxinfer.server.app import create_app
    from jaxinfer.server.engine_loop import EngineLoop

    loop = EngineLoop(llm.engine, max_waiting_requests=8)  # not started: /tokenize needs none
    app = create_app(server.make_state(llm, ServerConfig(), loop, "demo"))
    status, raw = asyncio.run(post(app, "/tokenize", json.dumps(
        {"messages": MESSAGES, "add_generation_prompt": False}).encode()))
    assert status == 200, raw
    assert json.loads(raw)["tokens"] == llm.get_tokenizer().encode(
        "[system] Be brief.\n[user] hi\n>", add_special_tokens=False)


def test_chat_takes_a_template_per_call(llm):
    inline = "{{ messages[-1].content }} ->"
    params = SamplingParams(max_tokens=1, temperature=0)
    out = llm.chat(MESSAGES, params, chat_template=inline, use_tqdm=False)[0]
    tokenizer = llm.get_tokenizer()
    assert out.prompt_token_ids == tokenizer.encode("hi ->", add_special_tokens=False)
    again = llm.chat(MESSAGES, params, use_tqdm=False)[0]  # the LLM's own is untouched
    assert again.prompt_token_ids == tokenizer.encode(_rendered(FILE_TEMPLATE),
                                                      add_special_tokens=False)


def test_inline_chat_template_reads_vllms_escapes_on_one_line():
    one_line = r"{% for m in messages %}{{ m.content }}\n{% endfor %}"
    tokenizer = loading.load_tokenizer(DEFAULT_MODEL, chat_template=one_line)
    assert tokenizer.apply_chat_template(MESSAGES, False) == "Be brief.\nhi\n"
    several = "{{ messages[0].content }}\n{{ '\\t' }}"  # as written: Jinja reads its \t
    assert loading.read_chat_template(several) == several


def test_a_chat_template_that_is_no_file_and_no_template_is_refused_by_name(llm):
    with pytest.raises(FileNotFoundError, match=r"chat_template='no/such\.jinja' looks like "
                       "a file name, but there is no such file"):
        LLM(DEFAULT_MODEL, warm_up=False, chat_template="no/such.jinja")
    with pytest.raises(FileNotFoundError, match="chat_template='chat.jinja'"):
        llm.chat(MESSAGES, chat_template="chat.jinja", use_tqdm=False)


# ---- generation_config and override_generation_config ---------------------------------

def test_generation_config_folder_with_override(llm):
    assert llm.engine.default_params == SamplingParams(temperature=0.3, top_k=5, top_p=0.5)


def test_generation_config_vllm_drops_the_checkpoints_defaults():
    assert loading.default_sampling_params(DEFAULT_MODEL) == DEMO_DEFAULTS
    neutral = LLM(DEFAULT_MODEL, warm_up=False, **SMALL, generation_config="vllm")
    assert neutral.engine.default_params == SamplingParams()
    assert loading.default_sampling_params(DEFAULT_MODEL, "vllm", {"max_new_tokens": 9}) == \
        SamplingParams(max_tokens=9)
    assert loading.default_sampling_params(DEFAULT_MODEL, "auto", {"temperature": 0}) == \
        SamplingParams(temperature=0, top_p=0.95, repetition_penalty=1.1)


def test_generation_config_refusals_name_the_setting(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"generation_config='{tmp_path}': no "):
        LLM(DEFAULT_MODEL, warm_up=False, generation_config=str(tmp_path))
    with pytest.raises(ValueError, match=r"override_generation_config='{\"max_tokens\": 5}': "
                       r"\['max_tokens'\] set no sampling default; its keys are "
                       r"\['temperature', .*name for max_tokens is max_new_tokens"):
        EngineConfig(override_generation_config='{"max_tokens": 5}')
    with pytest.raises(ValueError, match=r"\{'top_k': 'few'\}: top_k='few' is not a number"):
        EngineConfig(override_generation_config={"top_k": "few"})
    with pytest.raises(ValueError, match="override_generation_config='{' is not valid JSON"):
        EngineConfig(override_generation_config="{")
    with pytest.raises(ValueError, match=r"generation_config\.json with "
                       "override_generation_config: temperature=-1"):
        loading.default_sampling_params(DEFAULT_MODEL, "auto", {"temperature": -1})
    assert EngineConfig(override_generation_config={"top_k": 3}) == EngineConfig(
        override_generation_config='{"top_k": 3}')  # a dict or its JSON, hashable


# ---- vLLM's LLM keywords --------------------------------------------------------------

def test_enforce_eager_skips_the_warm_up(llm):
    metrics = llm.metrics()
    assert metrics["warmup_compiled"] == 0 and llm.engine.metrics.num_buckets == 0
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert llm.metrics()["compiles_after_warmup"] > 0  # compiled when first needed
    with pytest.raises(ValueError, match="enforce_eager=True compiles each bucket when first "
                       "used, which strict_compile=True refuses"):
        LLM(DEFAULT_MODEL, enforce_eager=True, strict_compile=True)


def test_vllms_none_means_the_default():
    settings, eager = engine_settings(dict(seed=None, max_num_seqs=None, max_model_len=None,
                                           max_num_batched_tokens=None, dtype="auto",
                                           enable_prefix_caching=None, enforce_eager=False))
    assert settings == {"dtype": "auto", "max_model_len": None} and not eager


REFUSED = [(name, kw) for name, kw in VLLM_KEYWORDS.items() if kw.accepted is not ANY]


@pytest.mark.parametrize("name, keyword", REFUSED, ids=[name for name, _ in REFUSED])
def test_each_refused_keyword_names_its_reason(name, keyword):
    assert engine_settings({name: keyword.accepted[0]}) == ({}, False)
    with pytest.raises(ValueError) as refused:
        LLM(DEFAULT_MODEL, **{name: "bogus"})
    shown = " or ".join(repr(a) for a in keyword.accepted)
    assert str(refused.value) == (f"LLM({name}='bogus') is not served: {keyword.reason} "
                                  f"(vLLM's keyword; jaxinfer takes {shown})")


def test_common_refusals_read_well():
    with pytest.raises(ValueError, match=r"LLM\(trust_remote_code=True\) is not served: "
                       "jaxinfer runs no code from a checkpoint"):
        LLM(trust_remote_code=True)
    with pytest.raises(ValueError, match=r"LLM\(tokenizer_mode='slow'\) is not served: "
                       "jaxinfer reads the fast tokenizer's tokenizer.json alone"):
        LLM(tokenizer_mode="slow")
    with pytest.raises(ValueError, match="page_size is jaxinfer's name"):
        LLM(block_size=16)


def test_unknown_keywords_name_the_close_fields():
    with pytest.raises(TypeError, match="LLM got an unexpected keyword 'max_num_seq'; did "
                       "you mean 'max_num_seqs'"):
        LLM(max_num_seq=8)
    with pytest.raises(TypeError, match="LLM got an unexpected keyword 'frobnicate'; it is "
                       "no EngineConfig field, nor a vLLM keyword"):
        LLM(frobnicate=1)


def test_the_docs_table_lists_every_vllm_keyword():
    docs = (pathlib.Path(__file__).parents[1] / "docs" / "sampling.md").read_text()
    section = docs[docs.index("### vLLM's LLM keywords"):docs.index("## Sampling parameters")]
    for name, keyword in VLLM_KEYWORDS.items():
        assert f"| `{name}` |" in section and keyword.reason in section, name
