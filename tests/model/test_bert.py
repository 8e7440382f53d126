"""BERT encoders and pooling against transformers and sentence-transformers: tiny random
models for the arithmetic of each piece, the bundled all-MiniLM-L6-v2 end to end (float32
and int8), and the runner built for a model with no KV cache."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
sentence_transformers = pytest.importorskip("sentence_transformers")

from gristmill.config import EngineConfig  # noqa: E402
from gristmill.model.backends.cpu import CpuBackend  # noqa: E402
from gristmill.model.context import forward_context  # noqa: E402
from gristmill.model.cpu import quant  # noqa: E402
from gristmill.model.cpu.qlinear import Int8Linear  # noqa: E402
from gristmill.model.layers import PagedAttention  # noqa: E402
from gristmill.model.loader import load_config, load_weights  # noqa: E402
from gristmill.model.loader.config import config_from_dict  # noqa: E402
from gristmill.model.metadata import StepMetadata  # noqa: E402
from gristmill.model.models import BertForSequenceClassification, BertModel, LlamaForCausalLM, model_class  # noqa: E402
from gristmill.model.pooling import build_pooler, pool, read_pooling_spec  # noqa: E402
from gristmill.model.runner import ModelRunner  # noqa: E402
from gristmill.paths import default_embedding_model_path  # noqa: E402
from gristmill.tokenizer import load_tokenizer  # noqa: E402

TEXT = Path(__file__).parent.parent / "data" / "public_domain_english.txt"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=128)
SENTENCES = ["A man is eating food.", "Hi", "The quick brown fox jumps over the lazy dog near the river bank today.",
             "¿Dónde está la biblioteca? Über café, naïve résumé.", "1234 5678 = 6912",
             "When in the Course of human events, it becomes necessary for one people to dissolve the "
             "political bands which have connected them with another"]


def _sentences(count: int) -> list[str]:
    """`count` varied sentences: a few written here (case, accents, numbers, one word), the
    rest windows of 1 to 32 words of the test text."""
    words = TEXT.read_text().split()
    rng = np.random.default_rng(7)
    windows = []
    while len(SENTENCES) + len(windows) < count:
        length = int(rng.integers(1, 33))
        start = int(rng.integers(0, len(words) - length))
        windows.append(" ".join(words[start:start + length]))
    return SENTENCES + windows


def _step(lengths: list[int]) -> StepMetadata:
    """The metadata of an encoder step of whole sequences of `lengths`, as the runner's
    backend uploads it (only the sequence bounds matter: there is no KV cache)."""
    bounds = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    return StepMetadata(slot_mapping=torch.full((bounds[-1],), -1), query_start=torch.tensor(bounds),
                        seq_lens=torch.tensor(lengths), block_tables=torch.zeros(len(lengths), 1, dtype=torch.long),
                        num_decodes=0, block_size=16, query_start_host=bounds, seq_lens_host=list(lengths))


@torch.no_grad()
def _run(model, encodings: list[dict]) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """(hidden (num_tokens, hidden_size), each sequence's span) of tokenized sequences, packed
    into one step as the engine runs them."""
    lengths = [len(e["input_ids"]) for e in encodings]
    ids = torch.tensor([i for e in encodings for i in e["input_ids"]])
    types = torch.tensor([t for e in encodings for t in e["token_type_ids"]])
    positions = torch.cat([torch.arange(n) for n in lengths])
    with forward_context(_step(lengths), CpuBackend()):
        hidden = model(ids, positions, types)
    bounds = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    return hidden, list(zip(bounds[:-1], bounds[1:]))


def _ours(model_dir: Path):
    config = load_config(model_dir)
    model = model_class(config)(config, config.max_position_embeddings)
    load_weights(model, model_dir)
    return model.eval(), config


@pytest.fixture(scope="module")
def minilm() -> Path:
    return default_embedding_model_path()


@pytest.fixture(scope="module")
def tokenizer(minilm):
    return load_tokenizer(minilm, "bert")


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory, minilm) -> Path:
    """A tiny random BertModel with MiniLM's vocabulary and tokenizer files (its pooler
    included, as BertModel saves it)."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny_bert")
    transformers.BertModel(transformers.BertConfig(**TINY)).save_pretrained(path)
    for name in TOKENIZER_FILES:
        shutil.copy(minilm / name, path / name)
    return path


@pytest.fixture(scope="module")
def tiny_classifier(tmp_path_factory, minilm) -> Path:
    torch.manual_seed(1)
    path = tmp_path_factory.mktemp("tiny_classifier")
    config = transformers.BertConfig(**TINY, id2label={0: "negative", 1: "neutral", 2: "positive"},
                                     architectures=["BertForSequenceClassification"])
    transformers.BertForSequenceClassification(config).save_pretrained(path)
    for name in TOKENIZER_FILES:
        shutil.copy(minilm / name, path / name)
    return path


