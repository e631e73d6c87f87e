"""vLLM's /tokenize, /detokenize, /version, /ping and FastAPI's /docs and /openapi.json
on the shared server (a real `serve` subprocess), against `LLM.get_tokenizer()` and
transformers' tokenizer of the same checkpoint. Template variables, special tokens,
the API key and a server without a tokenizer: the app served in this process (uvicorn on
a thread) with a tokenizer built here, no second warm-up."""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import pathlib
import threading
import time
import tomllib

import httpx2 as httpx
import jsonschema
import pytest
import uvicorn
from serving import greedy
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import processors

from jaxinfer import server as serving_package
from jaxinfer.config import DEFAULT_MODEL, ServerConfig
from jaxinfer.engine.request import SamplingParams
from jaxinfer.server import app
from jaxinfer.text.tokenizer import Tokenizer

ROOT = pathlib.Path(__file__).parents[2]
TEXT = "def parse(line):\n    return line.split(', ')  # héllo ✓<|endoftext|>"
MESSAGES = [{"role": "system", "content": "You write Python."},
            {"role": "user", "content": "def main():"}]


@pytest.fixture(scope="module")
def hf_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(DEFAULT_MODEL)


def _post(server, path: str, body: dict) -> dict:
    response = server.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


# ---- /tokenize and /detokenize on the shared server ------------------------------------

def test_tokenize_prompt_round_trips_and_agrees_with_get_tokenizer(server, demo_llm,
                                                                   hf_tokenizer):
    tokenizer = demo_llm.get_tokenizer()
    answer = _post(server, "/tokenize", {"model": server.model, "prompt": TEXT})
    ids = tokenizer.encode(TEXT)
    assert answer == {"count": len(ids), "max_model_len": demo_llm.max_model_len,
                      "tokens": ids, "token_strs": None}
    assert ids == hf_tokenizer.encode(TEXT) and 0 in ids  # <|endoftext|> is one token
    with_strs = _post(server, "/tokenize", {"prompt": TEXT, "return_token_strs": True,
                                            "add_special_tokens": False})
    assert with_strs["tokens"] == tokenizer.encode(TEXT, add_special_tokens=False)
    assert with_strs["token_strs"] == hf_tokenizer.convert_ids_to_tokens(ids)
    assert with_strs["token_strs"] == tokenizer.convert_ids_to_tokens(ids)
    # special tokens kept, as vLLM's /detokenize (transformers' decode) keeps them
    back = _post(server, "/detokenize", {"model": server.model, "tokens": ids})
    assert back == {"prompt": TEXT} and hf_tokenizer.decode(ids) == TEXT
    assert _post(server, "/detokenize", {"tokens": []}) == {"prompt": ""}


def test_tokenize_chat_is_the_prompt_chat_completions_run(server, client, demo_llm,
                                                          hf_tokenizer):
    tokenizer = demo_llm.get_tokenizer()
    answer = _post(server, "/tokenize", {"model": server.model, "messages": MESSAGES})
    assert answer["tokens"] == tokenizer.apply_chat_template(
        MESSAGES, tokenize=True, add_generation_prompt=True)
    chat = client.chat.completions.create(model=server.model, messages=MESSAGES,
                                          max_tokens=1, temperature=0)
    assert chat.usage.prompt_tokens == answer["count"]
    expected = demo_llm.chat(MESSAGES, greedy(demo_llm, 1), use_tqdm=False)[0]
    assert expected.prompt_token_ids == answer["tokens"]
    text = _post(server, "/detokenize", {"tokens": answer["tokens"]})["prompt"]
    assert text == hf_tokenizer.apply_chat_template(MESSAGES, tokenize=False,
                                                    add_generation_prompt=True)
    assert text == tokenizer.apply_chat_template(MESSAGES, tokenize=False,
                                                 add_generation_prompt=True)


@pytest.mark.parametrize("fields", [{"add_generation_prompt": False},
                                    {"continue_final_message": True},
                                    {"continue_final_message": True,
                                     "add_generation_prompt": False}])
def test_tokenize_chat_generation_prompt_and_continuation_as_transformers(
        server, hf_tokenizer, fields):
    messages = [*MESSAGES, {"role": "assistant", "content": "    print('hi')  "}]
    ids = _post(server, "/tokenize", {"messages": messages, **fields})["tokens"]
    want = hf_tokenizer.apply_chat_template(messages, tokenize=False, **fields)
    assert _post(server, "/detokenize", {"tokens": ids})["prompt"] == want
    assert want.endswith("    print('hi')  " if "continue_final_message" in fields else "\n")


