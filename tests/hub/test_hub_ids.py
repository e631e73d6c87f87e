"""Models by Hub id (jaxinfer/checkpoint/hub.py) against a fake Hub on 127.0.0.1 with the
real huggingface_hub client: downloads, revisions, the cache offline, access, errors,
and the engine and server serving `org/name`. docs/models.md#models-by-hub-id."""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest
from serving import start_server

from jaxinfer import LLM, SamplingParams, testing
from jaxinfer.checkpoint import hub
from jaxinfer.config import ModelConfig

TINY = ModelConfig(architecture="llama", vocab_size=128, hidden_size=64, intermediate_size=128,
                   num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                   max_position_embeddings=128)
SMALL = dict(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64, page_size=8,
             compilation_cache_dir="")
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
PROMPT = [5, 17, 3, 99]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[int, pathlib.Path]:
    """seed -> a tiny random Llama directory, plus files jaxinfer must not fetch: a .bin
    and a subfolder."""
    out = {}
    for seed in (0, 1):
        root = testing.make_random_model(tmp_path_factory.mktemp(f"model-{seed}"), TINY,
                                         seed=seed)
        (root / "pytorch_model.bin").write_bytes(b"not fetched")
        (root / "original").mkdir()
        (root / "original" / "params.json").write_text("{}")
        out[seed] = root
    return out


def _tokens(llm: LLM) -> list[int]:
    return llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def _same_files(downloaded: pathlib.Path, source: pathlib.Path) -> bool:
    return all((downloaded / name).read_bytes() == (source / name).read_bytes()
               for name in ("config.json", "model.safetensors", "tokenizer.json"))


def test_llm_by_id_equals_the_directory_and_fetches_only_what_it_reads(
        fake_hub, hub_env, models):
    fake_hub.add_repo("org/tiny", models[0])
    by_id = LLM(model="org/tiny", **SMALL)
    assert _tokens(by_id) == _tokens(LLM(model=models[0], **SMALL))
    fetched = [path for method, path in fake_hub.requests if "/resolve/" in path]
    assert any(path.endswith("/model.safetensors") for path in fetched)
    assert not [p for p in fetched if p.endswith(".bin") or "/original/" in p], fetched
    assert str(by_id.engine.model_dir).startswith(str(hub_env.cache))


def test_revision_as_branch_and_commit(fake_hub, hub_env, models):
    first = fake_hub.add_repo("org/tiny", models[0])
    second = fake_hub.add_repo("org/tiny", models[1], branch="v2")
    assert _same_files(hub.resolve("org/tiny"), models[0])
    assert _same_files(hub.resolve("org/tiny", revision="v2"), models[1])
    assert _same_files(hub.resolve("org/tiny", revision=first), models[0])
    assert hub.resolve("org/tiny", revision=second).name == second


def test_a_second_start_reads_the_cache_offline(fake_hub, hub_env, models):
    fake_hub.add_repo("org/tiny", models[0])
    online = hub.resolve("org/tiny")
    fake_hub.stop()
    hub_env.offline()
    assert hub.resolve("org/tiny") == online
    with pytest.raises(FileNotFoundError, match="model 'org/other' is not in the Hub cache "
                       ".* and HF_HUB_OFFLINE=1 is set .*--download_dir=DIR"):
        hub.resolve("org/other")


def test_download_dir_is_where_the_model_goes(fake_hub, hub_env, models, tmp_path):
    fake_hub.add_repo("org/tiny", models[0])
    root = hub.resolve("org/tiny", download_dir=str(tmp_path / "models"))
    assert root.is_relative_to(tmp_path / "models") and _same_files(root, models[0])
    assert not hub_env.cache.exists() or not any(hub_env.cache.glob("models--org--tiny"))


def test_a_gated_model_needs_hf_token(fake_hub, hub_env, models, monkeypatch):
    fake_hub.add_repo("org/gated", models[0], token="hf_secret")
    with pytest.raises(PermissionError, match="model 'org/gated' is gated or private and no "
                       "token was given: set HF_TOKEN"):
        hub.resolve("org/gated")
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    with pytest.raises(PermissionError, match="the token in HF_TOKEN was refused"):
        hub.resolve("org/gated")
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    assert _same_files(hub.resolve("org/gated"), models[0])


