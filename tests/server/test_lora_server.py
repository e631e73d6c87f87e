"""LoRA adapters served as vLLM serves them (docs/lora.md#serving-adapters): a real
`serve` of a tiny Llama on 127.0.0.1 with `--lora_modules` (both of vLLM's spellings)
and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True. A request's `model` naming an adapter gets
what LLM.generate / LLM.chat give with that adapter (completions, chat, a stream),
/v1/models lists the adapters after the base model in vLLM's shape, adapters load and
unload while the server runs (in place too; on both replicas of a data-parallel server),
each refused load or unload is a 4xx naming its field, and a server without runtime
updating answers those routes 404. Also the flag refused before the model loads, and a
batch file's lines choosing adapters."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
from serving import greedy, start_server

from jaxinfer import LLM, batch, testing
from jaxinfer.cli import argv
from jaxinfer.config import ServerConfig
from jaxinfer.lora import LoRARequest
from jaxinfer.server import adapters
from jaxinfer.server.protocol import APIError

SMALL = dict(dtype="float32", page_size=8, max_model_len=64, max_num_seqs=4,
             max_num_batched_tokens=32)
LORA = dict(enable_lora=True, max_loras=2, max_lora_rank=16)
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
NAME = "tiny"  # --served_model_name
PROMPT = "the quick brown fox"
IDS = {"a": 1, "b": 2, "c": 3}  # the ids the server gives its adapters, in load order
ROOT = pathlib.Path(__file__).resolve().parents[2]


def _save_adapter(model_dir, out, *, rank: int, targets: list[str], seed: int) -> None:
    """A random, non-zero PEFT LoRA adapter of the model at `model_dir`, saved by peft."""
    import peft
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager")
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=rank, lora_alpha=16, target_modules=targets,
                             init_lora_weights=False)
    peft.get_peft_model(model, config).save_pretrained(out)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tiny Llama; adapters a, b, c (c loaded at run time) and two it must refuse."""
    root = tmp_path_factory.mktemp("lora-serve")
    testing.make_hf_model(root / "model", "llama", seed=7)
    _save_adapter(root / "model", root / "a", rank=8, targets=["q_proj", "v_proj"], seed=1)
    _save_adapter(root / "model", root / "b", rank=4, seed=2,
                  targets=["q_proj", "k_proj", "o_proj", "down_proj"])
    _save_adapter(root / "model", root / "c", rank=16, targets=["v_proj", "up_proj"], seed=3)
    _save_adapter(root / "model", root / "big", rank=32, targets=["q_proj"], seed=4)
    _save_adapter(root / "model", root / "bad", rank=8, targets=["q_proj"], seed=5)
    (root / "bad" / "adapter_config.json").write_text("{not json")
    return {name: str(root / name) for name in ("model", "a", "b", "c", "big", "bad")}


@pytest.fixture(scope="module")
def server(files):
    s = start_server(f"--model={files['model']}", f"--served_model_name={NAME}",
                     "--lora_modules", f"a={files['a']}",
                     json.dumps({"name": "b", "path": files["b"],
                                 "base_model_name": "llama-tiny"}),
                     env={adapters.ENV: "True"}, chat_template=TEMPLATE, **LORA, **SMALL)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def llm(files):
    return LLM(files["model"], warm_up=False, chat_template=TEMPLATE, **LORA, **SMALL)


@pytest.fixture(scope="module")
def expected(files, llm):
    """Each model's greedy completion of PROMPT and chat reply, in this process."""
    params = greedy(llm, 8)
    texts = {}
    for name in (NAME, "a", "b", "c"):
        lora = None if name == NAME else LoRARequest(name, IDS[name], files[name])
        texts[name] = (
            llm.generate(PROMPT, params, lora_request=lora, use_tqdm=False)[0].outputs[0].text,
            llm.chat([{"role": "user", "content": PROMPT}], params, lora_request=lora,
                     use_tqdm=False)[0].outputs[0].text)
    assert len({completion for completion, _ in texts.values()}) == 4  # adapters matter
    return texts


@pytest.fixture(scope="module")
def client(server):
    import openai

    with openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0,
                       timeout=120) as c:
        yield c


def _complete(client, model: str) -> str:
    response = client.completions.create(model=model, prompt=PROMPT, max_tokens=8,
                                         temperature=0)
    assert response.model == model  # vLLM's: the adapter's name
    return response.choices[0].text


