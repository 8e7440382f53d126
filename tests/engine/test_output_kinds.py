"""What a request stream hands out (`output_kind`), on the bundled model through a real
engine-core process: "cumulative" (everything so far, each step), "delta" (what is new)
and "final" (one output at the end, nothing copied per step) describe the same request;
max_tokens=None is the room the context leaves, counted where the prompt is tokenized,
once; the client validates a request's SamplingParams once."""

from __future__ import annotations

import asyncio

import pytest

from gristmill import AsyncEngine, EngineConfig, RequestError, SamplingParams

MAX_MODEL_LEN = 96


@pytest.fixture(scope="module")
def engine():
    engine = AsyncEngine(EngineConfig(device="cpu", max_model_len=MAX_MODEL_LEN))
    yield engine
    engine.shutdown()


def collect(engine, prompt, params, kind):
    async def run():
        return [out async for out in engine.generate(prompt, params, output_kind=kind)]
    return asyncio.run(run())


def test_cumulative_delta_and_final_outputs_describe_the_same_request(engine):
    params = SamplingParams(max_tokens=30, temperature=0.8, seed=7, n=2, logprobs=2, ignore_eos=True,
                            stop=["never-there"])
    cumulative, delta, final = (collect(engine, "Once upon a time", params, kind)
                                for kind in ("cumulative", "delta", "final"))
    assert len(final) == 1 and final[0].finished
    assert len(cumulative) >= 5 and len(delta) >= 5  # (how many: as the steps reached the client)
    for i in range(2):
        whole, last = final[0].outputs[i], cumulative[-1].outputs[i]
        assert len(whole.token_ids) == 30 and whole.finish_reason == "length"
        assert (whole.text, whole.token_ids, whole.logprobs) == (last.text, last.token_ids, last.logprobs)
        assert whole.delta_text == whole.text  # handed out at once
        assert "".join(out.outputs[i].delta_text for out in cumulative) == whole.text
        pieces = [out.outputs[i] for out in delta]
        assert all(p.text == p.delta_text for p in pieces)
        assert "".join(p.text for p in pieces) == whole.text
        assert sum((p.token_ids for p in pieces), []) == whole.token_ids
        assert sum((p.logprobs for p in pieces), []) == whole.logprobs
        # cumulative outputs are copies: an early one still holds only its tokens
        assert len(cumulative[0].outputs[i].token_ids) < len(whole.token_ids)
    arrivals = final[0].metrics.token_arrivals
    assert sum(count for _, count in arrivals) == 60 and arrivals == sorted(arrivals)
    assert arrivals[0][0] >= final[0].metrics.arrival_time


