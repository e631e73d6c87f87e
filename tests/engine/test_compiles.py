"""CompileCounter: per-thread spans, so an engine never counts another thread's compiles
(two engines in one process); it stops listening when closed."""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp

from jaxinfer import SamplingParams
from jaxinfer.config import EngineConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.runner import CompileCounter


def _compile_new_function(x: jax.Array, scale: float) -> None:
    jax.jit(lambda v: v * scale + 1.0)(x).block_until_ready()  # one new compile


def test_compile_counter_spans_count_only_their_own_thread():
    x = jnp.ones(3)
    counter = CompileCounter()
    span = counter.begin()
    other = threading.Thread(target=_compile_new_function, args=(x, 3.25))
    other.start()
    other.join()
    assert counter.end(span) == 0  # the other thread's compile is not this span's
    assert counter.total == 1
    _compile_new_function(x, 4.5)
    assert counter.end(span) == 1
    assert counter.on_this_thread() == 1 and counter.total == 2
    counter.close()
    _compile_new_function(x, 5.75)
    assert counter.total == 2  # closed: no longer listening


def test_engine_steps_while_another_engine_compiles_count_no_compiles(hf_model_dirs):
    small = dict(page_size=4, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64,
                 compilation_cache_dir="")
    serving = Engine(hf_model_dirs["llama"], EngineConfig(**small, strict_compile=True))
    others: list[Engine] = []
    loader = threading.Thread(target=lambda: others.append(Engine(
        hf_model_dirs["qwen3"], EngineConfig(**small | {"max_num_batched_tokens": 64}))))
    loader.start()
    steps_during_warmup, i = 0, 0
    while loader.is_alive() or serving.has_unfinished():
        if not serving.has_unfinished() and loader.is_alive():
            serving.add_request(f"r{i}", [1 + i % 200, 2, 3],
                                SamplingParams(max_tokens=8, temperature=0.0))
            i += 1
        serving.step()  # strict_compile: would raise on the other engine's compiles
        steps_during_warmup += loader.is_alive()
    loader.join()
    assert steps_during_warmup > 0
    assert serving.metrics.compiles_after_warmup == 0
    assert others[0].compiles.total >= others[0].metrics.num_buckets > 0