def test_errors_name_the_id_and_the_fix(fake_hub, hub_env, models, tmp_path):
    fake_hub.add_repo("org/tiny", models[0])
    with pytest.raises(FileNotFoundError, match="model 'org/missing' is neither a directory "
                       "here nor a repository on the Hub"):
        hub.resolve("org/missing")
    with pytest.raises(FileNotFoundError, match="'org/tiny@nope': no such revision"):
        hub.resolve("org/tiny", revision="nope")
    bin_only = tmp_path / "bin-only"
    shutil.copytree(models[0], bin_only)
    (bin_only / "model.safetensors").unlink()
    fake_hub.add_repo("org/bin-only", bin_only)
    with pytest.raises(ValueError, match=r"'org/bin-only' has no .safetensors weights \(only "
                       r"\.bin\); jaxinfer reads safetensors only"):
        hub.resolve("org/bin-only")
    for name, extra in (("org/bert", {}), ("org/remote", {"auto_map": {"AutoModel": "x.Y"}})):
        odd = tmp_path / name.split("/")[1]
        shutil.copytree(models[0], odd)
        config = json.loads((odd / "config.json").read_text())
        config |= {"architectures": ["BertModel"], "model_type": "bert"} | extra
        (odd / "config.json").write_text(json.dumps(config))
        fake_hub.add_repo(name, odd)
    with pytest.raises(ValueError, match=r"'org/bert' is a \['BertModel'\] model; jaxinfer "
                       "serves .*LlamaForCausalLM"):
        hub.resolve("org/bert")
    with pytest.raises(ValueError, match="needs trust_remote_code, which jaxinfer refuses"):
        hub.resolve("org/remote")
    assert not [p for _, p in fake_hub.requests
                if "org/bert/resolve" in p and p.endswith(".safetensors")]  # refused first


def test_a_cut_download_fails_then_resumes_and_is_never_loaded_half(
        fake_hub, hub_env, models, monkeypatch):
    from huggingface_hub import constants

    fake_hub.add_repo("org/tiny", models[0])
    fake_hub.cut("org/tiny", "model.safetensors", after_bytes=100, times=6)  # every retry
    with pytest.raises(OSError, match="model 'org/tiny': the Hub download failed .*it "
                       "resumes where it stopped when run again"):
        hub.resolve("org/tiny")
    hub_env.offline()
    with pytest.raises(FileNotFoundError, match="the snapshot in .* is incomplete"):
        hub.resolve("org/tiny")  # never the half snapshot
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    assert _same_files(hub.resolve("org/tiny"), models[0])


def test_a_directory_wins_over_an_id_and_a_missing_one_is_named(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "local").mkdir(parents=True)
    assert hub.resolve("org/local") == pathlib.Path("org/local")  # no Hub request
    with pytest.raises(FileNotFoundError, match="model directory '/no/such' does not exist"):
        hub.resolve("/no/such")


def test_serve_names_the_id_in_models(fake_hub, hub_env, models):
    fake_hub.add_repo("org/tiny", models[0])
    server = start_server("--model=org/tiny", env=hub_env.environ(), max_model_len=64,
                          max_num_seqs=2, max_num_batched_tokens=16)
    try:
        import openai

        with openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0) as client:
            assert [m.id for m in client.models.list().data] == ["org/tiny"]
            done = client.completions.create(model="org/tiny", prompt=PROMPT, max_tokens=4,
                                             temperature=0.0)
            assert done.choices[0].finish_reason == "length"
    finally:
        server.stop()


def test_plan_by_id_fetches_the_config_only(fake_hub, hub_env, models):
    import subprocess
    import sys

    fake_hub.add_repo("org/tiny", models[0])
    result = subprocess.run(
        [sys.executable, "-m", "jaxinfer", "plan", "--model=org/tiny", "--memory_gb=1",
         "--format=json"], capture_output=True, text=True, timeout=300,
        env=hub_env.environ() | {"JAX_PLATFORMS": "cpu"})
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["model"] == "org/tiny"
    fetched = {path.rsplit("/", 1)[-1] for _, path in fake_hub.requests if "/resolve/" in path}
    assert fetched == {"config.json"}, fetched


def test_a_tokenizer_by_id_with_its_revision(fake_hub, hub_env, models, tmp_path):
    no_tokenizer = tmp_path / "weights-only"
    shutil.copytree(models[0], no_tokenizer)
    (no_tokenizer / "tokenizer.json").unlink()
    fake_hub.add_repo("org/tok", models[1], branch="v2")
    llm = LLM(model=no_tokenizer, tokenizer="org/tok", tokenizer_revision="v2",
              warm_up=False, **SMALL)
    assert llm.tokenizer.encode("<17>") == [17]  # the word-level tokenizer of make_random_model
    assert pathlib.Path(llm.engine.config.tokenizer).is_relative_to(hub_env.cache)
