"""Batch rows naming LoRA adapters (`lora` or `model` column) on a tiny random-weight Llama
with adapters made by `peft`: a processor of its own engine, a shared deployment and an
OpenAI-compatible server each give a row what `LLM(enable_lora=True).generate(...,
lora_request=...)` gives for its adapter (the base for its name, an empty value, or no
column); a row naming an adapter not given, or one that fails to load, is that row's
error and the other rows go on."""

from __future__ import annotations

import pytest

pytest.importorskip("peft")

from gristmill import LLM, EngineConfig, LoRARequest, SamplingParams  # noqa: E402
from gristmill.batch import (DeploymentProcessorConfig, EngineProcessorConfig, HttpProcessorConfig,  # noqa: E402
                             build_processor, deploy)
from gristmill.batch import runtime  # noqa: E402
from tests.lora_models import broken_adapter, make_adapter, tiny_base  # noqa: E402

GREEDY = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
PROMPTS = ["the quick brown fox", "a river runs through it"]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """(base, {name: adapter directory}): two adapters and one whose config reads well and
    whose weights are not safetensors (it fails when the engine loads it)."""
    base = tiny_base("llama")
    alpha, beta = make_adapter(base, "alpha", seed=1), make_adapter(base, "beta", seed=2)
    broken = broken_adapter(alpha, tmp_path_factory.mktemp("broken-adapter"))
    return base, {"alpha": str(alpha), "beta": str(beta), "broken": str(broken)}


@pytest.fixture(scope="module")
def expected(adapters) -> dict:
    """{(prompt, adapter name or None): token ids} as LLM gives them."""
    base, paths = adapters
    llm = LLM(str(base), device="cpu", quantization=None, enable_lora=True, max_loras=2, max_model_len=64,
              num_kv_blocks=64, block_size=4)
    loras = [None, LoRARequest("alpha", 1, paths["alpha"]), LoRARequest("beta", 2, paths["beta"])]
    cases = [(prompt, lora) for prompt in PROMPTS for lora in loras]
    outputs = llm.generate([p for p, _ in cases], SamplingParams(**GREEDY), use_tqdm=False,
                           lora_request=[lora for _, lora in cases])
    llm.client.shutdown()
    tokens = {(p, lora.lora_name if lora else None): o.outputs[0].token_ids for (p, lora), o in zip(cases, outputs)}
    assert len({tuple(t) for t in tokens.values()}) == len(tokens)  # (each adapter changes the answer)
    return tokens


def engine_config(base) -> EngineConfig:
    return EngineConfig(model=str(base), device="cpu", quantization=None, max_model_len=64, num_kv_blocks=64,
                        block_size=4)


def named_rows(base) -> list[tuple[dict, str | None]]:
    """(row, the adapter it runs with) for each way a row names its model, on each prompt."""
    names = [({"model": "alpha"}, "alpha"), ({"lora": "beta"}, "beta"), ({"model": str(base)}, None),
             ({"model": base.name}, None), ({"model": ""}, None), ({}, None),
             ({"model": str(base), "lora": "alpha"}, "alpha")]  # (`lora` wins)
    return [({"id": f"{i}-{j}", "prompt": prompt, **columns}, adapter)
            for i, prompt in enumerate(PROMPTS) for j, (columns, adapter) in enumerate(names)]


def check_rows(out: list[dict], cases, expected) -> None:
    assert [row["id"] for row in out] == [row["id"] for row, _ in cases]
    for row, (given, adapter) in zip(out, cases):
        assert row["__inference_error__"] == "", row
        assert row["generated_tokens"] == expected[given["prompt"], adapter], row
        assert {k: row.get(k) for k in ("model", "lora")} == {k: given.get(k) for k in ("model", "lora")}


def bad_rows() -> list[dict]:
    return [{"id": "gamma", "prompt": PROMPTS[0], "model": "gamma"},
            {"id": "broken", "prompt": PROMPTS[0], "lora": "broken"},
            {"id": "number", "prompt": PROMPTS[0], "model": 7}]


