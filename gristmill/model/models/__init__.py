"""Model families, one file each; `model_class` picks one from an HF config."""

from __future__ import annotations

from gristmill.model.models.bert import BertForSequenceClassification, BertModel
from gristmill.model.models.gemma3 import Gemma3ForCausalLM
from gristmill.model.models.heads import DecoderBackbone, DecoderForSequenceClassification
from gristmill.model.models.llama import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM

MODEL_CLASSES = {
    "llama": LlamaForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "gemma3_text": Gemma3ForCausalLM,
    "bert": BertModel,
}
# A checkpoint saved from one of these classes (config.json's `architectures`) gets it
# instead of its model type's class: a head on the same encoder.
ARCHITECTURE_CLASSES = {
    "BertForSequenceClassification": BertForSequenceClassification,
    **{f"{family}ForSequenceClassification": DecoderForSequenceClassification
       for family in ("Llama", "Qwen2", "Qwen3", "Gemma3Text")},
    **{f"{family}Model": DecoderBackbone for family in ("Llama", "Qwen2", "Qwen3", "Gemma3Text")},
}


def model_class(config):
    for architecture in config.architectures:
        if architecture in ARCHITECTURE_CLASSES:
            return ARCHITECTURE_CLASSES[architecture]
    cls = MODEL_CLASSES.get(config.model_type)
    if cls is None:
        raise ValueError(f"model type {config.model_type!r} is not supported; "
                         f"supported: {sorted(MODEL_CLASSES)} (Gemma 3 multimodal checkpoints: "
                         f"use the text model)")
    return cls
