"""Penalties, bans and biases (model/logits.py) against transformers' own logits
processors and the OpenAI formulas: on the same logits, and end to end through a real
engine core over a tiny model, synchronous and async, against `generate`."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

transformers = pytest.importorskip("transformers")

from gristmill import SamplingParams  # noqa: E402
from gristmill.config import EngineConfig  # noqa: E402
from gristmill.engine.core import EngineCore  # noqa: E402
from gristmill.engine.messages import AddRequest  # noqa: E402
from gristmill.engine.request import PLACEHOLDER, Request  # noqa: E402
from gristmill.errors import RequestError  # noqa: E402
from gristmill.model.logits import LogitsControls, banned_tokens  # noqa: E402
from gristmill.model.runner import ModelRunner  # noqa: E402
from gristmill.step import ScheduledRequest  # noqa: E402

VOCAB = 96
EOS = 3
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _item(request: Request) -> ScheduledRequest:
    """What the runner hands the controls: a request's part of the step that samples its next token."""
    request.num_computed_tokens = request.num_tokens - 1
    return request.scheduled(1)


def _request(prompt, output, pending=False, bad_words_ids=(), **params) -> Request:
    request = Request(f"r{id(prompt)}", list(prompt), SamplingParams(max_tokens=64, **params), frozenset({EOS}),
                      bad_words_ids=bad_words_ids)
    request.token_ids.extend(output)
    if pending:
        request.token_ids.append(PLACEHOLDER)
        request.pending = True
    return request


def _openai(logits: torch.Tensor, output: list[int], presence: float, frequency: float) -> torch.Tensor:
    """OpenAI's documented formula: mu[j] - c[j] * frequency - (c[j] > 0) * presence."""
    expected = logits.clone()
    for token, count in Counter(output).items():
        expected[token] -= count * frequency + presence
    return expected


def test_penalties_equal_transformers_and_openai_formulas():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, VOCAB, generator=gen) * 4
    prompts = [[5, 6, 7, 8], [9, 9, 10], [11, 12], [13]]
    outputs = [[6, 20, 20, 21], [9, 30], [40, 40, 40, 11], []]
    cases = [dict(repetition_penalty=1.3), dict(presence_penalty=0.7, frequency_penalty=0.4),
             dict(), dict(repetition_penalty=0.8, presence_penalty=-1.5, frequency_penalty=2.0)]
    requests = [_request(p, o, **c) for p, o, c in zip(prompts, outputs, cases)]
    got = logits.clone()
    assert LogitsControls(torch.device("cpu")).apply(got, [_item(r) for r in requests], torch.zeros(4), dict)

    hf_rep = transformers.RepetitionPenaltyLogitsProcessor
    expected0 = hf_rep(1.3)(torch.tensor([prompts[0] + outputs[0]]), logits[0:1].clone())[0]
    torch.testing.assert_close(got[0], expected0, rtol=0, atol=1e-6)
    torch.testing.assert_close(got[1], _openai(logits[1], outputs[1], 0.7, 0.4), rtol=0, atol=1e-6)
    assert torch.equal(got[2], logits[2]), "a row that asks for nothing is untouched"
    assert not requests[2].controlled and all(r.controlled for r in requests[:2] + requests[3:])
    # vLLM's order: the repetition penalty first, then presence and frequency over the completion.
    rep = hf_rep(0.8)(torch.tensor([prompts[3] + outputs[3]]), logits[3:4].clone())[0]
    torch.testing.assert_close(got[3], _openai(rep, outputs[3], -1.5, 2.0), rtol=0, atol=1e-6)


def test_a_pending_token_counts_from_the_device_buffer():
    """Async scheduling: the last token of a request is a placeholder on the host; the
    controls read it from the last step's sampled ids, as if it were known."""
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(1))
    params = dict(repetition_penalty=1.7, presence_penalty=0.5, frequency_penalty=0.3)
    known = _request([1, 2], [30, 31, 31], **params)
    pending = _request([1, 2], [30, 31], pending=True, **params)
    buffer = torch.tensor([0, 0, 31], dtype=torch.int32)
    controls = LogitsControls(torch.device("cpu"))
    a, b = logits[:1].clone(), logits[:1].clone()
    controls.apply(a, [_item(known)], buffer, dict)
    controls.apply(b, [_item(pending)], buffer, lambda: {pending.request_id: 2})
    assert torch.equal(a, b)
    assert not torch.equal(a, logits[:1])


def test_min_tokens_and_bad_words_bans():
    request = _request([1], [50, 51], min_tokens=3, stop_token_ids=[7],
                       bad_words_ids=((60,), (51, 61), (50, 62), (40, 51, 63)))
    # EOS and stop ids before min_tokens; single-token words always; a longer word when the
    # completion ends with all but its last token.
    assert sorted(banned_tokens(_item(request))) == [EOS, 7, 60, 61]
    request.token_ids.append(52)
    assert sorted(banned_tokens(_item(request))) == [60]
    ignore = _request([1], [], min_tokens=2, ignore_eos=True)
    assert banned_tokens(_item(ignore)) == []