def test_a_final_output_is_decoded_once_at_its_end_and_reads_as_a_streamed_one(engine):
    """Nobody reads a "final" request's text before it ends: without stop strings to look
    for, its tokens are held and decoded once, at the end (no detokenizing per step);
    its text is the one a streamed request gets. With a stop string it is decoded as it
    goes, and the stop string still ends it."""
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    prompt = "Write a word in French, Japanese and emoji:"

    async def final_while_watching():
        held = []
        async for out in engine.generate(prompt, params, output_kind="final", request_id="held-1"):
            held.append(out)
        return held

    async def run():
        task = asyncio.ensure_future(final_while_watching())
        seen = None
        while not task.done():
            live = engine.outputs._live.get("held-1")
            if live is not None:
                seen = live.detokenizer.held
            await asyncio.sleep(0.001)
        return (await task), seen
    final, seen_held = asyncio.run(run())
    streamed = collect(engine, prompt, params, "cumulative")[-1].outputs[0]
    whole = final[0].outputs[0]
    assert isinstance(seen_held, list), "the final request's detokenizer was decoding per step"
    assert (whole.text, whole.token_ids, whole.finish_reason) == (streamed.text, streamed.token_ids, "length")
    assert whole.text and whole.delta_text == whole.text

    stop = streamed.text[len(streamed.text) // 2:][:3]
    assert stop.strip(), streamed.text
    cut = collect(engine, prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=[stop]),
                  "final")[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.text == streamed.text[:streamed.text.index(stop)]


def test_a_final_output_comes_from_the_core_once_and_reads_the_same(engine, monkeypatch):
    """The core sends a "final" request's tokens once, at its end, not every step (and
    nothing before that, not even an empty update); its output is the one a streamed
    request gets. With `token_times` (the default; the server's latency metrics read
    them) the core sends when each token became known; without (what batch rows ask),
    the arrivals are one per completion. A request that needs its tokens as they come
    (stop strings, logprobs) still gets them every step."""
    updates = []  # (request id, tokens) of every update the client processes: a spy
    process = engine.outputs.process
    monkeypatch.setattr(engine.outputs, "process",
                        lambda batch, *a: updates.extend((u.request_id, len(u.new_token_ids)) for u in batch)
                        or process(batch, *a))

    async def final(prompt, params, token_times):
        async for out in engine.generate(prompt, params, output_kind="final", token_times=token_times):
            pass
        return out

    def token_updates(out):
        return sorted(count for request_id, count in updates if request_id.startswith(out.request_id) and count)

    params = SamplingParams(max_tokens=24, temperature=0.8, seed=3, n=2, ignore_eos=True)
    prompt = "The river ran"
    streamed = collect(engine, prompt, params, "cumulative")[-1]
    for token_times in (False, True):
        quiet = asyncio.run(final(prompt, params, token_times))
        assert [(o.text, o.token_ids, o.finish_reason) for o in quiet.outputs] == \
            [(o.text, o.token_ids, o.finish_reason) for o in streamed.outputs]
        assert all(len(o.token_ids) == 24 and o.text for o in quiet.outputs)
        assert token_updates(quiet) == [24, 24], token_times  # one update per completion
        assert [count for request_id, count in updates if request_id.startswith(quiet.request_id)] == [24, 24]
        arrivals = quiet.metrics.token_arrivals
        if token_times:  # the time of each step that sampled tokens, and how many
            assert sum(count for _, count in arrivals) == 48 and len(arrivals) >= 24
            times = [at for at, _ in arrivals]
            assert times == sorted(set(times)) and times[0] >= quiet.metrics.arrival_time
        else:
            assert sorted(count for _, count in arrivals) == [24, 24]
    for needs_tokens in (dict(stop=["never-there"]), dict(logprobs=1)):
        loud = asyncio.run(final(prompt, params.clone(**needs_tokens), False))
        assert len(token_updates(loud)) > 2 and len(loud.metrics.token_arrivals) > 2, needs_tokens


def test_an_unknown_output_kind_is_a_request_error(engine):
    with pytest.raises(RequestError, match="output_kind must be one of cumulative, delta, final") as info:
        collect(engine, "Hi", SamplingParams(max_tokens=2), "last")
    assert info.value.param == "output_kind"


def test_max_tokens_none_is_the_room_left_counted_from_one_tokenization(engine, monkeypatch):
    calls = []
    encode = engine.tokenizer.encode
    monkeypatch.setattr(engine.tokenizer, "encode", lambda *a, **k: calls.append(a) or encode(*a, **k))
    prompt = "The history of the city goes back a long way, and"
    out, = collect(engine, prompt, SamplingParams(max_tokens=None, temperature=0, ignore_eos=True), "final")
    assert len(calls) == 1
    assert out.finish_reason == "length"
    assert len(out.prompt_token_ids) + len(out.token_ids) == MAX_MODEL_LEN

    with pytest.raises(RequestError, match=r"min_tokens \(90\) is more than the") as info:
        collect(engine, prompt, SamplingParams(max_tokens=None, min_tokens=90), "final")
    assert info.value.param == "min_tokens"


def test_the_client_validates_sampling_params_once_per_request(engine, monkeypatch):
    calls = []
    validate = SamplingParams.validate
    monkeypatch.setattr(SamplingParams, "validate", lambda self: calls.append(1) or validate(self))
    params = SamplingParams(max_tokens=None, n=3, temperature=0.5, seed=1,
                            structured_output={"choice": ["yes", "no"]})
    assert len(calls) == 1  # where it is built
    outs = collect(engine, "Is the sky blue? Answer:", params, "final")
    assert len(calls) == 1, "validated again on its way to the core"
    assert sorted(c.text in ("yes", "no") for c in outs[0].outputs) == [True] * 3
    params.temperature = -1  # assigned after it was built: checked again, and refused
    with pytest.raises(RequestError, match="temperature must be a number >= 0"):
        collect(engine, "Hi", params, "final")
