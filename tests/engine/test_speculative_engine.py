"""Speculative decoding end to end: greedy outputs with speculation (n-gram and draft
model) are token for token those without it, over a workload with batching, chunked
prefill, prefix-cache hits and preemption; nothing compiles after warm-up; sampling
settings are honoured; a draft that cannot serve the target is refused at load.

The random tiny pair (target: tests' tiny llama; draft: a smaller random llama) rarely
agrees, so rejections and residual paths run; the bundled demo pair is trained and
agrees often. The sweep over k = 1..6 and both methods is `slow`.
"""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

from jaxinfer import SamplingParams, testing
from jaxinfer.config import EngineConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.server import prometheus

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
DEMO, DEMO_DRAFT = ROOT / "checkpoints" / "demo", ROOT / "checkpoints" / "demo-draft"
SMALL = dict(page_size=4, max_num_seqs=8, max_num_batched_tokens=32, max_model_len=64,
             compilation_cache_dir="", strict_compile=True)
TOKEN_BYTES = 512 + 128  # K/V of one token: tiny target (2 layers x 2 heads) + draft


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    """A smaller random llama with the tiny models' byte tokenizer."""
    path = tmp_path_factory.mktemp("draft")
    testing.make_hf_model(path, "llama", seed=7, num_hidden_layers=1, num_attention_heads=2,
                          num_key_value_heads=1, hidden_size=32, intermediate_size=64)
    return path


def _workload():
    """Shared system prompts (prefix hits), duplicates, random prompts; short and long
    outputs; with SMALL's 32-token budget the long prompts are chunked."""
    rng = np.random.default_rng(3)
    systems = [rng.integers(0, 256, size=n).tolist() for n in (9, 21)]
    prompts = [systems[i % 2] + rng.integers(0, 256, size=int(rng.integers(1, 8))).tolist()
               for i in range(16)]
    prompts += [rng.integers(0, 256, size=int(rng.integers(2, 41))).tolist()
                for _ in range(16)]
    prompts += [prompts[3], prompts[20]]
    max_tokens = [int(rng.integers(2, 24)) for _ in prompts]
    return prompts, max_tokens


def _greedy(engine, prompts, max_tokens):
    for i, (prompt, n) in enumerate(zip(prompts, max_tokens, strict=True)):
        engine.add_request(f"g{i}", prompt, SamplingParams(max_tokens=n, temperature=0.0,
                                                            ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    return [engine.release(f"g{i}").token_ids for i in range(len(prompts))]


@pytest.fixture(scope="module")
def plain_tokens(hf_model_dirs):
    """The plain engine's greedy tokens of the workload (golden-tested elsewhere)."""
    engine = Engine(hf_model_dirs["llama"], EngineConfig(**SMALL))
    return _greedy(engine, *_workload())


def _spec_engine(model, spec, pages=24, **settings):
    return Engine(model, EngineConfig(**(SMALL | settings), speculative_config=spec,
                                      kv_cache_memory_bytes=pages * 4 * TOKEN_BYTES))


def _check_exact(engine, want):
    tokens = _greedy(engine, *_workload())
    assert tokens == want
    metrics = engine.metrics.summary()
    assert metrics["compiles_after_warmup"] == 0
    assert metrics["preemptions"] > 0 and metrics["prefix_cache_hit_tokens"] > 0
    assert metrics["spec_verify_steps"] > 0 and metrics["spec_draft_tokens"] > 0
    assert engine.scheduler.pool.num_used == 0  # every page came back
    return metrics


@pytest.fixture(scope="module")
def draft_engine(hf_model_dirs, draft_dir):
    spec = {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 4,
            "adaptive": False}
    return _spec_engine(hf_model_dirs["llama"], spec)


def test_ngram_greedy_equals_plain_engine(hf_model_dirs, plain_tokens):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "adaptive": False, "disable_by_batch_size": 6}
    metrics = _check_exact(_spec_engine(hf_model_dirs["llama"], spec), plain_tokens)
    assert 0 < metrics["spec_accepted_tokens"] < metrics["spec_draft_tokens"]
    assert metrics["spec_skipped_batch_size"] > 0  # steps of 6 to 8 requests: none


def test_draft_model_greedy_equals_plain_engine(draft_engine, plain_tokens):
    metrics = _check_exact(draft_engine, plain_tokens)
    assert metrics["spec_accepted_tokens"] < metrics["spec_draft_tokens"]  # rejections ran
    assert metrics["spec_draft_time_share"] > 0
    text = prometheus.exposition(prometheus.snapshot(draft_engine), "m").decode()
    accepted = ('jaxinfer:spec_decode_num_accepted_tokens_total{model_name="m"} '
                f"{metrics['spec_accepted_tokens']}")
    assert accepted + ".0" in text or accepted in text
    assert "jaxinfer:spec_decode_num_draft_tokens_total" in text
    assert 'jaxinfer:spec_decode_skipped_total{model_name="m",reason="prompt_chunks"}' in text


def test_sampling_settings_hold_under_speculation(draft_engine):
    """Seeds, penalties, top-k/p, min_tokens, logprobs, stop strings and max_tokens with
    drafts verified (distribution exactness is tests/model/test_rejection.py's)."""
    params = SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, top_k=50, seed=11,
                            repetition_penalty=1.3, logprobs=2, min_tokens=3)
    prompt = list(range(40, 60))
    runs = []
    for rid in ("a", "b"):
        draft_engine.add_request(rid, prompt, params)
        while draft_engine.has_unfinished():
            draft_engine.step()
        runs.append(draft_engine.release(rid))
    assert runs[0].token_ids == runs[1].token_ids  # the seed fixes every draw
    out = runs[0]
    assert len(out.token_ids) == 20 and len(out.logprobs) == 20
    assert all(token in entry and len(entry) <= 3
               for token, entry in zip(out.token_ids, out.logprobs, strict=True))
    cut = bytes(out.token_ids[5:7]).decode("latin-1")
    draft_engine.add_request("s", prompt, SamplingParams(
        max_tokens=20, temperature=0.8, top_p=0.9, top_k=50, seed=11,
        repetition_penalty=1.3, min_tokens=3, stop=[cut]))
    while draft_engine.has_unfinished():
        draft_engine.step()
    stopped = draft_engine.release("s")
    assert stopped.finish_reason == "stop" and stopped.outputs[0].stop_reason == cut
    assert cut not in stopped.text and len(stopped.token_ids) <= 7
    assert draft_engine.scheduler.pool.num_used == 0


