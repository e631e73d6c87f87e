"""An embedding job through `python -m jaxinfer batch`, killed once and resumed
(docs/pooling.md#batch-jobs): `--num_lines` OpenAI batch lines with `url`
/v1/embeddings (one document each, 8-64 words) on a tiny random BERT with mean pooling;
the first run is killed with SIGKILL once `--kill_after` lines are written, the second
resumes. Checks every custom_id is written exactly once and every vector equals
`LLM.embed`'s for a sample; prints JSON: lines, seconds of each run, lines each wrote,
output bytes per line (base64 float32, the batch default).

    python benchmarks/bench_embed_job.py [--num_lines=10000] [--kill_after=3000]
"""

from __future__ import annotations

import base64
import datetime
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
from absl import app, flags

from jaxinfer import testing

flags.DEFINE_integer("num_lines", 10000, "embedding lines in the job")
flags.DEFINE_integer("kill_after", 3000, "output lines written before the first run dies")
flags.DEFINE_integer("check", 200, "lines whose vectors are compared with LLM.embed")
FLAGS = flags.FLAGS
ENGINE = ["--max_num_batched_tokens=2048", "--dtype=float32", "--compilation_cache_dir="]


def make_model(root: pathlib.Path) -> pathlib.Path:
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules

    testing.make_encoder_model(root / "bare", "bert")
    transformer = modules.Transformer(str(root / "bare"))
    st = SentenceTransformer(modules=[
        transformer, modules.Pooling(transformer.get_embedding_dimension(), "mean"),
        modules.Normalize()])
    st.save(str(root / "st"))
    return root / "st"


def lines(count: int, model: pathlib.Path) -> list[dict]:
    rng = np.random.default_rng(0)
    return [{"custom_id": f"doc-{i}", "method": "POST", "url": "/v1/embeddings",
             "body": {"model": str(model), "input": testing.encoder_text(
                 rng.integers(4, 300, rng.integers(8, 65)))}} for i in range(count)]


def command(model: pathlib.Path, inp: pathlib.Path, out: pathlib.Path) -> list[str]:
    return [sys.executable, "-m", "jaxinfer", "batch", f"--model={model}",
            f"--input={inp}", f"--output={out}", *ENGINE]


def count_lines(path: pathlib.Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def main(argv: list[str]) -> None:
    del argv
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        model = make_model(root)
        job = lines(FLAGS.num_lines, model)
        inp, out = root / "in.jsonl", root / "out.jsonl"
        inp.write_text("".join(json.dumps(line) + "\n" for line in job))
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        began = time.perf_counter()
        proc = subprocess.Popen(command(model, inp, out), env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        while proc.poll() is None and count_lines(out) < FLAGS.kill_after:
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        first_s, first_lines = time.perf_counter() - began, count_lines(out)
        began = time.perf_counter()
        second = subprocess.run(command(model, inp, out), env=env, capture_output=True,
                                text=True, timeout=3600)
        second_s = time.perf_counter() - began
        report = check(model, job, out)
        print(json.dumps({
            "date": datetime.date.today().isoformat(), "lines": FLAGS.num_lines,
            "first_run": {"seconds": round(first_s, 1), "lines_written": first_lines,
                          "killed": "SIGKILL"},
            "resumed_run": {"seconds": round(second_s, 1), "exit_code": second.returncode,
                            "lines_written": count_lines(out) - first_lines},
            **report}, indent=1))


def check(model: pathlib.Path, job: list[dict], out: pathlib.Path) -> dict:
    """Each custom_id once (a torn last line of the killed run aside), vectors equal to
    LLM.embed's for the first `--check` lines."""
    from jaxinfer import LLM

    records = []
    for text in out.read_text().splitlines():
        try:
            records.append(json.loads(text))
        except json.JSONDecodeError:
            continue  # the killed run's torn last line, which the resumed run redoes
    ids = [r["custom_id"] for r in records]
    by_id = {r["custom_id"]: r for r in records}
    llm = LLM(str(model), max_num_batched_tokens=2048, dtype="float32")
    wanted = [line["body"]["input"] for line in job[:FLAGS.check]]
    want = np.array([o.outputs.embedding for o in llm.embed(wanted)], np.float32)
    got = np.array([np.frombuffer(base64.b64decode(
        by_id[f"doc-{i}"]["response"]["body"]["data"][0]["embedding"]), "<f4")
        for i in range(FLAGS.check)])
    return {"records": len(records), "distinct_ids": len(set(ids)),
            "duplicates": len(ids) - len(set(ids)),
            "missing": len({line["custom_id"] for line in job} - set(ids)),
            "errors": sum(r.get("error") is not None for r in records),
            "bytes_per_line": round(out.stat().st_size / max(len(records), 1)),
            "max_abs_diff_vs_llm_embed": float(np.abs(got - want).max())}


if __name__ == "__main__":
    app.run(main)