@pytest.mark.parametrize("params", [
    dict(presence_penalty=2.5), dict(frequency_penalty=-3), dict(repetition_penalty=0), dict(repetition_penalty=-1),
    dict(min_tokens=-1), dict(min_tokens=20, max_tokens=10), dict(bad_words=[""]), dict(bad_words=[3]),
    dict(bad_words=["x"] * 101)])
def test_bad_values_are_request_errors(params):
    with pytest.raises(RequestError) as info:
        SamplingParams(**params)
    assert info.value.param == next(iter(params))


# -- end to end, greedy, against transformers' generate -----------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Gemma 3 that repeats itself (so penalties change what it says), saved
    for the engine, and the same weights as transformers' reference."""
    config = transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=256, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"], eos_token_id=EOS, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
    path = tmp_path_factory.mktemp("tiny_penalties")
    model.save_pretrained(path)
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                                  attn_implementation="eager").eval()
    return path, reference


class _OpenAIPenalties(transformers.LogitsProcessor):
    """OpenAI's presence / frequency formula over the generated tokens, for `generate`."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        return torch.stack([_openai(scores[i], input_ids[i, self.prompt_len:].tolist(), self.presence, self.frequency)
                            for i in range(len(scores))])


PROMPTS = [[(i * 13 + 5 * j + 1) % VOCAB for j in range(4 + 3 * i)] for i in range(4)]
MAX_TOKENS = 24


@torch.no_grad()
def _generate(reference, prompt, **kwargs) -> list[int]:
    out = reference.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                             eos_token_id=EOS, pad_token_id=0, **kwargs)
    return out[0, len(prompt):].tolist()


def _engine(path, async_scheduling: bool, device: str, requests) -> dict[str, list[int]]:
    config = EngineConfig(model=str(path), device=device, dtype="float32", quantization=None, block_size=4,
                          max_model_len=96, num_kv_blocks=96, max_num_seqs=8, max_num_batched_tokens=64,
                          async_scheduling=async_scheduling)
    core = EngineCore(config, ModelRunner(config))
    for request_id, prompt, params, bad_words_ids in requests:
        assert core.add_request(AddRequest(request_id, prompt, params, frozenset({EOS}),
                                           bad_words_ids=bad_words_ids)) is None
    tokens = {request_id: [] for request_id, *_ in requests}
    for _ in range(500):
        if not core.has_unfinished:
            break
        for update in core.step():
            tokens[update.request_id] += update.new_token_ids
    assert not core.has_unfinished
    assert core.block_manager.num_free_blocks == core.block_manager.num_total_blocks
    return tokens


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_greedy_generation_equals_transformers(tiny, device, async_scheduling):
    path, reference = tiny
    requests, expected = [], {}
    for i, prompt in enumerate(PROMPTS):
        free = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
        requests.append((f"free{i}", prompt, free, ()))
        expected[f"free{i}"] = _generate(reference, prompt)
        requests.append((f"rep{i}", prompt, free.clone(repetition_penalty=1.8), ()))
        expected[f"rep{i}"] = _generate(reference, prompt, repetition_penalty=1.8)
        requests.append((f"oai{i}", prompt, free.clone(presence_penalty=1.2, frequency_penalty=0.9), ()))
        expected[f"oai{i}"] = _generate(reference, prompt, logits_processor=transformers.LogitsProcessorList(
            [_OpenAIPenalties(len(prompt), 1.2, 0.9)]))
        requests.append((f"min{i}", prompt, free.clone(min_tokens=MAX_TOKENS - 2), ()))
        expected[f"min{i}"] = _generate(reference, prompt, min_new_tokens=MAX_TOKENS - 2)
    # The penalties change what this model says, so the comparison means something.
    assert any(expected[f"rep{i}"] != expected[f"free{i}"] for i in range(len(PROMPTS)))
    assert any(expected[f"oai{i}"] != expected[f"free{i}"] for i in range(len(PROMPTS)))
    got = _engine(path, async_scheduling, device, requests)
    assert got == expected


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_bad_words_never_appear(tiny, async_scheduling):
    """The token the free run says most is banned, then a pair the run without it says:
    the output never contains them, and equals transformers' `bad_words_ids`."""
    path, reference = tiny
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)

    def run(*words):
        return _engine(path, async_scheduling, "cpu", [("r", PROMPTS[1], params, words)])["r"]

    free = run()
    (single, _), = Counter(free).most_common(1)
    without_single = run((single,))
    assert single in free and single not in without_single
    pair = tuple(without_single[:2])
    got = run((single,), pair)
    assert single not in got
    assert all((a, b) != pair for a, b in zip(got, got[1:]))
    assert got != without_single
    expected = _generate(reference, PROMPTS[1], bad_words_ids=[[single], list(pair)], min_new_tokens=MAX_TOKENS)
    assert got == expected
