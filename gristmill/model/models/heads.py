"""Decoder backbones under other heads than the LM head: a sequence classifier (the
`*ForSequenceClassification` checkpoints of Llama, Qwen 2/3 and Gemma 3: a `score` layer
over the last token's hidden state) and a bare backbone (checkpoints saved from
`Qwen3Model`, `LlamaModel`, ... : embedding models such as Qwen3-Embedding, pooled by
model/pooling.py)."""

from __future__ import annotations

import torch
from torch import nn

from gristmill.model.models.gemma3 import Gemma3TextModel
from gristmill.model.models.llama import LlamaModel


def _backbone(config, max_positions: int) -> nn.Module:
    if config.model_type == "gemma3_text":
        return Gemma3TextModel(config, max_positions)  # (bidirectional for EmbeddingGemma, as its config says)
    qwen2, qwen3 = config.model_type == "qwen2", config.model_type == "qwen3"
    return LlamaModel(config, max_positions, qwen2 or config.attention_bias, qwen3)


class DecoderBackbone(nn.Module):
    """A decoder without its LM head: `forward` gives the final hidden states."""

    def __init__(self, config, max_positions: int):
        super().__init__()
        self.config = config
        self.model = _backbone(config, max_positions)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    @staticmethod
    def checkpoint_name(name: str) -> str | None:
        """Our name of a checkpoint tensor: a bare backbone's names gain `model.`; an LM
        head it may carry is left out."""
        if name.startswith("lm_head."):
            return None
        return name if name.startswith("model.") else f"model.{name}"


class DecoderForSequenceClassification(DecoderBackbone):
    """`score` (no bias) over the hidden state of each sequence's last token, as
    transformers' *ForSequenceClassification classes read it (a prompt has no padding)."""

    def __init__(self, config, max_positions: int):
        super().__init__(config, max_positions)
        self.score = nn.Linear(config.hidden_size, config.num_labels, bias=False)

    def classify(self, hidden: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
        last = torch.tensor([end - 1 for _, end in spans], device=hidden.device)
        return self.score(hidden[last])

    @staticmethod
    def checkpoint_name(name: str) -> str | None:
        return name if name.startswith("score.") else DecoderBackbone.checkpoint_name(name)