def test_get_tokenizer_matches_transformers(demo_llm, hf_tokenizer):
    tokenizer = demo_llm.get_tokenizer()
    assert tokenizer is demo_llm.tokenizer and demo_llm.llm_engine is demo_llm.engine
    assert tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True
                                         ) == hf_tokenizer.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True)
    assert tokenizer.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True
                                         ) == hf_tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, return_dict=False)
    ids = tokenizer.encode(TEXT)
    assert ids == hf_tokenizer.encode(TEXT)
    assert tokenizer.decode(ids, skip_special_tokens=False) == hf_tokenizer.decode(ids)
    assert tokenizer.decode(ids, skip_special_tokens=True) == hf_tokenizer.decode(
        ids, skip_special_tokens=True)
    assert tokenizer.eos_token_id == hf_tokenizer.eos_token_id


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": "\ud800"}, "prompt"),  # a lone surrogate: no valid text
    ("/tokenize", {"prompt": "x", "chat_template": "{{ 1 }}"}, "chat_template"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"messages": [{"role": "user"}]}, "messages[0].content"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    ("/tokenize", {"messages": MESSAGES, "add_generation_prompt": True,
                   "continue_final_message": True}, "continue_final_message"),
    ("/tokenize", {"messages": MESSAGES, "chat_template_kwargs": {"tools": []}},
     "chat_template_kwargs.tools"),
    ("/tokenize", {"messages": MESSAGES, "tools": [{"type": "function"}]},
     "tools.0.function"),
    ("/detokenize", {}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/detokenize", {"tokens": [1, -1]}, "tokens.1"),
    ("/detokenize", {"tokens": [1, 4096]}, "tokens.1"),  # the demo vocabulary: 4,096
    ("/detokenize", {"tokens": [1], "prompt": "x"}, "prompt"),
])
def test_bad_bodies_are_400s_naming_the_field(server, path, body, param):
    # json.dumps escapes the lone surrogate as JSON does ("\\ud800"); no client-side error
    response = server.post(path, content=json.dumps(body),
                           headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert param.split(".")[0].split("[")[0] in error["message"]


def test_wrong_model_is_404_and_the_server_goes_on(server):
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
        response = server.post(path, json=body | {"model": "gpt-4"})
        assert response.status_code == 404
        assert response.json()["error"] | {"message": None} == {
            "message": None, "type": "not_found_error", "param": "model",
            "code": "model_not_found"}
    assert server.post("/tokenize", content=b"{").status_code == 400
    assert server.get("/tokenize").status_code == 405
    assert server.get("/health").status_code == 200


# ---- /version, /ping, /docs, /openapi.json ---------------------------------------------

def test_version_and_ping(server):
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    version = importlib.metadata.version("jaxinfer")
    assert version == pyproject["project"]["version"]
    assert server.get("/version").json() == {"version": version}
    health = server.get("/health")
    for response in (server.get("/ping"), server.post("/ping")):
        assert (response.status_code, response.json()) == (200, health.json())


def test_docs_page_and_openapi_schema_with_the_real_bodies(server):
    docs = server.get("/docs")
    assert docs.status_code == 200 and "text/html" in docs.headers["content-type"]
    assert "swagger" in docs.text.lower() and "/openapi.json" in docs.text
    document = server.get("/openapi.json").json()
    assert document["info"]["version"] == importlib.metadata.version("jaxinfer")
    methods = {path: sorted(ops) for path, ops in document["paths"].items()}
    assert methods == {path: sorted(m.lower() for m in ms) for path, ms in app.ROUTES.items()}

    def validator(path: str) -> jsonschema.Validator:
        body = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        schema = body["schema"] | {"components": document["components"]}
        return jsonschema.Draft202012Validator(schema)

    good = {
        "/v1/completions": {"model": "demo", "prompt": ["a", "b"], "max_tokens": 4},
        "/v1/chat/completions": {"messages": MESSAGES, "stream": True,
                                 "stream_options": {"include_usage": True}},
        "/tokenize": {"messages": MESSAGES, "chat_template_kwargs": {"x": 1}},
        "/detokenize": {"tokens": [1, 2]},
    }
    bad = {
        "/v1/completions": {"prompt": "a", "suffix": "b"},  # refused fields: not in it
        "/v1/chat/completions": {"messages": [{"role": "robot", "content": "x"}]},
        "/tokenize": {"prompt": "a", "messages": MESSAGES},  # neither form
        "/detokenize": {"tokens": [-1]},
    }
    for path in good:
        assert validator(path).is_valid(good[path]), path
        assert not validator(path).is_valid(bad[path]), path
    assert validator("/tokenize").is_valid({"prompt": "x", "return_token_strs": True})
    answer = document["paths"]["/tokenize"]["post"]["responses"]["200"]["content"]
    ref = answer["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]
    assert set(document["components"]["schemas"][ref]["properties"]) == {
        "count", "max_model_len", "tokens", "token_strs"}
    error = document["paths"]["/detokenize"]["post"]["responses"]["4XX"]["content"]
    assert error["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")


# ---- the app in this process: template variables, special tokens, API key ----------------

TEMPLATE = ("{% if tools %}TOOLS {{ tools | tojson }}\n{% endif %}"
            "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>"
            "{% if enable_thinking is defined and not enable_thinking %}<think></think>"
            "{% endif %}{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def bos_tokenizer() -> Tokenizer:
    """The demo vocabulary with a post-processor that adds `<|endoftext|>` (id 0) in front,
    as a BOS, and a template reading `tools` and `enable_thinking`."""
    backend = HFTokenizer.from_file(str(DEFAULT_MODEL / "tokenizer.json"))
    backend.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)])
    return Tokenizer(backend, special_tokens={"bos_token": "<|endoftext|>"},
                     eos_token_ids=frozenset({0}), bos_token_id=0, chat_template=TEMPLATE)


