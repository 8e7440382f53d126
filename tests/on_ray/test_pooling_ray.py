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
