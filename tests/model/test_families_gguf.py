"""GGUF files of the families people run (Llama 3.2 and 3.1, Qwen3, Qwen2.5, Gemma 3 1B),
as llama.cpp's own converter writes them (tests/gguf_families.py), against transformers on
the HF directories they were converted from: the same greedy tokens (and text) and
log-probabilities on the exact float path, the same token ids for text and chat (and
llama.cpp's own on its tokenizer tests), the end-of-sequence tokens and config of the
original, and int8 weights that mostly pick float's tokens."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")  # (llama.cpp's converter reads Gemma's tokenizer.model with it)

from gristmill import LLM, SamplingParams  # noqa: E402
from gristmill.model.loader import load_config  # noqa: E402
from tests import gguf_converter, gguf_families  # noqa: E402

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    return", "Ünïcödé — 東京 🦙 3.14159"]
# "Cửa Việt": " Việt" is one Llama 3 token, which merging would split in three.
TEXTS = [*PROMPTS, "  leading spaces,\ttabs\n\nand newlines  ", "I've been 'told he's there, 'RE you sure?",
         "Cửa Việt"]
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there! 2+2?"},
        {"role": "assistant", "content": "4."}, {"role": "user", "content": "And 3 × 3?"}]
MAX_TOKENS = 32
TOP_K = 5
# Log-probabilities on the float path: float32 on both sides, summed in other orders.
LOGPROB_TOLERANCE = dict(rel=1e-5, abs=1e-4)
# The fewest of float's greedy positions int8 weights must agree on (teacher-forced).
INT8_AGREEMENT = 0.75
# Engines as small as these prompts need (the default KV cache takes a GiB).
ENGINE = dict(device="cpu", max_model_len=256, num_kv_blocks=64)


@dataclass
class Family:
    """One family's files, gristmill on its GGUF (the float path), transformers on its HF directory."""

    files: gguf_families.FamilyFiles
    llm: LLM
    reference: object  # the transformers model
    tokenizer: object  # the transformers tokenizer
    cache_dir: Path

    def reference_logprobs(self, token_ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return self.reference(torch.tensor([token_ids])).logits[0].float().log_softmax(-1)


@pytest.fixture(scope="session")
def family_files(tmp_path_factory):
    """Each family's HF directory and its GGUF, built once."""
    return gguf_families.build(tmp_path_factory.mktemp("gguf-families"))


@pytest.fixture(scope="module", params=list(gguf_families.FAMILIES))
def family(request, family_files, tmp_path_factory):
    files = family_files[request.param]
    cache_dir = tmp_path_factory.mktemp(f"cache-{request.param}")
    llm = LLM(model=str(files.gguf), quantization=None, cache_dir=str(cache_dir), **ENGINE)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        files.hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
    return Family(files, llm, reference, transformers.AutoTokenizer.from_pretrained(files.hf_dir), cache_dir)


def _assert_logprobs(entry: dict, row: torch.Tensor, token: int, where: str) -> None:
    """One position's {token: Logprob} (the token at it and the top-k) against transformers'."""
    assert entry[token].logprob == pytest.approx(row[token].item(), **LOGPROB_TOLERANCE), where
    top = row.topk(TOP_K)
    assert set(top.indices.tolist()) <= set(entry), where
    for token_id, logprob in zip(top.indices.tolist(), top.values.tolist()):
        assert entry[token_id].logprob == pytest.approx(logprob, **LOGPROB_TOLERANCE), where


def test_greedy_tokens_and_logprobs_are_transformers(family):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=TOP_K,
                            prompt_logprobs=TOP_K)
    for out in family.llm.generate(PROMPTS, params, use_tqdm=False):
        ids = out.prompt_token_ids + out.token_ids
        want = family.reference_logprobs(ids)
        start = len(out.prompt_token_ids) - 1
        assert len(out.token_ids) == MAX_TOKENS
        assert want[start:-1].argmax(-1).tolist() == out.token_ids, out.prompt
        assert out.text == family.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        for position, entry in enumerate(out.prompt_logprobs[1:], 1):
            _assert_logprobs(entry, want[position - 1], ids[position], f"{out.prompt!r} prompt token {position}")
        for step, entry in enumerate(out.logprobs):
            _assert_logprobs(entry, want[start + step], out.token_ids[step], f"{out.prompt!r} token {step}")


