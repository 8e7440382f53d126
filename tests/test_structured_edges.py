"""Edges of structured output across its faces (LLM.generate, the OpenAI server), each
once a bug: logprobs of refused tokens on the wire, seeded constrained rows beside rows
that want logprobs, grammars only the model's tokenizer can refuse, min_tokens against a
grammar that completes early.

Everything runs on a tiny one-layer random-weight GGUF model (tests.model.test_loader),
loaded once for offline use and once behind an in-process server."""

from __future__ import annotations

import json
import re
import threading
import time

import httpx
import pytest

from gristmill import LLM, RequestError, SamplingParams
from tests.model.test_loader import write_tiny_gguf
from tests.server.conftest import free_port


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf", "llama", "gpt2")


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(model=str(tiny_model), device="cpu")


@pytest.fixture(scope="module")
def server_url(tiny_model):
    import uvicorn

    from gristmill import AsyncEngine, EngineConfig
    from gristmill.server.app import build_app

    engine = AsyncEngine(EngineConfig(model=str(tiny_model), device="cpu"))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(engine, "tiny"), host="127.0.0.1", port=port,
                                           log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}/v1"
    server.should_exit = True
    thread.join(30)
    engine.shutdown()


def _strict_json(text: str):
    """json.loads that refuses what is not JSON (RFC 8259): NaN, Infinity, -Infinity."""
    def refuse(name):
        raise ValueError(f"{name} is not JSON")
    return json.loads(text, parse_constant=refuse)


# -- logprobs of constrained rows -------------------------------------------------------

def test_top_logprobs_with_a_choice_constraint_is_not_a_500(server_url):
    """A classifier's usual request: `structured_outputs: {"choice": [...]}` with top
    logprobs. The masked logits hold -inf for every token the grammar refuses; JSON has
    no infinities, so they go out as -9999.0 (as vLLM sends them), on completions and
    chat alike (it was a 500: "Out of range float values are not JSON compliant")."""
    completion = httpx.post(f"{server_url}/completions", timeout=60, json={
        "prompt": "hello", "max_tokens": 5, "temperature": 0, "logprobs": 5,
        "structured_outputs": {"choice": ["yes", "no"]}})
    chat = httpx.post(f"{server_url}/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0,
        "logprobs": True, "top_logprobs": 5, "structured_outputs": {"choice": ["yes", "no"]}})
    for response in (completion, chat):
        assert response.status_code == 200, response.text
        _strict_json(response.text)


def test_streamed_top_logprobs_of_a_constrained_request_are_json(server_url):
    """The same request streamed: every event is strict JSON (json.dumps would write
    -Infinity, which JSON.parse, Go and serde refuse)."""
    with httpx.stream("POST", f"{server_url}/completions", timeout=60, json={
            "prompt": "hello", "max_tokens": 5, "temperature": 0, "logprobs": 5, "stream": True,
            "structured_outputs": {"choice": ["yes", "no"]}}) as response:
        body = response.read().decode()
    events = [e[len("data: "):] for e in body.split("\n\n") if e.startswith("data: ") and e != "data: [DONE]"]
    assert events
    logprobs = [v for e in events for top in (_strict_json(e)["choices"][0]["logprobs"] or {}).get("top_logprobs", [])
                for v in top.values()]
    assert -9999.0 in logprobs


# -- seeds --------------------------------------------------------------------------------

