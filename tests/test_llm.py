"""LLM.generate / LLM.chat end to end on the real bundled Gemma 3 270M."""

from __future__ import annotations

import pytest
import torch

from gristmill import LLM, Logprob, PromptTooLongError, RequestError, SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at",
           "Here is a short poem about the sea:\n"]


@pytest.fixture(scope="module")
def hf_model(float_llm):
    from transformers import AutoModelForCausalLM

    from tests.harness import transformers_dir
    return AutoModelForCausalLM.from_pretrained(str(transformers_dir(float_llm.model_dir)),
                                                dtype=torch.float32).eval()


def greedy(max_tokens=32, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0, **kw)


def test_greedy_matches_transformers_token_for_token(float_llm, hf_model):
    # Greedy decoding token for token: transformers' argmax after every prefix of ours
    # (prompt + the tokens so far) is our next token. By induction that is what its
    # `generate(do_sample=False)` gives, read off one forward pass per prompt instead of
    # 32 (seconds instead of tens of seconds on 2 cores).
    outs = float_llm.generate(PROMPTS, greedy(32, ignore_eos=True), use_tqdm=False)
    for out in outs:
        ids = torch.tensor([out.prompt_token_ids + out.token_ids])
        with torch.inference_mode():
            logits = hf_model(ids).logits[0]
        start = len(out.prompt_token_ids) - 1
        assert len(out.token_ids) == 32
        assert logits[start:-1].argmax(-1).tolist() == out.token_ids, out.prompt
        assert out.finish_reason == "length"
        assert out.text == float_llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)


def test_single_prompt_and_token_id_prompt(default_llm):
    [by_text] = default_llm.generate("The capital of France is", greedy(8), use_tqdm=False)
    [by_ids] = default_llm.generate(by_text.prompt_token_ids, greedy(8), use_tqdm=False)
    assert by_text.prompt_token_ids[0] == default_llm.tokenizer.bos_token_id
    assert by_ids.token_ids == by_text.token_ids and len(by_ids.token_ids) == 8
    assert by_ids.prompt is None and by_text.prompt == "The capital of France is"


def test_seeded_sampling_is_reproducible_whatever_the_batch(default_llm):
    seeded = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    [alone] = default_llm.generate("Once upon a time", seeded, use_tqdm=False)
    others = [SamplingParams(max_tokens=n, temperature=1.0) for n in (5, 30, 12)]
    mixed = default_llm.generate(["Hello", "Once upon a time", "A list of fruits:", "Why is the sky"],
                                 [others[0], seeded, others[1], others[2]], use_tqdm=False)
    assert mixed[1].token_ids == alone.token_ids
    assert len(alone.token_ids) == 24
    other_seeds = default_llm.generate(["Once upon a time"] * 3,
                                       [seeded.clone(seed=s) for s in (1, 2, 3)], use_tqdm=False)
    assert any(o.token_ids != alone.token_ids for o in other_seeds)


def test_stop_string_ends_generation_and_is_not_returned(default_llm):
    [full] = default_llm.generate("The capital of France is", greedy(32, ignore_eos=True), use_tqdm=False)
    text = full.text
    stop = text[12:17]
    expected = text[:text.find(stop)]
    [out] = default_llm.generate("The capital of France is", greedy(32, stop=[stop, "zzzz-never"]),
                                 use_tqdm=False)
    assert out.finish_reason == "stop"
    assert out.text == expected
    assert stop not in out.text
    assert len(out.token_ids) < 32


def test_stop_token_ids(default_llm):
    [full] = default_llm.generate("def fibonacci(n):", greedy(32, ignore_eos=True), use_tqdm=False)
    stop_token = full.token_ids[6]
    cut = full.token_ids.index(stop_token)
    [out] = default_llm.generate("def fibonacci(n):", greedy(32, stop_token_ids=[stop_token]), use_tqdm=False)
    assert out.finish_reason == "stop"
    assert out.token_ids == full.token_ids[:cut + 1]
    # The token that ended it stays in token_ids, not in the text (as vLLM).
    assert out.text == default_llm.tokenizer.decode(full.token_ids[:cut], skip_special_tokens=True)


