"""Builds an engine's parts: the one place the engine package reaches the model package.

The `EngineClient` (client.py; the core in its process or a child's) and the
engine-core process build through here:

- `start_kernels(config)`: on a first start on a CPU, starts compiling the C++ kernels on
  a thread (once per machine), so the model is converted and loaded meanwhile.
- `resolve_config(config)`: the config with `model` the HF directory (a GGUF file is
  converted once into the cache, in the caller's process, so a core never converts)
  and `task` what the model runs ("auto" resolved).
- `build_core(config)`: an `EngineCore` over a `ModelRunner` (loads the weights).
- `load_tokenizer(model_dir)`: the tokenizer and the ids that end a sequence (a copy is
  kept in the cache).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from gristmill.config import EngineConfig
from gristmill.engine.core import EngineCore
from gristmill.errors import RequestError
from gristmill.tasks import resolve_task


def start_kernels(config: EngineConfig) -> None:
    from gristmill.model.cpu import kernels  # imports no torch, nor does is_built

    q4 = config.quantization == "q4"
    if config.device in ("auto", "cpu") and not kernels.is_built(q4):
        kernels.build_in_background(q4, unless_cuda=config.device == "auto")


def resolve_model_dir(config: EngineConfig) -> Path:
    """The model's HF directory. With no model named, an embed or score engine gets the
    bundled embedding model (all-MiniLM-L6-v2), a classify engine none (it must name one)."""
    from gristmill.model.loader import resolve_model  # imports no torch

    model = config.model
    if model is None and config.task in ("embed", "score"):
        from gristmill.paths import DEFAULT_EMBEDDING_MODEL_NAME
        model = DEFAULT_EMBEDDING_MODEL_NAME
    elif model is None and config.task == "classify":
        raise RequestError("task='classify' needs a model with a classification head (a "
                           "*ForSequenceClassification directory); there is no bundled one: pass model=",
                           param="model")
    return resolve_model(model, config.cache_dir)


def resolve_config(config: EngineConfig) -> EngineConfig:
    """`config` with its model as an HF directory and its task resolved (`tasks.resolve_task`)."""
    model_dir = resolve_model_dir(config)
    return dataclasses.replace(config, model=str(model_dir), task=resolve_task(config.task, model_dir))


def build_core(config: EngineConfig, model_dir: Path | None = None) -> EngineCore:
    from gristmill.model.runner import ModelRunner
    runner = ModelRunner(config, model_dir)

    def grammars(eos_token_ids: frozenset[int]):
        from gristmill.structured.grammars import BACKENDS
        return BACKENDS[config.structured_output_backend](
            lambda: load_tokenizer(runner.model_dir, config.cache_dir)[0], runner.vocab_size, eos_token_ids,
            runner.model_dir / "tokenizer.json")

    return EngineCore(config, runner, grammars)


def preload() -> None:
    """Import what `build_core` will (torch and the model code), for a process that forks
    cores from here (core_launcher.py)."""
    from gristmill.model import runner  # noqa: F401
    from gristmill.model.cpu import kernels
    from gristmill.structured import grammars  # noqa: F401

    if kernels.is_built():  # (never built here: a first start builds them in its client)
        kernels.int8_extension()


def load_tokenizer(model_dir: Path, cache_dir: str | None = None) -> tuple[object, frozenset[int]]:
    """(tokenizer, end-of-sequence token ids) of the model in `model_dir`; a copy of the
    tokenizer is cached under `cache_dir` (or GRISTMILL_CACHE) for faster starts. Reads
    config.json as JSON: transformers' config classes import torch, which a client
    (server, batch job) otherwise never needs."""
    import json

    from gristmill.paths import cache_root
    from gristmill.tokenizer import eos_token_ids
    from gristmill.tokenizer import load_tokenizer as load

    config = json.loads((model_dir / "config.json").read_text())
    model_type = (config.get("text_config") or {}).get("model_type") or config.get("model_type", "")
    tokenizer = load(model_dir, model_type, cache_root(cache_dir))
    return tokenizer, eos_token_ids(tokenizer, model_dir, config)
