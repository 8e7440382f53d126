"""Pooling heads: the hidden states of a step's sequences -> one vector each.

- "embed": each sequence's hidden states pooled (mean, [CLS] or last token) and passed
  through the model's sentence-transformers Dense layers, as `read_pooling_spec` reads
  them from the model directory. Normalizing and truncating to fewer dimensions
  (Matryoshka) are per request, so the engine applies them; `Pooler` says the model's
  defaults.
- "classify" / "score": a classifier's logits, from the model's own head (`classify`).
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from gristmill.model.models import model_class

TASKS = ("embed", "classify", "score")
# sentence-transformers' pooling modes -> ours ("pooling_mode" in its config, or one of
# the older `pooling_mode_*` flags).
_MODES = {"mean": "mean", "cls": "cls", "lasttoken": "last"}
_MODE_FLAGS = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls", "pooling_mode_lasttoken": "lasttoken",
               "pooling_mode_max_tokens": "max", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
               "pooling_mode_weightedmean_tokens": "weightedmean"}


class Dense(nn.Module):
    """sentence-transformers' Dense module: activation(linear(x)), plus x (projected when
    the sizes differ) with `use_residual`."""

    def __init__(self, in_features: int, out_features: int, bias: bool, activation: nn.Module,
                 use_residual: bool = False):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features, bias=bias)
        self.activation = activation
        self.use_residual = use_residual
        self.residual = nn.Linear(in_features, out_features, bias=False) \
            if use_residual and in_features != out_features else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.activation(self.linear(x))
        if self.use_residual:
            out = out + (x if self.residual is None else self.residual(x))
        return out


@dataclass
class PoolingSpec:
    """How an embedding model turns a sequence's hidden states into its embedding."""

    mode: str  # "mean" | "cls" | "last"
    #: Whether its embeddings are normalized unless a request says otherwise (a Normalize module).
    normalize: bool
    #: The output size: the last Dense layer's, else the hidden size.
    dimensions: int
    #: Dense layers after the pooling, loaded, in order.
    dense: list[Dense] = field(default_factory=list)
    #: The sizes it was trained to be truncated to, when the model says.
    matryoshka_dimensions: list[int] | None = None
    #: sentence-transformers' `include_prompt`: False means the tokens of a prompt it
    #: prepends (its `prompts`) are left out of the mean; the engine pools what it is given.
    include_prompt: bool = True
    #: The longest input sentence-transformers feeds it (it truncates past this), when set.
    max_seq_length: int | None = None


def read_pooling_spec(model_dir: Path, hf_config) -> PoolingSpec:
    """The pooling of the model in `model_dir` from its sentence-transformers files
    (modules.json and each module's folder); without them, the family's usual pooling
    ([CLS] for an encoder, the last token for a decoder), normalized."""
    model_dir = Path(model_dir)
    encoder = getattr(model_class(hf_config), "is_encoder", False)
    spec = PoolingSpec(mode="cls" if encoder else "last", normalize=True, dimensions=hf_config.hidden_size,
                       matryoshka_dimensions=_matryoshka_dimensions(model_dir),
                       max_seq_length=_read_json(model_dir / "sentence_bert_config.json").get("max_seq_length"))
    modules_file = model_dir / "modules.json"
    if not modules_file.exists():
        return spec
    spec.normalize = False
    for module in _read_json(modules_file):
        kind, folder = module["type"].rpartition(".")[2], model_dir / module.get("path", "")
        if spec.normalize and kind != "Normalize":
            raise ValueError(f"{modules_file}: a {kind} module after Normalize is not supported")
        if kind == "Pooling":
            spec.mode, spec.include_prompt = _pooling_mode(folder / "config.json")
        elif kind == "Dense":
            layer = _load_dense(folder)
            if layer.linear.in_features != spec.dimensions:
                raise ValueError(f"{folder}: a Dense layer of {layer.linear.in_features} inputs after "
                                 f"{spec.dimensions} dimensions")
            spec.dense.append(layer)
            spec.dimensions = layer.linear.out_features
        elif kind == "Normalize":
            spec.normalize = True
        elif kind not in ("Transformer", "Dropout"):  # (the model itself; nothing at inference)
            raise ValueError(f"{modules_file}: sentence-transformers module {module['type']!r} is not supported "
                             f"(Transformer, Pooling, Dense, Normalize are)")
    return spec


def _read_json(path: Path):
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON ({exc})") from None


def _matryoshka_dimensions(model_dir: Path) -> list[int] | None:
    for name in ("config_sentence_transformers.json", "config.json"):
        dims = _read_json(model_dir / name).get("matryoshka_dimensions")
        if dims:
            return [int(d) for d in dims]
    return None


