"""A model's config.json, read as JSON into the fields our model classes use.

transformers' config classes take ~2 s to import (and import torch); the engine needs a
dozen numbers from the file. `ModelConfig` holds them with the defaults transformers'
classes fill in for a key the file leaves out (LlamaConfig, Qwen2Config, Qwen3Config,
Gemma3TextConfig, BertConfig; a multimodal Gemma 3 config gives its text half), and rope parameters
standardized as they standardize them: `rope_parameters` is one dict (`rope_type`,
`rope_theta`, ...) or, for Gemma 3, one per layer type. tests/model/test_loader.py checks
each field against transformers' classes. Imports no torch and no transformers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# Each family's defaults, as its transformers config class has them (None: derived below).
_LLAMA_DEFAULTS = {
    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": None, "head_dim": None, "hidden_act": "silu",
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "attention_bias": False, "mlp_bias": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None,
}
_QWEN_DEFAULTS = {
    "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 32, "hidden_act": "silu",
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "attention_bias": False, "mlp_bias": False, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
}
_DEFAULTS = {
    "llama": _LLAMA_DEFAULTS,
    # Qwen2Config has no head_dim (hidden / heads, or the file's) nor attention_bias (q/k/v
    # always biased, which the model class knows).
    "qwen2": {**_QWEN_DEFAULTS, "head_dim": None},
    "qwen3": {**_QWEN_DEFAULTS, "head_dim": 128},
    "gemma3_text": {
        "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True, "attention_bias": False, "mlp_bias": False, "bos_token_id": 2,
        "eos_token_id": 1, "pad_token_id": 0, "query_pre_attn_scalar": 256, "sliding_window": 4096,
        "final_logit_softcapping": None, "use_bidirectional_attention": False,
    },
    # BERT has no rotary and no RMSNorm (rms_norm_eps, rope_parameters None), every linear
    # biased (which the model class knows), no LM head to tie.
    "bert": {
        "vocab_size": 30522, "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
        "num_attention_heads": 12, "num_key_value_heads": None, "head_dim": None, "hidden_act": "gelu",
        "max_position_embeddings": 512, "rms_norm_eps": None, "tie_word_embeddings": False,
        "attention_bias": False, "mlp_bias": False, "bos_token_id": None, "eos_token_id": None, "pad_token_id": 0,
        "type_vocab_size": 2, "layer_norm_eps": 1e-12,
    },
}
_DEFAULT_THETA = 10_000.0
_GEMMA3_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}
_GEMMA3_SLIDING_WINDOW_PATTERN = 6
# Rope types whose parameters carry the pretraining length (transformers adds it).
_LONG_ROPE_TYPES = ("llama3", "yarn", "longrope")


@dataclass(frozen=True)
class ModelConfig:
    """What the model classes read of config.json (attribute names as in transformers)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    hidden_act: str
    max_position_embeddings: int
    rms_norm_eps: float | None  # (None: BERT, whose norms are LayerNorms)
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    #: One dict (rope_type, rope_theta, scaling fields) or, Gemma 3, one per layer type;
    #: None for BERT (absolute position embeddings).
    rope_parameters: dict | None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    # Gemma 3 only (None elsewhere).
    query_pre_attn_scalar: float | None = None
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    final_logit_softcapping: float | None = None
    # BERT only (None elsewhere).
    type_vocab_size: int | None = None
    layer_norm_eps: float | None = None
    #: The classes the checkpoint was saved from ("BertForSequenceClassification", ...).
    architectures: tuple[str, ...] = ()
    #: Gemma 3 only: every token attends to every other (EmbeddingGemma), not causally.
    bidirectional: bool = False
    #: A classifier's label names by class index; None when the file names none.
    id2label: dict[int, str] | None = None

    @property
    def hidden_activation(self) -> str:  # Gemma's name for it
        return self.hidden_act

    @property
    def num_labels(self) -> int:
        """Classes of a classifier head (2, transformers' default, when the file names none)."""
        return len(self.id2label) if self.id2label is not None else 2


def load_config(model_dir: Path) -> ModelConfig:
    """The config of the model in `model_dir` (its config.json)."""
    path = Path(model_dir) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON ({exc})") from None
    return config_from_dict(raw, str(path))