def test_the_eos_that_ends_a_completion_has_no_text_even_with_special_tokens(default_llm):
    eos = default_llm.tokenizer.convert_tokens_to_ids("<end_of_turn>")
    [out] = default_llm.generate("The capital of France is", greedy(8, skip_special_tokens=False,
                                                                     logit_bias={eos: 100}), use_tqdm=False)
    assert out.finish_reason == "stop" and out.token_ids == [eos]
    assert out.text == ""
    [kept] = default_llm.generate("The capital of France is", greedy(4, skip_special_tokens=False,
                                                                     ignore_eos=True, logit_bias={eos: 100}),
                                  use_tqdm=False)
    assert kept.finish_reason == "length" and kept.text == "<end_of_turn>" * 4, "ignored, EOS is text"


def test_eos_stops_unless_ignored(default_llm):
    eos = default_llm.tokenizer.convert_tokens_to_ids("<end_of_turn>")
    assert eos in default_llm.inputs.eos_token_ids
    [chat] = default_llm.chat([{"role": "user", "content": "Say hi."}], greedy(200), use_tqdm=False)
    assert chat.prompt_token_ids[-3:] == default_llm.tokenizer.encode(
        "<start_of_turn>model\n", add_special_tokens=False)[-3:]
    if chat.finish_reason == "stop":
        assert chat.token_ids[-1] in default_llm.inputs.eos_token_ids
        [ignored] = default_llm.chat([{"role": "user", "content": "Say hi."}],
                                     greedy(len(chat.token_ids) + 3, ignore_eos=True), use_tqdm=False)
        assert ignored.finish_reason == "length"
        assert ignored.token_ids[:len(chat.token_ids)] == chat.token_ids
    else:
        assert chat.finish_reason == "length" and len(chat.token_ids) == 200


def test_invalid_prompts_become_error_outputs_and_others_are_unaffected(default_llm):
    limit = default_llm.max_model_len
    too_long = [2] + [236743] * 40
    outs = default_llm.generate(["The capital of France is", "", too_long, [10**9]],
                                [greedy(8), greedy(8), greedy(limit - 20), greedy(8)], use_tqdm=False)
    [reference] = default_llm.generate("The capital of France is", greedy(8), use_tqdm=False)
    assert outs[0].error is None and outs[0].token_ids == reference.token_ids
    assert outs[1].finish_reason == "error"
    assert outs[1].error.startswith("RequestError: prompt is empty")
    assert outs[2].finish_reason == "error"
    assert outs[2].error.startswith("PromptTooLongError:")
    assert f"max_model_len ({limit})" in outs[2].error and "41 tokens" in outs[2].error
    assert outs[3].error.startswith("RequestError:") and "vocabulary" in outs[3].error