@contextlib.contextmanager
def _served(tokenizer: Tokenizer | None, **config):
    """create_app over a state without an engine loop (the tokenization routes never use
    it), served on 127.0.0.1: its base URL."""
    state = app.ServerState(loop=None, config=ServerConfig(**config), model_name="local",
                            model_root="", max_model_len=64, defaults=SamplingParams(),
                            token_text=None, tokenizer=tokenizer)
    uv = uvicorn.Server(uvicorn.Config(app.create_app(state), log_config=None,
                                       lifespan="off"))
    sock = serving_package.bind("127.0.0.1", 0)
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not uv.started:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        uv.should_exit = True
        thread.join(30)


def test_special_tokens_template_variables_and_tools(bos_tokenizer):
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    key = {"Authorization": "Bearer k"}
    with _served(bos_tokenizer, api_key="k") as url, httpx.Client(base_url=url,
                                                                  headers=key) as http:
        def ids(**body) -> list[int]:
            response = http.post("/tokenize", json=body)
            assert response.status_code == 200, response.text
            return response.json()["tokens"]

        def text(**body) -> str:
            return http.post("/detokenize", json={"tokens": ids(**body)}).json()["prompt"]

        plain = bos_tokenizer.encode("hello", add_special_tokens=False)
        assert ids(prompt="hello") == [0, *plain]  # completion form: special tokens added
        assert ids(prompt="hello", add_special_tokens=False) == plain
        assert text(messages=messages) == "<user>Weather in Paris?\n<assistant>"  # chat: none
        assert text(messages=messages, add_special_tokens=True) == (
            "<|endoftext|><user>Weather in Paris?\n<assistant>")
        assert text(messages=messages, chat_template_kwargs={"enable_thinking": False}
                    ).endswith("<assistant><think></think>")
        with_tools = text(messages=messages, tools=TOOLS)
        assert with_tools == bos_tokenizer.apply_chat_template(messages, tools=TOOLS)
        assert with_tools.startswith('TOOLS [{"type": "function", "function": {"name": '
                                     '"get_weather", "parameters": ')
        refused = httpx.post(f"{url}/tokenize", json={"prompt": "hello"})
        assert refused.status_code == 401
        assert refused.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{url}/openapi.json").status_code == 200  # no key: as /health


def test_a_server_without_a_tokenizer_says_so():
    with _served(None) as url:
        for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
            response = httpx.post(f"{url}{path}", json=body)
            assert response.status_code == 400
            error = response.json()["error"]
            assert error["code"] == "no_tokenizer" and "--skip_tokenizer_init" in error[
                "message"]


def test_openapi_schema_is_json_serializable_and_stable(bos_tokenizer):
    """The schema is built once, from the models (no request needed), and is plain JSON."""
    state = app.ServerState(loop=None, config=ServerConfig(), model_name="local",
                            model_root="", max_model_len=64, defaults=SamplingParams(),
                            token_text=None, tokenizer=bos_tokenizer)
    application = app.create_app(state)
    first = application.openapi()
    assert application.openapi() is first
    assert json.loads(json.dumps(first)) == first
