"""BERT encoders: sentence embeddings (`BertModel`, pooled by model/pooling.py) and
sequence classification (`BertForSequenceClassification`). Post-LayerNorm layers over
absolute position and token type embeddings; every token attends to its whole sequence
(`EncoderAttention`), so there is no KV cache."""

from __future__ import annotations

import torch
from torch import nn

from gristmill.model.layers import (ACTIVATIONS, QKV, EncoderAttention, add_layer_norm, embedding,
                                    linear_activation, project)

# Checkpoint names inside an encoder layer (HF's, after "encoder.layer.N.") -> ours. Our
# q/k/v are named as the decoders' so fuse_projections makes them one matmul.
_LAYER_NAMES = (
    ("attention.self.query.", "attn.q_proj."), ("attention.self.key.", "attn.k_proj."),
    ("attention.self.value.", "attn.v_proj."), ("attention.output.dense.", "attn.o_proj."),
    ("attention.output.LayerNorm.", "attn_norm."), ("intermediate.dense.", "up_proj."),
    ("output.dense.", "down_proj."), ("output.LayerNorm.", "mlp_norm."),
)


def _layer_norm(config) -> nn.LayerNorm:
    return nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)


class BertEmbeddings(nn.Module):
    def __init__(self, config):
        super().__init__()
        hidden = config.hidden_size
        self.word_embeddings = embedding(config.vocab_size, hidden)
        self.position_embeddings = embedding(config.max_position_embeddings, hidden)
        self.token_type_embeddings = embedding(config.type_vocab_size, hidden)
        self.norm = _layer_norm(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor | None) -> torch.Tensor:
        x = self.word_embeddings(input_ids)  # (num_tokens, hidden)
        if token_type_ids is None:  # every token of type 0, as transformers defaults
            x = x + self.token_type_embeddings.weight[0]
        else:
            x = x + self.token_type_embeddings(token_type_ids)
        return add_layer_norm(x, self.position_embeddings(positions), self.norm)


class BertAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        inner = self.num_heads * self.head_dim
        self.q_proj = nn.Linear(hidden, inner)
        self.k_proj = nn.Linear(hidden, inner)
        self.v_proj = nn.Linear(hidden, inner)
        self.o_proj = nn.Linear(inner, hidden)
        self.attn = EncoderAttention(self.num_heads, self.head_dim, self.head_dim ** -0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = (t.view(n, self.num_heads, self.head_dim) for t in project(self, x, *QKV))
        return self.o_proj(self.attn(q, k, v).reshape(n, -1))


class BertLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        if config.hidden_act not in ACTIVATIONS:
            raise ValueError(f"activation {config.hidden_act!r} is not supported ({sorted(ACTIVATIONS)} are)")
        self.attn = BertAttention(config)
        self.attn_norm = _layer_norm(config)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size)
        self.mlp_norm = _layer_norm(config)
        self.activation = config.hidden_act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = add_layer_norm(x, self.attn(x), self.attn_norm)  # post-LayerNorm: the norm follows the residual add
        return add_layer_norm(x, self.down_proj(linear_activation(self.up_proj, x, self.activation)), self.mlp_norm)


class BertModel(nn.Module):
    """The encoder: the hidden state of every token (pooled into sentence embeddings by
    model/pooling.py). `max_positions` is the engine's max_model_len; the position table
    is the checkpoint's (max_position_embeddings)."""

    is_encoder = True
    uses_token_types = True

    def __init__(self, config, max_positions: int):
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.layers = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions, token_type_ids: (num_tokens,), the step's sequences one
        after another, each whole (positions from 0). Returns (num_tokens, hidden)."""
        x = self.embeddings(input_ids, positions, token_type_ids)
        for layer in self.layers:
            x = layer(x)
        return x

    @staticmethod
    def checkpoint_name(name: str) -> str | None:
        """Our parameter name of a checkpoint tensor; None for those an embedding model
        leaves out on purpose: BERT's pooler and a masked-LM head (sentence embeddings pool
        the hidden states instead) and the position_ids buffer older checkpoints hold."""
        name = name.removeprefix("bert.")
        if name.startswith(("pooler.", "cls.")) or name == "embeddings.position_ids":
            return None
        if name == "embeddings.LayerNorm.weight" or name == "embeddings.LayerNorm.bias":
            return "embeddings.norm." + name.rpartition(".")[2]
        prefix, layer, rest = name.partition(".layer.")
        if prefix == "encoder" and rest:
            index, _, part = rest.partition(".")
            for theirs, ours in _LAYER_NAMES:
                if part.startswith(theirs):
                    return f"layers.{index}.{ours}{part.removeprefix(theirs)}"
        return name


class BertForSequenceClassification(nn.Module):
    """The encoder, BERT's pooler (dense + tanh of the [CLS] token) and a linear classifier."""

    is_encoder = True
    uses_token_types = True

    def __init__(self, config, max_positions: int):
        super().__init__()
        self.config = config
        self.bert = BertModel(config, max_positions)
        self.pooler = nn.Linear(config.hidden_size, config.hidden_size)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.bert(input_ids, positions, token_type_ids)

    def classify(self, hidden: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
        """Logits (num_spans, num_labels) of the sequences at token rows `spans` of `hidden`."""
        first = torch.tensor([start for start, _ in spans], device=hidden.device)  # each [CLS] row
        return self.classifier(torch.tanh(self.pooler(hidden[first])))

    @staticmethod
    def checkpoint_name(name: str) -> str | None:
        if name.startswith("bert.pooler.dense."):
            return "pooler." + name.removeprefix("bert.pooler.dense.")
        if name.startswith("classifier."):
            return name
        ours = BertModel.checkpoint_name(name)
        return None if ours is None else "bert." + ours