def test_invalid_sampling_params_name_the_field():
    for kwargs, param in [({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"),
                          ({"max_tokens": 0}, "max_tokens"), ({"n": 0}, "n"),
                          ({"logprobs": 99}, "logprobs"), ({"stop": [""]}, "stop"),
                          ({"seed": 2**64}, "seed"), ({"top_k": -2}, "top_k"), ({"min_p": 1.5}, "min_p")]:
        with pytest.raises(RequestError) as info:
            SamplingParams(**kwargs)
        assert info.value.param == param
        assert param in str(info.value)


def test_prompt_too_long_is_a_request_error():
    assert issubclass(PromptTooLongError, RequestError) and issubclass(RequestError, ValueError)


def test_n_completions_and_logprobs(default_llm):
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=7, n=3, logprobs=3)
    [out] = default_llm.generate("My favourite animal is", params, use_tqdm=False)
    assert len(out.outputs) == 3
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    for completion in out.outputs:
        assert len(completion.logprobs) == len(completion.token_ids) == 8
        for token, entry in zip(completion.token_ids, completion.logprobs):
            assert token in entry and 3 <= len(entry) <= 4
            assert all(v.logprob <= 0 for v in entry.values())
    [top] = default_llm.generate("My favourite animal is", greedy(6, logprobs=2), use_tqdm=False)
    for token, entry in zip(top.token_ids, top.logprobs):
        assert entry[token].logprob == pytest.approx(max(v.logprob for v in entry.values()))
        assert entry[token].rank == 1


def test_logprobs_are_logprob_objects_with_true_ranks_and_token_texts(float_llm, hf_model):
    """As vLLM's: each entry maps a token id to a Logprob with its logprob, its rank in the
    step's distribution (1 = the most likely) and its text. The top-k rank 1..k; the
    sampled token's rank is its true place, also far outside the top-k (checked against
    transformers' logits, up to float noise)."""
    params = SamplingParams(max_tokens=12, temperature=2.0, seed=3, logprobs=2, ignore_eos=True)
    [out] = float_llm.generate("My favourite animal is", params, use_tqdm=False)
    ids = torch.tensor([out.prompt_token_ids + out.token_ids[:-1]])
    with torch.inference_mode():
        reference = hf_model(ids).logits[0, -len(out.token_ids):].float().log_softmax(-1)
    ranks = []
    for step, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        assert all(isinstance(v, Logprob) for v in entry.values())
        assert all(v.decoded_token == float_llm.tokenizer.decode([i]) for i, v in entry.items())
        by_rank = sorted(entry.values(), key=lambda v: v.rank)
        assert [v.rank for v in by_rank][:2] == [1, 2] and len(entry) in (2, 3)
        assert [v.logprob for v in by_rank] == sorted((v.logprob for v in by_rank), reverse=True)
        sampled = entry[token]
        assert sampled.logprob == pytest.approx(reference[step, token].item(), abs=1e-3)
        at_least = 1 + int((reference[step] > sampled.logprob + 1e-3).sum())
        at_most = 1 + int((reference[step] > sampled.logprob - 1e-3).sum())
        assert at_least <= sampled.rank <= at_most, (step, sampled, at_least, at_most)
        ranks.append(sampled.rank)
    assert max(ranks) > 2, ranks  # (temperature 2: some sampled token is outside the top 2)


def test_plain_greedy_steps_take_the_argmax_from_the_lm_head_alone(default_llm):
    # Steps of plain greedy rows ask the GGUF LM head for its argmax alone (its logits, 1
    # MiB a row, are never written); rows that ask for logprobs take the logits. The same
    # tokens either way, prefill steps and decode steps, alone and in a batch.
    head = default_llm.core.executor.model.lm_head
    rows = []

    def counted(hidden):  # the head's own argmax, its calls counted
        rows.append(hidden.shape[0])
        return type(head).argmax(head, hidden)

    prompts = ["The capital of France is", "def fib(n):", "Once upon a time, in a land far away,"]
    head.argmax = counted
    try:
        plain = default_llm.generate(prompts, greedy(10), use_tqdm=False)
        [alone] = default_llm.generate(prompts[1], greedy(10), use_tqdm=False)
    finally:
        del head.argmax
    assert sum(rows) == 4 * 10 and max(rows) == 3, rows  # every sampled row: one per token
    with_logits = default_llm.generate(prompts, greedy(10, logprobs=1), use_tqdm=False)
    assert [o.token_ids for o in plain] == [o.token_ids for o in with_logits]
    assert alone.token_ids == plain[1].token_ids


def test_every_block_is_returned(default_llm):
    stats = default_llm.core.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert default_llm.outputs.num_live == 0


def test_per_request_failure_is_an_error_output_and_the_rest_complete(default_llm, monkeypatch):
    from gristmill import faults
    [reference] = default_llm.generate("Water boils at", greedy(8), use_tqdm=False)
    monkeypatch.setenv("GRISTMILL_FAULTS", "detokenize@prompt~DTKFAIL")
    faults.load()
    try:
        outs = default_llm.generate(["Water boils at", "DTKFAIL here"], greedy(8), use_tqdm=False)
    finally:
        monkeypatch.delenv("GRISTMILL_FAULTS")
        faults.load()
    assert outs[0].token_ids == reference.token_ids and outs[0].error is None
    assert outs[1].finish_reason == "error"
    assert outs[1].error.startswith("GenerationError: detokenizing failed: injected fault")
    monkeypatch.setenv("GRISTMILL_FAULTS", "detokenize_init@prompt~INITFAIL")
    faults.load()
    try:
        [many] = default_llm.generate("INITFAIL", SamplingParams(max_tokens=4, n=3), use_tqdm=False)
    finally:
        monkeypatch.delenv("GRISTMILL_FAULTS")
        faults.load()
    assert [o.finish_reason for o in many.outputs] == ["error"] * 3
    assert default_llm.outputs.num_live == 0
    stats = default_llm.core.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_a_failed_forward_pass_raises_engine_dead_error(monkeypatch, tmp_path):
    # An engine of its own, to break: a tiny random-weight model (the failure is the point).
    from gristmill import EngineDeadError
    from gristmill import faults
    from tests.model.test_loader import write_tiny_gguf
    model = write_tiny_gguf(tmp_path / "tiny.gguf", "llama", "gpt2")
    llm = LLM(str(model), device="cpu", num_kv_blocks=64, cache_dir=str(tmp_path / "cache"))
    monkeypatch.setenv("GRISTMILL_FAULTS", "forward@step=3")
    faults.load()
    try:
        with pytest.raises(EngineDeadError, match="injected fault at 'forward'"):
            llm.generate(["one", "two"], greedy(8), use_tqdm=False)
    finally:
        monkeypatch.delenv("GRISTMILL_FAULTS")
        faults.load()
    with pytest.raises(EngineDeadError, match="create a new LLM"):
        llm.generate("later", greedy(4), use_tqdm=False)


def test_n_completions_with_the_largest_seed(default_llm):
    params = SamplingParams(max_tokens=3, temperature=1.0, seed=2**64 - 1, n=2)
    [out] = default_llm.generate("Hello", params, use_tqdm=False)
    assert out.error is None and [len(o.token_ids) for o in out.outputs] == [3, 3]


def test_max_new_tokens_is_the_room_a_prompt_leaves(default_llm):
    prompt = "The capital of France is"
    ids = default_llm.tokenizer.encode(prompt)
    room = default_llm.max_new_tokens(prompt)
    capacity = default_llm.capacity
    assert room == min(capacity.max_model_len, capacity.num_total_blocks * capacity.block_size) - len(ids)
    assert default_llm.max_new_tokens(ids) == default_llm.max_new_tokens(len(ids)) == room
    default_llm.inputs.make_requests("fits", ids, SamplingParams(max_tokens=room))  # does not raise
    [out] = default_llm.generate(prompt, SamplingParams(max_tokens=room + 1))
    assert out.finish_reason == "error" and out.error.startswith("PromptTooLongError")


def test_prefix_caching_changes_no_output_on_the_real_model(float_llm):
    """Prompts sharing a preamble shorter than Gemma 3's sliding window (512) and one past
    it: greedy tokens and their logprobs equal those of each prompt computed whole
    (alone, after `reset_prefix_cache`), both the first time (siblings share in one
    batch) and again (all preambles cached).

    On the exact float path: int8 activations round each value to one of 255 levels, so
    a difference in the last float bit (attention over a cached prefix sums in another
    order) can move a value a whole level and the logprobs by up to ~0.1."""
    short = "You answer questions about animals briefly and kindly. "
    long = " ".join(f"Fact {i}: the {w} lives near water." for i, w in
                    enumerate(["heron", "otter", "frog", "newt", "beaver", "crab"] * 12)) + " "
    assert len(float_llm.tokenizer.encode(long)) > 600
    prompts = [pre + q for pre in (short, long) for q in ("What does a fox eat?", "Where do owls sleep?")]
    params = greedy(6, logprobs=2)
    uncached = []
    for prompt in prompts:
        assert float_llm.reset_prefix_cache()
        before = float_llm.core.stats()
        uncached += float_llm.generate(prompt, params, use_tqdm=False)
        assert float_llm.core.stats()["prefix_cache_hits"] == before["prefix_cache_hits"]
    assert float_llm.reset_prefix_cache()
    before = float_llm.core.stats()
    for _ in range(2):
        cached = float_llm.generate(prompts, params, use_tqdm=False)
        for on, off in zip(cached, uncached):
            assert on.token_ids == off.token_ids
            for a, b in zip(on.logprobs, off.logprobs):
                assert a.keys() == b.keys()
                assert all(a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4) for t in a)
    after = float_llm.core.stats()
    prompt_tokens = sum(len(float_llm.tokenizer.encode(p)) for p in prompts)
    assert after["prefix_cache_queries"] - before["prefix_cache_queries"] == 2 * prompt_tokens
    # The second round finds nearly every prompt token cached (all but each last block).
    assert after["prefix_cache_hits"] - before["prefix_cache_hits"] > prompt_tokens