def test_token_ids_are_transformers(family):
    ours, theirs = family.llm.tokenizer, family.tokenizer
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text), text
    # Every added token (control and user-defined: <|eot_id|>, <think>, Gemma's runs of
    # newlines...) read as itself in text.
    text = "x".join(token.content for token in theirs.added_tokens_decoder.values()) + " after"
    assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False)
    # A chat as LLM.chat tokenizes it: the real chat template (from the GGUF), its special tokens.
    [out] = family.llm.chat(CHAT, SamplingParams(max_tokens=1), use_tqdm=False)
    rendered = theirs.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert out.prompt_token_ids == theirs.encode(rendered, add_special_tokens=False)


def test_token_ids_are_llama_cpps_own(family):
    """llama.cpp's tokenizer tests (texts, and the ids llama.cpp gives them) on the families
    whose vocabulary they cover."""
    vocab = family.files.family.llama_cpp_vocab
    if vocab is None:
        pytest.skip(f"llama.cpp ships no tokenizer test of {family.files.family.name}'s vocabulary (Gemma 3's is "
                    f"the bundled model's: test_gemma3_vocabulary_is_the_bundled_models)")
    path = gguf_converter.vocab_file(vocab)
    texts = path.with_name(path.name + ".inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    expected = path.with_name(path.name + ".out").read_text(encoding="utf-8").split("\n")
    for text, ids in zip(texts, expected):
        assert family.llm.tokenizer.encode(text, add_special_tokens=False) == [int(i) for i in ids.split()], text


def test_gemma3_vocabulary_is_the_bundled_models(family_files):
    """The tiny Gemma 3's GGUF holds the vocabulary of a real Gemma 3 GGUF, token for token
    (text, score and type): the tokenizer.model it was converted from is Gemma 3's."""
    from gristmill.gguf_file import GGUFFile
    from gristmill.paths import default_model_path

    ours, real = GGUFFile(family_files["gemma3"].gguf).fields, GGUFFile(default_model_path()).fields
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
        assert list(ours[key]) == list(real[key]), key


def test_generation_ends_where_the_originals_does(family):
    """At each end-of-sequence id of the original's config.json and generation_config.json
    (a GGUF names one: the others are found by their text, as llama.cpp finds them)."""
    ids = set()
    for eos in (transformers.AutoConfig.from_pretrained(family.files.hf_dir).eos_token_id,
                transformers.GenerationConfig.from_pretrained(family.files.hf_dir).eos_token_id):
        ids.update([eos] if isinstance(eos, int) else eos)
    ids = sorted(ids)
    forced = [SamplingParams(max_tokens=4, temperature=0, logit_bias={token: 100}) for token in ids]
    for token, out in zip(ids, family.llm.generate(["Once upon a time"] * len(ids), forced, use_tqdm=False)):
        assert (out.finish_reason, len(out.token_ids)) == ("stop", 1), token


# What a GGUF does not carry of a config.json (the converted directory has gristmill's
# defaults): the classes it was saved from, a pad token, the order of the end-of-sequence
# ids (test_generation_ends_where_the_originals_does checks them).
_NOT_IN_GGUF = {"architectures", "pad_token_id", "eos_token_id"}


def test_config_is_the_originals(family):
    ours, original = load_config(family.llm.model_dir), load_config(family.files.hf_dir)
    for field in original.__dataclass_fields__:
        if field in _NOT_IN_GGUF:
            continue
        want, got = getattr(original, field), getattr(ours, field)
        if isinstance(want, float):  # (a GGUF holds float32)
            assert got == pytest.approx(want, rel=1e-6), field
        else:
            assert got == want, field


def test_int8_weights_mostly_pick_floats_tokens(family):
    """The default quantization (int8 on CPU) on the same GGUF: teacher-forced on float's
    greedy answers, its best token after each prefix is float's at most positions."""
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    scoring = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)  # (the best token at each)
    quantized = LLM(model=str(family.files.gguf), cache_dir=str(family.cache_dir), **ENGINE)
    agree = total = 0
    for out in family.llm.generate(PROMPTS, greedy, use_tqdm=False):
        [scored] = quantized.generate([out.prompt_token_ids + out.token_ids], scoring, use_tqdm=False)
        answer = scored.prompt_logprobs[len(out.prompt_token_ids):]
        best = [min(entry, key=lambda token: entry[token].rank) for entry in answer]
        agree += sum(ours == floats for ours, floats in zip(best, out.token_ids))
        total += len(out.token_ids)
    assert agree >= INT8_AGREEMENT * total, f"int8 picked float's token at {agree} of {total} positions"
