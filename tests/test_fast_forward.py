"""Fast-forward (`EngineConfig.fast_forward`, on by default): text a request's grammar
forces is appended without sampling and computed in the next step, so a constrained
output takes fewer steps; the output is still whole, valid, within max_tokens, and a
request that asks for logprobs still samples every token.

On a tiny one-layer random-weight GGUF model (tests.model.test_loader), one engine with
fast-forward and one without."""

from __future__ import annotations

import json

import jsonschema
import pytest

from gristmill import LLM, SamplingParams
from tests.model.test_loader import write_tiny_gguf

LONG_CHOICE = "the quick brown fox jumps over the lazy dog"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "status": {"enum": ["active", "inactive"]},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "status", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf", "llama", "gpt2")


@pytest.fixture(scope="module")
def llms(tiny_model):
    """{fast_forward: LLM}"""
    return {on: LLM(model=str(tiny_model), device="cpu", fast_forward=on) for on in (True, False)}


def _run(llm: LLM, prompts, params):
    """(outputs, engine steps they took)"""
    before = llm.core.num_steps
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0] for o in outs], llm.core.num_steps - before


def test_a_forced_text_is_written_in_two_steps_instead_of_one_per_token(llms):
    params = SamplingParams(max_tokens=64, temperature=0, structured_output={"choice": [LONG_CHOICE]})
    [fast], fast_steps = _run(llms[True], "Say it:", params)
    [slow], slow_steps = _run(llms[False], "Say it:", params)
    for out in (fast, slow):
        assert out.text == LONG_CHOICE and out.finish_reason == "stop"
    assert slow_steps == len(slow.token_ids) >= 5  # (each token sampled, the last one EOS)
    # The first token sampled in the prompt's step, the rest forced, computed in one step
    # that samples EOS.
    assert fast_steps <= 3 < slow_steps
    assert llms[True].get_tokenizer().decode(fast.token_ids, skip_special_tokens=True) == LONG_CHOICE


def test_forced_text_stops_at_max_tokens(llms):
    params = SamplingParams(max_tokens=3, temperature=0, structured_output={"choice": [LONG_CHOICE]})
    for on in (True, False):
        [out], _ = _run(llms[on], "Say it:", params)
        assert len(out.token_ids) == 3 and out.finish_reason == "length", (on, out)
        assert LONG_CHOICE.startswith(out.text) and out.text


def test_json_rows_validate_and_take_fewer_steps(llms):
    prompts = [f"Customer {i} as JSON:" for i in range(8)]
    params = SamplingParams(max_tokens=60, temperature=0, structured_output={"json": SCHEMA})
    fast, fast_steps = _run(llms[True], prompts, params)
    slow, slow_steps = _run(llms[False], prompts, params)
    for out in fast + slow:
        if out.finish_reason == "stop":
            jsonschema.validate(json.loads(out.text), SCHEMA)
        else:
            assert out.finish_reason == "length" and len(out.token_ids) == 60
    assert sum(o.finish_reason == "stop" for o in fast) >= 4
    assert fast_steps < slow_steps


def test_sampled_rows_are_fast_forwarded_too_and_stay_valid(llms):
    params = [SamplingParams(max_tokens=60, temperature=1.0, seed=i, structured_output={"json": SCHEMA})
              for i in range(8)]
    outs, _ = _run(llms[True], [f"Record {i}:" for i in range(8)], params)
    for out in outs:
        if out.finish_reason == "stop":
            jsonschema.validate(json.loads(out.text), SCHEMA)
    again, _ = _run(llms[True], [f"Record {i}:" for i in range(8)], params)
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]  # seeded: the same draws


def test_a_request_with_logprobs_samples_every_token(llms):
    params = SamplingParams(max_tokens=64, temperature=0, logprobs=1, structured_output={"choice": [LONG_CHOICE]})
    [out], steps = _run(llms[True], "Say it:", params)
    assert out.text == LONG_CHOICE
    assert steps == len(out.token_ids) == len(out.logprobs)
    assert all(token in entry for token, entry in zip(out.token_ids, out.logprobs))


def test_streamed_forced_text_arrives_whole(tiny_model):
    # An AsyncEngine's delta stream: the forced tokens of a step come as one delta.
    import asyncio

    from gristmill import AsyncEngine, EngineConfig

    async def stream(engine):
        params = SamplingParams(max_tokens=64, temperature=0, structured_output={"choice": [LONG_CHOICE]})
        return [out async for out in engine.generate("Say it:", params, output_kind="delta")]

    engine = AsyncEngine(EngineConfig(model=str(tiny_model), device="cpu"))
    try:
        outs = asyncio.run(stream(engine))
    finally:
        engine.shutdown()
    assert "".join(o.outputs[0].text for o in outs) == LONG_CHOICE
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "stop"
    assert len([o for o in outs if o.outputs[0].text]) <= 2  # the sampled token, then the rest at once


def test_a_spent_reasoning_budget_forces_the_end_marker_and_the_answers_fixed_start():
    # The reasoning gate (structured/reasoning_gate.py): once max_reasoning_tokens are out,
    # </think> is forced, then the JSON answer's fixed start; both written without steps.
    from tests.chat.reasoning_models import cache_dir, tiny_reasoning_model, token_id

    schema = {"type": "object", "properties": {"answer": {"enum": ["four", "five"]}}, "required": ["answer"]}
    params = SamplingParams(max_tokens=48, temperature=0, structured_output={"json": schema}, max_reasoning_tokens=4)
    runs = {}
    for on in (True, False):
        llm = LLM(model=tiny_reasoning_model("qwen3_opened"), device="cpu", cache_dir=cache_dir(),
                  quantization=None, fast_forward=on)
        before = llm.core.num_steps
        [out] = llm.chat([{"role": "user", "content": "What is 2+2?"}], params, use_tqdm=False)
        runs[on] = (out.outputs[0], llm.core.num_steps - before)
        end = token_id(llm.get_tokenizer(), "</think>")
    for completion, _ in runs.values():
        assert completion.finish_reason == "stop", completion.error
        assert completion.token_ids[4] == end  # four reasoning tokens, then the marker
        jsonschema.validate(json.loads(completion.text), schema)
    # Without fast-forward a step per token; with it, the marker and '{"answer": "' (and
    # the rest of the enum value once it is decided) come with the tokens before them.
    assert runs[False][1] == len(runs[False][0].token_ids)
    assert runs[True][1] <= runs[False][1] - 4
