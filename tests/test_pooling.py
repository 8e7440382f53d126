"""Pooling engines through the offline face: LLM.embed, classify, score and encode on
tiny random-weight models, against sentence-transformers and transformers; what each
task refuses, and how a bad prompt fails alone."""

from __future__ import annotations

import numpy as np
import pytest

from gristmill import LLM, PoolingParams
from gristmill.errors import RequestError
from tests.pooling_models import LABELS, tiny_classifier, tiny_decoder_embedder, tiny_embedder, with_tokenizer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Hello", "Embeddings turn text into vectors of numbers.",
         "A much longer sentence, with commas, numbers like 42 and 3.14, and words that split into several "
         "word pieces: tokenization, unbelievably, antidisestablishmentarianism.", "ok"]


def _cosine(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def embedder():
    return LLM(str(tiny_embedder()), device="cpu", quantization=None)


@pytest.fixture(scope="module")
def classifier():
    return LLM(str(tiny_classifier(3)), device="cpu", quantization=None)


@pytest.fixture(scope="module")
def cross_encoder():
    return LLM(str(tiny_classifier(1)), device="cpu", quantization=None)


def test_embed_matches_sentence_transformers(embedder):
    from sentence_transformers import SentenceTransformer

    expected = SentenceTransformer(str(tiny_embedder()), device="cpu").encode(TEXTS, convert_to_numpy=True)
    outputs = embedder.embed(TEXTS)
    assert embedder.config.task == "embed"
    assert [o.prompt for o in outputs] == TEXTS and all(o.finished and o.error is None for o in outputs)
    for out, want in zip(outputs, expected):
        assert isinstance(out.outputs.embedding, list) and len(out.outputs.embedding) == 32
        assert _cosine(out.outputs.embedding, want) >= 0.99999
        assert abs(np.linalg.norm(out.outputs.embedding) - 1) < 1e-5  # (the model's Normalize module)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tiny_embedder()))
    assert outputs[0].prompt_token_ids == tokenizer(TEXTS[0])["input_ids"]


def test_embed_takes_token_ids_and_per_request_normalize_and_truncation(embedder):
    ids = embedder.get_tokenizer()(TEXTS[3])["input_ids"]
    by_text, by_ids = embedder.embed([TEXTS[3], ids])
    assert _cosine(by_text.outputs.embedding, by_ids.outputs.embedding) >= 0.999999
    raw = embedder.embed(TEXTS[3], PoolingParams(normalize=False))[0].outputs.embedding
    assert abs(np.linalg.norm(raw) - 1) > 1e-3 and _cosine(raw, by_text.outputs.embedding) >= 0.99999
    cut = embedder.embed(TEXTS[3], truncate_prompt_tokens=8)[0]
    tokenizer = embedder.get_tokenizer()
    assert cut.prompt_token_ids == tokenizer(TEXTS[3], truncation=True, max_length=8)["input_ids"]
    assert cut.prompt_token_ids[-1] == tokenizer.sep_token_id  # (the tokenizer keeps its special tokens)
    cut_ids = embedder.embed(ids, PoolingParams(truncate_prompt_tokens=5))[0]
    assert cut_ids.prompt_token_ids == ids[-5:]


def test_a_prompt_past_the_context_fails_alone_unless_it_asks_to_be_cut(embedder):
    long_text = "word " * 400  # > 128 positions
    outputs = embedder.embed([TEXTS[0], long_text, TEXTS[1]])
    assert outputs[1].finish_reason == "error" and outputs[1].outputs is None
    assert "PromptTooLongError" in outputs[1].error and "truncate_prompt_tokens" in outputs[1].error
    assert outputs[0].error is None and outputs[2].error is None
    cut = embedder.embed(long_text, truncate_prompt_tokens=-1)[0]
    assert cut.error is None and len(cut.prompt_token_ids) == 128


def test_dimensions_are_refused_for_a_model_not_trained_to_be_cut(embedder):
    out = embedder.embed(TEXTS[0], PoolingParams(dimensions=8))[0]
    assert out.finish_reason == "error" and "dimensions" in out.error and "Matryoshka" in out.error
    assert embedder.embed(TEXTS[0], PoolingParams(dimensions=32))[0].error is None  # (all of them)


def test_a_matryoshka_model_cuts_then_normalizes():
    llm = LLM(str(tiny_embedder(matryoshka=(32, 16, 8))), device="cpu", quantization=None)
    full = llm.embed(TEXTS[0])[0].outputs.embedding
    short = llm.embed(TEXTS[0], PoolingParams(dimensions=16))[0].outputs.embedding
    assert len(short) == 16 and abs(np.linalg.norm(short) - 1) < 1e-5
    assert _cosine(short, full[:16]) >= 0.99999
    refused = llm.embed(TEXTS[0], PoolingParams(dimensions=12))[0]
    assert "dimensions" in refused.error and "[8, 16, 32]" in refused.error


def test_classify_matches_transformers(classifier):
    model = transformers.BertForSequenceClassification.from_pretrained(str(tiny_classifier(3))).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tiny_classifier(3)))
    outputs = classifier.classify(TEXTS)
    assert classifier.config.task == "classify"
    for text, out in zip(TEXTS, outputs):
        with torch.no_grad():
            want = model(**tokenizer(text, return_tensors="pt")).logits.softmax(-1)[0].numpy()
        assert len(out.outputs.probs) == 3
        assert np.abs(np.array(out.outputs.probs) - want).max() < 1e-4
    assert classifier.capacity.pooler.labels == tuple(LABELS.values())
    logits = classifier.classify(TEXTS[0], PoolingParams(use_activation=False))[0].outputs.probs
    assert np.abs(torch.tensor(logits).softmax(-1).numpy() - outputs[0].outputs.probs).max() < 1e-5


