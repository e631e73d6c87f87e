"""Multi-host serving on one machine: `serve` as two processes joined by jax.distributed on
127.0.0.1, 4 CPU devices each, tensor parallel over all 8 or in 2 pipeline stages (one a
process) of 4 (process 0 answers HTTP, process 1 follows its engine step by step),
answers the real `openai` client with exactly the text of one process with 8 devices and
the same layout; SIGTERM to both drains the request in flight and both exit 0; `kill -9`
of process 1 fails process 0's requests in flight with an error, turns /health to 503,
and process 0 exits non-zero within 60 s.

The processes are CLI subprocesses; the harness (never the package) sets their device
count through JAX's own JAX_NUM_CPU_DEVICES.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx2 as httpx
import openai
import pytest
from serving import START_TIMEOUT_S, Server, start_server

from jaxinfer import testing

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODEL = "tiny"
ENGINE = {"dtype": "float32", "max_num_seqs": 4, "max_num_batched_tokens": 32,
          "max_model_len": 128}
# A tiny llama (2 layers, 8 query heads, 2 KV heads) over 8 devices: tensor parallel over
# all, or 2 pipeline stages of 4 (stage 0 on process 0's devices, stage 1 on process 1's)
LAYOUTS = {"tp8": {"tensor_parallel_size": 8},
           "pp2-tp4": {"pipeline_parallel_size": 2, "tensor_parallel_size": 4}}
TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
EXIT_TIMEOUT_S = 120  # a process that outlives this after being stopped fails the test
FOLLOWING = "jaxinfer: following process 0's server"  # the follower is warm
LOST_HOST_EXIT_S = 60  # the bound the behaviour promises (heartbeat_timeout_s below it)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("tp8-llama")
    testing.make_hf_model(path, "llama", num_attention_heads=8, num_key_value_heads=2)
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps(config | {"chat_template": TEMPLATE}))
    return path


@pytest.fixture(scope="module")
def cache_dir() -> pathlib.Path:
    """The run's compilation cache (tests/conftest.py), passed as a flag: later starts
    load, not compile."""
    return pathlib.Path(os.environ["JAX_COMPILATION_CACHE_DIR"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Job:
    """Process 0 (the server) and process 1 (the follower) of one multi-host server, both
    warm. Process 0 listens once its own warm-up is done, but the follower's can take
    far longer (JAX writes the persistent compilation cache from process 0 alone, and
    process 1 found nothing to load: it compiles every program), and a step waits for
    it: a request sent before it is warm can outlast --heartbeat_timeout_s."""

    def __init__(self, model: pathlib.Path, cache: pathlib.Path, *extra: str,
                 layout: str = "tp8") -> None:
        job = [f"--coordinator_address=127.0.0.1:{_free_port()}", "--num_processes=2", *extra]
        model_flags = [f"--model={model}", f"--served_model_name={MODEL}",
                       f"--compilation_cache_dir={cache}"]
        engine = ENGINE | LAYOUTS[layout]
        self.follower_log: list[str] = []
        self.follower = subprocess.Popen(
            [sys.executable, "-m", "jaxinfer", "serve", "--port=0", *model_flags,
             *(f"--{k}={v}" for k, v in engine.items()), *job, "--process_id=1"],
            cwd=ROOT, env=os.environ | _env(4), stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, text=True)
        warm = threading.Event()

        def read() -> None:  # keeps draining stderr so the follower never blocks on it
            for line in self.follower.stderr:
                self.follower_log.append(line)
                if line.startswith(FOLLOWING):
                    warm.set()
            warm.set()

        threading.Thread(target=read, daemon=True).start()
        try:
            self.server: Server = start_server(*model_flags, *job, "--process_id=0",
                                               env=_env(4), **engine)
        except BaseException:
            self.follower.kill()
            raise
        self.processes = [self.server.process, self.follower]
        if not (warm.wait(START_TIMEOUT_S) and self.follower.poll() is None):
            self.kill()
            raise RuntimeError("the follower did not start:\n"
                               + "".join(self.follower_log[-30:]))

    def wait(self) -> list[int]:
        """Both exit codes; kills any process still running after EXIT_TIMEOUT_S."""
        try:
            return [p.wait(EXIT_TIMEOUT_S) for p in self.processes]
        finally:
            self.kill()

    def kill(self) -> None:
        for p in self.processes:
            if p.poll() is None:
                p.kill()


def _env(num_devices: int) -> dict[str, str]:
    return {"JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": str(num_devices)}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout(request: pytest.FixtureRequest) -> str:
    """The layout the module's servers run (one pair of reference and job at a time)."""
    return request.param


@pytest.fixture(scope="module")
def reference(model_dir, cache_dir, layout):
    """One process, 8 devices, the same layout: the expected text."""
    server = start_server(f"--model={model_dir}", f"--served_model_name={MODEL}",
                          f"--compilation_cache_dir={cache_dir}", env=_env(8),
                          **ENGINE | LAYOUTS[layout])
    yield server
    server.stop()


