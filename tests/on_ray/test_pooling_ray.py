"""A pooling processor applied to a Ray Dataset: the engine stage's actors embed, with
the local runner's rows and column types."""

from __future__ import annotations

import numpy as np
import pytest
import ray

from gristmill import EngineConfig
from gristmill.batch import ERROR_COLUMN, EngineProcessorConfig, build_processor
from tests.pooling_models import tiny_embedder

pytestmark = pytest.mark.timeout(180)


def test_an_embed_processor_on_a_dataset_gives_the_local_runners_embeddings():
    rows = [{"key": i, "prompt": f"row {i} says hello"} for i in range(6)]
    rows.append({"key": 6, "prompt": "bad", "sampling_params": {"max_tokens": 3}})
    config = EngineProcessorConfig(engine=EngineConfig(model=str(tiny_embedder()), device="cpu", quantization=None),
                                   task="embed", batch_size=4, should_continue_on_error=True, id_column="key")
    dataset = build_processor(config)(ray.data.from_items(rows))
    out = {row["key"]: row for row in dataset.take_all()}
    local = {row["key"]: row for row in build_processor(config)(rows)}
    assert sorted(out) == list(range(7))
    assert out[6][ERROR_COLUMN].startswith("RequestError: the row has sampling_params")
    assert len(out[6]["embeddings"]) == 0
    for key in range(6):
        assert out[key][ERROR_COLUMN] == "" and out[key]["num_input_tokens"] == local[key]["num_input_tokens"]
        assert np.allclose(np.asarray(out[key]["embeddings"]), local[key]["embeddings"], atol=1e-6)
    schema = dataset.schema()
    assert str(schema.types[schema.names.index("embeddings")]) in ("list<item: float>", "list<element: float>")


def test_ray_data_llms_http_processor_embeds_through_our_embeddings_endpoint():
    """ray.data.llm's own HttpRequestProcessorConfig pointed at our /v1/embeddings: each
    row's body is the OpenAI embeddings response, its vector the local runner's; a bad
    row's body is the error envelope."""
    from ray.data.llm import HttpRequestProcessorConfig
    from ray.data.llm import build_processor as build_llm_processor

    from tests.server.conftest import AppServer, ServerLoop, start_engine

    model = tiny_embedder()
    rows = [{"key": i, "text": f"row {i} says hello"} for i in range(4)] + [{"key": 4, "text": "word " * 400}]
    loop = ServerLoop()
    flags = ("--model", str(model), "--quantization", "none")
    engine = start_engine(*flags)
    server = AppServer(loop, engine, *flags, model=model.name)
    try:
        processor = build_llm_processor(
            HttpRequestProcessorConfig(url=f"{server.url}/v1/embeddings", batch_size=5),
            preprocess=lambda r: {"key": r["key"], "payload": {"model": model.name, "input": r["text"]}},
            postprocess=lambda r: {"key": r["key"], "response": r["http_response"]})
        out = {row["key"]: row["response"] for row in processor(ray.data.from_items(rows)).take_all()}
    finally:
        server.stop()
        engine.shutdown()
        loop.close()
    config = EngineProcessorConfig(engine=EngineConfig(model=str(model), device="cpu", quantization=None),
                                   task="embed")
    local = build_processor(config)([{"prompt": row["text"]} for row in rows[:4]])
    assert sorted(out) == list(range(5))
    for key in range(4):
        [item] = out[key]["data"]
        assert out[key]["object"] == "list" and item["object"] == "embedding"
        assert np.allclose(item["embedding"], local[key]["embeddings"], atol=1e-6)
        assert out[key]["usage"]["prompt_tokens"] == local[key]["num_input_tokens"]
    assert out[4]["error"]["type"] == "invalid_request_error"