def _demo_prompts(count=12):
    from jaxinfer.text.corpus import corpus_files, read_texts
    from jaxinfer.text.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(DEMO)
    texts = read_texts(corpus_files()[1][:count])
    return [tokenizer.encode(t, add_special_tokens=False)[:48] for t in texts]


def test_demo_pair_greedy_equals_plain_engine():
    prompts = [p for p in _demo_prompts() if len(p) > 4]
    settings = dict(SMALL, max_model_len=96, max_num_batched_tokens=64)
    plain = _greedy(Engine(DEMO, EngineConfig(**settings)), prompts, [32] * len(prompts))
    # Not adaptive: whether the cost model tries the pair depends on step times measured
    # on a shared CPU; here every step verifies, so the equality is checked every time.
    spec = {"method": "draft_model", "model": str(DEMO_DRAFT), "num_speculative_tokens": 3,
            "adaptive": False}
    engine = Engine(DEMO, EngineConfig(**settings, speculative_config=spec))
    assert _greedy(engine, prompts, [32] * len(prompts)) == plain
    metrics = engine.metrics.summary()
    assert metrics["compiles_after_warmup"] == 0 and metrics["spec_verify_steps"] > 0
    assert metrics["spec_acceptance_rate"] > 0.2  # a trained pair agrees often


def test_a_draft_that_cannot_serve_the_target_is_refused(hf_model_dirs, draft_dir, tmp_path):
    target = hf_model_dirs["llama"]

    def load(**spec):
        spec = {"method": "draft_model", "num_speculative_tokens": 2} | spec
        return Engine(target, EngineConfig(**SMALL, speculative_config=spec), warm_up=False)

    with pytest.raises(FileNotFoundError, match="no such directory"):
        load(model=str(tmp_path / "nothing"))
    with pytest.raises(ValueError, match="does not share the target's tokenizer"):
        load(model=str(DEMO_DRAFT))
    short = tmp_path / "short"
    testing.make_hf_model(short, "llama", seed=1, max_position_embeddings=32)
    with pytest.raises(ValueError, match="max_position_embeddings=32 is below max_model_len=64"):
        load(model=str(short))
    with pytest.raises(ValueError, match="draft_tensor_parallel_size=2: .* must equal "
                                         "tensor_parallel_size=1"):
        load(model=str(draft_dir), draft_tensor_parallel_size=2)
    odd = tmp_path / "odd"  # 3 query heads: no split over 2 devices
    testing.make_hf_model(odd, "llama", seed=3, num_attention_heads=3, num_key_value_heads=1,
                          hidden_size=48)
    with pytest.raises(ValueError, match="draft model .*must divide the 3 query heads"):
        Engine(target, EngineConfig(**SMALL, tensor_parallel_size=2, speculative_config={
            "method": "draft_model", "model": str(odd), "num_speculative_tokens": 2}),
            warm_up=False)
    no_tokenizer = tmp_path / "bare"
    testing.make_hf_model(no_tokenizer, "llama", seed=2)
    (no_tokenizer / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match="has no tokenizer.json"):
        load(model=str(no_tokenizer))


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 6])
def test_sweep_greedy_equals_plain_engine(hf_model_dirs, draft_dir, plain_tokens, method, k):
    spec = {"method": method, "num_speculative_tokens": k, "adaptive": False}
    if method == "draft_model":
        spec["model"] = str(draft_dir)
    else:
        spec["prompt_lookup_min"] = 1
    _check_exact(_spec_engine(hf_model_dirs["llama"], spec), plain_tokens)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
@pytest.mark.parametrize("k", [1, 2, 4, 6])
def test_sweep_demo_pair_greedy_equals_plain_engine(method, k):
    prompts = [p for p in _demo_prompts(24) if len(p) > 4]
    settings = dict(SMALL, max_model_len=96, max_num_batched_tokens=64)
    plain = _greedy(Engine(DEMO, EngineConfig(**settings)), prompts, [40] * len(prompts))
    spec = {"method": method, "num_speculative_tokens": k, "adaptive": False}
    if method == "draft_model":
        spec["model"] = str(DEMO_DRAFT)
    engine = Engine(DEMO, EngineConfig(**settings, speculative_config=spec))
    assert _greedy(engine, prompts, [40] * len(prompts)) == plain
    assert engine.metrics.summary()["compiles_after_warmup"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_tensor_parallel_speculation_equals_plain_engine(hf_model_dirs, draft_dir,
                                                         plain_tokens, method):
    """Target and draft split over 2 devices (the draft's one KV head copied)."""
    spec = {"method": method, "num_speculative_tokens": 3, "adaptive": False}
    spec |= {"model": str(draft_dir)} if method == "draft_model" else {"prompt_lookup_min": 1}
    engine = _spec_engine(hf_model_dirs["llama"], spec, tensor_parallel_size=2)
    _check_exact(engine, plain_tokens)