def test_the_tokenizer_gives_cls_sep_and_token_types(minilm, tokenizer, tmp_path):
    cls, sep = tokenizer.convert_tokens_to_ids(["[CLS]", "[SEP]"])
    single = tokenizer("Hello, World!")
    assert single["input_ids"][0] == cls and single["input_ids"][-1] == sep
    assert single["token_type_ids"] == [0] * len(single["input_ids"])
    pair = tokenizer("what is it?", "a cat")
    first_sep = pair["input_ids"].index(sep)
    assert pair["input_ids"][0] == cls and pair["input_ids"][-1] == sep
    assert pair["token_type_ids"] == [0] * (first_sep + 1) + [1] * (len(pair["input_ids"]) - first_sep - 1)
    cached = load_tokenizer(minilm, "bert", cache=tmp_path)  # written, then read back
    assert load_tokenizer(minilm, "bert", cache=tmp_path)("what is it?", "a cat") == pair
    assert cached("Über café") == tokenizer("Über café")


def test_model_class_picks_the_classifier_by_architecture(tiny_bert, tiny_classifier):
    assert model_class(load_config(tiny_bert)) is BertModel
    assert model_class(load_config(tiny_classifier)) is BertForSequenceClassification
    for cls in (BertModel, BertForSequenceClassification):
        model = cls(load_config(tiny_classifier), 128)
        assert model.is_encoder and model.uses_token_types
        assert not any(isinstance(m, PagedAttention) for m in model.modules())
    assert not getattr(LlamaForCausalLM, "is_encoder", False)


# Lengths that pad into one batch, that are all one length, and that run one sequence at a time.
@pytest.mark.parametrize("lengths", [[5, 9, 1, 13, 7], [6, 6, 6], [1, 2, 1, 3, 60, 2]])
def test_hidden_states_are_transformers(tiny_bert, lengths):
    ours, _ = _ours(tiny_bert)
    theirs = transformers.BertModel.from_pretrained(tiny_bert).eval()
    gen = torch.Generator().manual_seed(len(lengths))
    encodings = [{"input_ids": torch.randint(0, 30522, (n,), generator=gen).tolist(),
                  "token_type_ids": torch.randint(0, 2, (n,), generator=gen).tolist()} for n in lengths]
    hidden, spans = _run(ours, encodings)
    with torch.no_grad():
        for e, (start, end) in zip(encodings, spans):
            want = theirs(input_ids=torch.tensor([e["input_ids"]]),
                          token_type_ids=torch.tensor([e["token_type_ids"]])).last_hidden_state[0]
            assert (hidden[start:end] - want).abs().max() < 1e-5


def _sentence_transformer(model_dir: Path, out: Path, mode: str, dense: bool):
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Dense, Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    torch.manual_seed(2)
    modules = [Transformer(str(model_dir)), Pooling(TINY["hidden_size"], pooling_mode=mode)]
    if dense:
        modules.append(Dense(TINY["hidden_size"], 16, activation_function=torch.nn.Tanh()))
    SentenceTransformer(modules=[*modules, Normalize()], device="cpu").save(str(out))
    return SentenceTransformer(str(out), device="cpu")


@pytest.mark.parametrize("mode, dense", [("mean", False), ("cls", True), ("lasttoken", False)])
def test_embeddings_are_sentence_transformers(tiny_bert, tokenizer, tmp_path, mode, dense):
    st = _sentence_transformer(tiny_bert, tmp_path / "st", mode, dense)
    if dense:  # a Matryoshka model says so in this file
        config_file = tmp_path / "st" / "config_sentence_transformers.json"
        config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "matryoshka_dimensions": [16, 8]}))
    model, config = _ours(tmp_path / "st")
    spec = read_pooling_spec(tmp_path / "st", config)
    assert (spec.mode, spec.normalize, spec.dimensions) == ({"lasttoken": "last"}.get(mode, mode), True,
                                                            16 if dense else TINY["hidden_size"])
    pooler = build_pooler(model, config, tmp_path / "st", "embed")
    assert (pooler.dimensions, pooler.default_normalize) == (spec.dimensions, True)
    assert pooler.matryoshka_dimensions == ([16, 8] if dense else None)
    embeddings = pooler(*_run(model, [tokenizer(s) for s in SENTENCES]))
    assert embeddings.dtype == torch.float32 and embeddings.shape == (len(SENTENCES), spec.dimensions)
    want = st.encode(SENTENCES, convert_to_tensor=True)
    assert F.cosine_similarity(F.normalize(embeddings, dim=-1), want).min() >= 0.99999


def test_without_sentence_transformers_files_bert_pools_cls_and_decoders_the_last_token(tiny_bert):
    spec = read_pooling_spec(tiny_bert, load_config(tiny_bert))
    assert (spec.mode, spec.normalize, spec.dense, spec.matryoshka_dimensions) == ("cls", True, [], None)
    llama = config_from_dict({"model_type": "llama", "hidden_size": 32, "num_attention_heads": 2})
    assert (read_pooling_spec(tiny_bert, llama).mode, read_pooling_spec(tiny_bert, llama).dimensions) == ("last", 32)