def test_a_cross_encoder_scores_each_pair_in_one_request(cross_encoder):
    model = transformers.BertForSequenceClassification.from_pretrained(str(tiny_classifier(1))).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tiny_classifier(1)))
    query, documents = "what do foxes do?", TEXTS[:3]
    assert cross_encoder.config.task == "score"
    outputs = cross_encoder.score(query, documents)
    assert len(outputs) == 3
    for document, out in zip(documents, outputs):
        with torch.no_grad():
            want = model(**tokenizer(query, document, return_tensors="pt")).logits.sigmoid()[0, 0].item()
        assert abs(out.outputs.score - want) < 1e-4
    pairwise = cross_encoder.score([query, query, "other"], documents)
    assert [o.outputs.score for o in pairwise[:2]] == pytest.approx([o.outputs.score for o in outputs[:2]], abs=1e-6)
    with pytest.raises(RequestError, match="data_1 has 2 texts and data_2 3"):
        cross_encoder.score([query, query], documents)


def test_an_embedding_model_scores_by_cosine(embedder):
    query, documents = "a fox", TEXTS[:3]
    vectors = [o.outputs.embedding for o in embedder.embed([query, *documents])]
    outputs = embedder.score(query, documents)
    for vector, out in zip(vectors[1:], outputs):
        assert out.outputs.score == pytest.approx(_cosine(vectors[0], vector), abs=1e-5)


def test_encode_gives_the_poolers_vector(classifier):
    out = classifier.encode(TEXTS[0])[0]
    assert out.outputs.data.dtype == np.float32 and out.outputs.data.shape == (3,)
    assert np.abs(out.outputs.data - classifier.classify(TEXTS[0])[0].outputs.probs).max() < 1e-6


def test_each_task_refuses_the_calls_of_the_others(embedder, classifier):
    with pytest.raises(RequestError, match="task 'embed'.*does not generate"):
        embedder.generate("hello")
    with pytest.raises(RequestError, match="classify needs a model that gives a classifier's labels"):
        embedder.classify("hello")
    with pytest.raises(RequestError, match="embed needs a model that gives embeddings"):
        classifier.embed("hello")
    with pytest.raises(RequestError, match="cross-encoder"):
        classifier.score("a", "b")
    with pytest.raises(RequestError, match="task='generate'.*encoder") as info:
        LLM(str(tiny_embedder()), device="cpu", quantization=None, task="generate")
    assert info.value.param == "task"


def test_a_generating_engine_refuses_pooling_calls():
    from tests.batch.inprocess import tiny_model

    llm = LLM(str(tiny_model()), device="cpu", quantization=None, num_kv_blocks=8)
    assert llm.config.task == "generate"
    with pytest.raises(RequestError, match="embed needs a pooling engine.*task='embed'"):
        llm.embed("hello")


def test_a_decoder_embeds_by_its_last_token():
    llm = LLM(str(tiny_decoder_embedder()), device="cpu", quantization=None, task="embed")
    model = transformers.Qwen3Model.from_pretrained(str(tiny_decoder_embedder())).eval()
    outputs = llm.embed(TEXTS)
    for out in outputs:
        with torch.no_grad():
            hidden = model(torch.tensor([out.prompt_token_ids])).last_hidden_state[0, -1]
        assert _cosine(out.outputs.embedding, hidden.numpy()) >= 0.99999
        assert abs(np.linalg.norm(out.outputs.embedding) - 1) < 1e-5


def test_int8_embeddings_stay_close_to_float(embedder):
    int8 = LLM(str(tiny_embedder()), device="cpu", quantization="int8")
    for exact, quantized in zip(embedder.embed(TEXTS), int8.embed(TEXTS)):
        assert _cosine(exact.outputs.embedding, quantized.outputs.embedding) >= 0.99


