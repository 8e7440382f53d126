"""The offline Python faces (LLM, SamplingParams, EngineConfig, AsyncEngine) as a vLLM user
meets them in a first script: what a review found broken or missing. Runs on a tiny
random-weight GGUF model."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import shutil
import time
import weakref

import pytest

from gristmill import LLM, AsyncEngine, EngineConfig, RequestError, SamplingParams
from tests.model.test_loader import write_tiny_gguf

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(the tiny model's path, its cache dir): a one-layer llama with a byte-level vocabulary."""
    root = tmp_path_factory.mktemp("faces")
    return str(write_tiny_gguf(root / "tiny.gguf", "llama", "gpt2")), str(root / "cache")


@pytest.fixture(scope="module")
def llm(tiny):
    model, cache = tiny
    return LLM(model=model, device="cpu", cache_dir=cache)


def engine_is_idle(llm) -> bool:
    stats = llm.core.stats()
    return (stats["num_free_blocks"] == stats["num_total_blocks"] and not llm.core.has_unfinished
            and llm.outputs.num_live == 0)


# -- LLM.chat ---------------------------------------------------------------------------------


CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("option", [
    {"chat_template_kwargs": {"enable_thinking": False}},
    {"chat_template": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"},
], ids=["chat_template_kwargs", "chat_template"])
def test_chat_takes_vllm_chat_options(llm, option):
    """vLLM's `LLM.chat(..., chat_template_kwargs=..., chat_template=...)` (e.g. Qwen3's
    `enable_thinking`; a template of one's own) render with them and generate."""
    [out] = llm.chat(CONVERSATION, SamplingParams(max_tokens=2, **GREEDY), use_tqdm=False, **option)
    assert out.error is None and len(out.token_ids) == 2
    if "chat_template" in option:
        assert out.prompt == "system: Be brief.\nuser: Hi\n"


def test_chat_continue_final_message(llm):
    """vLLM's `chat(..., add_generation_prompt=False, continue_final_message=True)` continues a
    partial assistant turn: the prompt ends with the open assistant text."""
    messages = CONVERSATION + [{"role": "assistant", "content": "Sure, the answer is"}]
    [out] = llm.chat(messages, SamplingParams(max_tokens=2, **GREEDY), use_tqdm=False,
                     add_generation_prompt=False, continue_final_message=True)
    assert out.error is None and out.prompt.endswith("Sure, the answer is")


def test_get_tokenizer_like_vllm(llm):
    """`llm.get_tokenizer()`, how vLLM scripts reach the tokenizer."""
    assert llm.get_tokenizer() is llm.tokenizer


# -- SamplingParams -------------------------------------------------------------------------------


def test_stop_assigned_as_a_string_is_one_stop_string(llm):
    """`params.stop = "abc"` after construction is one stop string, as at construction (it
    was once iterated per character: generation stopped at the first 'a', 'b' or 'c')."""
    [full] = llm.generate("Hello world", SamplingParams(max_tokens=30, **GREEDY), use_tqdm=False)
    text = full.text
    # A stop string late in the text, with a character that also appears before it.
    stop = next(text[i:i + 4] for i in range(len(text) - 4, 0, -1)
                if "\ufffd" not in text[i:i + 4] and text.find(text[i:i + 4]) == i
                and any(c in text[:i] for c in text[i:i + 4]))
    [by_init] = llm.generate("Hello world", SamplingParams(max_tokens=30, stop=stop, **GREEDY), use_tqdm=False)
    assigned = SamplingParams(max_tokens=30, **GREEDY)
    assigned.stop = stop
    try:
        [by_assign] = llm.generate("Hello world", assigned, use_tqdm=False)
    except RequestError as exc:
        assert exc.param == "stop"
        return
    assert by_init.text == text[:text.find(stop)]
    assert by_assign.text == by_init.text, (
        f"stop={stop!r} assigned: text {by_assign.text!r}; at construction: {by_init.text!r}")


@pytest.mark.parametrize("field", ["stop", "stop_token_ids", "bad_words"])
def test_list_field_assigned_none_does_not_break_the_batch(llm, field):
    """`params.stop = None` (or stop_token_ids / bad_words) after construction means none,
    as at construction (it once raised a bare TypeError that lost every prompt of the call)."""
    params = SamplingParams(max_tokens=3, **GREEDY)
    setattr(params, field, None)
    outs = llm.generate(["Hello world", "abc"], [SamplingParams(max_tokens=3, **GREEDY), params], use_tqdm=False)
    assert outs[0].error is None and len(outs[0].token_ids) == 3
    assert outs[1].error is None or field in outs[1].error
    assert engine_is_idle(llm)


def test_include_stop_str_in_output(llm):
    """vLLM's `include_stop_str_in_output=True` keeps the stop string at the end of the text."""
    [full] = llm.generate("Hello world", SamplingParams(max_tokens=30, **GREEDY), use_tqdm=False)
    stop = full.text[8:12]
    params = SamplingParams(max_tokens=30, stop=[stop], include_stop_str_in_output=True, **GREEDY)
    [out] = llm.generate("Hello world", params, use_tqdm=False)
    assert out.finish_reason == "stop" and out.text == full.text[:full.text.find(stop) + len(stop)]


def test_generate_without_sampling_params_samples_as_the_models_generation_config(llm, tiny, tmp_path):
    """vLLM's `LLM.generate(prompts)` with no SamplingParams samples as the model's
    generation_config.json says (max_new_tokens as max_tokens, temperature, top_k,
    repetition_penalty ...); SamplingParams that are passed are used as given, and a
    model without the file keeps SamplingParams()."""
    model_dir = tmp_path / "with-defaults"
    shutil.copytree(llm.model_dir, model_dir)
    config = {"max_new_tokens": 5, "temperature": 0.0, "top_k": 3, "repetition_penalty": 1.3, "do_sample": True}
    (model_dir / "generation_config.json").write_text(json.dumps(config))
    configured = LLM(model=str(model_dir), device="cpu", cache_dir=tiny[1])
    as_configured = SamplingParams(max_tokens=5, temperature=0.0, top_k=3, repetition_penalty=1.3)
    assert configured.get_default_sampling_params() == as_configured
    prompts = ["Once upon a time", "The sea is"]
    by_default = configured.generate(prompts, use_tqdm=False)
    assert [len(out.token_ids) for out in by_default] == [5, 5]
    again = configured.generate(prompts, as_configured, use_tqdm=False)
    assert [out.token_ids for out in by_default] == [out.token_ids for out in again]  # greedy: the same again
    [chat] = configured.chat(CONVERSATION, use_tqdm=False)
    assert len(chat.token_ids) == 5
    [given] = configured.generate(prompts[0], SamplingParams(max_tokens=7, ignore_eos=True), use_tqdm=False)
    assert len(given.token_ids) == 7
    assert llm.get_default_sampling_params() == SamplingParams()
    # The file is read once, when the LLM starts (as vLLM does): a bad value fails generate.
    (model_dir / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    misconfigured = LLM(model=str(model_dir), device="cpu", cache_dir=tiny[1])
    with pytest.raises(RequestError, match="generation_config.json gives an invalid default: temperature") as info:
        misconfigured.generate(prompts, use_tqdm=False)
    assert info.value.param == "temperature"


# -- EngineConfig / LLM(...) -------------------------------------------------------------------------


def test_max_model_len_past_the_models_limit_is_refused(tiny):
    """The tiny model has 256 positions: `LLM(max_model_len=100000)` is a RequestError naming
    max_model_len and the limit (as vLLM refuses it), not prompts run past what the model knows."""
    model, cache = tiny
    with pytest.raises(RequestError, match="256") as caught:
        LLM(model=model, device="cpu", cache_dir=cache, max_model_len=100_000)
    assert caught.value.param == "max_model_len"


def test_engine_seed_none_as_vllm_takes_it(tiny):
    """vLLM takes `LLM(..., seed=None)`: a random seed (it once failed in torch.manual_seed
    after the model loaded)."""
    model, cache = tiny
    try:
        llm = LLM(model=model, device="cpu", cache_dir=cache, seed=None)
    except RequestError as exc:
        assert exc.param == "seed"
        return
    [out] = llm.generate("Hi", SamplingParams(max_tokens=2), use_tqdm=False)
    assert out.error is None


@pytest.mark.parametrize("field, value", [
    ("device", 0), ("seed", "1"), ("enforce_eager", "no"), ("model", 5),
], ids=["device-int", "seed-str", "enforce_eager-str", "model-int"])
def test_engine_options_of_the_wrong_type_name_the_option(tiny, field, value):
    """An EngineConfig field of the wrong type is a RequestError naming it, before anything
    loads (device=0, seed="1", enforce_eager="no", model=5); a torch.device is taken as its
    name."""
    model, cache = tiny
    options = {"model": model, "device": "cpu", "cache_dir": cache, field: value}
    started = time.monotonic()
    with pytest.raises(RequestError) as caught:
        LLM(**options)
    assert caught.value.param == field and time.monotonic() - started < 1.0


# -- AsyncEngine ---------------------------------------------------------------------------------------


def _engine(tiny) -> AsyncEngine:
    model, cache = tiny
    return AsyncEngine(EngineConfig(model=model, device="cpu", cache_dir=cache, num_kv_blocks=64))


def test_async_engine_takes_vllm_prompt_dicts(tiny):
    """AsyncEngine.generate takes vLLM's TextPrompt / TokensPrompt dicts, as LLM.generate
    does: the same output as the plain prompt."""
    engine = _engine(tiny)
    params = SamplingParams(max_tokens=3, **GREEDY)

    async def run(prompt):
        async for out in engine.generate(prompt, params):
            pass
        return out

    try:
        plain = asyncio.run(run("Hello world"))
        by_text = asyncio.run(run({"prompt": "Hello world"}))
        by_ids = asyncio.run(run({"prompt_token_ids": plain.prompt_token_ids}))
    finally:
        engine.shutdown()
    assert by_text.token_ids == by_ids.token_ids == plain.token_ids


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # (gone before, or while, it was read)
        return False


def test_a_dropped_async_engine_leaves_no_core_process(tiny):
    """An AsyncEngine nobody references any more (a helper that forgot shutdown(), a notebook
    cell run again) is collected and its core process exits with it (the client's threads
    once held it, and the core, with the model in memory, lived until the interpreter
    exited)."""
    engine = _engine(tiny)

    async def one():
        async for _ in engine.generate("Hi", SamplingParams(max_tokens=2)):
            pass

    asyncio.run(one())
    pid, ref = engine.core_pid, weakref.ref(engine)
    del engine
    try:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            gc.collect()
            if not _alive(pid):
                break
            time.sleep(0.1)
        assert not _alive(pid), f"core pid {pid} still running; engine collected: {ref() is None}"
    finally:
        if ref() is not None:
            ref().shutdown()
        elif _alive(pid):
            os.kill(pid, 9)


def test_a_torch_device_is_taken_as_its_name():
    import torch

    assert EngineConfig(device=torch.device("cpu")).device == "cpu"


def test_stop_reason_and_cumulative_logprob(llm):
    """vLLM's CompletionOutput.stop_reason: the stop string or stop_token_ids entry that
    ended it (None for a length limit); cumulative_logprob: the sum of its tokens'
    logprobs when it asked for them."""
    [full] = llm.generate("Hello world", SamplingParams(max_tokens=20, logprobs=0, **GREEDY), use_tqdm=False)
    out = full.outputs[0]
    assert out.stop_reason is None and out.cumulative_logprob == pytest.approx(
        sum(entry[t].logprob for t, entry in zip(out.token_ids, out.logprobs)))
    stop = full.text[5:8]
    [by_string] = llm.generate("Hello world", SamplingParams(max_tokens=20, stop=[stop], **GREEDY), use_tqdm=False)
    assert by_string.outputs[0].stop_reason == stop and by_string.outputs[0].cumulative_logprob is None
    token = out.token_ids[3]
    [by_token] = llm.generate("Hello world", SamplingParams(max_tokens=20, stop_token_ids=[token], **GREEDY),
                              use_tqdm=False)
    assert by_token.finish_reason == "stop" and by_token.outputs[0].stop_reason == token


def test_a_text_that_ends_inside_a_character_keeps_every_character_before_it(llm):
    """The tiny model's byte-level tokens split characters: a completion cut after any
    token has the text of the characters completed so far (an output decoded once, at
    its end, used to lose all of its text when its last token ended inside one)."""
    texts = [llm.generate("The capital of France is", SamplingParams(max_tokens=n, **GREEDY), use_tqdm=False)[0].text
             for n in range(1, 9)]
    for shorter, longer in zip(texts, texts[1:]):
        assert longer.startswith(shorter), texts
    assert texts[-1], texts
