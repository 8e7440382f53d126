"""LoRA adapters per request and per row, offline (`LLM(enable_lora=True)`, `LoRARequest`):
against `peft`'s own model on tiny random-weight bases, rows of several adapters in one
step, slots evicted and reloaded, bad adapters failing only their requests, the prefix
cache kept apart per adapter."""

from __future__ import annotations

import pickle

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

from gristmill import LLM, LoRAAdapterError, LoRARequest, RequestError, SamplingParams  # noqa: E402
from tests.lora_models import make_adapter, peft_model, tiny_base  # noqa: E402
from tests.pooling_models import with_tokenizer  # noqa: E402

MAX_TOKENS = 6
TOP = 3
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=TOP)
PROMPTS = ["the quick brown fox", "a river runs through it", "hello"]
# float32 throughout (base and adapters), the same arithmetic as peft's in another order
# (the base matmul, then x A^T B^T on the rows; attention over paged blocks): as the
# families' parity with transformers (tests/model/test_parity.py), within 1e-4.
ATOL = 1e-4


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _lora(adapter, lora_id: int) -> LoRARequest:
    return LoRARequest(adapter.name, lora_id, str(adapter))


def _engine(base, quantization=None, **options) -> LLM:
    return LLM(str(base), device="cpu", quantization=quantization, enable_lora=True, max_model_len=64,
               num_kv_blocks=64, block_size=4, **options)


@torch.no_grad()
def _peft_greedy(model, prompt_ids: list[int]) -> tuple[list[int], list[torch.Tensor]]:
    """peft's greedy tokens and, at each, the log-softmax of its logits."""
    ids, logprobs = list(prompt_ids), []
    for _ in range(MAX_TOKENS):
        row = model(torch.tensor([ids])).logits[0, -1].float().log_softmax(-1)
        logprobs.append(row)
        ids.append(int(row.argmax()))
    return ids[len(prompt_ids):], logprobs


def _assert_matches_peft(output, model):
    tokens, rows = _peft_greedy(model, output.prompt_token_ids)
    completion = output.outputs[0]
    assert completion.error is None
    assert completion.token_ids == tokens
    for entry, row in zip(completion.logprobs, rows):
        top = row.topk(TOP)
        for token, value in zip(top.indices.tolist(), top.values.tolist()):
            assert entry[token].logprob == pytest.approx(value, abs=ATOL)


def _same(a, b, atol=1e-5):
    """Two outputs of the same request: the same tokens, the same top logprobs."""
    ca, cb = a.outputs[0], b.outputs[0]
    assert ca.error is None and cb.error is None
    assert ca.token_ids == cb.token_ids
    for ea, eb in zip(ca.logprobs, cb.logprobs):
        assert ea.keys() == eb.keys()
        for token in ea:
            assert ea[token].logprob == pytest.approx(eb[token].logprob, abs=atol)


def _idle(llm) -> bool:
    stats, slots = llm.core.stats(), llm.core.lora_slots
    return (stats["num_free_blocks"] == stats["num_total_blocks"] and not llm.core.has_unfinished
            and not any(slots.users))


# -- parity with peft ---------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_greedy_tokens_and_logprobs_are_peft_s(family):
    """Adapters of different ranks, modules and scalings (rsLoRA), and the base, in one
    call, each row as peft's model of its adapter computes it."""
    base = tiny_base(family)
    adapters = [make_adapter(base, "all-r8", 11),
                make_adapter(base, "qv-r4", 12, r=4, lora_alpha=32, targets=("q_proj", "v_proj")),
                make_adapter(base, "mlp-r16-rs", 13, r=16, lora_alpha=8, use_rslora=True,
                             targets=("gate_proj", "up_proj", "down_proj", "o_proj"))]
    llm = _engine(base, max_loras=3)
    loras = [_lora(a, i + 1) for i, a in enumerate(adapters)] + [None]
    outputs = llm.generate(["the quick brown fox"] * 4, GREEDY, use_tqdm=False, lora_request=loras)
    for output, adapter in zip(outputs, [*adapters, None]):
        _assert_matches_peft(output, peft_model(base, adapter))
    assert len({tuple(o.outputs[0].token_ids) for o in outputs}) > 1  # the adapters change the answer
    assert _idle(llm)


