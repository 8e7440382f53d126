"""Builds an engine's parts: the one place the engine package reaches the model package.

`LLM` (everything in one process), `AsyncEngine` (the client side) and the engine-core
process all build through here:

- `resolve_model_dir(config)`: the HF directory of `config.model`; a GGUF file is
  converted once into the cache, in the caller's process, so a core never converts.
- `build_core(config)`: an `EngineCore` over a `ModelRunner` (loads the weights).
- `load_tokenizer(model_dir)`: the tokenizer and the ids that end a sequence.
"""

from __future__ import annotations

from pathlib import Path

from gristmill.config import EngineConfig
from gristmill.engine.core import EngineCore


def resolve_model_dir(config: EngineConfig) -> Path:
    from gristmill.model.loader import resolve_model
    return resolve_model(config.model, config.cache_dir)


def build_core(config: EngineConfig, model_dir: Path | None = None) -> EngineCore:
    from gristmill.model.runner import ModelRunner
    runner = ModelRunner(config, model_dir)

    def grammars():
        from gristmill.structured.grammars import BACKENDS
        tokenizer, eos_ids = load_tokenizer(runner.model_dir)
        return BACKENDS[config.structured_output_backend](tokenizer, runner.vocab_size, eos_ids)

    return EngineCore(config, runner, grammars)


def load_tokenizer(model_dir: Path) -> tuple[object, frozenset[int]]:
    """(tokenizer, end-of-sequence token ids) of the model in `model_dir`."""
    from gristmill.model.loader import load_config
    from gristmill.tokenizer import eos_token_ids
    from gristmill.tokenizer import load_tokenizer as load

    hf_config = load_config(model_dir)
    tokenizer = load(model_dir, hf_config.model_type)
    return tokenizer, eos_token_ids(tokenizer, model_dir, hf_config)
