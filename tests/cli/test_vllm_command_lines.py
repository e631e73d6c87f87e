"""vLLM's documented command lines, `vllm` replaced by `python -m jaxinfer` and the model
id by the demo model's directory, parse unchanged into the configs they mean; one of them
starts a real server that the official `openai` client talks to."""

from __future__ import annotations

import os
import pathlib
import shlex
import subprocess
import sys

import openai
import pytest
from absl import flags
from serving import start_server

from jaxinfer.cli import argv as argv_lib
from jaxinfer.cli.flags import SERVER_FLAGS, engine_config, from_flags
from jaxinfer.cli.main import parse
from jaxinfer.config import DEFAULT_MODEL, ServerConfig

FLAGS = flags.FLAGS
DEMO = str(DEFAULT_MODEL)
ROOT = pathlib.Path(__file__).resolve().parents[2]

# (a command line as vLLM's docs print it, the EngineConfig and ServerConfig fields it sets)
VLLM_SERVE_LINES = [
    # docs.vllm.ai, serving/openai_compatible_server.md: the server's first example
    ("vllm serve NousResearch/Meta-Llama-3-8B-Instruct --dtype auto --api-key token-abc123",
     {"dtype": "auto"}, {"api_key": "token-abc123"}),
    # docs.vllm.ai, quickstart: the model alone
    ("vllm serve Qwen/Qwen2.5-1.5B-Instruct", {}, {}),
    # vLLM's `vllm serve` examples (its CLI reference): parallelism, memory, context,
    # prefix caching, host and port
    ("vllm serve meta-llama/Llama-2-70b-hf --tensor-parallel-size 1",
     {"tensor_parallel_size": 1}, {}),
    ("vllm serve mistralai/Mistral-7B-v0.1 --gpu-memory-utilization 0.95 --max-model-len 8192",
     {"gpu_memory_utilization": 0.95, "max_model_len": 8192}, {}),
    ("vllm serve meta-llama/Llama-2-7b-hf --enable-prefix-caching",
     {"enable_prefix_caching": True}, {}),
    ("vllm serve facebook/opt-125m --host 0.0.0.0 --port 8080", {},
     {"host": "0.0.0.0", "port": 8080}),
    ("vllm serve meta-llama/Llama-3.2-1B-Instruct --data-parallel-size 4 "
     "--tensor-parallel-size 2", {"data_parallel_size": 4, "tensor_parallel_size": 2}, {}),
    # vLLM's engine arguments as guides combine them: fp8 weights and KV cache
    ("vllm serve unsloth/Llama-3.1-8B-Instruct --quantization fp8 --kv-cache-dtype fp8 "
     "--max-model-len 32768 --port 8000 --api-key sk-local",
     {"quantization": "fp8", "kv_cache_dtype": "fp8", "max_model_len": 32768},
     {"port": 8000, "api_key": "sk-local"}),
    # argparse's other spellings: name=value with underscores, the negation, -tp
    ("vllm serve Qwen/Qwen3-8B --gpu_memory_utilization=0.8 --max_model_len=4096 "
     "--no-enable-prefix-caching -tp 1 --served-model-name qwen-local",
     {"gpu_memory_utilization": 0.8, "max_model_len": 4096, "enable_prefix_caching": False,
      "tensor_parallel_size": 1}, {"served_model_name": "qwen-local"}),
]


def _jaxinfer(line: str) -> list[str]:
    """`vllm serve MODEL ...` as jaxinfer's argv, the model replaced by the demo's."""
    words = shlex.split(line)
    assert words[:2] == ["vllm", "serve"] and not words[2].startswith("-")
    return ["jaxinfer", "serve", DEMO, *words[3:]]


@pytest.fixture
def fresh_flags():
    """FLAGS as no command line set them, before and after the test."""
    FLAGS.unparse_flags()
    yield
    FLAGS.unparse_flags()
    FLAGS.mark_as_parsed()


@pytest.mark.parametrize("line, engine, server", VLLM_SERVE_LINES)
def test_vllm_serve_lines_parse_into_their_configs(fresh_flags, line, engine, server):
    assert parse(_jaxinfer(line)) == ["jaxinfer", "serve"]
    assert FLAGS.model == DEMO
    settings = engine_config()
    assert {name: getattr(settings, name) for name in engine} == engine
    config = from_flags(ServerConfig, **{name: FLAGS[name].value for name in SERVER_FLAGS})
    assert {name: getattr(config, name) for name in server} == server