def _load(server, **body):
    return server.post("/v1/load_lora_adapter", json=body)


def _unload(server, **body):
    return server.post("/v1/unload_lora_adapter", json=body)


def _error(response, status: int, param: str | None) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    return error["message"]


# ---- selecting adapters by name -------------------------------------------------------

def test_models_lists_each_adapter_after_the_base_in_vllms_shape(server, client, files):
    assert [m.id for m in client.models.list().data] == [NAME, "a", "b"]
    base, a, b = server.get("/v1/models").json()["data"]
    assert base["root"] == files["model"] and base["parent"] is None
    assert (a["root"], a["parent"]) == (files["a"], NAME)
    assert (b["root"], b["parent"]) == (files["b"], "llama-tiny")  # JSON's base_model_name
    assert a["object"] == "model" and a["max_model_len"] == SMALL["max_model_len"]
    paths = server.get("/openapi.json").json()["paths"]
    assert "requestBody" in paths["/v1/load_lora_adapter"]["post"]


def test_a_completion_naming_an_adapter_is_that_adapters(client, expected):
    for model in (NAME, "a", "b"):
        assert _complete(client, model) == expected[model][0], model


def test_chat_and_stream_naming_an_adapter(client, expected):
    reply = client.chat.completions.create(
        model="b", messages=[{"role": "user", "content": PROMPT}], max_tokens=8,
        temperature=0)
    assert reply.model == "b" and reply.choices[0].message.content == expected["b"][1]
    chunks = list(client.completions.create(model="a", prompt=PROMPT, max_tokens=8,
                                            temperature=0, stream=True))
    assert {c.model for c in chunks} == {"a"}
    assert "".join(c.choices[0].text for c in chunks) == expected["a"][0]


def test_an_unknown_model_is_still_404_naming_the_adapters(client):
    import openai

    with pytest.raises(openai.NotFoundError) as caught:
        _complete(client, "zzz")
    assert "'zzz' does not exist" in str(caught.value)
    assert "'tiny' and the adapters 'a', 'b'" in str(caught.value)


# ---- loading and unloading while serving -----------------------------------------------

def test_load_serve_unload_and_load_again(server, client, files, expected):
    response = _load(server, lora_name="c", lora_path=files["c"])
    assert response.status_code == 200, response.text
    assert response.text == "Success: LoRA adapter 'c' added successfully."
    assert [m.id for m in client.models.list().data] == [NAME, "a", "b", "c"]
    assert _complete(client, "c") == expected["c"][0]
    response = _unload(server, lora_name="c")
    assert response.status_code == 200, response.text
    assert response.text == "Success: LoRA adapter 'c' removed successfully."
    assert [m.id for m in client.models.list().data] == [NAME, "a", "b"]
    assert "'c' does not exist" in _error(server.post("/v1/completions", json={
        "model": "c", "prompt": PROMPT}), 404, "model")
    assert _load(server, lora_name="c", lora_path=files["c"]).status_code == 200  # a new id
    assert _complete(client, "c") == expected["c"][0]
    assert _unload(server, lora_name="c").status_code == 200


def test_load_in_place_replaces_the_adapter_under_its_name(server, client, files, expected):
    assert _load(server, lora_name="d", lora_path=files["a"]).status_code == 200
    assert _complete(client, "d") == expected["a"][0]
    message = _error(_load(server, lora_name="d", lora_path=files["b"]), 400, "lora_name")
    assert "already been loaded" in message and "load_inplace" in message
    response = _load(server, lora_name="d", lora_path=files["b"], load_inplace=True)
    assert response.status_code == 200, response.text
    assert _complete(client, "d") == expected["b"][0]
    d = server.get("/v1/models").json()["data"][-1]
    assert (d["id"], d["root"]) == ("d", files["b"])
    assert _unload(server, lora_name="d").status_code == 200


