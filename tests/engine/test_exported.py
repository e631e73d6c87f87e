"""exported.py: a start with the compilation cache on exports each program once; the
next start reads them back and traces no step or admission program, with the same
tokens as an engine that traces (no cache at all). Each start is its own process, as
JAX's cache setting is process-wide."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import pytest

from jaxinfer.engine.runner import exported

START = """
import json, sys
import jax
traced = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, duration, **kw: event == "/jax/core/compile/jaxpr_trace_duration"
    and traced.append(kw.get("fun_name")))
from jaxinfer import LLM, SamplingParams
from jaxinfer.engine.runner import exported
model, cache, seqs = sys.argv[1:]
llm = LLM(model, compilation_cache_dir=cache, page_size=8, max_model_len=64,
          max_num_seqs=int(seqs), max_num_batched_tokens=32)
outputs = llm.generate([[1, 2, 3, 4], [5, 6, 7]], SamplingParams(max_tokens=8,
                                                               temperature=0))
print(json.dumps({"read": exported.COUNTS.read, "written": exported.COUNTS.written,
                  "traced": sorted(set(traced)), "buckets": llm.metrics()["buckets"],
                  "tokens": [o.outputs[0].token_ids for o in outputs]}))
"""


def _start(model_dir, cache_dir, max_num_seqs: int = 2) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # each start here names its own
    result = subprocess.run([sys.executable, "-c", START, str(model_dir), str(cache_dir),
                             str(max_num_seqs)],
                            capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


def test_a_second_start_reads_every_program_and_traces_none(hf_model_dirs, tmp_path):
    model, cache = hf_model_dirs["qwen2"], tmp_path / "xla"
    first = _start(model, cache)
    programs = first["buckets"] + 1  # and the admission program
    assert first["written"] == programs and first["read"] == 0
    assert "flat" in first["traced"]  # the programs, traced to be exported
    assert len(list((cache / "exported").glob("*.jax"))) == programs
    second = _start(model, cache)
    assert second["read"] == programs and second["written"] == 0
    assert "flat" not in second["traced"]
    untraced = _start(model, "")  # no compilation cache: no export, traced as JAX does
    assert untraced["read"] == untraced["written"] == 0 and "flat" not in untraced["traced"]
    assert first["tokens"] == second["tokens"] == untraced["tokens"]


def test_other_shapes_export_their_own_and_a_damaged_file_is_exported_again(
        hf_model_dirs, tmp_path):
    model, cache = hf_model_dirs["qwen2"], tmp_path / "xla"
    first = _start(model, cache)
    firsts = sorted((cache / "exported").glob("decode-*.jax"))
    wider = _start(model, cache, max_num_seqs=4)  # other slot counts: other programs
    assert wider["written"] > 0 and wider["read"] + wider["written"] == wider["buckets"] + 1
    damaged = firsts[0]
    damaged.write_bytes(damaged.read_bytes()[:100])
    again = _start(model, cache)
    assert again["written"] == 1 and again["read"] == first["written"] - 1
    assert again["tokens"] == first["tokens"]


class _NoRepr:
    pass


def test_settings_without_a_stable_text_are_never_keyed(tmp_path):
    spec = jax.ShapeDtypeStruct((2,), jax.numpy.float32,
                                sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    tree = jax.tree.structure((spec,))
    assert exported._key("f", ("plain", 1), tree, [spec], ()) is not None
    assert exported._key("f", ("plain", 1), tree, [spec], ()) == exported._key(
        "f", ("plain", 1), tree, [spec], ())
    assert exported._key("f", ("plain", 2), tree, [spec], ()) != exported._key(
        "f", ("plain", 1), tree, [spec], ())
    assert exported._key("f", _NoRepr(), tree, [spec], ()) is None


def test_arguments_without_a_sharding_are_refused():
    with pytest.raises(ValueError, match="needs its sharding"):
        exported._spec(jax.ShapeDtypeStruct((2,), jax.numpy.float32))
