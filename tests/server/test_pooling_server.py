"""A pooling model served (docs/pooling.md#serving): a real `serve` of a tiny embedding
model and of a tiny cross-encoder on 127.0.0.1, against LLM.embed / LLM.score /
LLM.classify on the same checkpoints: OpenAI's client for /v1/embeddings (float and
base64), plain HTTP for /score, /rerank and /classify, a 400 naming the field for each
bad input, the generation routes refused, concurrent requests; and the PoolingLoop
alone: what is queued pools as one batch, a failing request fails alone."""

from __future__ import annotations

import asyncio
import base64
import json
import threading

import numpy as np
import pytest
from pooling_models import SETTINGS, cross_encoder, embedding_model
from serving import metric_values, start_server

from jaxinfer import LLM, server
from jaxinfer.batch import in_process
from jaxinfer.config import DEFAULT_MODEL, ServerConfig
from jaxinfer.pooling import PoolingParams
from jaxinfer.server.app import create_app
from jaxinfer.server.engine_loop import EngineLoop
from jaxinfer.server.pooling_loop import PoolingLoop
from jaxinfer.server.protocol import APIError

TEXTS = ["hello world", "a", "the quick brown fox jumps over the lazy dog", "embeddings",
         "x y z " * 6]
QUERY, DOCUMENTS = "what is a fox?", ["a small wild dog", "Paris", "foxes hunt at night",
                                      "tea", "a fox is an animal"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return (embedding_model(tmp_path_factory.mktemp("embed")),
            cross_encoder(tmp_path_factory.mktemp("cross")))


@pytest.fixture(scope="module")
def embed_server(models):
    s = start_server(f"--model={models[0]}", **SETTINGS)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def cross_server(models):
    s = start_server(f"--model={models[1]}", **SETTINGS)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def embed_llm(models):
    return LLM(str(models[0]), **SETTINGS)


@pytest.fixture(scope="module")
def cross_llm(models):
    return LLM(str(models[1]), **SETTINGS)


@pytest.fixture
def client(embed_server):
    import openai

    with openai.OpenAI(base_url=embed_server.url, api_key="unused", max_retries=0,
                       timeout=120) as c:
        yield c


def _vectors(llm, prompts, **kwargs) -> np.ndarray:
    return np.array([o.outputs.embedding for o in llm.embed(prompts, **kwargs)])


# ---- /v1/embeddings ---------------------------------------------------------------------

def test_openai_client_float_and_base64_equal_llm_embed(client, embed_server, embed_llm):
    floats = client.embeddings.create(model=embed_server.model, input=TEXTS,
                                      encoding_format="float")
    default = client.embeddings.create(model=embed_server.model, input=TEXTS)  # base64
    got = np.array([d.embedding for d in floats.data], np.float32)
    # the second request's prompts are prefix-cache hits: computed in other chunks
    np.testing.assert_allclose(got, [d.embedding for d in default.data], atol=1e-6)
    np.testing.assert_allclose(got, _vectors(embed_llm, TEXTS), atol=1e-6)
    assert [d.index for d in floats.data] == list(range(len(TEXTS)))
    assert floats.model == embed_server.model and floats.object == "list"
    tokens = sum(len(o.prompt_token_ids) for o in embed_llm.embed(TEXTS))
    assert (floats.usage.prompt_tokens, floats.usage.total_tokens) == (tokens, tokens)


def test_base64_is_little_endian_float32(embed_server, embed_llm):
    body = embed_server.post("/v1/embeddings", json={
        "input": "hello", "encoding_format": "base64", "user": "someone"}).json()
    raw = base64.b64decode(body["data"][0]["embedding"])
    np.testing.assert_allclose(np.frombuffer(raw, "<f4"), _vectors(embed_llm, "hello")[0],
                               atol=1e-6)


def test_token_ids_prompts_and_truncation(client, embed_server, embed_llm):
    ids = [list(t.encode()) for t in TEXTS[:3]]
    lists = client.embeddings.create(model=embed_server.model, input=ids,
                                     encoding_format="float")
    one = client.embeddings.create(model=embed_server.model, input=ids[2],
                                   encoding_format="float")
    want = _vectors(embed_llm, ids)
    np.testing.assert_allclose([d.embedding for d in lists.data], want, atol=1e-6)
    np.testing.assert_allclose(one.data[0].embedding, want[2], atol=1e-6)
    query = embed_server.post("/v1/embeddings", json={
        "input": TEXTS, "prompt_name": "query", "truncate_prompt_tokens": 5,
        "normalize": False}).json()
    np.testing.assert_allclose([d["embedding"] for d in query["data"]], _vectors(
        embed_llm, TEXTS, prompt_name="query", truncate_prompt_tokens=5,
        pooling_params=PoolingParams(normalize=False)), atol=1e-6)
    assert query["usage"]["prompt_tokens"] == 5 * len(TEXTS)


# ---- /score and /rerank ------------------------------------------------------------------

@pytest.mark.parametrize("path", ["/score", "/v1/score"])
def test_score_equals_llm_score(embed_server, embed_llm, path):
    body = embed_server.post(path, json={"text_1": QUERY, "text_2": DOCUMENTS}).json()
    want = [o.outputs.score for o in embed_llm.score(QUERY, DOCUMENTS)]
    assert body["object"] == "list" and body["model"] == embed_server.model
    assert [d["index"] for d in body["data"]] == list(range(len(DOCUMENTS)))
    assert {d["object"] for d in body["data"]} == {"score"}
    np.testing.assert_allclose([d["score"] for d in body["data"]], want, atol=1e-6)
    pairwise = embed_server.post(path, json={"text_1": DOCUMENTS[:2],
                                             "text_2": DOCUMENTS[2:4]}).json()
    want = [o.outputs.score for o in embed_llm.score(DOCUMENTS[:2], DOCUMENTS[2:4])]
    np.testing.assert_allclose([d["score"] for d in pairwise["data"]], want, atol=1e-6)


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank_orders_by_score(embed_server, embed_llm, path):
    want = [o.outputs.score for o in embed_llm.score(QUERY, DOCUMENTS)]
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -want[i])
    body = embed_server.post(path, json={"query": QUERY, "documents": DOCUMENTS}).json()
    assert [r["index"] for r in body["results"]] == order
    for result in body["results"]:
        assert result["document"] == {"text": DOCUMENTS[result["index"]]}
        assert result["relevance_score"] == pytest.approx(want[result["index"]], abs=1e-6)
    assert body["model"] == embed_server.model and body["usage"]["total_tokens"] > 0
    top = embed_server.post(path, json={"query": QUERY, "documents": DOCUMENTS, "top_n": 2,
                                        "return_documents": False}).json()
    assert [r["index"] for r in top["results"]] == order[:2]
    assert all("document" not in r for r in top["results"])