@pytest.mark.parametrize("body, status, param, words", [
    ({"lora_name": "x", "lora_path": "/no/such/adapter"}, 404, "lora_path",
     "no adapter directory at '/no/such/adapter'"),
    ({"lora_name": "x", "lora_path": "{bad}"}, 400, "lora_path", "adapter_config.json: not JSON"),
    ({"lora_name": "x", "lora_path": "{big}"}, 400, "lora_path",
     "has rank 32, over max_lora_rank=16"),
    ({"lora_name": "x", "lora_path": "{model}"}, 400, "lora_path",
     "adapter_config.json: no such file"),
    ({"lora_name": "a", "lora_path": "{c}"}, 400, "lora_name", "'a' has already been loaded"),
    ({"lora_name": NAME, "lora_path": "{c}"}, 400, "lora_name", "the served model's own name"),
    ({"lora_name": "x"}, 400, "lora_path", "lora_path"),
    ({"lora_name": "", "lora_path": "{c}"}, 400, "lora_name", "must not be empty"),
    ({"lora_name": "x", "lora_path": "{c}", "lora_int_id": 9}, 400, "lora_int_id",
     "unknown or unsupported parameter"),
])
def test_each_refused_load_is_a_4xx_naming_its_field(server, files, body, status, param,
                                                      words):
    body = {k: v.format(**files) if k == "lora_path" else v for k, v in body.items()}
    assert words in _error(_load(server, **body), status, param)
    models = [m["id"] for m in server.get("/v1/models").json()["data"]]
    assert models == [NAME, "a", "b"]  # nothing changed


@pytest.mark.parametrize("body, status, param, words", [
    ({"lora_name": "zzz"}, 404, "lora_name", "'zzz' is not loaded (loaded: 'a', 'b')"),
    ({"lora_name": "a", "lora_int_id": 7}, 400, "lora_int_id", "the adapter 'a' has id 1"),
    ({}, 400, "lora_name", "lora_name"),
])
def test_each_refused_unload_is_a_4xx_naming_its_field(server, body, status, param, words):
    assert words in _error(_unload(server, **body), status, param)
    assert len(server.get("/v1/models").json()["data"]) == 3


def test_data_parallel_replicas_each_serve_the_adapters(files, expected):
    """Two replicas, requests dealt round-robin: each replica holds the adapters loaded at
    start and at run time, and forgets the unloaded one."""
    s = start_server(f"--model={files['model']}", f"--served_model_name={NAME}",
                     "--enforce_eager", "--data_parallel_size=2",
                     "--load_balance_method=round_robin", f"--lora_modules=a={files['a']}",
                     "--allow_runtime_lora_updating",
                     env={"JAX_NUM_CPU_DEVICES": "2", adapters.ENV: "0"}, **LORA, **SMALL)
    try:
        body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0}
        assert _load(s, lora_name="c", lora_path=files["c"]).status_code == 200
        for model in ("a", "a", "c", "c"):  # one request to each replica
            response = s.post("/v1/completions", json=body | {"model": model})
            assert response.json()["choices"][0]["text"] == expected[model][0], model
        assert _unload(s, lora_name="c").status_code == 200
        _error(s.post("/v1/completions", json=body | {"model": "c"}), 404, "model")
    finally:
        assert s.stop() == 0


# ---- runtime updating off ----------------------------------------------------------------

def test_without_runtime_updating_the_routes_are_404(files):
    s = start_server(f"--model={files['model']}", f"--served_model_name={NAME}",
                     "--enforce_eager", f"--lora_modules=a={files['a']}",
                     env={adapters.ENV: "0"}, **LORA, **SMALL)
    try:
        for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            message = _error(s.post(path, json={"lora_name": "a", "lora_path": files["a"]}),
                             404, None)
            assert "is served only with --allow_runtime_lora_updating" in message
        assert [m["id"] for m in s.get("/v1/models").json()["data"]] == [NAME, "a"]
        assert "/v1/load_lora_adapter" not in s.get("/openapi.json").json()["paths"]
    finally:
        assert s.stop() == 0


def test_a_name_being_changed_is_a_409_until_that_change_ends():
    served = adapters.Adapters(enabled=True)
    with served.changing("x"):
        with pytest.raises(APIError) as caught, served.changing("x"):
            pass
        assert (caught.value.status, caught.value.param) == (409, "lora_name")
        with served.changing("y"):  # another name meanwhile: fine
            pass
    with served.changing("x"):  # the first change ended
        pass


def test_runtime_updating_is_the_flag_or_vllms_variable(monkeypatch):
    monkeypatch.delenv(adapters.ENV, raising=False)
    assert not adapters.runtime_updating(ServerConfig())
    assert adapters.runtime_updating(ServerConfig(allow_runtime_lora_updating=True))
    for value, on in (("True", True), ("1", True), ("true", True), ("0", False),
                      ("False", False), ("", False)):
        monkeypatch.setenv(adapters.ENV, value)
        assert adapters.runtime_updating(ServerConfig()) is on, value


