"""Decoder pooling models through the paged engine, against sentence-transformers and
transformers on tiny random checkpoints: last-token and mean pooling, a prompt chunked
across steps, Matryoshka dimensions, a sequence classifier's scores."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxinfer import LLM, testing
from jaxinfer.pooling import PoolingParams

TEXTS = ["hello world", "a", "the quick brown fox jumps over the lazy dog " * 2,
         "embeddings of many lengths", "x y z " * 12, "pooled through the paged engine"]
SMALL = dict(max_model_len=128, max_num_batched_tokens=16, max_num_seqs=4,
             dtype="float32")


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def _save_st(path, mode: str, matryoshka: bool = False):
    """A bare Qwen3Model with sentence-transformers' pooling `mode` and Normalize."""
    import torch
    import transformers
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules

    torch.manual_seed(0)
    config = testing.hf_config("qwen3", is_matryoshka=matryoshka)
    model = transformers.AutoModel.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    bare = path / "bare"
    model.save_pretrained(bare)
    testing.write_byte_tokenizer(bare)
    transformer = modules.Transformer(str(bare))
    st = SentenceTransformer(modules=[
        transformer, modules.Pooling(transformer.get_embedding_dimension(), mode),
        modules.Normalize()])
    st.save(str(path / "st"))
    return st, path / "st"


@pytest.fixture(scope="module")
def last_model(tmp_path_factory):
    return _save_st(tmp_path_factory.mktemp("last"), "lasttoken", matryoshka=True)


def test_last_token_pooling_matches_sentence_transformers_chunked(last_model):
    st, path = last_model
    want = st.encode(TEXTS, convert_to_numpy=True)
    llm = LLM(str(path), **SMALL)  # auto: a sentence-transformers directory pools
    assert llm.llm_engine.pooler.pooling_type == "last"
    got = np.array([o.outputs.embedding for o in llm.embed(TEXTS)])
    assert got.shape == want.shape
    assert _cosines(got, want).min() >= 0.99999
    np.testing.assert_allclose(np.linalg.norm(got, axis=-1), 1.0, rtol=1e-5)
    # the long prompts ran in several steps of 16 tokens
    assert max(len(o.prompt_token_ids) for o in llm.embed(TEXTS)) > 16


def test_dimensions_cut_then_normalize(last_model):
    st, path = last_model
    llm = LLM(str(path), **SMALL)
    got = llm.embed(TEXTS[:3], PoolingParams(dimensions=16))
    want = st.encode(TEXTS[:3], convert_to_numpy=True, truncate_dim=16)
    vectors = np.array([o.outputs.embedding for o in got])
    assert vectors.shape == (3, 16)
    assert _cosines(vectors, want).min() >= 0.99999
    raw = llm.embed(TEXTS[:1], PoolingParams(normalize=False))[0].outputs.embedding
    assert abs(np.linalg.norm(raw) - 1.0) > 1e-3


def test_mean_pooling_turns_prefix_caching_off(tmp_path):
    st, path = _save_st(tmp_path, "mean")
    llm = LLM(str(path), **SMALL)
    assert llm.llm_engine.pooler.pooling_type == "mean"
    assert not llm.llm_engine.backend.engine.config.enable_prefix_caching
    got = np.array([o.outputs.embedding for o in llm.embed(TEXTS)])
    assert _cosines(got, st.encode(TEXTS, convert_to_numpy=True)).min() >= 0.99999
    with pytest.raises(ValueError, match="dimensions"):
        llm.embed("a", PoolingParams(dimensions=8))


def test_sequence_classifier_scores_match_transformers(tmp_path):
    import torch
    import transformers

    torch.manual_seed(1)
    config = testing.hf_config("qwen3", num_labels=1, pad_token_id=258)
    model = transformers.AutoModelForSequenceClassification.from_config(
        config, dtype=torch.float32).eval()
    model.save_pretrained(tmp_path)
    testing.write_byte_tokenizer(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == [
        "Qwen3ForSequenceClassification"]
    llm = LLM(str(tmp_path), **SMALL)
    query, documents = "what is a fox", ["a fox is an animal", "paris", "x" * 40]
    scores = [o.outputs.score for o in llm.score(query, documents)]
    tokenizer = llm.get_tokenizer()
    want = []
    for document in documents:
        ids, _ = tokenizer.encode_for_pooling(query, document)
        with torch.no_grad():
            logit = model(torch.tensor([ids])).logits[0, 0].item()
        want.append(1 / (1 + np.exp(-logit)))
    np.testing.assert_allclose(scores, want, atol=1e-4)
    with pytest.raises(ValueError, match="generative model"):
        llm.generate("hi")


def test_prefix_hits_and_a_full_context_input_pool_alike(last_model):
    st, path = last_model
    llm = LLM(str(path), max_model_len=48, max_num_batched_tokens=16, max_num_seqs=4,
              dtype="float32", enable_prefix_caching=True)
    instruction = "Instruct: find the answer. Query: "  # 2 full pages of 16
    texts = [instruction + q for q in ("a", "bb", "hello")]
    first = np.array([o.outputs.embedding for o in llm.embed(texts)])
    again = np.array([o.outputs.embedding for o in llm.embed(texts)])
    engine = llm.llm_engine.backend.engine
    assert engine.scheduler.cache_stats["hit_tokens"] >= 3 * 32  # the instruction's pages
    np.testing.assert_allclose(again, first, atol=1e-5)
    want = st.encode(texts, convert_to_numpy=True)
    assert _cosines(again, want).min() >= 0.99999
    full = "z" * 48  # max_model_len tokens: one a character
    (out,) = llm.embed(full)
    assert len(out.prompt_token_ids) == 48
    assert _cosines(np.array(out.outputs.embedding), st.encode([full])[0]) >= 0.99999
    with pytest.raises(ValueError, match="more than max_model_len 48"):
        llm.embed(full + "z")