@pytest.mark.parametrize("family", ["qwen3", "llama", "gemma3"])
def test_decoder_classifiers_match_transformers(family):
    from tests.pooling_models import tiny_decoder_classifier

    path = tiny_decoder_classifier(family)
    llm = LLM(str(path), device="cpu", quantization=None)
    assert llm.config.task == "classify" and llm.capacity.pooler.labels == tuple(LABELS.values())
    model = transformers.AutoModelForSequenceClassification.from_pretrained(str(path)).eval()
    for out in llm.classify(TEXTS):
        with torch.no_grad():
            want = model(torch.tensor([out.prompt_token_ids])).logits.softmax(-1)[0].numpy()
        assert np.abs(np.array(out.outputs.probs) - want).max() < 1e-4


def test_a_bare_decoder_checkpoint_is_an_embedding_model():
    from tests.pooling_models import tiny_bare_decoder

    llm = LLM(str(tiny_bare_decoder()), device="cpu", quantization=None)
    assert llm.config.task == "embed"
    model = transformers.Qwen3Model.from_pretrained(str(tiny_bare_decoder())).eval()
    for out in llm.embed(TEXTS[:3]):
        with torch.no_grad():
            hidden = model(torch.tensor([out.prompt_token_ids])).last_hidden_state[0, -1]
        assert _cosine(out.outputs.embedding, hidden.numpy()) >= 0.99999
    for task in ("classify", "generate"):
        with pytest.raises(RequestError, match=f"task='{task}'.*embedding model.*can run task 'embed' or 'score'"):
            LLM(str(tiny_bare_decoder()), device="cpu", quantization=None, task=task)


def test_an_embeddinggemma_shaped_model_matches_sentence_transformers(tmp_path):
    # Gemma 3 with bidirectional attention (a sliding window shorter than the prompts, so
    # both kinds of layer are checked), mean pooling and two Dense layers, as EmbeddingGemma.
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules as models

    torch.manual_seed(5)
    config = transformers.Gemma3TextConfig(vocab_size=30522, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                           sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                                           use_bidirectional_attention=True, max_position_embeddings=128)
    backbone = tmp_path / "backbone"
    transformers.Gemma3TextModel(config).save_pretrained(backbone)
    with_tokenizer(backbone)
    modules = [models.Transformer(str(backbone)), models.Pooling(32, "mean"),
               models.Dense(32, 64, bias=False, activation_function=torch.nn.Identity()),
               models.Dense(64, 32, bias=False, activation_function=torch.nn.Identity()), models.Normalize()]
    reference = SentenceTransformer(modules=modules, device="cpu")
    path = tmp_path / "embeddinggemma"
    reference.save(str(path))
    llm = LLM(str(path), device="cpu", quantization=None)
    assert llm.config.task == "embed"
    # (the last text longer than the window + a chunk of queries: its sliding layer runs in
    # chunks, backends/cpu.py chunked_attention)
    texts = TEXTS + [" ".join(f"word{i % 9} and" for i in range(26))]
    want = reference.encode(texts, convert_to_numpy=True)
    outs = llm.embed(texts)
    assert len(outs[-1].prompt_token_ids) > 8 + 64
    for out, expected in zip(outs, want):
        assert _cosine(out.outputs.embedding, expected) >= 0.99999
    with pytest.raises(RequestError, match="task='generate'"):
        LLM(str(path), device="cpu", quantization=None, task="generate")


def test_an_engine_death_while_pooling_fails_every_request_fast(monkeypatch, request):
    # The core exits as it schedules the marked prompt: every pooling request in flight
    # ends with EngineDeadError within seconds, and no core process is left.
    import asyncio
    import time

    from gristmill import AsyncEngine, EngineConfig, EngineDeadError, faults
    from tests.harness import process_gone

    # (the client keeps the faults it loaded at start, to tag the marked prompt for the core)
    monkeypatch.setenv("GRISTMILL_FAULTS", "core_exit@prompt~poison")
    try:
        engine = AsyncEngine(EngineConfig(model=str(tiny_embedder()), device="cpu", quantization=None))
    finally:
        monkeypatch.delenv("GRISTMILL_FAULTS")
    request.addfinalizer(faults.load)  # (off again after the test)
    pid = engine.core_pid

    async def embed(text):
        try:
            async for out in engine.encode(text, kind="embed"):
                pass
            return out
        except EngineDeadError as exc:
            return exc

    async def run():
        return await asyncio.wait_for(asyncio.gather(*(embed(t) for t in [*TEXTS, "poison pill"])), 30)

    began = time.monotonic()
    results = asyncio.run(run())
    assert time.monotonic() - began < 10
    assert isinstance(results[-1], EngineDeadError) and "exited" in str(results[-1])
    assert all(isinstance(r, EngineDeadError) or (r.finished and r.error is None) for r in results)
    assert engine.errored

    async def after():
        async for _ in engine.encode("after", kind="embed"):
            pass
    with pytest.raises(EngineDeadError):
        asyncio.run(after())
    engine.shutdown()
    assert process_gone(pid)