def test_mean_pooling_of_spans_with_gaps_is_each_spans_mean():
    hidden = torch.randn(40, 8, dtype=torch.bfloat16)
    spans = [(0, 3), (5, 6), (6, 20), (30, 40)]  # rows 3-4 and 20-29 belong to no span
    want = torch.stack([hidden[s:e].float().mean(0) for s, e in spans])
    assert torch.allclose(pool(hidden, spans, "mean"), want, atol=1e-6)
    assert torch.equal(pool(hidden, spans, "cls"), hidden[[0, 5, 6, 30]].float())
    assert torch.equal(pool(hidden, spans, "last"), hidden[[2, 5, 19, 39]].float())


def test_classifier_probabilities_are_transformers(tiny_classifier, tokenizer):
    model, config = _ours(tiny_classifier)
    assert isinstance(model, BertForSequenceClassification)
    pooler = build_pooler(model, config, tiny_classifier, "classify")
    assert (pooler.num_labels, pooler.labels, pooler.dimensions) == (3, ["negative", "neutral", "positive"], 3)
    pairs = [("what is it?", "a cat"), ("Hi", SENTENCES[5]), ("1234", "5678 = 6912")]
    encodings = [tokenizer(s) for s in SENTENCES] + [tokenizer(a, b) for a, b in pairs]
    logits = pooler(*_run(model, encodings))
    theirs = transformers.BertForSequenceClassification.from_pretrained(tiny_classifier).eval()
    with torch.no_grad():
        want = torch.cat([theirs(**{k: torch.tensor([v]) for k, v in e.items()}).logits for e in encodings])
    assert (logits.softmax(-1) - want.softmax(-1)).abs().max() < 1e-4


def test_classify_needs_a_classifier_head(tiny_bert):
    model, config = _ours(tiny_bert)
    with pytest.raises(ValueError, match="needs a classifier head"):
        build_pooler(model, config, tiny_bert, "classify")
    llama = config_from_dict({"model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
                              "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 64})
    with pytest.raises(NotImplementedError, match="not supported yet for llama models"):
        build_pooler(LlamaForCausalLM(llama, 64), llama, tiny_bert, "score")


def test_minilm_is_sentence_transformers_in_float32_and_int8(minilm, tokenizer):
    from sentence_transformers import SentenceTransformer

    sentences = _sentences(100)
    want = SentenceTransformer(str(minilm), device="cpu").encode(sentences, convert_to_tensor=True)
    model, config = _ours(minilm)
    pooler = build_pooler(model, config, minilm, "embed")
    assert (pooler.dimensions, pooler.default_normalize) == (384, True)
    step = _run(model, [tokenizer(s) for s in sentences])
    assert F.cosine_similarity(F.normalize(pooler(*step), dim=-1), want).min() >= 0.99999
    int8 = copy.deepcopy(model)
    quant.quantize_model(int8, "int8")  # as the engine does on CPU
    int8_layers = [m for m in int8.modules() if isinstance(m, Int8Linear)]
    assert len(int8_layers) == 6 * 4  # q/k/v fused, o, up, down per layer
    assert {m.x_levels for m in int8_layers} == {quant.ENCODER_X_LEVELS}  # 7-bit activations
    embeddings = pooler(*_run(int8, [tokenizer(s) for s in sentences]))
    assert F.cosine_similarity(F.normalize(embeddings, dim=-1), want).min() >= 0.995


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_runner_builds_an_encoder_without_a_kv_cache(tiny_classifier, tokenizer, tmp_path, quantization):
    config = EngineConfig(model=str(tiny_classifier), device="cpu", quantization=quantization, cache_dir=str(tmp_path),
                          max_num_seqs=8, max_model_len=100)
    runner = ModelRunner(config)
    assert runner.kv_cache is None
    assert runner.num_blocks == 8 * -(-100 // runner.block_size)
    assert isinstance(runner.model.classifier, Int8Linear if quantization else torch.nn.Linear)
    encodings = [tokenizer(s) for s in SENTENCES]
    logits = build_pooler(runner.model, runner.hf_config, tiny_classifier, "classify")(*_run(runner.model, encodings))
    float_model, _ = _ours(tiny_classifier)
    want = build_pooler(float_model, runner.hf_config, tiny_classifier, "classify")(*_run(float_model, encodings))
    assert (logits.softmax(-1) - want.softmax(-1)).abs().max() < (1e-2 if quantization else 1e-5)
    if quantization:  # a warm start reads the quantized layers from the cache: the same model
        warm = ModelRunner(config)
        assert torch.equal(_run(warm.model, encodings)[0], _run(runner.model, encodings)[0])