def test_a_seeded_constrained_sample_does_not_depend_on_another_rows_logprobs(llm):
    """`SamplingParams.seed`: same seed, same output, whatever else is in the batch. On a
    CPU a sampled constrained row is drawn unmasked and drawn again when refused
    (`GrammarMasks.resample_refused`); whether it is, is decided per row (it once was per
    step: a row asking for logprobs anywhere in the step changed a seeded row's tokens)."""
    constrained = SamplingParams(max_tokens=12, temperature=1.5, seed=7, structured_output={"regex": "[a-z]{3,10}"})
    alone = llm.generate(["hello"], constrained, use_tqdm=False)[0].outputs[0].token_ids
    beside_plain = llm.generate(["hello", "world"], [constrained, SamplingParams(max_tokens=12, temperature=0)],
                                use_tqdm=False)[0].outputs[0].token_ids
    beside_logprobs = llm.generate(["hello", "world"],
                                   [constrained, SamplingParams(max_tokens=12, temperature=0, logprobs=1)],
                                   use_tqdm=False)[0].outputs[0].token_ids
    assert beside_plain == alone
    assert beside_logprobs == alone


# -- invalid grammars are refused at admission ------------------------------------------

BAD_FOR_THE_TOKENIZER = ['start: <[99999]>', 'start: <|nonexistent|>']


@pytest.mark.parametrize("grammar", BAD_FOR_THE_TOKENIZER)
def test_a_grammar_naming_tokens_the_model_lacks_is_a_request_error(llm, grammar):
    """A grammar naming a token id past the vocabulary (`<[99999]>`) or a special token
    the tokenizer lacks (`<|nonexistent|>`) can only be found invalid against the model's
    tokenizer, which the engine core holds: the core refuses it, and that refusal is the
    RequestError it is (the request alone ends, as any invalid prompt of LLM.generate
    does), not a GenerationError "the engine core refused the request"."""
    params = SamplingParams(max_tokens=4, temperature=0, structured_output={"grammar": grammar})
    outputs = llm.generate(["hello", "world"], [params, SamplingParams(max_tokens=4, temperature=0)],
                           use_tqdm=False)
    bad, good = outputs[0].outputs[0], outputs[1].outputs[0]
    assert bad.finish_reason == "error"
    assert bad.error.startswith("RequestError: structured_output.grammar is not valid"), bad.error
    assert good.finish_reason == "length" and len(good.token_ids) == 4


def test_a_grammar_naming_tokens_the_model_lacks_is_a_400_not_a_500(server_url):
    """The same grammar on the server: a 400 naming the field it came in, as for any
    other grammar that does not parse (it was a 500 with param null)."""
    response = httpx.post(f"{server_url}/completions", timeout=60, json={
        "prompt": "hello", "max_tokens": 4, "temperature": 0,
        "structured_outputs": {"grammar": BAD_FOR_THE_TOKENIZER[0]}})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "structured_outputs", response.text


# -- min_tokens against a grammar that finishes -----------------------------------------

def test_min_tokens_is_not_silently_dropped_by_a_finished_grammar(llm):
    """min_tokens bans EOS (and stop tokens, stop strings) until that many tokens. A
    choice that completes earlier cannot be satisfied, as a constraint that needs EOS to
    end under the same min_tokens cannot (regex "a{0}"): GenerationError, saying why,
    never a 2-token "stop" as if min_tokens had not been sent."""
    params = SamplingParams(max_tokens=8, temperature=0, min_tokens=4, structured_output={"choice": ["yes", "no"]})
    out = llm.generate(["hello"], params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "error", (out.text, out.finish_reason, out.token_ids)
    assert out.error.startswith("GenerationError: the structured output constraint is complete after")
    assert "before min_tokens (4)" in out.error


# -- values refused where SamplingParams are built ------------------------------------

@pytest.mark.parametrize("fields,says", [
    ({"structured_output": {"json": True}}, 'for any JSON object send {"json_object": true}'),
    ({"logit_bias": {"5": True}}, "values numbers"),
    ({"logit_bias": {"5": "3"}}, "values numbers"),
    ({"logit_bias": {"\u0665": 1}}, "keys must be token ids"),  # an Arabic-Indic 5: not a token id
])
def test_values_a_client_did_not_mean_are_refused(fields, says):
    with pytest.raises(RequestError, match=re.escape(says)) as caught:
        SamplingParams(**fields)
    assert caught.value.param == next(iter(fields))