def test_an_adapter_gives_what_its_merged_weights_give(tmp_path):
    """An adapter's rows equal the base with the adapter merged into its weights (peft's
    merge_and_unload, saved as a plain checkpoint, run without LoRA): the update is the
    low-rank form of exactly that weight change."""
    base = tiny_base("llama")
    adapter = make_adapter(base, "all-r8", 11)
    merged_dir = tmp_path / "merged"
    peft_model(base, adapter).merge_and_unload().save_pretrained(merged_dir)
    with_tokenizer(merged_dir)
    with_adapter = _engine(base, max_loras=1).generate(PROMPTS, GREEDY, use_tqdm=False,
                                                       lora_request=_lora(adapter, 1))
    merged = LLM(str(merged_dir), device="cpu", quantization=None, max_model_len=64, num_kv_blocks=64,
                 block_size=4).generate(PROMPTS, GREEDY, use_tqdm=False)
    for a, b in zip(with_adapter, merged):
        _same(a, b, atol=ATOL)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_llama_cpp_lora_gguf_gives_what_its_peft_directory_gives(family, tmp_path):
    """llama.cpp's LoRA GGUF of an adapter (its own convert_lora_to_gguf.py, as llama.cpp
    users make one) runs as the PEFT directory it came from: the same tokens and logprobs
    (a llama file's q/k B rows put back from llama.cpp's rotary order); one that is not
    a LoRA GGUF fails only its requests, saying what it is."""
    from tests.gguf_converter import convert_lora

    base = tiny_base(family)
    adapter = make_adapter(base, "to-gguf", seed=21, r=8, lora_alpha=32)
    gguf = convert_lora(adapter, base, tmp_path / f"{family}-lora.gguf")
    llm = _engine(base, max_loras=2)
    by_dir = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=LoRARequest("dir", 1, str(adapter)))
    by_gguf = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=LoRARequest("gguf", 2, str(gguf)))
    plain = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for a, b, c in zip(by_dir, by_gguf, plain):
        _same(a, b)
        moved = [abs(ea[t].logprob - ec[t].logprob) for ea, ec in zip(a.outputs[0].logprobs, c.outputs[0].logprobs)
                 for t in ea.keys() & ec.keys()]
        # (the adapter changes the output, so the comparison can fail)
        assert a.outputs[0].token_ids != c.outputs[0].token_ids or max(moved) > 1e-2
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(gguf.read_bytes()[:200])
    [bad, good] = llm.generate([PROMPTS[0]] * 2, GREEDY, use_tqdm=False,
                               lora_request=[LoRARequest("cut", 3, str(truncated)), LoRARequest("gguf", 2, str(gguf))])
    assert bad.outputs[0].error.startswith("LoRAAdapterError: LoRA adapter 'cut': ")
    assert "not a readable GGUF file" in bad.outputs[0].error
    _same(good, by_gguf[0])
    # a model's GGUF given as an adapter: refused before any engine loads it, saying so
    from gristmill.lora import check_adapter
    from gristmill.paths import default_model_path
    with pytest.raises(LoRAAdapterError, match=r"LoRA adapter 'model': .* is a model, not an adapter"):
        check_adapter(LoRARequest("model", 4, str(default_model_path())), 16)


# -- rows of several adapters in one step ------------------------------------------------------

@pytest.fixture(scope="module")
def llama():
    base = tiny_base("llama")
    return base, [make_adapter(base, "all-r8", 11), make_adapter(base, "qv-r4", 12, r=4, lora_alpha=32,
                                                                targets=("q_proj", "v_proj")),
                  make_adapter(base, "mlp-r16-rs", 13, r=16, lora_alpha=8, use_rslora=True,
                               targets=("gate_proj", "up_proj", "down_proj", "o_proj"))]


@pytest.mark.parametrize("quantization,async_scheduling", [(None, False), ("int8", False), ("int8", True)],
                         ids=["float", "int8", "int8-async"])