def test_flags_jaxinfer_lacks_are_all_named_in_one_line(fresh_flags, capsys):
    # a Hugging Face Space's start script, as pasted
    line = ("vllm serve ./merged --gpu-memory-utilization=0.8 --port 6002 "
            "--served-model-name=VLINSTRUCT --trust-remote-code --max-model-len 8192 "
            "--disable-log-requests")
    with pytest.raises(SystemExit) as exit_info:
        parse(_jaxinfer(line))
    assert exit_info.value.code == 2
    (message,) = capsys.readouterr().err.splitlines()
    assert message == (
        "jaxinfer: error: serve: --trust-remote-code is not a flag of serve (jaxinfer runs "
        "no code from a checkpoint; leave it out); --disable-log-requests is not a flag of "
        "serve (jaxinfer has no such setting); see python -m jaxinfer serve --help")


def test_names_are_read_and_values_left_as_they_are():
    reading = argv_lib.read(["jaxinfer", "serve", "--served-model-name", "my-model",
                             "--api-key", "-k-e-y-", "--max-model-len", "4096", "MODEL",
                             "--enable-prefix-caching", "--noenable-prefix-caching",
                             "-tp", "2", "-pp", "2", "-dp=1", "--prompt", "--x--", "--",
                             "--y"])
    assert reading.argv == ["jaxinfer", "serve", "--served_model_name", "my-model",
                            "--api_key", "-k-e-y-", "--max_model_len", "4096", "MODEL",
                            "--enable_prefix_caching", "--noenable_prefix_caching",
                            "--tensor_parallel_size", "2", "--pipeline_parallel_size", "2",
                            "--data_parallel_size=1",
                            "--prompt", "--x--", "--", "--y"]
    assert reading.positionals == ["serve", "MODEL", "--y"]
    assert reading.unknown == [] and reading.stray_values == []
    assert reading.spelled("max_model_len") == "--max-model-len"
    assert reading.spelled("tensor_parallel_size") == "-tp"


def test_unknown_flags_and_their_values_are_taken_out():
    reading = argv_lib.read(["jaxinfer", "serve", "--swap-space", "4", "--tp", "2",
                             "--disable-log-stats", "--port", "1", "--seed=3", "MODEL"])
    assert reading.argv == ["jaxinfer", "serve", "--port", "1", "--seed=3", "MODEL"]
    assert reading.unknown == ["--swap-space", "--tp", "--disable-log-stats"]


def test_absl_takes_a_value_after_a_space_and_the_negation(fresh_flags):
    parse(["jaxinfer", "serve", "--max-model-len", "4096", "--no-enable-prefix-caching",
           "--api-key", "token-abc123", "--port", "0", DEMO])
    assert (FLAGS.max_model_len, FLAGS.enable_prefix_caching, FLAGS.api_key, FLAGS.port) \
        == (4096, False, "token-abc123", 0)
    assert FLAGS["max_model_len"].present and FLAGS.model == DEMO


def test_the_same_model_as_argument_and_flag_is_one_model(fresh_flags):
    assert parse(["jaxinfer", "generate", DEMO + "/", f"--model={DEMO}"])[1] == "generate"
    assert FLAGS.model == DEMO + "/"


def test_a_served_vllm_command_line_answers_the_openai_client():
    """One real start: the documented line, dashed flags and the model as an argument;
    --enforce-eager (no warm-up) and --uvicorn-log-level warning (no access log)."""
    words = _jaxinfer("vllm serve NousResearch/Meta-Llama-3-8B-Instruct --dtype auto "
                      "--api-key token-abc123 --enable-prefix-caching "
                      "--gpu-memory-utilization 0.9 --tensor-parallel-size 1 "
                      "--enforce-eager --uvicorn-log-level warning")
    server = start_server(*words[2:])
    try:
        assert server.model == DEMO  # the model as given names it, as in vLLM
        client = openai.OpenAI(base_url=server.url, api_key="token-abc123")
        completion = client.chat.completions.create(
            model=server.model, messages=[{"role": "user", "content": "Hello!"}],
            max_tokens=8, temperature=0)
        assert completion.choices[0].message.content
        assert completion.usage.completion_tokens == 8
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=server.url, api_key="wrong").models.list()
    finally:
        assert server.stop() == 0
    assert not any("warm-up:" in line for line in server.log)
    assert not any("HTTP/1.1" in line for line in server.log)  # uvicorn's INFO lines


def test_enforce_eager_skips_warm_up_and_generates_the_same():
    def generate(*flags: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "jaxinfer", "generate", DEMO, "--max-tokens", "16",
             "--temperature", "0", *flags], cwd=ROOT, capture_output=True, text=True,
            timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))

    eager, warmed = generate("--enforce-eager"), generate()
    assert eager.returncode == warmed.returncode == 0, eager.stderr + warmed.stderr
    assert eager.stdout == warmed.stdout
    assert "warm-up:" in warmed.stderr and "warm-up:" not in eager.stderr
    assert "compilation(s) after warm-up" in eager.stderr  # each bucket on first use
