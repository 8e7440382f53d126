"""The CUDA path on a real GPU: parity with transformers for every tiny family in float32
and bfloat16 through the real scheduler (batched prefills of different lengths, chunked
prefill, preemption, prefix caching) with decode steps replayed from CUDA graphs; graph
replay equal to eager; seeded sampling reproducible; fatal faults; KV cache sizing."""

from __future__ import annotations

import os

import pytest
import torch

from gristmill import LLM, SamplingParams
from gristmill.config import EngineConfig
from gristmill.model.runner import ModelRunner
from tests.model.test_parity import BLOCK_SIZE, _prompt, _run_and_compare, family  # noqa: F401

GPU_MODEL = os.environ.get("GRISTMILL_GPU_MODEL")  # set by the GPU machine's remote.sh
needs_gpu_model = pytest.mark.skipif(not GPU_MODEL, reason="GRISTMILL_GPU_MODEL (a model with a tokenizer) is unset")

# (atol, rtol of the largest logit). bf16 keeps 8 bits of mantissa: through 3-4 layers the
# logits of these random models move by about 1% of their largest magnitude (which reaches
# ~30 with a tied, unit-variance embedding).
TOL = {"float32": dict(atol=2e-4), "bfloat16": dict(atol=0.05, rtol=0.015)}


def _runner(path, dtype, num_kv_blocks=64, max_num_seqs=8, max_num_batched_tokens=256) -> ModelRunner:
    return ModelRunner(EngineConfig(
        model=str(path), device="cuda", dtype=dtype, quantization=None, block_size=BLOCK_SIZE,
        num_kv_blocks=num_kv_blocks, max_model_len=128, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_parity_batched_chunked_and_prefix_cached(family, dtype):
    name, path, reference = family
    runner = _runner(path, dtype)
    assert runner.backend.name == "cuda" and runner.graphs is not None
    prefix = _prompt(20, seed=7)
    prompts = {f"r{n}": _prompt(n, seed=n) for n in (5, 11, 17, 30)}
    late = {2: {"late13": _prompt(13, seed=99), "shares20": prefix + _prompt(4, seed=8)},
            5: {"again20": prefix + _prompt(6, seed=9)}}
    for budget in (256, 12):
        result = _run_and_compare(runner, reference, dict(prompts, first20=prefix + _prompt(3, seed=1)),
                                  max_num_seqs=8, max_num_batched_tokens=budget, max_tokens=6, late=late,
                                  **TOL[dtype])
        facts = result.pop("_")
        assert set(result) == {*prompts, "first20", "late13", "shares20", "again20"}
        assert facts["max_decode_batch"] >= 5 and facts["mixed_steps"] >= 1 and facts["hit_tokens"] > 0, facts
        print(f"{name} {dtype} budget {budget}: max logit diff {facts['max_diff']:.2e}")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_parity_with_preemption(family, dtype):
    name, path, reference = family
    runner = _runner(path, dtype, num_kv_blocks=14)
    prompts = {"a": _prompt(20, seed=4), "b": _prompt(18, seed=5), "c": _prompt(9, seed=6)}
    result = _run_and_compare(runner, reference, prompts, max_num_seqs=8, max_num_batched_tokens=64,
                              max_tokens=8, **TOL[dtype])
    facts = result.pop("_")
    assert facts["preemptions"] >= 1, facts
    assert result == {rid: 8 for rid in prompts}


@needs_gpu_model
@pytest.mark.parametrize("lengths,max_model_len", [((3, 9, 14, 22, 5), 256),
                                                   # decodes past 512 keys: split (flash-decoding) graphs
                                                   ((600, 9, 1100, 1500), 2048)])
def test_graph_replay_equals_eager(lengths, max_model_len):
    prompts = [_prompt(n, seed=n) for n in lengths]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3)
    outs = {}
    for eager in (False, True):
        llm = LLM(GPU_MODEL, device="cuda", dtype="float32", max_model_len=max_model_len, max_num_seqs=8,
                  enforce_eager=eager, gpu_memory_utilization=0.3)
        assert (llm.core.executor.graphs is None) == eager
        if not eager:
            assert llm.core.executor.graphs.splits == (1 if max_model_len <= 512 else max_model_len // 512)
        outs[eager] = llm.generate(prompts, params, use_tqdm=False)
    for graph, eager in zip(outs[False], outs[True]):
        assert graph.token_ids == eager.token_ids
        for a, b in zip(graph.outputs[0].logprobs, eager.outputs[0].logprobs):
            assert a.keys() == b.keys() and all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)


@needs_gpu_model
def test_seeded_sampling_is_reproducible_whatever_the_batch():
    """float32, so that the batch size cuBLAS sees cannot move a logit enough to matter."""
    llm = LLM(GPU_MODEL, device="cuda", dtype="float32", max_model_len=256, max_num_seqs=8,
              gpu_memory_utilization=0.3)
    seeded = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    alone = llm.generate([_prompt(7, seed=1)], seeded, use_tqdm=False)[0].token_ids
    assert llm.generate([_prompt(7, seed=1)], seeded, use_tqdm=False)[0].token_ids == alone
    others = [SamplingParams(max_tokens=16, temperature=0.8, ignore_eos=True)] * 4
    crowd = llm.generate([_prompt(n, seed=n) for n in (3, 11, 5, 20)] + [_prompt(7, seed=1)],
                         others + [seeded], use_tqdm=False)
    assert crowd[-1].token_ids == alone
    other_seed = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=99, ignore_eos=True)
    assert llm.generate([_prompt(7, seed=1)], other_seed, use_tqdm=False)[0].token_ids != alone