# ---- the flag ------------------------------------------------------------------------------

def test_lora_modules_takes_vllms_spellings():
    reading = argv.read(["jaxinfer", "serve", "m", "--lora-modules", "a=/x",
                         '{"name": "b", "path": "/y"}', "--port", "0"])
    assert reading.positionals == ["serve", "m"] and not reading.unknown
    config = ServerConfig(lora_modules=["a=/x", '{"name": "b", "path": "/y", '
                                        '"base_model_name": "m"}'])
    assert [(m.name, m.path, m.base_model_name) for m in config.lora_adapters] == [
        ("a", "/x", None), ("b", "/y", "m")]


@pytest.mark.parametrize("modules, words", [
    (["a"], "lora_modules='a' must be name=path or a JSON object"),
    (['{"name": "a"}'], "'path' must be a non-empty string"),
    (['{"name": "a", "path": "/x", "rank": 2}'], "unknown key(s) ['rank']"),
    (["a=/x", "a=/y"], "the name 'a' is given twice"),
])
def test_bad_lora_modules_name_the_field(modules, words):
    with pytest.raises(ValueError, match="lora_modules") as caught:
        ServerConfig(lora_modules=modules)
    assert words in str(caught.value)


def _cli(*args):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "jaxinfer", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_serve_refuses_bad_modules_before_the_model_loads(files, tmp_path):
    model = f"--model={files['model']}"
    cases = [((model, f"--lora_modules=a={files['a']}"), 2, "--lora_modules needs "
              "--enable_lora"),
             ((model, "--enable_lora", f"--lora_modules=a={tmp_path}/gone"), 2,
              f"--lora_modules a={tmp_path}/gone: no such directory"),
             ((model, "--enable_lora", "--lora_modules=a"), 2, "--lora_modules='a' must be "
              "name=path"),
             (("--input=x.jsonl", "--output=y.jsonl", "--ray", "--enable_lora",
               f"--lora_modules=a={files['a']}"), 2, "--lora_modules is not taken with "
              "--ray")]
    for args, code, words in cases:
        command = "batch" if "--ray" in args else "serve"
        result = _cli(command, "--port=0" if command == "serve" else "--format=json", *args)
        assert result.returncode == code and words in result.stderr, (args, result.stderr)


def test_serve_names_the_module_the_engine_refuses(files):
    result = _cli("serve", f"--model={files['model']}", "--port=0", "--enable_lora",
                  "--enforce_eager", f"--lora_modules=big={files['big']}",
                  *(f"--{k}={v}" for k, v in SMALL.items()))
    assert result.returncode == 1, result.stderr
    assert f"lora_modules: big={files['big']}: " in result.stderr
    assert "over max_lora_rank=16" in result.stderr


# ---- batch files ---------------------------------------------------------------------------

def test_batch_lines_choose_adapters_by_model(files, llm, expected, tmp_path):
    lines = [{"custom_id": model, "method": "POST", "url": "/v1/completions",
              "body": {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}}
             for model in (NAME, "a", "b", "zzz")]
    lines.append({"custom_id": "chat-b", "method": "POST", "url": "/v1/chat/completions",
                  "body": {"model": "b", "messages": [{"role": "user", "content": PROMPT}],
                           "max_tokens": 8, "temperature": 0}})
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    summary = batch.run(llm, source, out, progress=False, model_name=NAME,
                        lora_modules=[f"a={files['a']}", f"b={files['b']}"])
    assert (summary["done"], summary["errors"]) == (4, 1)
    records = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    for model in (NAME, "a", "b"):
        body = records[model]["response"]["body"]
        assert (body["model"], body["choices"][0]["text"]) == (model, expected[model][0])
    reply = records["chat-b"]["response"]["body"]["choices"][0]["message"]["content"]
    assert reply == expected["b"][1]
    assert records["zzz"]["error"]["code"] == "model_not_found"


def test_batch_refuses_modules_for_jaxinfers_format(files, llm, tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"id": 1, "prompt": PROMPT}) + "\n")
    with pytest.raises(ValueError, match="lora_modules: .* jaxinfer's format"):
        batch.run(llm, source, tmp_path / "out.jsonl", progress=False,
                  lora_modules=[f"a={files['a']}"])