def _pooling_mode(config_file: Path) -> tuple[str, bool]:
    """(our mode, include_prompt) of a sentence-transformers Pooling config."""
    config = _read_json(config_file)
    modes = config.get("pooling_mode") or [mode for flag, mode in _MODE_FLAGS.items() if config.get(flag)]
    modes = [modes] if isinstance(modes, str) else list(modes)
    if len(modes) != 1 or modes[0] not in _MODES:
        raise ValueError(f"{config_file}: pooling {modes} is not supported; one of {sorted(_MODES)} is")
    return _MODES[modes[0]], bool(config.get("include_prompt", True))


def _load_dense(folder: Path) -> Dense:
    """A sentence-transformers Dense module from its folder (config.json and its weights)."""
    config = _read_json(folder / "config.json")
    name = config.get("activation_function", "torch.nn.modules.activation.Tanh")
    activation = getattr(nn, name.rpartition(".")[2], None) if name.startswith("torch.nn.") else None
    if not (isinstance(activation, type) and issubclass(activation, nn.Module)):
        raise ValueError(f"{folder}: activation {name!r} is not supported (torch.nn modules are)")
    layer = Dense(config["in_features"], config["out_features"], config.get("bias", True), activation(),
                  config.get("use_residual", False))
    if (folder / "model.safetensors").exists():
        from safetensors.torch import load_file
        weights = load_file(str(folder / "model.safetensors"))
    elif (folder / "pytorch_model.bin").exists():
        weights = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise FileNotFoundError(f"{folder} has no model.safetensors or pytorch_model.bin for its Dense layer")
    layer.load_state_dict(weights)
    return layer.eval()


class Pooler(nn.Module):
    """One vector per sequence of a step, float32 (S, dimensions): a pooled embedding
    (before normalization and truncation) for "embed", logits for "classify" / "score"."""

    def __init__(self, task: str, spec: PoolingSpec | None = None, classify=None, hf_config=None):
        super().__init__()
        self.task = task
        self.dense = nn.ModuleList(spec.dense if spec is not None else [])
        self.mode = spec.mode if spec is not None else None
        self.default_normalize = spec.normalize if spec is not None else False
        self.matryoshka_dimensions = spec.matryoshka_dimensions if spec is not None else None
        self._classify = classify  # the model's head (a bound method: its weights stay the model's)
        if task == "embed":
            self.dimensions, self.num_labels, self.labels = spec.dimensions, None, None
        else:
            self.num_labels = self.dimensions = hf_config.num_labels
            id2label = hf_config.id2label
            self.labels = [id2label[i] for i in range(self.num_labels)] if id2label is not None else None

    def forward(self, hidden: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
        """hidden (num_tokens, hidden_size); spans: each sequence's (start, end) token rows."""
        if self._classify is not None:
            return self._classify(hidden, spans).float()
        pooled = pool(hidden, spans, self.mode)
        for layer in self.dense:
            pooled = layer(pooled)
        return pooled


def pool(hidden: torch.Tensor, spans: list[tuple[int, int]], mode: str) -> torch.Tensor:
    """(num_spans, hidden_size) float32: each span's mean, first or last row, for all
    spans at once."""
    bounds = np.asarray(spans, dtype=np.int64).reshape(-1, 2)
    if mode == "cls":
        return hidden[torch.from_numpy(bounds[:, 0]).to(hidden.device)].float()
    if mode == "last":
        return hidden[torch.from_numpy(bounds[:, 1] - 1).to(hidden.device)].float()
    # Each span's sum as the difference of two running sums, in float64 so the difference
    # loses nothing a float32 sum keeps (index_add_ took 60 ms for 2,048 rows on CPU: a
    # row at a time).
    running = torch.cat([hidden.new_zeros(1, hidden.shape[1], dtype=torch.float64),
                         hidden.double().cumsum(dim=0)])
    ends = torch.from_numpy(bounds).to(hidden.device)
    lengths = (ends[:, 1] - ends[:, 0]).double()[:, None]
    return ((running[ends[:, 1]] - running[ends[:, 0]]) / lengths).float()


def build_pooler(model: nn.Module, hf_config, model_dir: Path, task: str) -> Pooler:
    """The pooler of `task` for `model` (loaded from `model_dir`), on the model's device."""
    if task not in TASKS:
        raise ValueError(f"task {task!r} is not a pooling task; one of {TASKS} is")
    device = next(itertools.chain(model.parameters(), model.buffers())).device
    if task == "embed":
        return Pooler(task, read_pooling_spec(model_dir, hf_config)).to(device)
    classify = getattr(model, "classify", None)
    if classify is None and getattr(model, "is_encoder", False):
        raise ValueError(f"task {task!r} needs a classifier head, and {model_dir.name} ({type(model).__name__}) "
                         f"has none: use a checkpoint saved from a *ForSequenceClassification class")
    if classify is None:
        raise NotImplementedError(f"task {task!r} is not supported yet for {hf_config.model_type} models "
                                  f"({type(model).__name__}); BERT classifiers run it")
    return Pooler(task, classify=classify, hf_config=hf_config)