@pytest.mark.parametrize("family", ["llama"], indirect=True)
def test_kv_cache_that_does_not_fit_is_refused_at_start(family):
    _, path, _ = family
    free, total = torch.cuda.mem_get_info()
    with pytest.raises(ValueError, match=r"does not fit on cuda.*lower kv_cache_memory_gb"):
        ModelRunner(EngineConfig(model=str(path), device="cuda", kv_cache_memory_gb=2 * total / 2**30))
    with pytest.raises(ValueError, match=r"does not fit on cuda.*lower num_kv_blocks"):
        ModelRunner(EngineConfig(model=str(path), device="cuda", num_kv_blocks=10**9))
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.0001 .* leaves no room"):
        ModelRunner(EngineConfig(model=str(path), device="cuda", gpu_memory_utilization=0.0001))
    runner = ModelRunner(EngineConfig(model=str(path), device="cuda", gpu_memory_utilization=0.5))
    used = runner.kv_cache.numel() * runner.kv_cache.element_size()
    assert 0.2 * total < used < 0.5 * total


@needs_gpu_model
@pytest.mark.parametrize("spec,says", [("forward@step=4", "injected fault at 'forward'"),
                                       # a real illegal memory access, reported asynchronously
                                       ("device_error@step=4", "an illegal memory access was encountered"),
                                       ("core_exit@step=4", "exited with code 17")])
def test_fatal_faults_fail_every_request_within_a_second(monkeypatch, spec, says):
    from gristmill import faults
    from tests.engine.test_async_engine import assert_a_fatal_fault_fails_every_request, start_engine

    try:
        engine = start_engine(monkeypatch, spec, model=GPU_MODEL, device="cuda", max_model_len=2048)
    finally:
        faults.load()  # the client's own copy of the spec, read at its start
    assert_a_fatal_fault_fails_every_request(engine, says)


@needs_gpu_model
def test_real_size_gemma3_greedy_equals_transformers():
    """Gemma 3 270M's shape (random bf16 weights): our greedy tokens equal transformers'."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(GPU_MODEL)
    texts = ["The capital of France is", "def fib(n):", "Once upon a time", "1, 2, 3, 4,"]
    llm = LLM(GPU_MODEL, device="cuda", max_model_len=1024)
    ours = llm.generate(texts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(GPU_MODEL, dtype=torch.bfloat16).cuda().eval()
    agree = 0
    for text, out in zip(texts, ours):
        ids = tokenizer(text, return_tensors="pt").input_ids.cuda()
        with torch.inference_mode():
            theirs = hf.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=None)[0, ids.shape[1]:]
        agree += out.token_ids == theirs.tolist()
    assert agree >= 3, agree  # bf16 near-ties may flip one prompt


@needs_gpu_model
def test_a_pool_of_two_engines_shares_one_gpu():
    """`concurrency=2` on a machine with one GPU: both replicas go on it, each with half of
    gpu_memory_utilization, started one after the other; together they hold about the KV
    cache one would, and both generate."""
    import asyncio

    from gristmill import gpus
    from gristmill.batch import runtime
    from gristmill.batch.engines import start_pool
    from gristmill.batch.rows import RowRequest

    assert gpus.visible_gpu_count() == torch.cuda.device_count()
    config = EngineConfig(model=GPU_MODEL, device="cuda", max_model_len=1024, max_num_seqs=16,
                          gpu_memory_utilization=0.5)
    alone = start_pool(config, concurrency=1)
    try:
        single_blocks = runtime.call(alone.replicas[0].engine.stats())["num_total_blocks"]
    finally:
        runtime.call(alone.close())
    pool = start_pool(config, concurrency=2)
    try:
        engines = [r.engine for r in pool.replicas]
        stats = [runtime.call(e.stats()) for e in engines]
        visible = [e._core_env["CUDA_VISIBLE_DEVICES"] for e in engines]
        assert (visible[0] == visible[1]) == (torch.cuda.device_count() == 1), visible
        if torch.cuda.device_count() == 1:
            assert [e.config.gpu_memory_utilization for e in engines] == [0.25, 0.25]
            both = sum(s["num_total_blocks"] for s in stats)
            assert 0.7 * single_blocks < both < 1.1 * single_blocks, (both, single_blocks)

        async def rows():
            params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
            return await asyncio.gather(*(pool.generate(RowRequest(i, f"Row {i}:", None, None, params))
                                          for i in range(8)))
        generated = runtime.call(rows())
        assert all(len(g.token_ids) == 8 for g in generated)
        assert all(len(r.in_flight) == 0 for r in pool.replicas)
    finally:
        runtime.call(pool.close())


@needs_gpu_model
def test_the_graphs_hold_one_logits_buffer():
    """Every captured size (unsplit and split) writes its logits into one buffer: before,
    each held its own, rows x vocab apiece, and 512 rows ran out of memory mid-job."""
    llm = LLM(GPU_MODEL, device="cuda", max_model_len=2048, max_num_seqs=256, gpu_memory_utilization=0.3)
    graphs = llm.core.executor.graphs
    assert graphs.splits > 1 and len(graphs.graphs) == 2 * len(graphs.sizes)
    one_buffer = 256 * llm.core.capacity.vocab_size * 2
    assert graphs.memory < 1.2 * one_buffer + 64 * 2**20, (graphs.memory, one_buffer)
    outs = llm.generate([_prompt(n, seed=n) for n in (700, 20, 300)],
                        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [8, 8, 8]
