"""guidellm against jaxinfer: a streaming benchmark at a constant rate, through
/v1/completions and /v1/chat/completions, with no errored or incomplete request and
every output as long as asked (guidellm sends `ignore_eos` and vLLM's
`stream_options.continuous_usage_stats` on every streamed request).

    python3 -m venv /work/venv-guidellm
    /work/venv-guidellm/bin/pip install -r tools/clients/requirements-guidellm.txt
    /work/venv-guidellm/bin/python tools/clients/check_guidellm.py [--url URL]
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import tempfile
from importlib import metadata

from serve import REPO, Report, arguments, expect, server

DEMO = REPO / "checkpoints" / "demo"  # its tokenizer counts the synthetic prompts' tokens
OUTPUT_TOKENS = 24


def benchmark(url: str, model: str, request_format: str, requests: int) -> dict:
    """Run one bounded benchmark; its request totals and output tokens per request."""
    guidellm = pathlib.Path(sys.executable).parent / "guidellm"
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "benchmarks.json"
        command = [str(guidellm), "run",
                   f"--backend=kind=openai_http,target={url},model={model},"
                   f"request_format={request_format}",
                   "--profile=kind=constant,rate=2",
                   f"--constraint=kind=max_requests,count={requests}",
                   f"--data=kind=synthetic_text,prompt_tokens=48,output_tokens={OUTPUT_TOKENS}",
                   f"--tokenizer=kind=huggingface_auto,model={DEMO}",
                   f"--output=kind=json,path={out}", "--disable-progress"]
        run = subprocess.run(command, capture_output=True, text=True, timeout=600)
        expect(run.returncode == 0, f"guidellm exited {run.returncode}: {run.stderr[-2000:]}")
        (bench,) = json.loads(out.read_text())["benchmarks"]
    totals = bench["metrics"]["request_totals"]
    tokens = bench["metrics"]["output_token_count"]["successful"]
    expect(totals["errored"] == 0 and totals["incomplete"] == 0, f"totals {totals}")
    expect(totals["successful"] >= requests - 1, f"totals {totals}")
    expect(tokens["min"] == tokens["max"] == OUTPUT_TOKENS, f"output tokens {tokens}")
    return {"command": " ".join(command[1:]), "request_totals": totals,
            "output_tokens_per_request": tokens["median"],
            "ttft_ms_median": bench["metrics"]["time_to_first_token_ms"]["successful"]["median"]}


def main() -> None:
    args = arguments(__doc__.splitlines()[0])
    report = Report("guidellm", metadata.version("guidellm"))
    with server(args) as (url, model):
        report.check("stream_completions", lambda: benchmark(url, model, "/v1/completions", 20))
        report.check("stream_chat", lambda: benchmark(url, model, "/v1/chat/completions", 10))
    report.finish()


if __name__ == "__main__":
    main()