def check_bad_rows(out: list[dict]) -> None:
    errors = {row["id"]: row["__inference_error__"] for row in out}
    assert errors["gamma"].startswith("RequestError: the row names the model 'gamma', which is neither the base")
    assert "'alpha', 'beta', 'broken'" in errors["gamma"] and "--lora-modules gamma=PATH" in errors["gamma"]
    assert errors["broken"].startswith("LoRAAdapterError: LoRA adapter 'broken'"), errors["broken"]
    assert errors["number"].startswith("RequestError: 'model' names the row's model")


def test_rows_of_several_adapters_and_the_base_get_what_llm_gives_each(adapters, expected):
    base, paths = adapters
    cases = named_rows(base)
    bad = bad_rows()
    rows = [row for row, _ in cases]
    mixed = rows[:5] + bad + rows[5:]  # the bad rows among the others, in the same batches
    processor = build_processor(EngineProcessorConfig(engine=engine_config(base), lora_modules=paths,
                                                      sampling_params=GREEDY, should_continue_on_error=True,
                                                      batch_size=8))
    assert processor.config.engine.enable_lora and processor.config.engine.max_loras == 3
    out = processor(mixed)
    check_rows([row for row in out if row["id"] not in {r["id"] for r in bad}], cases, expected)
    check_bad_rows(out)


def test_a_shared_deployment_runs_the_rows_of_several_adapters_together(adapters, expected):
    """Two processors in turn on one deployment, rows of both adapters in the same
    batches: each adapter is loaded once, into a slot of its own, and stays there."""
    base, paths = adapters
    cases = named_rows(base)
    with deploy(engine_config(base), name="lora-shared", lora_modules=paths) as deployment:
        config = DeploymentProcessorConfig(deployment_name="lora-shared", sampling_params=GREEDY,
                                           should_continue_on_error=True)
        first = build_processor(config)([row for row, _ in cases[:7]])
        second = build_processor(config)([row for row, _ in cases[7:]] + bad_rows())
        stats = runtime.call(deployment.pool.replicas[0].engine.stats())
    check_rows(first + second[:-3], cases, expected)
    check_bad_rows(second[-3:])
    # (the broken adapter's failed load takes no slot and leaves the others in theirs)
    assert sorted(stats["lora_adapters"]) == ["alpha", "beta"] and stats["num_lora_loads"] == 2, stats


def test_rows_sent_to_a_server_name_its_adapters_in_model(adapters, expected):
    """HttpProcessorConfig: a row's adapter goes as the request's `model`, which the
    server maps; a name it does not serve (a 404) is that row's error, not the job's."""
    from tests.server.conftest import AppServer, ServerLoop, start_engine

    base, paths = adapters
    cases = [(row, adapter) for row, adapter in named_rows(base) if row.get("model") != base.name]
    loop = ServerLoop()
    engine = start_engine("--model", str(base), "--enable-lora", "--quantization", "none", "--max-model-len", "64",
                          "--num-kv-blocks", "64", "--block-size", "4", "--max-loras", "2")
    server = AppServer(loop, engine, "--lora-modules", f"alpha={paths['alpha']}", f"beta={paths['beta']}",
                       model=str(base))
    try:
        processor = build_processor(HttpProcessorConfig(url=f"{server.url}/v1", sampling_params=GREEDY,
                                                        should_continue_on_error=True, method="completions"))
        out = processor([row for row, _ in cases] + [{"id": "gamma", "prompt": PROMPTS[0], "model": "gamma"}])
    finally:
        server.stop()
        engine.shutdown()
        loop.close()
    check_rows(out[:-1], cases, expected)
    assert out[-1]["__inference_error__"].startswith("RequestError: HTTP 404"), out[-1]
    assert "'gamma'" in out[-1]["__inference_error__"]