def test_cross_encoder_scores_reranks_and_classifies(cross_server, cross_llm):
    want = [o.outputs.score for o in cross_llm.score(QUERY, DOCUMENTS)]
    body = cross_server.post("/v1/score", json={"text_1": QUERY, "text_2": DOCUMENTS}).json()
    np.testing.assert_allclose([d["score"] for d in body["data"]], want, atol=1e-6)
    ranked = cross_server.post("/rerank", json={"query": QUERY, "documents": DOCUMENTS,
                                                "top_n": 3}).json()["results"]
    assert [r["index"] for r in ranked] == sorted(range(5), key=lambda i: -want[i])[:3]
    classified = cross_server.post("/classify", json={"input": TEXTS[:2]}).json()
    probs = [o.outputs.probs for o in cross_llm.classify(TEXTS[:2])]
    assert [d["label"] for d in classified["data"]] == ["LABEL_0", "LABEL_0"]
    assert [d["num_classes"] for d in classified["data"]] == [1, 1]
    np.testing.assert_allclose([d["probs"] for d in classified["data"]], probs, atol=1e-6)


# ---- errors --------------------------------------------------------------------------------

BAD = [
    ("/v1/embeddings", {"input": []}, "input"),
    ("/v1/embeddings", {"input": ""}, "input"),
    ("/v1/embeddings", {"input": ["fine", ""]}, "input.1"),
    ("/v1/embeddings", {"input": [[1, 2], [3, 99999]]}, "input.1"),
    ("/v1/embeddings", {"input": [5, -1]}, "input"),
    ("/v1/embeddings", {"input": "x" * 200}, "input"),  # over max_model_len 128
    ("/v1/embeddings", {"input": "hi", "dimensions": 16}, "dimensions"),  # no Matryoshka
    ("/v1/embeddings", {"input": 5}, "input"),
    ("/v1/embeddings", {"input": ["a", 1]}, "input"),
    ("/v1/embeddings", {"input": "hi", "encoding_format": "hex"}, "encoding_format"),
    ("/v1/embeddings", {"input": "hi", "prompt_name": "nope"}, "prompt_name"),
    ("/v1/embeddings", {"input": "hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ("/v1/embeddings", {"input": "hi", "normalize": "yes"}, "normalize"),
    ("/v1/embeddings", {"input": "hi", "bogus": 1}, "bogus"),
    ("/rerank", {"query": "q", "documents": []}, "documents"),
    ("/rerank", {"query": "q", "documents": ["a"], "top_n": 0}, "top_n"),
    ("/rerank", {"query": "", "documents": ["a"]}, "query"),
    ("/rerank", {"query": "q", "documents": "a"}, "documents"),
    ("/rerank", {"query": "q", "documents": ["a", "y" * 200]}, "documents.1"),
    ("/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_2"),
    ("/score", {"text_1": "a", "text_2": 3}, "text_2"),
    ("/score", {"text_2": "a"}, "text_1"),
    ("/classify", {"input": "a"}, "model"),  # an embedding model has no classifier
]


@pytest.mark.parametrize(("path", "body", "field"), BAD, ids=[f"{p}-{f}" for p, _, f in BAD])
def test_a_bad_request_is_a_400_naming_the_field(embed_server, path, body, field):
    response = embed_server.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and field in error["message"], error


def test_bad_requests_leave_the_server_serving(embed_server):
    for path, body, _ in BAD[:4]:
        embed_server.post(path, json=body)
    assert embed_server.get("/health").json() == {"status": "ok"}
    assert embed_server.post("/v1/embeddings", json={"input": "ok"}).status_code == 200


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_generation_routes_on_a_pooling_model_are_refused(embed_server, path):
    response = embed_server.post(path, json={"prompt": "x", "messages": []})
    assert response.status_code == 400
    error = response.json()["error"]
    assert "pooling model" in error["message"] and "/v1/embeddings" in error["message"]
    assert "/rerank" in error["message"]


def test_pooling_routes_on_a_generating_model_are_refused():
    llm = LLM(DEFAULT_MODEL, max_num_seqs=4, max_num_batched_tokens=32, warm_up=False)
    loop = EngineLoop(llm.engine, max_waiting_requests=8)
    app = create_app(server.make_state(llm, ServerConfig(), loop, "demo"))
    for path, body in [("/v1/embeddings", {"input": "x"}), ("/rerank", {"query": "q",
                                                                       "documents": ["a"]})]:
        status, raw = asyncio.run(in_process.post(app, path, json.dumps(body).encode()))
        error = json.loads(raw)["error"]
        assert status == 400 and "needs a pooling model" in error["message"], error
        assert "generates text" in error["message"]


def test_models_health_version_and_metrics(embed_server):
    models = embed_server.get("/v1/models").json()["data"]
    assert [m["id"] for m in models] == [embed_server.model]
    assert models[0]["max_model_len"] == 128
    assert embed_server.get("/version").status_code == 200
    assert embed_server.get("/health").json() == {"status": "ok"}
    paths = embed_server.get("/openapi.json").json()["paths"]
    assert "requestBody" in paths["/v1/embeddings"]["post"]
    assert "requestBody" in paths["/v2/rerank"]["post"]
    before = metric_values(embed_server)
    embed_server.post("/v1/embeddings", json={"input": ["abc", "de"]})
    after = metric_values(embed_server)
    assert after["jaxinfer:pooling_requests_total"] == (
        before["jaxinfer:pooling_requests_total"] + 1)
    assert after["jaxinfer:pooling_inputs_total"] == before["jaxinfer:pooling_inputs_total"] + 2
    assert after["jaxinfer:prompt_tokens_total"] == before["jaxinfer:prompt_tokens_total"] + 5
    assert after["jaxinfer:num_requests_waiting"] == 0


def test_concurrent_requests_are_all_answered_right(embed_server, embed_llm):
    texts = [f"request {i}: " + "abc " * (i % 7) for i in range(48)]
    want = _vectors(embed_llm, texts)
    got: dict[int, list] = {}
    errors = []

    def send(thread: int) -> None:
        try:
            for k in range(thread * 4, thread * 4 + 4, 2):
                body = embed_server.post("/v1/embeddings", json={"input": texts[k:k + 2]})
                got[k], got[k + 1] = (d["embedding"] for d in body.json()["data"])
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=send, args=(t,)) for t in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    np.testing.assert_allclose([got[i] for i in range(len(texts))], want, atol=1e-6)


# ---- the loop alone ---------------------------------------------------------------------------

class _Engine:
    """pool(): each input's id sum; the first call waits for `gate`; [666] fails."""

    def __init__(self) -> None:
        self.calls: list[int] = []
        self.gate = threading.Event()

    def pool(self, inputs):
        self.calls.append(len(inputs))
        if len(self.calls) == 1:
            self.gate.wait(10)
        if any(ids == [666] for ids, _ in inputs):
            raise RuntimeError("a bad input")
        return [sum(ids) for ids, _ in inputs]


def test_the_loop_pools_what_is_queued_together_and_fails_one_request_alone():
    engine = _Engine()
    loop = PoolingLoop(engine, max_waiting_requests=100)
    loop.start()

    async def run():
        first = asyncio.create_task(loop.pool([([1], [0])]))
        while not engine.calls:
            await asyncio.sleep(0.01)
        rest = [asyncio.create_task(loop.pool([([i], [0]), ([i, 1], [0])]))
                for i in range(2, 6)]
        bad = asyncio.create_task(loop.pool([([666], [0])]))
        await asyncio.sleep(0.2)  # all queued behind the first batch
        engine.gate.set()
        return await first, await asyncio.gather(*rest), await asyncio.gather(
            bad, return_exceptions=True)

    try:
        first, rest, (bad,) = asyncio.run(run())
    finally:
        loop.stop()
    assert first == [1] and rest == [[i, i + 1] for i in range(2, 6)]
    assert isinstance(bad, APIError) and bad.status == 500 and "a bad input" in bad.message
    assert engine.calls == [1, 9, 2, 2, 2, 2, 1]  # one batch of all queued, then each alone
    assert loop.snapshot() == {"requests": 5, "failed_requests": 1, "inputs": 9,
                              "prompt_tokens": 13, "batches": 5, "waiting": 0,
                              "running": 0}
