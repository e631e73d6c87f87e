"""Parity of the paged forward pass with transformers, the ground truth."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxinfer import checkpoint, testing
from jaxinfer.engine.runner import Chunk, Runner
from jaxinfer.model import transformer
from jaxinfer.pallas import AttentionSettings

FAMILIES = testing.DENSE_FAMILIES
PAGE_SIZE = 8
PAGES = [5, 2, 11, 7, 1, 9, 3, 14]  # out of order, 64 slots
TOL = 1e-4


def _hf_logits(model: torch.nn.Module, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(ids)[None]).logits[0].numpy()


def _runner(model_dir, num_pages: int = 32) -> Runner:
    cfg = checkpoint.load_config(model_dir)
    params = checkpoint.load_params(model_dir, cfg)
    return Runner(cfg, params, num_pages=num_pages, page_size=PAGE_SIZE, max_model_len=64)


def _prompt(seed: int, length: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=length)


@pytest.mark.parametrize("family", FAMILIES)
def test_forward_full_prompt_matches_transformers(family, hf_model_dirs, hf_models):
    ids = _prompt(1, 45)  # crosses 5 page boundaries, past the windows (24, gemma's 12)
    runner = _runner(hf_model_dirs[family])
    ours = testing.logits(runner, [Chunk(ids.tolist(), 0, PAGES[:6])])
    diff = np.abs(ours - _hf_logits(hf_models[family], ids)).max()
    print(f"{family}: max abs logit diff {diff:.2e}")
    assert diff < TOL


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("chunks", [(40, 1, 1, 1, 1, 1), (5, 1, 13, 7, 14, 2)])
def test_forward_incremental_matches_full(family, chunks, hf_model_dirs, hf_models):
    ids = _prompt(2, sum(chunks))
    runner = _runner(hf_model_dirs[family])
    pieces, start = [], 0
    for n in chunks:
        chunk = Chunk(ids[start:start + n].tolist(), start, PAGES[:6])
        pieces.append(testing.logits(runner, [chunk]))
        start += n
    diff = np.abs(np.concatenate(pieces) - _hf_logits(hf_models[family], ids)).max()
    assert diff < TOL


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_forward_mixed_batch_matches_separate_requests(family, hf_model_dirs, hf_models):
    """Prefill chunks and decode tokens of three requests in one ragged step."""
    runner = _runner(hf_model_dirs[family])
    a, b, c = _prompt(3, 30), _prompt(4, 17), _prompt(5, 9)
    tables = {"a": [4, 12, 6, 20], "b": [8, 3, 17], "c": [30, 2]}
    testing.logits(runner, [Chunk(a[:29].tolist(), 0, tables["a"]),
                            Chunk(b[:10].tolist(), 0, tables["b"])])
    step = testing.logits(runner, [Chunk(a[29:].tolist(), 29, tables["a"]),  # decode
                                   Chunk(b[10:].tolist(), 10, tables["b"]),  # prefill chunk
                                   Chunk(c.tolist(), 0, tables["c"])])  # whole prompt
    want = np.concatenate([_hf_logits(hf_models[family], a)[29:],
                           _hf_logits(hf_models[family], b)[10:],
                           _hf_logits(hf_models[family], c)])
    assert np.abs(step - want).max() < TOL


@pytest.mark.parametrize("family", FAMILIES + testing.MOE_FAMILIES)
def test_forward_dense_matches_paged(family, hf_model_dirs, hf_models):
    cfg = checkpoint.load_config(hf_model_dirs[family])
    params = checkpoint.load_params(hf_model_dirs[family], cfg)
    ids = _prompt(6, 33)
    dense = transformer.forward_dense(params, jnp.asarray(ids)[None], cfg=cfg)[0]
    assert np.abs(np.asarray(dense) - _hf_logits(hf_models[family], ids)).max() < TOL


def test_forward_bfloat16_close_to_float32(hf_model_dirs, hf_models):
    cfg = checkpoint.load_config(hf_model_dirs["llama"])
    params = checkpoint.load_params(hf_model_dirs["llama"], cfg, "bfloat16")
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}
    runner = Runner(cfg, params, num_pages=16, page_size=PAGE_SIZE, max_model_len=64,
                    kv_dtype="bfloat16")
    ids = _prompt(7, 20)
    ours = testing.logits(runner, [Chunk(ids.tolist(), 0, PAGES[:3])])
    ref = _hf_logits(hf_models["llama"], ids)
    assert np.abs(ours - ref).max() < 0.05 * np.abs(ref).max()
    assert (ours.argmax(-1) == ref.argmax(-1)).mean() > 0.9


@pytest.mark.parametrize("impl", ["gpu", "tpu"])
def test_forward_through_pallas_kernel_matches_transformers(impl, hf_model_dirs, hf_models):
    """The model runs the chosen kernel (interpret mode): the runner's attention settings."""
    cfg = checkpoint.load_config(hf_model_dirs["qwen3"])
    runner = Runner(cfg, checkpoint.load_params(hf_model_dirs["qwen3"], cfg), num_pages=8,
                    page_size=PAGE_SIZE, max_model_len=32,
                    attention=AttentionSettings(impl=impl, interpret=True))
    ids = _prompt(8, 12)
    first = testing.logits(runner, [Chunk(ids[:10].tolist(), 0, [3, 5])])
    second = testing.logits(runner, [Chunk(ids[10:].tolist(), 10, [3, 5])])
    ours = np.concatenate([first, second])
    assert np.abs(ours - _hf_logits(hf_models["qwen3"], ids)).max() < TOL
