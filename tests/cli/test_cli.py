"""The command line as a new user meets it: help, one-line errors, flags derived from
EngineConfig, sampling flags over the checkpoint's defaults, `plan` without the runner."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import subprocess
import sys

import pytest
from absl import flags
from absl.testing import flagsaver

from jaxinfer import SamplingParams
from jaxinfer.cli.flags import ENGINE_FLAGS, sampling_params
from jaxinfer.cli.main import COMMANDS
from jaxinfer.config import EngineConfig

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _cli(*args, timeout=300):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "jaxinfer", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_help_lists_the_commands_one_line_each():
    result = _cli("--help")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    for name, command in COMMANDS.items():
        assert [line for line in lines if line.split()[:1] == [name]] == \
            [f"  {name:<8}  {command.summary}"]
    assert "<command> --help" in result.stdout


def test_command_help_lists_its_flags_with_defaults():
    result = _cli("generate", "--help")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "--max_tokens (int; default 64)\n      tokens to generate" in out
    assert ('--dtype (auto|float32|bfloat16|float|float16|half; default "auto")\n'
            "      weights dtype") in out
    assert "--max_num_seqs (int; default 1)" in out  # generate's own default
    assert "--temperature (float; default unset)" in out
    assert "--skip_tokenizer_init (bool; default false)" in out
    assert "--device" not in out and "--helpfull" not in out  # aot's flag; no absl dump
    plan = _cli("plan", "-h").stdout
    assert "--bandwidth_gb_per_s" in plan and "--prompt" not in plan
    for flag in ("--device (string; default unset)", "--tensor_parallel_size (int;",
                 "--price_per_hour (float; default unset)"):
        assert flag in plan
    assert '--device (string; default "v5e-1")' in _cli("aot", "-h").stdout


def test_engine_flags_are_derived_from_engine_config():
    for field in dataclasses.fields(EngineConfig):
        flag = flags.FLAGS[field.name]
        assert flag.default == field.default, field.name
        assert field.metadata["help"] in flag.help
        choices = field.metadata["choices"]
        assert getattr(flag.parser, "enum_values", None) == (list(choices) if choices
                                                             else None)
    assert set(ENGINE_FLAGS) == {f.name for f in dataclasses.fields(EngineConfig)}


def test_sampling_flags_override_only_their_field():
    flags.FLAGS.mark_as_parsed()
    defaults = SamplingParams(temperature=0.8, top_p=0.95, repetition_penalty=1.1)
    with flagsaver.flagsaver(temperature=0.2, max_tokens=9):
        assert sampling_params(defaults) == SamplingParams(
            temperature=0.2, top_p=0.95, repetition_penalty=1.1, max_tokens=9)
    with flagsaver.flagsaver():
        assert sampling_params(defaults) == dataclasses.replace(defaults, max_tokens=64)


@pytest.mark.parametrize("args, message, code", [
    (["generate", "--dtype=float8"], "flag --dtype=float8: value should be one of", 2),
    (["generate", "--dtype=half"], "--dtype='half' is not served: jaxinfer's attention "
     "kernels and KV cache take float32 or bfloat16 activations", 2),
    (["generate", "--max_num_seqs=0"], "generate: --max_num_seqs=0 must be a positive int", 2),
    (["generate", "--max_num_seqs=lots"], "flag --max_num_seqs=lots: 'lots' is not an integer",
     2),
    (["generate", "--port=9000"], "--port is not a flag of generate (it is one of serve)", 2),
    (["plan", "--model=qwen3-0.6b", "--memory_gb=8", "--prompt=x"],
     "--prompt is not a flag of plan (it is one of generate)", 2),
    (["generate", "--model=/no/such/model"], "model directory '/no/such/model' does not exist",
     1),
    (["generate", "--max_model_len=16", "--prompt=" + "x = 1\n" * 20],
     "tokens; max_model_len 16 leaves no room to generate", 1),
    ([], "give one command of generate, batch", 2),
    (["bogus"], "'bogus' is not a command; the commands are generate, batch", 2),
    (["generat"], "'generat' is not a command (did you mean 'generate'?)", 2),
    (["plan", "--model=qwen3-0.6b"], "plan needs --memory_gb=GB", 2),
    (["plan", "--model=llama3.1-8b", "--device=v5e-1", "--dtype=bfloat16"],
     "plan: 15.220 GB holds the 16.061 GB of bfloat16 weights, 0.018 GB of per-request "
     "state", 1),
    (["plan", "--model=smollm-135m", "--device=v6e-8"], "tensor_parallel_size=8 must divide "
     "the 9 query heads (by default every device of --device=v6e-8; give "
     "--tensor_parallel_size)", 1),
    (["plan", "--model=qwen3-0.6b", "--device=h200-8"], "'h200-8' is not a known accelerator", 2),
    (["aot", "--model=qwen3-0.6b", "--device=a3-highgpu-8g"], "aot compiles for TPU only", 2),
    (["serve", "--port=70000"], "--port=70000 must be in [0, 65536)", 2),
    (["serve", "--max_waiting_requests=0"], "--max_waiting_requests=0 must be a positive int",
     2),
    (["serve", "--reasoning_parser=deepseek_r9"],
     "flag --reasoning_parser=deepseek_r9: value should be one of <openai_gptoss|qwen3>", 2),
    (["serve", "--include_reasoning_content"],
     "serve: --include_reasoning_content=True needs reasoning_parser", 2),
    (["serve", "--model=/no/such/model", "--port=0"],
     "model directory '/no/such/model' does not exist", 1),
    # every command: a flag value refused on its own exits 2 before anything loads
    (["generate", "--max_tokens=-5"], "generate: --max_tokens=-5 must be", 2),
    (["generate", "--top-p", "2"], "generate: --top_p=2.0 must be in (0, 1]", 2),
    (["generate", "--prompt="], "generate: --prompt is empty", 2),
    (["batch", "--input=/no/such.jsonl", "--output=/no/out.jsonl", "--max_num_seqs=0"],
     "batch: --max_num_seqs=0 must be a positive int", 2),
    (["batch", "--input=/no/such.jsonl", "--output=/no/out.jsonl"],
     "--input='/no/such.jsonl': no such file", 1),
    (["serve", "--gpu-memory-utilization", "1.5", "--port=0"],
     "serve: --gpu_memory_utilization=1.5 must be in (0, 1]", 2),
    (["convert", "--model=checkpoints/demo", "--output=/no/out", "--quantization=awq"],
     "convert: --quantization='awq' must be one of", 2),
    (["convert", "--model=checkpoints/demo", "--output=/no/out", "--calibration_data=x"],
     "convert: --calibration_data needs --quantization=int4, not None", 2),
    (["convert", "--model=/no/such/model", "--output=/no/out"],
     "convert: model directory '/no/such/model' does not exist", 1),
    (["plan", "--device=v9z-8"], "plan: --device='v9z-8' is not a known accelerator preset", 2),
    (["plan", "--memory_gb=0"], "plan: --memory_gb=0.0 must be > 0", 2),
    (["plan", "--memory_gb=4", "--price_per_hour=-1"],
     "plan: --price_per_hour=-1.0 must be >= 0", 2),
    (["plan", "--memory_gb=4", "--enable_expert_parallel"],
     "plan: enable_expert_parallel=True needs a mixture-of-experts model", 1),
    (["audit", "--input=/no/such.jsonl", "--page_size=0"],
     "audit: --page_size=0 must be a positive int", 2),
    (["audit", "--input=/no/such.jsonl"], "No such file or directory", 1),
    (["aot", "--device=v9z-8"], "aot: --device='v9z-8' is not a known TPU accelerator type", 2),
    (["aot", "--buckets=most"], "flag --buckets=most: value should be one of", 2),
    (["eval_ppl", "--input=/no/such.txt", "--window=1"], "eval_ppl: --window=1 must be >= 2",
     2),
    (["eval_ppl", "--input=/no/such.txt", "--max_tokens_per_file=0"],
     "eval_ppl: --max_tokens_per_file=0 must be >= 1", 2),
    (["eval_ppl", "--input=/no/such.txt"], "input file '/no/such.txt' does not exist", 1),
    # every unknown flag at once, spelt as given, each with its suggestion
    (["serve", "--swap-space", "4", "--max-num-seq", "8", "--prompt", "x", "--block_size=16"],
     "serve: --swap-space is not a flag of serve (jaxinfer has no such setting); "
     "--max-num-seq is not a flag of serve (did you mean --max-num-seqs?); --block_size is "
     "not a flag of serve (did you mean --page-size? vLLM's KV cache block is jaxinfer's "
     "page); --prompt is not a flag of serve (it is one of generate); see python -m "
     "jaxinfer serve --help", 2),
    (["generate", "--max-num-seqs", "lots", "--bogus"], "flag --max_num_seqs=lots: 'lots' is "
     "not an integer; --bogus is not a flag of generate (jaxinfer has no such setting)", 2),
    (["serve", "--enable-prefix-caching", "false"], "serve: --enable-prefix-caching takes "
     "no value: give --enable-prefix-caching=false", 2),
    (["serve", "--noenable_prefix_caching=1"],
     "--noenable_prefix_caching=1 does not take an argument", 2),
    (["generate", "--enforce-eager", "--strict-compile"], "generate: --enforce_eager "
     "compiles each bucket when first used, which --strict_compile refuses", 2),
    (["batch", "--ray", "--enforce_eager", "--input=in.jsonl", "--output=out.jsonl"],
     "batch: --enforce_eager is not taken with --ray", 2),
    (["serve", "--uvicorn-log-level", "loud"],
     "flag --uvicorn_log_level=loud: value should be one of", 2),
    # the model as a plain argument
    (["generate", "checkpoints/demo", "--model=/no/such/model"], "generate: two models "
     "given: 'checkpoints/demo' (the plain argument) and --model='/no/such/model'", 2),
    (["serve", "a", "b"], "serve takes one plain argument, the model, not 'a b'", 2),
    (["generate", "batch"], "one command at a time: 'generate batch'", 2),
    (["generate", "/no/such/model"], "model directory '/no/such/model' does not exist", 1),
    # vLLM's --chat-template and --override-generation-config
    (["generate", "--chat-template", "no/such.jinja"], "generate: chat_template="
     "'no/such.jinja' looks like a file name, but there is no such file", 1),
    (["serve", "--override-generation-config", '{"max_tokens": 5}', "--port=0"],
     "serve: --override_generation_config='{\"max_tokens\": 5}': ['max_tokens'] set no "
     "sampling default", 2),
])
def test_errors_print_one_line_and_exit_non_zero(args, message, code):
    result = _cli(*args)
    assert result.returncode == code, result.stderr
    assert "Traceback" not in result.stderr
    last = result.stderr.splitlines()[-1]
    assert last.startswith("jaxinfer: error: ") and message in last


def test_plan_does_not_import_the_runner():
    code = ("import sys\nfrom jaxinfer import cli\ntry:\n"
            "    cli.run(['jaxinfer', 'plan', '--model=qwen3-0.6b', '--memory_gb=4',\n"
            "             '--max_model_len=4096'])\n"
            "except SystemExit as e:\n    assert not e.code, e.code\n"
            "print(sorted(m for m in sys.modules if m.startswith('jaxinfer.engine')))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert result.returncode == 0, result.stderr
    assert ["decode_roofline_tokens_per_s", "-"] in [  # no bandwidth given
        line.split() for line in result.stdout.splitlines()]
    assert result.stdout.splitlines()[-1] == (
        "['jaxinfer.engine', 'jaxinfer.engine.request', 'jaxinfer.engine.structured', "
        "'jaxinfer.engine.structured.params']")


def test_serve_refuses_a_taken_port_before_loading():
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = _cli("serve", f"--port={port}", "--model=/no/such/model")
    assert result.returncode == 1, result.stderr
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in result.stderr
