"""Logit parity of our model implementations with HF `transformers`.

Each family gets a tiny model with random weights, saved as an HF directory; our
ModelRunner, driven step by step through the real Scheduler and BlockManager (batched
prefills of different lengths, batched decodes, chunked prefill, preemption), must give
the logits that HF computes on the same full sequence without a cache.
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch

transformers = pytest.importorskip("transformers")

from gristmill.config import EngineConfig  # noqa: E402
from gristmill.engine.kv_blocks import BlockManager  # noqa: E402
from gristmill.engine.request import Request  # noqa: E402
from gristmill.engine.scheduler import Scheduler  # noqa: E402
from gristmill.model.runner import ModelRunner  # noqa: E402
from gristmill.sampling import SamplingParams  # noqa: E402
from tests.engine.harness import step_tokens  # noqa: E402
from tests.model.decode_stack_check import run_comparing_stack_and_layers  # noqa: E402

ATOL = 1e-4
VOCAB = 256
BLOCK_SIZE = 4
SLIDING_WINDOW = 8

_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False)


def _llama():
    return transformers.LlamaConfig(**_COMMON, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def _llama3_rope():
    return transformers.LlamaConfig(**{**_COMMON, "tie_word_embeddings": True}, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64})


def _llama_bias():
    # attention_bias puts a bias on q, k, v and o; mlp_bias on the three MLP projections.
    return transformers.LlamaConfig(**_COMMON, attention_bias=True, mlp_bias=True,
                                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def _qwen2():
    return transformers.Qwen2Config(**_COMMON, rope_parameters={"rope_type": "default", "rope_theta": 1e6})


def _qwen3():
    return transformers.Qwen3Config(**_COMMON, rope_parameters={"rope_type": "default", "rope_theta": 1e6})


def _gemma3():
    common = {k: v for k, v in _COMMON.items() if k != "tie_word_embeddings"}
    return transformers.Gemma3TextConfig(
        **{**common, "num_hidden_layers": 4}, sliding_window=SLIDING_WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        # Different from head_dim so a wrong attention scale shows.
        query_pre_attn_scalar=24, final_logit_softcapping=30.0,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}})


FAMILIES = {"llama": _llama, "llama3_rope": _llama3_rope, "llama_bias": _llama_bias,
            "qwen2": _qwen2, "qwen3": _qwen3, "gemma3": _gemma3}


def _randomize(model: torch.nn.Module, zero_centered_norms: bool) -> None:
    """Weights large enough that every part of the model moves the logits: unit-scale
    activations, norm weights away from their neutral value, sizeable biases."""
    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(0.3 * noise if zero_centered_norms else 1.0 + 0.3 * noise)
            elif name.endswith("bias"):
                p.copy_(0.5 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise)
            else:  # (out, in) matrices
                p.copy_(noise / math.sqrt(p.shape[1]))


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """The models are tiny: one thread is as fast, and does not thrash when other
    processes share the CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(name, model dir, HF reference model) for one family."""
    name = request.param
    torch.manual_seed(0)
    config = FAMILIES[name]()
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    _randomize(model, zero_centered_norms=name.startswith("gemma"))
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()
    return name, path, reference


def _runner(path, max_num_seqs=8, max_num_batched_tokens=256, num_kv_blocks=64, max_model_len=128) -> ModelRunner:
    return ModelRunner(EngineConfig(
        model=str(path), device="cpu", dtype="float32", quantization=None, block_size=BLOCK_SIZE,
        num_kv_blocks=num_kv_blocks, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens))


@torch.no_grad()
def _reference_logits(reference, token_ids: list[int]) -> torch.Tensor:
    return reference(torch.tensor([token_ids])).logits[0, -1].float()


def _run_and_compare(runner, reference, prompts: dict[str, list[int]], *, max_num_seqs: int,
                     max_num_batched_tokens: int, max_tokens: int, late: dict | None = None,
                     seed: int = 0, enable_prefix_caching: bool = True, atol: float = ATOL,
                     rtol: float = 0.0) -> dict:
    """Drive the runner through the scheduler until every request finishes, comparing each
    sampled row with HF. `late` maps a step number to prompts added before that step.
    Returns {request_id: number of compared rows}, plus scheduling facts under "_" (with
    the tokens each request sampled and the prefix cache's hit tokens)."""
    bm = BlockManager(runner.num_blocks, BLOCK_SIZE, enable_prefix_caching)
    sched = Scheduler(bm, max_num_seqs, max_num_batched_tokens, runner.max_model_len)
    late = dict(late or {})

    def add(batch):
        for rid, ids in batch.items():
            sched.add_request(Request(rid, list(ids), SamplingParams(max_tokens=max_tokens, temperature=0)))

    add(prompts)
    compared: dict[str, int] = {}
    facts = {"max_diff": 0.0, "steps_without_logits": 0, "mixed_steps": 0, "max_decode_batch": 0, "preemptions": 0, "tokens": {}}
    step = 0
    while sched.num_unfinished or late:
        if step in late:
            add(late.pop(step))
        out = sched.schedule()
        facts["preemptions"] += len(out.preempted_request_ids)
        decodes = sum(1 for s in out.scheduled if s.num_new_tokens == 1)
        facts["max_decode_batch"] = max(facts["max_decode_batch"], decodes)
        if decodes and decodes < len(out.scheduled):
            facts["mixed_steps"] += 1
        logits, items = runner.forward(out)
        if not items:
            facts["steps_without_logits"] += 1
        sampled = {}
        for row, item in enumerate(items):
            request = sched.requests[item.request_id]
            expected = _reference_logits(reference, request.token_ids)
            diff = (logits[row].float().cpu() - expected).abs().max().item()
            bound = atol + rtol * expected.abs().max().item()
            assert diff <= bound, (
                f"request {request.request_id} at length {request.num_tokens} (step {step}, "
                f"{request.num_output_tokens} tokens generated): max abs logit diff {diff:.3e} > {bound:.3e}")
            facts["max_diff"] = max(facts["max_diff"], diff)
            compared[request.request_id] = compared.get(request.request_id, 0) + 1
            # Alternate greedy and arbitrary next tokens so decode inputs are varied; the
            # arbitrary ones depend on the request and position only, not on the schedule.
            if request.num_output_tokens % 2:
                token = int(logits[row].argmax())
            else:
                token = zlib.crc32(f"{seed}:{request.request_id}:{request.num_tokens}".encode()) % VOCAB
            sampled[request.request_id] = token
            facts["tokens"].setdefault(request.request_id, []).append(token)
        sched.update(out, step_tokens(sampled))
        step += 1
        assert step < 500, "scheduler did not finish"
    assert bm.num_free_blocks == runner.num_blocks
    facts["hit_tokens"] = bm.num_hit_tokens
    return {**compared, "_": facts}


def _prompt(length: int, seed: int) -> list[int]:
    return torch.randint(VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_batched_prefill_and_decode(family):
    """Prompts of 5, 11, 17, 30 tokens prefilled together, then decoded together (mixed
    lengths in one decode batch); a late request prefills while the others decode."""
    name, path, reference = family
    runner = _runner(path)
    prompts = {f"r{n}": _prompt(n, seed=n) for n in (5, 11, 17, 30)}
    result = _run_and_compare(runner, reference, prompts, max_num_seqs=8, max_num_batched_tokens=256,
                              max_tokens=6, late={2: {"late13": _prompt(13, seed=99)}})
    facts = result.pop("_")
    # Prefill + 5 decodes each (max_tokens=6): every step of every request was compared.
    assert result == {rid: 6 for rid in [*prompts, "late13"]}
    assert facts["max_decode_batch"] == 5 and facts["mixed_steps"] >= 1, facts


def test_chunked_prefill(family):
    """A token budget of 8: the 30- and 21-token prompts are computed over several steps,
    sharing steps with each other and with decodes, and their logits still match."""
    name, path, reference = family
    runner = _runner(path, max_num_seqs=4, max_num_batched_tokens=8)
    prompts = {"long30": _prompt(30, seed=1), "short5": _prompt(5, seed=2), "mid21": _prompt(21, seed=3)}
    result = _run_and_compare(runner, reference, prompts, max_num_seqs=4, max_num_batched_tokens=8,
                              max_tokens=5)
    facts = result.pop("_")
    assert result == {rid: 5 for rid in prompts}
    assert facts["steps_without_logits"] >= 3 and facts["mixed_steps"] >= 1, facts


@pytest.mark.parametrize("budget", [256, 100], ids=["whole", "chunked"])
def test_long_prompts_through_the_chunked_prefill_attention(family, budget):
    """Prompts of two to four chunks of queries (backends/cpu.py,
    chunked_attention; a Gemma 3 sliding layer skips the keys behind its window),
    whole or over several steps with earlier keys in the cache, still match."""
    name, path, reference = family
    runner = _runner(path, max_num_seqs=4, max_num_batched_tokens=budget, num_kv_blocks=128, max_model_len=240)
    prompts = {"p150": _prompt(150, seed=7), "p230": _prompt(230, seed=8)}
    result = _run_and_compare(runner, reference, prompts, max_num_seqs=4, max_num_batched_tokens=budget,
                              max_tokens=3)
    result.pop("_")
    assert result == {rid: 3 for rid in prompts}


def test_preemption_recompute(family):
    """Too few KV blocks for all requests: the newest is preempted, recomputed from scratch
    (prompt + generated tokens) and its logits still match."""
    name, path, reference = family
    runner = _runner(path, num_kv_blocks=14)
    prompts = {"a": _prompt(20, seed=4), "b": _prompt(18, seed=5), "c": _prompt(9, seed=6)}
    result = _run_and_compare(runner, reference, prompts, max_num_seqs=8, max_num_batched_tokens=64,
                              max_tokens=8)
    facts = result.pop("_")
    assert facts["preemptions"] >= 1, facts
    assert result == {rid: 8 for rid in prompts}


@pytest.mark.parametrize("budget", [256, 12], ids=["whole", "chunked"])
def test_prefix_caching_matches_reference_and_uncached_run(family, budget):
    """Requests that share a prefix with earlier ones reuse its cached blocks: a prefix
    shorter than a block (nothing to reuse), exactly 2 blocks, 5 blocks (past Gemma 3's
    sliding window of 8), a prompt sent twice, and a prefix reused while its first user
    is still decoding; with prompts prefilled whole or in chunks of a 12-token budget.
    Every sampled row matches HF, and the tokens equal those of the same run with
    caching off."""
    name, path, reference = family
    prefix = {n: _prompt(n, seed=200 + n) for n in (3, 8, 20)}
    first = {f"first{n}": prefix[n] + _prompt(5, seed=300 + n) for n in prefix}
    again = {f"again{n}": prefix[n] + _prompt(6, seed=400 + n) for n in prefix}
    again["same20"] = list(first["first20"])
    during = {"during8": prefix[8] + _prompt(3, seed=500)}
    runs = {}
    for caching in (True, False):
        result = _run_and_compare(_runner(path), reference, first, max_num_seqs=8, max_num_batched_tokens=budget,
                                  max_tokens=4, late={2: during, 6: again}, enable_prefix_caching=caching)
        runs[caching] = result.pop("_")
        assert result == {rid: 4 for rid in [*first, *again, *during]}
    # Cached tokens: 2 blocks for during8 and again8, 5 for again20; same20 (25 tokens) has
    # 6 full blocks but keeps its last token's block, and so reuses 6 of them.
    assert runs[True]["hit_tokens"] == (2 + 2 + 5 + 6) * BLOCK_SIZE, runs[True]["hit_tokens"]
    assert runs[False]["hit_tokens"] == 0
    assert runs[True]["tokens"] == runs[False]["tokens"]


@pytest.mark.parametrize("family", ["gemma3"], indirect=True)
def test_gemma3_sliding_window_matters(family):
    """Guard for the Gemma 3 cases: the sliding window changes the reference logits at
    the lengths the tests use, so matching HF really checks the window."""
    name, path, reference = family
    ids = _prompt(30, seed=30)
    windowed = _reference_logits(reference, ids)
    saved = reference.config.sliding_window
    try:
        reference.config.sliding_window = 10_000
        for layer in reference.model.layers:
            if getattr(layer.self_attn, "sliding_window", None) is not None:
                layer.self_attn.sliding_window = 10_000
        full = _reference_logits(reference, ids)
    finally:
        reference.config.sliding_window = saved
        for layer in reference.model.layers:
            if getattr(layer.self_attn, "sliding_window", None) is not None:
                layer.self_attn.sliding_window = saved
    assert (windowed - full).abs().max().item() > 1e-2


def test_large_vocab_many_rows(tmp_path):
    """A larger vocabulary and 9 rows sampled per step still match the reference."""
    config = transformers.LlamaConfig(**{**_COMMON, "vocab_size": 40_000, "num_hidden_layers": 2},
                                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    _randomize(model, zero_centered_norms=False)
    model.save_pretrained(tmp_path)
    reference = model.eval()
    runner = _runner(tmp_path)
    prompts = {f"p{i}": _prompt(3 + 2 * i, seed=100 + i) for i in range(9)}
    result = _run_and_compare(runner, reference, prompts, max_num_seqs=16, max_num_batched_tokens=256,
                              max_tokens=3)
    facts = result.pop("_")
    assert result == {rid: 3 for rid in prompts} and facts["max_decode_batch"] == 9, facts


def _stack_against_layers(path, quantization: str, kv_cache_dtype: str = "auto") -> ModelRunner:
    """Three sequences of 3, 12 and 7 tokens decoded together, each decode-only step's
    stack compared with the layers one by one (run_comparing_stack_and_layers)."""
    runner = ModelRunner(EngineConfig(
        model=str(path), device="cpu", dtype="float32", quantization=quantization, block_size=BLOCK_SIZE,
        num_kv_blocks=64, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64,
        kv_cache_dtype=kv_cache_dtype))
    bm = BlockManager(runner.num_blocks, BLOCK_SIZE, True)
    sched = Scheduler(bm, 4, 64, runner.max_model_len)
    for rid, n in (("a", 3), ("b", 12), ("c", 7)):
        sched.add_request(Request(rid, _prompt(n, seed=n), SamplingParams(max_tokens=6 + n, temperature=0)))
    stacked_steps, _ = run_comparing_stack_and_layers(runner, sched)
    assert stacked_steps >= 10
    return runner


@pytest.mark.parametrize("quantization", ["int8", "q4"])
def test_decode_stack_equals_layer_by_layer(family, quantization):
    """Quantized models run decode-only steps as one C++ call (cpu/decode_stack.py). At
    every such step, with 1 to 3 sequences of different lengths decoding (past Gemma 3's
    sliding window too), its hidden states are bit-identical to the layers run one by
    one, so a request's tokens do not depend on whether a prefill shares its step."""
    _stack_against_layers(family[1], quantization)


@pytest.mark.parametrize("kv_cache_dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("family", ["llama", "gemma3"], indirect=True)
def test_a_narrower_kv_cache_in_the_decode_stack_and_the_layers(family, kv_cache_dtype):
    """EngineConfig.kv_cache_dtype: the decode stack writes each step's keys and values
    into the float16 / bfloat16 cache rounded as the layers' torch writes round them
    (nearest even), and reads them alike: its hidden states stay bit-identical to the
    layers run one by one, step after step (past Gemma 3's sliding window too)."""
    runner = _stack_against_layers(family[1], "int8", kv_cache_dtype)
    assert runner.kv_cache.dtype == getattr(torch, kv_cache_dtype)
