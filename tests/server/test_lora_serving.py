"""LoRA adapters served by name (`gristmill serve --lora-modules name=path`), through the
real `openai` client on a tiny random-weight Llama with adapters made by `peft`: a request
whose `model` names an adapter runs with it (the same tokens as `LLM` with that
LoRARequest), the base's requests are unchanged, `/v1/models` lists each adapter with its
parent, adapters load and unload over HTTP only when allowed, and a bad adapter fails only
the requests that name it (at start: the start stops, naming it)."""

from __future__ import annotations

import subprocess
import sys

import httpx
import openai
import pytest

pytest.importorskip("peft")

from gristmill import LLM, LoRARequest, SamplingParams  # noqa: E402
from tests.lora_models import broken_adapter, make_adapter, tiny_base  # noqa: E402
from tests.server.conftest import AppServer, start_engine  # noqa: E402

BASE = "tiny-llama"
PROMPT = "the quick brown fox"
FLAGS = ("--quantization", "none", "--max-model-len", "64", "--num-kv-blocks", "64", "--block-size", "4",
         "--max-loras", "2")


@pytest.fixture(scope="module")
def adapters():
    base = tiny_base("llama")
    return base, make_adapter(base, "alpha", seed=1), make_adapter(base, "beta", seed=2)


@pytest.fixture(scope="module")
def engine(adapters):
    base, _, _ = adapters
    engine = start_engine("--model", str(base), "--enable-lora", *FLAGS)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def served(server_loop, engine, adapters):
    _, alpha, beta = adapters
    srv = AppServer(server_loop, engine, "--lora-modules", f"alpha={alpha}", f"beta={beta}", "--allow-runtime-lora",
                    model=BASE)
    yield srv, openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0)
    srv.stop()


def completion(client, model: str) -> list[int]:
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0,
                                    extra_body={"ignore_eos": True, "return_token_ids": True})
    return out.choices[0].token_ids


@pytest.fixture(scope="module")
def offline(adapters):
    """The same requests through LLM: each adapter's tokens and the base's."""
    base, alpha, beta = adapters
    llm = LLM(str(base), device="cpu", quantization=None, enable_lora=True, max_model_len=64, num_kv_blocks=64,
              block_size=4)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    tokens = {name: llm.generate(PROMPT, params, use_tqdm=False, lora_request=lora)[0].outputs[0].token_ids
              for name, lora in (("base", None), ("alpha", LoRARequest("alpha", 1, str(alpha))),
                                 ("beta", LoRARequest("beta", 2, str(beta))))}
    llm.client.shutdown()
    return tokens


def test_a_model_naming_an_adapter_runs_with_it(served, offline):
    _, client = served
    assert completion(client, BASE) == offline["base"]
    assert completion(client, "alpha") == offline["alpha"]
    assert completion(client, "beta") == offline["beta"]
    assert len({tuple(t) for t in offline.values()}) == 3  # (each adapter changes the answer)
    with pytest.raises(openai.NotFoundError, match="'alpha', 'beta'"):
        completion(client, "gamma")


def test_models_lists_each_adapter_with_its_parent(served, adapters):
    srv, client = served
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {BASE, "alpha", "beta"}
    assert cards["alpha"].model_extra["parent"] == BASE and cards["alpha"].model_extra["root"] == str(adapters[1])
    assert httpx.get(f"{srv.url}/v1/models/beta").json()["parent"] == BASE


def test_load_and_unload_over_http(served, adapters, offline):
    srv, client = served
    base, alpha, _ = adapters
    loaded = httpx.post(f"{srv.url}/v1/load_lora_adapter", json={"lora_name": "alpha2", "lora_path": str(alpha)})
    assert loaded.status_code == 200, loaded.text
    assert completion(client, "alpha2") == offline["alpha"]
    taken = httpx.post(f"{srv.url}/v1/load_lora_adapter", json={"lora_name": "alpha2", "lora_path": str(alpha)})
    assert taken.status_code == 400 and "taken" in taken.json()["error"]["message"]
    missing = httpx.post(f"{srv.url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(base / "no")})
    assert missing.status_code == 400 and "'x'" in missing.json()["error"]["message"]
    assert httpx.post(f"{srv.url}/v1/unload_lora_adapter", json={"lora_name": "alpha2"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        completion(client, "alpha2")
    assert httpx.post(f"{srv.url}/v1/unload_lora_adapter", json={"lora_name": "alpha2"}).status_code == 404


def test_runtime_loading_is_refused_unless_allowed(server_loop, engine, adapters):
    _, alpha, _ = adapters
    srv = AppServer(server_loop, engine, model=BASE)
    try:
        refused = httpx.post(f"{srv.url}/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(alpha)})
        assert refused.status_code == 400 and "--allow-runtime-lora" in refused.json()["error"]["message"]
    finally:
        srv.stop()


def test_an_adapter_that_fails_to_load_fails_only_its_requests(served, adapters, tmp_path, offline):
    """Its config is fine, its weights are not: it fails when the engine loads it."""
    srv, client = served
    _, alpha, _ = adapters
    broken = broken_adapter(alpha, tmp_path / "broken")
    assert httpx.post(f"{srv.url}/v1/load_lora_adapter",
                      json={"lora_name": "broken", "lora_path": str(broken)}).status_code == 200
    with pytest.raises(openai.BadRequestError, match="broken"):
        completion(client, "broken")
    assert completion(client, "alpha") == offline["alpha"] and completion(client, BASE) == offline["base"]


def test_a_bad_adapter_at_start_stops_the_start_naming_it(tmp_path, adapters):
    base, _, _ = adapters
    done = subprocess.run([sys.executable, "-m", "gristmill.cli", "serve", "--model", str(base), "--device", "cpu",
                           "--port", "0", "--lora-modules", f"nope={tmp_path / 'missing'}"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "'nope'" in done.stderr and "--lora-modules" in done.stderr, done.stderr
