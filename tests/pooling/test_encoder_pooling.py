"""Encoder pooling models (BERT, XLM-RoBERTa) packed into dense steps, against
sentence-transformers and transformers on tiny random checkpoints: mean and cls pooling
over a packed batch of 64 mixed-length inputs, Matryoshka dimensions, every token's
vector, cross-encoder scores and classifier probabilities."""

from __future__ import annotations

import numpy as np
import pytest

from jaxinfer import LLM, testing
from jaxinfer.pooling import PoolingParams

ARCHITECTURES = ("bert", "xlm_roberta")
SMALL = dict(max_num_batched_tokens=256, dtype="float32")


def _texts(count: int, seed: int = 0, longest: int = 120) -> list[str]:
    rng = np.random.default_rng(seed)
    return [testing.encoder_text(rng.integers(4, 300, n))
            for n in rng.integers(1, longest, count)]


def _cosines(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def _save_st(path, architecture: str, mode: str, **overrides):
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules

    testing.make_encoder_model(path / "bare", architecture, **overrides)
    transformer = modules.Transformer(str(path / "bare"))
    st = SentenceTransformer(modules=[
        transformer, modules.Pooling(transformer.get_embedding_dimension(), mode),
        modules.Normalize()])
    st.save(str(path / "st"))
    return st, path / "st"


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_mean_pooling_of_64_packed_inputs_matches_sentence_transformers(tmp_path,
                                                                        architecture):
    st, path = _save_st(tmp_path, architecture, "mean", is_matryoshka=True)
    texts = _texts(64)
    llm = LLM(str(path), **SMALL)
    engine = llm.llm_engine
    assert engine.is_encoder and engine.pooler.pooling_type == "mean"
    got = np.array([o.outputs.embedding for o in llm.embed(texts)])
    want = st.encode(texts, convert_to_numpy=True)
    assert _cosines(got, want).min() >= 0.99999
    # 64 inputs in few steps: rows shared, little padding
    assert engine.backend.real_tokens / engine.backend.padded_tokens > 0.7
    alone = np.array(llm.embed(texts[5])[0].outputs.embedding)
    assert _cosines(alone, got[5]) >= 0.99999  # its row's neighbours change nothing
    cut = np.array([o.outputs.embedding for o in llm.embed(texts[:4],
                                                            PoolingParams(dimensions=16))])
    want_cut = st.encode(texts[:4], convert_to_numpy=True, truncate_dim=16)
    assert cut.shape == (4, 16) and _cosines(cut, want_cut).min() >= 0.99999
    np.testing.assert_allclose(np.linalg.norm(cut, axis=-1), 1.0, rtol=1e-5)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_cls_pooling_and_every_token_match_transformers(tmp_path, architecture):
    import torch

    model = testing.make_encoder_model(tmp_path, architecture)
    texts = _texts(9, seed=1)
    llm = LLM(str(tmp_path), **SMALL)  # no sentence-transformers files: cls, normalized
    assert llm.llm_engine.pooler.pooling_type == "cls"
    tokenizer = llm.get_tokenizer()
    got = llm.embed(texts)
    for text, output in zip(texts, got, strict=True):
        ids, types = tokenizer.encode_for_pooling(text)
        assert output.prompt_token_ids == ids
        with torch.no_grad():
            hidden = model(torch.tensor([ids]), token_type_ids=torch.tensor([types]))
        want = hidden.last_hidden_state[0, 0].numpy()
        assert _cosines(output.outputs.embedding, want) >= 0.99999
    with pytest.raises(ValueError, match="dimensions"):
        llm.embed(texts[0], PoolingParams(dimensions=8))


def test_every_token_pooling_of_packed_inputs(tmp_path):
    import json

    import torch

    st, path = _save_st(tmp_path, "bert", "mean")
    (path / "modules.json").write_text(json.dumps(
        [m for m in json.loads((path / "modules.json").read_text())
         if not m["type"].endswith(("Pooling", "Normalize"))]))
    texts = _texts(7, seed=2)
    llm = LLM(str(path), runner="pooling", **SMALL)
    model = testing.make_encoder_model(tmp_path / "again", "bert")  # the same seed
    engine = llm.llm_engine
    engine.pooler = type(engine.pooler)(pooling_type="all", normalize=False)
    engine.backend.pooling_type = "all"
    engine.backend.runner = type(engine.backend.runner)(
        engine.backend.cfg, engine.backend.runner.params, engine.backend.ladder,
        all_tokens=True)
    for output in llm.embed(texts):
        ids = output.prompt_token_ids
        with torch.no_grad():
            want = model(torch.tensor([ids])).last_hidden_state[0].numpy()
        got = np.array(output.outputs.embedding).reshape(len(ids), -1)
        assert _cosines(got, want).min() >= 0.99999


@pytest.mark.parametrize("architecture,labels", [("bert", 1), ("xlm_roberta", 3)])
def test_cross_encoder_matches_transformers_classifier(tmp_path, architecture, labels):
    import torch

    model = testing.make_encoder_model(tmp_path, architecture, num_labels=labels)
    llm = LLM(str(tmp_path), **SMALL)
    query, documents = _texts(1, seed=3, longest=60)[0], _texts(6, seed=4, longest=40)
    tokenizer = llm.get_tokenizer()
    logits = []
    for document in documents:
        ids, types = tokenizer.encode_for_pooling(query, document)
        with torch.no_grad():
            kwargs = {"token_type_ids": torch.tensor([types])} if architecture == "bert" else {}
            logits.append(model(torch.tensor([ids]), **kwargs).logits[0].numpy())
    logits = np.array(logits, np.float64)
    if labels == 1:
        scores = [o.outputs.score for o in llm.score(query, documents)]
        np.testing.assert_allclose(scores, 1 / (1 + np.exp(-logits[:, 0])), atol=1e-4)
    else:
        probs = np.array([o.outputs.probs for o in llm.classify(documents)])
        assert probs.shape == (6, 3)
        want = []
        for document in documents:
            ids, types = tokenizer.encode_for_pooling(document)
            with torch.no_grad():
                want.append(model(torch.tensor([ids])).logits[0].softmax(-1).numpy())
        np.testing.assert_allclose(probs, want, atol=1e-4)


def test_bad_inputs_name_the_problem(tmp_path):
    testing.make_encoder_model(tmp_path, "bert")
    llm = LLM(str(tmp_path), **SMALL)
    with pytest.raises(ValueError, match="prompt 1: token id 999 is out of range"):
        llm.embed([[5, 6], [999]])
    with pytest.raises(ValueError, match="more than max_model_len 128"):
        llm.embed(testing.encoder_text([5] * 200))
    cut = llm.embed(testing.encoder_text([5] * 200), truncate_prompt_tokens=-1)
    assert len(cut[0].prompt_token_ids) == 128 and cut[0].prompt_token_ids[-1] == 3  # [SEP]
    with pytest.raises(ValueError, match="generative model"):
        llm.generate("w5")
    with pytest.raises(ValueError, match="no classification head"):
        llm.classify("w5")


def test_plan_of_an_encoder_has_no_kv_cache(tmp_path):
    import json
    import subprocess
    import sys

    model = testing.make_encoder_model(tmp_path, "bert")
    result = subprocess.run([sys.executable, "-m", "jaxinfer", "plan", f"--model={tmp_path}",
                             "--memory_gb=1", "--format=json"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["kind"] == "encoder" and plan["kv_cache_bytes"] == 0 and plan["fits"]
    assert plan["largest_step"]["tokens"] == 512 and plan["max_model_len"] == 128
    pooler = sum(p.numel() for p in model.pooler.parameters())  # read by no head here
    assert plan["weight_bytes"] == 4 * (sum(p.numel() for p in model.parameters()) - pooler)


def test_what_a_pooling_model_refuses(tmp_path):
    testing.make_encoder_model(tmp_path, "bert")
    llm = LLM(str(tmp_path), **SMALL)
    for call in (lambda: llm.sleep(), lambda: llm.update_weights({}),
                 lambda: llm.chat([{"role": "user", "content": "hi"}])):
        with pytest.raises(ValueError, match="needs a generative model"):
            call()
    assert llm.metrics()["pooled_inputs"] == 0
    llm.embed(["w5 w6", "w7"])
    metrics = llm.metrics()
    assert metrics["pooled_inputs"] == 2 and metrics["input_tokens"] == 2 + 2 + 1 + 2
    with pytest.raises(ValueError, match="quantization='w8a8'"):
        LLM(str(tmp_path), quantization="w8a8", **SMALL)


def test_many_short_inputs_beside_a_long_one_pack_within_the_buckets():
    from jaxinfer.pooling import packing

    ladder = packing.buckets(512, 512)
    inputs = [([1] * 200, [0] * 200)] + [([1] * 4, [0] * 4)] * 100
    batches = packing.pack(inputs, ladder)
    assert sorted(i for b in batches for i in b.indices) == list(range(101))
    assert all(len(b.indices) <= b.bucket.max_inputs for b in batches)
