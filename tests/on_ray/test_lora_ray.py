"""Rows naming LoRA adapters on Ray: a Ray Data processor whose engine actor runs the
adapters given (`EngineProcessorConfig(lora_modules=...)`), and a Ray Serve deployment
made with `deploy(..., lora_modules=...)` that maps each row's adapter name as the
server does; each row gets what `LLM(enable_lora=True)` gives for its adapter, and a row
naming an adapter not given is that row's error."""

from __future__ import annotations

import pytest
import ray
from ray import serve

pytest.importorskip("peft")

from gristmill import LLM, EngineConfig, LoRARequest, SamplingParams  # noqa: E402
from gristmill.batch import (ERROR_COLUMN, DeploymentProcessorConfig, EngineProcessorConfig,  # noqa: E402
                             build_processor)
from gristmill.ray import deploy  # noqa: E402
from tests.lora_models import make_adapter, tiny_base  # noqa: E402
from tests.on_ray.conftest import GREEDY, by_key  # noqa: E402

pytestmark = pytest.mark.timeout(300)

PROMPT = "the quick brown fox"


def test_rows_name_adapters_on_ray_data_and_on_a_serve_deployment():
    base = tiny_base("llama")
    paths = {"alpha": str(make_adapter(base, "alpha", seed=1)), "beta": str(make_adapter(base, "beta", seed=2))}
    llm = LLM(str(base), device="cpu", quantization=None, enable_lora=True, max_loras=2, max_model_len=64)
    loras = {None: None, "alpha": LoRARequest("alpha", 1, paths["alpha"]), "beta": LoRARequest("beta", 2, paths["beta"])}
    outputs = llm.generate([PROMPT] * 3, SamplingParams(**GREEDY), use_tqdm=False, lora_request=list(loras.values()))
    expected = {name: out.outputs[0].token_ids for name, out in zip(loras, outputs)}
    llm.client.shutdown()
    ways = [({"model": "alpha"}, "alpha"), ({"lora": "beta"}, "beta"), ({"model": str(base)}, None),
            ({"model": None}, None), ({"model": "gamma"}, "gamma")]
    rows = [{"key": i, "prompt": PROMPT, "sampling_params": dict(GREEDY), "lora": None, "model": None, **columns}
            for i, (columns, _) in enumerate(ways)]
    engine = EngineConfig(model=str(base), device="cpu", quantization=None, max_model_len=64)

    def check(out: dict) -> None:
        assert sorted(out) == list(range(len(ways)))  # every row, exactly once
        for key, (_, adapter) in enumerate(ways[:-1]):
            assert out[key][ERROR_COLUMN] == "" and list(out[key]["generated_tokens"]) == expected[adapter], out[key]
        assert "'gamma'" in out[len(ways) - 1][ERROR_COLUMN] and out[len(ways) - 1]["model"] == "gamma"

    processor = build_processor(EngineProcessorConfig(engine=engine, lora_modules=paths, batch_size=8,
                                                      should_continue_on_error=True, id_column="key"))
    check(by_key(processor(ray.data.from_items(rows)).take_all()))

    deploy(engine, name="lora", app_name="lora-app", lora_modules=paths)
    try:
        processor = build_processor(DeploymentProcessorConfig(deployment_name="lora", app_name="lora-app",
                                                              method="completions", should_continue_on_error=True,
                                                              id_column="key"))
        check(by_key(processor(ray.data.from_items(rows)).take_all()))
    finally:
        serve.delete("lora-app")
