"""Scoring text by its likelihood: SamplingParams(prompt_logprobs=k) gives each prompt
token's log-probability after the ones before it, in vLLM's shape, against transformers;
over chunked prefills, a cached prefix and a preemption alike."""

from __future__ import annotations

import json

import pytest

from gristmill import LLM, SamplingParams
from tests.batch.inprocess import tiny_model
from tests.harness import transformers_dir

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PROMPTS = ["The cat sat on the mat because it was warm there.", "ab", "Numbers: 1 2 3 4 5 6 7 8 9 10 11 12"]


@pytest.fixture(scope="module")
def reference():
    llm = LLM(str(tiny_model()), device="cpu", quantization=None)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(transformers_dir(llm.model_dir))).eval()

    def logprobs(token_ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([token_ids])).logits[0].float().log_softmax(-1)
    return llm, logprobs


def _check(out, logprobs, k: int) -> None:
    assert out.error is None, out.error
    ids = out.prompt_token_ids
    want = logprobs(ids)
    assert len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
    for position, entry in enumerate(out.prompt_logprobs[1:], 1):
        token = ids[position]
        row = want[position - 1]
        assert entry[token].logprob == pytest.approx(row[token].item(), rel=1e-5, abs=1e-4)
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        top = row.topk(k).indices.tolist()
        assert set(top) <= set(entry) and len(entry) <= k + 1
        assert [entry[t].rank for t in top] == list(range(1, k + 1))
        assert entry[token].decoded_token is not None


def test_prompt_logprobs_match_transformers(reference):
    llm, logprobs = reference
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3))
    for out in outputs:
        _check(out, logprobs, 3)
    plain = llm.generate(PROMPTS[0], SamplingParams(max_tokens=2, temperature=0))[0]
    assert plain.prompt_logprobs is None and plain.token_ids == outputs[0].token_ids


def test_prompt_logprobs_over_chunks_and_a_cached_prefix(reference):
    _, logprobs = reference
    chunked = LLM(str(tiny_model()), device="cpu", quantization=None, max_num_batched_tokens=8, max_num_seqs=4)
    long_prompt = " ".join(PROMPTS)
    chunked.generate(long_prompt, SamplingParams(max_tokens=1))  # (its blocks are cached now)
    out = chunked.generate(long_prompt, SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    _check(out, logprobs, 0)
    assert all(len(entry) == 1 for entry in out.prompt_logprobs[1:])


def test_prompt_logprobs_survive_a_preemption(reference):
    _, logprobs = reference
    # Ten blocks of 16 tokens: two requests start together, and cannot both grow to their end.
    small = LLM(str(tiny_model()), device="cpu", quantization=None, num_kv_blocks=10, block_size=16)
    outs = small.generate([PROMPTS[0], PROMPTS[2]], SamplingParams(max_tokens=80, ignore_eos=True,
                                                                   prompt_logprobs=1))
    assert small.core.scheduler.num_preemptions > 0
    assert small.core.scheduler.block_manager.num_free_blocks == 10
    for out in outs:
        _check(out, logprobs, 1)


def test_a_batch_job_writes_each_prompts_logprobs(reference, tmp_path):
    import pyarrow.parquet as pq

    from tests.batch.inprocess import batch_main

    llm, logprobs = reference
    source = tmp_path / "in.jsonl"
    rows = [{"prompt": PROMPTS[0]}, {"prompt": ""}, {"prompt": PROMPTS[2]}]  # (an empty prompt: an error row)
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    result = batch_main(source, "-o", tmp_path / "out.parquet", "--model", str(tiny_model()), "--device", "cpu",
                        "--quantization", "none", "--prompt-logprobs", "0", "--max-tokens", "1")
    assert result.returncode == 0, result.stderr
    out = pq.read_table(tmp_path / "out.parquet").to_pylist()
    assert out[1]["prompt_logprobs"] == [] and out[1]["__inference_error__"]
    for row in (out[0], out[2]):
        ids = llm.get_tokenizer()(row["prompt"])["input_ids"]
        want = logprobs(ids)
        assert row["prompt_logprobs"][0] is None and len(row["prompt_logprobs"]) == len(ids)
        assert row["prompt_logprobs"][1:] == pytest.approx([want[i - 1][ids[i]].item() for i in range(1, len(ids))],
                                                          rel=1e-5, abs=1e-4)