def test_a_mixed_step_gives_each_row_what_it_gets_alone(llama, quantization, async_scheduling):
    """Rows of three adapters and of the base, prompts of different lengths, in the same
    steps (prefills, then decodes): each is what it is run alone. With int8 the base's
    decode steps alone take the C++ decode stack, with adapter rows the layers one by
    one: the same arithmetic. With async scheduling (CUDA's way) each step is scheduled
    while the one before is in flight."""
    base, adapters = llama
    llm = _engine(base, quantization, max_loras=3, max_lora_rank=16, async_scheduling=async_scheduling)
    loras = [_lora(a, i + 1) for i, a in enumerate(adapters)] + [None]
    prompts = [p for p in PROMPTS for _ in loras]
    per_row = loras * len(PROMPTS)
    mixed = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=per_row)
    for prompt, lora, output in zip(prompts, per_row, mixed):
        [alone] = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=lora)
        _same(output, alone, atol=1e-4)
    assert _idle(llm)


def test_a_quantized_base_s_decode_steps_apply_the_adapter(llama):
    """int8 base: the logprob of each token generated with an adapter (decode steps) is
    the one a prefill of the whole text with the adapter gives it (prompt logprobs): the
    decode steps apply the adapter as prefills do (the C++ decode stack, which knows no
    adapter, is not taken for them)."""
    base, adapters = llama
    llm = _engine(base, "int8", max_loras=1)
    lora = _lora(adapters[0], 1)
    [generated] = llm.generate(PROMPTS[0], GREEDY, use_tqdm=False, lora_request=lora)
    [based] = llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)
    completion = generated.outputs[0]
    assert completion.token_ids != based.outputs[0].token_ids
    llm.reset_prefix_cache()
    ids = generated.prompt_token_ids + completion.token_ids
    [scored] = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0), use_tqdm=False,
                            lora_request=lora)
    prefill = scored.prompt_logprobs[len(generated.prompt_token_ids):]
    for token, entry, again in zip(completion.token_ids, completion.logprobs, prefill):
        assert entry[token].logprob == pytest.approx(again[token].logprob, abs=1e-4)


# -- slots ------------------------------------------------------------------------------------

def test_more_adapters_than_slots_wait_for_one_and_evict_the_least_recently_used(llama):
    base, adapters = llama
    many = adapters + [make_adapter(base, "kv-r2", 14, r=2, targets=("k_proj", "v_proj", "up_proj"))]
    llm = _engine(base, max_loras=2, max_lora_rank=16)
    loras = [_lora(a, i + 1) for i, a in enumerate(many)]
    prompts = [p for p in PROMPTS for _ in loras]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras * len(PROMPTS))
    stats = llm.core.stats()
    assert stats["num_lora_loads"] >= len(many) and len(stats["lora_adapters"]) == 2
    roomy = _engine(base, max_loras=len(many), max_lora_rank=16)
    expected = roomy.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras * len(PROMPTS))
    for output, alone in zip(outputs, expected):
        _same(output, alone, atol=1e-4)
    # used again: the least recently used of the two in slots goes first
    loaded = stats["lora_adapters"]
    fresh = next(lora for lora in loras if lora.lora_name not in loaded)
    llm.generate(PROMPTS[2], GREEDY, use_tqdm=False, lora_request=fresh)
    assert llm.core.stats()["lora_adapters"] == [loaded[1], fresh.lora_name]
    assert _idle(llm)


# -- failures ---------------------------------------------------------------------------------