@pytest.fixture(scope="module")
def job(model_dir, cache_dir, layout):
    job = Job(model_dir, cache_dir, layout=layout)
    yield job
    for p in job.processes:
        p.send_signal(signal.SIGTERM)
    job.wait()


def _client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def _completion_texts(server: Server, **request) -> list[str]:
    with _client(server) as client:
        response = client.completions.create(model=MODEL, **request)
    return [choice.text for choice in sorted(response.choices, key=lambda c: c.index)]


COMPLETIONS = [
    {"prompt": "def read(path):", "max_tokens": 12, "temperature": 0},
    {"prompt": "import os", "max_tokens": 12, "temperature": 0.8, "seed": 3},
    {"prompt": "x = ", "max_tokens": 8, "temperature": 0.7, "seed": 5, "n": 2},
    {"prompt": [5, 6, 7, 8], "max_tokens": 10, "temperature": 1.0, "seed": 11,
     "extra_body": {"top_k": 20}},
]


@pytest.mark.parametrize("request_body", COMPLETIONS, ids=["greedy", "seeded", "n2", "ids"])
def test_completions_match_one_process(job, reference, request_body):
    want = _completion_texts(reference, **request_body)
    assert len(want) == request_body.get("n", 1) and any(want)
    assert _completion_texts(job.server, **request_body) == want


def test_chat_matches_one_process(job, reference):
    messages = [{"role": "user", "content": "hello there"}]
    texts = []
    for server in (reference, job.server):
        with _client(server) as client:
            response = client.chat.completions.create(model=MODEL, messages=messages,
                                                      max_tokens=10, temperature=0)
        texts.append(response.choices[0].message.content)
    assert texts[0] and texts[1] == texts[0]


def test_stream_matches_one_process(job, reference):
    request = {"prompt": "class Point:", "max_tokens": 16, "temperature": 0}
    want = _completion_texts(reference, **request)[0]
    with _client(job.server) as client:
        chunks = list(client.completions.create(model=MODEL, stream=True, **request))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert chunks[-1].choices[0].finish_reason == "length"


def test_an_aborted_stream_leaves_the_processes_in_step(job, reference):
    """A client that goes away aborts its request on process 0; process 1 applies the
    abort at the same step, so the next requests still come out right."""
    with _client(job.server) as client:
        stream = client.completions.create(model=MODEL, prompt="while True:", max_tokens=100,
                                           temperature=0, stream=True, extra_body={
                                               "ignore_eos": True})
        next(iter(stream))
        stream.close()
    request = {"prompt": "def read(path):", "max_tokens": 12, "temperature": 0}
    assert _completion_texts(job.server, **request) == _completion_texts(reference, **request)
    assert job.follower.poll() is None


def test_sigterm_to_both_processes_drains_and_both_exit_0(model_dir, cache_dir):
    job = Job(model_dir, cache_dir)
    try:
        body = {"model": MODEL, "prompt": "def f(x):", "max_tokens": 60, "temperature": 0,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", job.server.url + "/completions", json=body,
                          timeout=120) as response:
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            for p in job.processes:  # as a slice's `--worker=all` stop does
                p.send_signal(signal.SIGTERM)
            events = [first] + [line for line in lines if line.startswith("data: ")]
        codes = job.wait()
    finally:
        job.kill()
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert not [c for c in chunks if "error" in c]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert codes == [0, 0], "".join(job.server.log[-20:] + job.follower_log[-20:])


@pytest.mark.parametrize("killed_layout", list(LAYOUTS))
def test_a_killed_follower_fails_the_requests_and_process_0_exits(model_dir, cache_dir,
                                                                   killed_layout):
    job = Job(model_dir, cache_dir, "--heartbeat_timeout_s=20", layout=killed_layout)
    results = {}
    try:
        body = {"model": MODEL, "prompt": "def g(y):", "max_tokens": 110, "temperature": 0,
                "ignore_eos": True}

        def whole() -> None:
            results["whole"] = httpx.post(job.server.url + "/completions", json=body,
                                          timeout=120)

        thread = threading.Thread(target=whole)
        thread.start()  # in flight before the stream's first token
        time.sleep(0.5)
        with httpx.stream("POST", job.server.url + "/completions", json=body | {
                "stream": True}, timeout=120) as response:
            lines = response.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            job.follower.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            events = [line for line in lines if line.startswith("data: ")]
        health = job.server.get("/health")
        thread.join(60)
        code = job.server.process.wait(EXIT_TIMEOUT_S)
        exited_after = time.monotonic() - killed
    finally:
        job.kill()
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert events[-1] == "data: [DONE]" and error["code"] == "engine_failed"
    assert results["whole"].status_code == 500
    assert results["whole"].json()["error"]["code"] == "engine_failed"
    assert health.status_code == 503
    assert code != 0 and exited_after < LOST_HOST_EXIT_S
