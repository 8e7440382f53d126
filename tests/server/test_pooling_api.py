"""The pooling endpoints of `gristmill serve` over real engines on tiny random-weight
models: /v1/embeddings through the real `openai` client (float and base64), /v1/rerank
and /v2/rerank, /v1/score and /v1/classify through httpx; what a server of another task
answers; the bounds."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest

from tests.pooling_models import LABELS, tiny_classifier, tiny_embedder
from tests.server.conftest import AppServer, start_engine

openai = pytest.importorskip("openai")

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Hello there", "Vectors of numbers stand for text."]


def _start(server_loop, model, *flags):
    flags = ("--model", str(model), "--quantization", "none", *flags)
    engine = start_engine(*flags)
    return engine, AppServer(server_loop, engine, *flags, model=model.name)


@pytest.fixture(scope="module")
def embed_server(server_loop):
    engine, srv = _start(server_loop, tiny_embedder(), "--max-inputs", "4")
    yield srv
    srv.stop()
    engine.shutdown()


@pytest.fixture(scope="module")
def cross_server(server_loop):
    engine, srv = _start(server_loop, tiny_classifier(1))
    yield srv
    srv.stop()
    engine.shutdown()


@pytest.fixture(scope="module")
def classify_server(server_loop):
    engine, srv = _start(server_loop, tiny_classifier(3))
    yield srv
    srv.stop()
    engine.shutdown()


def _reference(texts):
    from sentence_transformers import SentenceTransformer
    return SentenceTransformer(str(tiny_embedder()), device="cpu").encode(texts, convert_to_numpy=True)


def test_the_openai_client_embeds_as_floats_and_as_base64(embed_server):
    client = openai.OpenAI(base_url=f"{embed_server.url}/v1", api_key="none")
    want = _reference(TEXTS)
    name = tiny_embedder().name
    as_floats = client.embeddings.create(model=name, input=TEXTS, encoding_format="float")
    assert [d.index for d in as_floats.data] == [0, 1, 2] and as_floats.model == name
    # (without encoding_format, the openai client asks for base64 and decodes it itself)
    as_base64 = client.embeddings.create(model=name, input=TEXTS)
    for floats, decoded, reference in zip(as_floats.data, as_base64.data, want):
        assert len(floats.embedding) == 32
        assert np.allclose(floats.embedding, reference, atol=1e-5)
        # (the same texts in another step's batch: equal to float32 rounding, not bit for bit)
        assert np.allclose(floats.embedding, decoded.embedding, atol=1e-6)
    tokenizer = embed_server.engine.tokenizer
    tokens = sum(len(tokenizer(t)["input_ids"]) for t in TEXTS)
    assert as_floats.usage.prompt_tokens == as_floats.usage.total_tokens == tokens
    one = client.embeddings.create(model=name, input=TEXTS[0], encoding_format="float")
    assert len(one.data) == 1 and np.allclose(one.data[0].embedding, want[0], atol=1e-5)


def test_embeddings_of_token_ids_and_raw_base64_bytes(embed_server):
    ids = embed_server.engine.tokenizer(TEXTS[0])["input_ids"]
    r = httpx.post(f"{embed_server.url}/v1/embeddings",
                   json={"input": [ids, ids[:4]], "encoding_format": "base64"}, timeout=60)
    assert r.status_code == 200, r.text
    first = np.frombuffer(base64.b64decode(r.json()["data"][0]["embedding"]), dtype="<f4")
    assert np.allclose(first, _reference([TEXTS[0]])[0], atol=1e-5)
    assert r.json()["usage"]["prompt_tokens"] == len(ids) + 4


@pytest.mark.parametrize("body,param,says", [
    ({"input": TEXTS[0], "dimensions": 8}, "dimensions", "Matryoshka"),
    ({"input": ["a"] * 5}, "input", "at most 4"),
    ({"input": []}, "input", "input is empty"),
    ({"input": "word " * 400}, "prompt", "truncate_prompt_tokens"),
    ({"input": TEXTS[0], "use_activation": False}, "use_activation", "does not apply to /v1/embeddings"),
    ({"input": [True]}, "input", "expected a text"),
])
def test_bad_embedding_requests_are_400s_naming_the_field(embed_server, body, param, says):
    r = httpx.post(f"{embed_server.url}/v1/embeddings", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and says in error["message"] and error["type"] == "invalid_request_error"


def test_truncation_lets_a_long_input_through(embed_server):
    r = httpx.post(f"{embed_server.url}/v1/embeddings", json={"input": "word " * 400, "truncate_prompt_tokens": -1},
                   timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 128


def test_a_server_answers_only_its_tasks_endpoints(embed_server, classify_server, server):
    chat = httpx.post(f"{embed_server.url}/v1/chat/completions",
                      json={"messages": [{"role": "user", "content": "hi"}]}, timeout=60)
    assert chat.status_code == 400 and "task 'embed'" in chat.json()["error"]["message"]
    classify = httpx.post(f"{embed_server.url}/v1/classify", json={"input": "hi"}, timeout=60)
    assert classify.status_code == 400 and "task 'embed'" in classify.json()["error"]["message"]
    embeddings = httpx.post(f"{classify_server.url}/v1/embeddings", json={"input": "hi"}, timeout=60)
    assert embeddings.status_code == 400 and "task 'classify'" in embeddings.json()["error"]["message"]
    generating = httpx.post(f"{server.url}/v1/embeddings", json={"input": "hi"}, timeout=60,
                            headers={"Authorization": "Bearer test-key"})
    assert generating.status_code == 400 and "task 'generate'" in generating.json()["error"]["message"]
    card = httpx.get(f"{embed_server.url}/v1/models", timeout=60).json()["data"][0]
    assert card["task"] == "embed"


@pytest.mark.parametrize("path", ["/v1/rerank", "/v2/rerank"])
def test_rerank_by_a_cross_encoder(cross_server, path):
    query, documents = "what do foxes do?", [TEXTS[0], {"text": TEXTS[1]}, TEXTS[2]]
    scores = httpx.post(f"{cross_server.url}/v1/score", json={"text_1": query, "text_2": TEXTS}, timeout=60)
    assert scores.status_code == 200, scores.text
    by_index = {d["index"]: d["score"] for d in scores.json()["data"]}
    r = httpx.post(f"{cross_server.url}{path}", json={"query": query, "documents": documents, "top_n": 2},
                   timeout=60)
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    best = sorted(by_index, key=lambda i: -by_index[i])[:2]
    assert [x["index"] for x in results] == best
    assert [x["relevance_score"] for x in results] == pytest.approx([by_index[i] for i in best], abs=1e-6)
    assert results[0]["document"] == {"text": TEXTS[best[0]]}
    bare = httpx.post(f"{cross_server.url}{path}", json={"query": query, "documents": TEXTS,
                                                         "return_documents": False}, timeout=60).json()
    assert len(bare["results"]) == 3 and "document" not in bare["results"][0]
    assert bare["usage"]["total_tokens"] > 0


def test_score_matches_the_offline_face(cross_server):
    from gristmill import LLM

    llm = LLM(str(tiny_classifier(1)), device="cpu", quantization=None)
    want = [o.outputs.score for o in llm.score("q", TEXTS)]
    r = httpx.post(f"{cross_server.url}/v1/score", json={"queries": "q", "documents": TEXTS}, timeout=60)
    assert [d["score"] for d in r.json()["data"]] == pytest.approx(want, abs=1e-6)
    bad = httpx.post(f"{cross_server.url}/v1/score", json={"text_1": ["a", "b"], "text_2": TEXTS}, timeout=60)
    assert bad.status_code == 400 and "text_1 has 2 texts" in bad.json()["error"]["message"]


def test_rerank_by_an_embedding_model_is_by_cosine(embed_server):
    vectors = _reference(["a fox", *TEXTS])
    r = httpx.post(f"{embed_server.url}/v1/rerank", json={"query": "a fox", "documents": TEXTS}, timeout=60)
    assert r.status_code == 200, r.text
    for result in r.json()["results"]:
        want = float(vectors[0] @ vectors[1 + result["index"]])
        assert result["relevance_score"] == pytest.approx(want, abs=1e-5)


def test_classify_names_the_labels(classify_server):
    r = httpx.post(f"{classify_server.url}/v1/classify", json={"input": TEXTS}, timeout=60)
    assert r.status_code == 200, r.text
    for item in r.json()["data"]:
        assert item["num_classes"] == 3 and abs(sum(item["probs"]) - 1) < 1e-5
        assert item["label"] == LABELS[int(np.argmax(item["probs"]))]