def _broken_adapters(good, tmp_path):
    """name -> (directory, what its error says) of adapters that cannot run."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(good / "adapter_model.safetensors")
    config = (good / "adapter_config.json").read_text()

    def variant(name, change=None, weights=None, config_text=config):
        path = tmp_path / name
        path.mkdir()
        (path / "adapter_config.json").write_text(config_text)
        if weights is not None:
            (path / "adapter_model.safetensors").write_bytes(weights)
        else:
            changed = dict(tensors)
            change(changed)
            save_file(changed, path / "adapter_model.safetensors")
        return path

    key = next(k for k in tensors if k.endswith("q_proj.lora_A.weight"))
    return {
        "missing": (tmp_path / "nowhere", "does not exist"),
        "corrupt": (variant("corrupt", weights=b"\x00" * 64), "cannot be read"),
        "shapes": (variant("shapes", lambda t: t.__setitem__(key, torch.zeros(8, 48))), "has shape (8, 48)"),
        "layers": (variant("layers", lambda t: t.__setitem__(key.replace("layers.0.", "layers.7."), t[key].clone())),
                   "which this model does not have"),
        "rank": (variant("rank", lambda t: None, config_text=config.replace('"r": 8', '"r": 64')),
                 "more than max_lora_rank"),
        "head": (variant("head", lambda t: t.__setitem__("base_model.model.lm_head.lora_A.weight", t[key].clone())),
                 "not a LoRA A or B matrix of a q/k/v/o"),
    }


def test_an_adapter_that_cannot_load_fails_only_the_requests_naming_it(llama, tmp_path):
    base, adapters = llama
    llm = _engine(base, max_loras=2, max_lora_rank=16)
    good = _lora(adapters[0], 1)
    [expected] = llm.generate(PROMPTS[0], GREEDY, use_tqdm=False, lora_request=good)
    [expected_base] = llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)
    for i, (name, (path, says)) in enumerate(_broken_adapters(adapters[0], tmp_path).items()):
        bad = LoRARequest(f"bad-{name}", 100 + i, str(path))
        outputs = llm.generate([PROMPTS[0]] * 4, GREEDY, use_tqdm=False, lora_request=[bad, good, None, bad])
        for output in (outputs[0], outputs[3]):
            completion = output.outputs[0]
            assert completion.finish_reason == "error" and not completion.token_ids
            assert completion.error.startswith(f"LoRAAdapterError: LoRA adapter 'bad-{name}'")
            assert says in completion.error, completion.error
        _same(outputs[1], expected, atol=1e-4)
        _same(outputs[2], expected_base, atol=1e-4)
        assert _idle(llm), name


def test_lora_requests_need_an_engine_with_lora_and_one_adapter_per_id(llama):
    base, adapters = llama
    plain = LLM(str(base), device="cpu", quantization=None, max_model_len=64, num_kv_blocks=16)
    lora = _lora(adapters[0], 1)
    with pytest.raises(RequestError, match="without LoRA; start it with enable_lora=True"):
        plain.generate("hello", GREEDY, use_tqdm=False, lora_request=lora)
    llm = _engine(base, max_loras=2)
    with pytest.raises(RequestError, match=r"one \(or None\) per prompt \(2\), got list of 3"):
        llm.generate(["a", "b"], GREEDY, use_tqdm=False, lora_request=[lora] * 3)
    clash = LoRARequest("other", 1, str(adapters[1]))
    a, b = llm.generate(["a", "b"], GREEDY, use_tqdm=False, lora_request=[lora, clash])
    assert a.outputs[0].error is None
    assert "lora_int_id 1 names adapter" in b.outputs[0].error and "its own lora_int_id" in b.outputs[0].error
    with pytest.raises(RequestError, match="lora_int_id must be an integer > 0"):
        LoRARequest("x", 0, "/somewhere")
    error = pickle.loads(pickle.dumps(LoRAAdapterError("adapter 'x' is missing", lora_name="x")))
    assert isinstance(error, RequestError) and error.lora_name == "x" and error.param == "lora_request"


def test_lora_request_takes_vllm_s_positional_order():
    lora = LoRARequest("sql", 3, "/adapters/sql")
    assert (lora.lora_name, lora.lora_int_id, lora.lora_path) == ("sql", 3, "/adapters/sql")
    assert (lora.name, lora.adapter_id, lora.path) == ("sql", 3, "/adapters/sql")


# -- the prefix cache ------------------------------------------------------------------------

def test_the_prefix_cache_never_shares_kv_between_adapters(llama):
    base, adapters = llama
    llm = _engine(base, max_loras=2)
    prompt = "one two three four five six seven eight nine ten eleven twelve"
    first, second = _lora(adapters[0], 1), _lora(adapters[1], 2)

    def hits_of(lora):
        before = llm.core.stats()["prefix_cache_hits"]
        [output] = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=lora)
        return llm.core.stats()["prefix_cache_hits"] - before, output

    cold, output_first = hits_of(first)
    assert cold == 0
    assert hits_of(second)[0] == 0 and hits_of(None)[0] == 0  # other adapters, the base: computed anew
    warm, again = hits_of(first)
    assert warm > 0  # the same adapter reuses its own blocks
    _same(again, output_first, atol=1e-4)


# -- pooling ----------------------------------------------------------------------------------

def test_embed_runs_an_adapter_as_peft_does():
    base = tiny_base("qwen3")
    adapter = make_adapter(base, "all-r8", 21)
    llm = LLM(str(base), task="embed", device="cpu", quantization=None, enable_lora=True, max_model_len=64)
    lora = _lora(adapter, 1)
    with_adapter, without = llm.embed(["hello there", "hello there"], use_tqdm=False, lora_request=[lora, None])
    for output, model in ((with_adapter, peft_model(base, adapter)), (without, peft_model(base, None))):
        with torch.no_grad():
            hidden = model(torch.tensor([output.prompt_token_ids]), output_hidden_states=True).hidden_states[-1]
        expected = torch.nn.functional.normalize(hidden[0, -1], dim=-1)
        assert torch.allclose(torch.tensor(output.outputs.embedding), expected, atol=ATOL)


# -- the other offline faces ------------------------------------------------------------------

TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


def test_chat_takes_a_lora_request_per_conversation(llama):
    base, adapters = llama
    llm = _engine(base, max_loras=1)
    lora = _lora(adapters[0], 1)
    conversation = [{"role": "user", "content": "hello there"}]
    with_adapter, without = llm.chat([conversation, conversation], GREEDY, use_tqdm=False, chat_template=TEMPLATE,
                                     lora_request=[lora, None])
    [generated] = llm.generate([with_adapter.prompt_token_ids], GREEDY, use_tqdm=False, lora_request=lora)
    _same(with_adapter, generated)
    assert with_adapter.outputs[0].token_ids != without.outputs[0].token_ids


def test_adapters_load_in_a_child_process_core_and_a_bad_one_fails_only_its_request(llama, tmp_path):
    """LLM(core_process=True): the adapters load in the engine-core process; its error
    reaches the caller with its type and the adapter's name."""
    base, adapters = llama
    good = _lora(adapters[0], 1)
    bad = LoRARequest("missing", 2, str(tmp_path / "nowhere"))
    [expected] = _engine(base, max_loras=1).generate(PROMPTS[1], GREEDY, use_tqdm=False, lora_request=good)
    llm = _engine(base, max_loras=1, core_process=True)
    try:
        ok, failed = llm.generate([PROMPTS[1]] * 2, GREEDY, use_tqdm=False, lora_request=[good, bad])
    finally:
        llm.client.shutdown()
    _same(ok, expected, atol=1e-4)
    assert failed.outputs[0].error.startswith("LoRAAdapterError: LoRA adapter 'missing'")