def config_from_dict(raw: dict, where: str = "config.json") -> ModelConfig:
    """`ModelConfig` of a config.json's contents."""
    if not isinstance(raw, dict):
        raise ValueError(f"{where} is not a JSON object")
    if raw.get("model_type") == "gemma3":  # multimodal wrapper: its text half
        raw = {**(raw.get("text_config") or {}), "model_type": "gemma3_text"}
    model_type = raw.get("model_type")
    defaults = _DEFAULTS.get(model_type)
    if defaults is None:
        raise ValueError(f"model type {model_type!r} ({where}) is not supported; supported: {sorted(_DEFAULTS)} "
                         f"(Gemma 3 multimodal checkpoints: use the text model)")
    values = {key: raw.get(key, default) for key, default in defaults.items()}
    if values["num_key_value_heads"] is None:
        values["num_key_value_heads"] = values["num_attention_heads"]
    if values["head_dim"] is None:
        values["head_dim"] = values["hidden_size"] // values["num_attention_heads"]
    gemma = model_type == "gemma3_text"
    if gemma:
        values["hidden_act"] = values.pop("hidden_activation")
        values["bidirectional"] = values.pop("use_bidirectional_attention")
        if values["bidirectional"]:
            values["sliding_window"] = values["sliding_window"] // 2 + 1  # (as transformers sets it)
        layer_types = raw.get("layer_types")
        if layer_types is None:
            pattern = raw.get("sliding_window_pattern", _GEMMA3_SLIDING_WINDOW_PATTERN)
            layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                           for i in range(values["num_hidden_layers"])]
        values["layer_types"] = tuple(layer_types)
        values["rope_parameters"] = _gemma3_rope(raw, values["max_position_embeddings"])
    elif model_type == "bert":
        values["rope_parameters"] = None
        values["tie_word_embeddings"] = False  # (BertConfig says True, for BertForMaskedLM's head)
        if raw.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"{where}: position_embedding_type {raw['position_embedding_type']!r} is not "
                             f"supported; BERT models with absolute position embeddings are")
    else:
        values["rope_parameters"] = _rope(raw, values["max_position_embeddings"])
    return ModelConfig(model_type=model_type, architectures=tuple(raw.get("architectures") or ()),
                       id2label=_id2label(raw), **values)


def _id2label(raw: dict) -> dict[int, str] | None:
    """Label names by class index, keys as ints (JSON keeps them as strings); a file with
    only `num_labels` gets transformers' names for them (LABEL_0, ...)."""
    if raw.get("id2label"):
        return {int(index): name for index, name in raw["id2label"].items()}
    if raw.get("num_labels") is not None:
        return {index: f"LABEL_{index}" for index in range(raw["num_labels"])}
    return None


def _rope(raw: dict, max_positions: int) -> dict:
    """One rope dict, as transformers standardizes `rope_scaling` / `rope_parameters` and
    `rope_theta`: the theta and rope type filled in, the pretraining length for the types
    that scale from it."""
    params = dict(raw.get("rope_scaling") or raw.get("rope_parameters") or {})
    params.setdefault("rope_theta", raw.get("rope_theta", _DEFAULT_THETA))
    params.setdefault("rope_type", params.get("type", "default"))
    if params["rope_type"] in _LONG_ROPE_TYPES:
        if "original_max_position_embeddings" in raw:
            params["original_max_position_embeddings"] = raw["original_max_position_embeddings"]
        else:
            params.setdefault("original_max_position_embeddings", max_positions)
    return params


def _gemma3_rope(raw: dict, max_positions: int) -> dict:
    """Gemma 3's rope per layer type: global layers `rope_theta` (1e6) and any
    `rope_scaling`, sliding layers `rope_local_base_freq` (1e4)."""
    given = raw.get("rope_parameters")
    params = {key: dict(value) if isinstance(value, dict) else value for key, value in given.items()} \
        if given is not None else {"sliding_attention": {"rope_type": "default"},
                                   "full_attention": {"rope_type": "default"}}
    if raw.get("rope_scaling") is not None:
        params["full_attention"].update(raw["rope_scaling"])
    theta = {"full_attention": raw.get("rope_theta", _GEMMA3_THETA["full_attention"]),
             "sliding_attention": raw.get("rope_local_base_freq", _GEMMA3_THETA["sliding_attention"])}
    for layer_type in ("full_attention", "sliding_attention"):
        if params.get(layer_type) is None:
            params[layer_type] = {"rope_type": "default"}
        layer = params[layer_type]
        layer.setdefault("rope_theta", theta[layer_type])
        layer.setdefault("rope_type", layer.get("type", "default"))
        if layer["rope_type"] in _LONG_ROPE_TYPES:
            layer.setdefault("original_max_position_embeddings", max_positions)
    return params



def trained_length(model_dir: Path, config: ModelConfig) -> int:
    """The longest sequence the model is meant for: its positions, or, for a
    sentence-transformers model, the `max_seq_length` it was trained to cut inputs at
    (all-MiniLM-L6-v2: 256 of 512 positions), as sentence-transformers and vLLM use it."""
    length = config.max_position_embeddings
    try:
        trained = json.loads((model_dir / "sentence_bert_config.json").read_text()).get("max_seq_length")
    except (OSError, ValueError, AttributeError):
        return length
    return min(length, trained) if isinstance(trained, int) and trained > 0 else length