def test_the_memory_check_counts_the_slots_as_they_are_allocated(llama):
    """The figure a start checks against the memory available is what the slots take."""
    from gristmill.model.memory import lora_slot_bytes

    base, _ = llama
    llm = _engine(base, max_loras=3, max_lora_rank=8)
    runner = llm.core.executor
    allocated = sum(t.numel() * t.element_size() for site in runner.lora.sites for t in (site.a, site.b))
    assert allocated == lora_slot_bytes(runner.hf_config, 3, 8, 4)


def test_async_engine_streams_with_an_adapter_and_a_bad_one_raises_its_typed_error(llama, tmp_path):
    import asyncio

    from gristmill import AsyncEngine, EngineConfig

    base, adapters = llama
    good = _lora(adapters[0], 1)
    [expected] = _engine(base, max_loras=1).generate(PROMPTS[2], GREEDY, use_tqdm=False, lora_request=good)

    async def run():
        config = EngineConfig(model=str(base), device="cpu", quantization=None, enable_lora=True, max_model_len=64,
                              num_kv_blocks=64, block_size=4)
        async with AsyncEngine(config) as engine:
            async for output in engine.generate(PROMPTS[2], GREEDY, lora_request=good, output_kind="final"):
                last = output
            with pytest.raises(LoRAAdapterError, match="LoRA adapter 'missing'.*does not exist"):
                async for _ in engine.generate(PROMPTS[2], GREEDY, lora_request=LoRARequest(
                        "missing", 2, str(tmp_path / "nowhere"))):
                    pass
            return last

    _same(asyncio.run(run()), expected, atol=1e-4)
