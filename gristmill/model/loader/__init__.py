"""Find a model, read its config and weights: HF directories and GGUF files.

A GGUF file gets a directory in the cache, made once and keyed by the file's path, size
and mtime: its config.json and tokenizer files, read from the file's metadata, and a link
to the file (GGUF_LINK), whose weights are read from it where they lie at every start
(loader.tensors): nothing of the weights is copied into the cache.
Where a model argument points and where its directory is kept are gristmill.paths'.
Finding a model imports no torch (a client prepares a GGUF's directory before its engine
core starts); loading weights does.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import logging
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from gristmill import startup
from gristmill.model.loader.config import ModelConfig, load_config, trained_length  # noqa: F401 (the API)
from gristmill.model.loader.gguf_model import (GGUF_LINK, MODEL_TYPES as _GGUF_MODEL_TYPES,  # noqa: F401
                                               dequantize, hf_tensor_name, hf_transform, model_config)
from gristmill.model.loader.gguf_model import dequantize as _dequantize  # noqa: F401 (tests)
from gristmill.model.loader.gguf_model import unpermute_rotary as _unpermute_rotary  # noqa: F401 (tests)
from gristmill.paths import converted_gguf_dir, model_source

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


def resolve_model(model: str | None, cache_dir: str | None = None) -> Path:
    """The HF-style directory of `model` (None = the bundled default); a GGUF file's is
    made in the cache the first time (config and tokenizer; its weights stay in the file)."""
    path = model_source(model, cache_dir)
    if path.is_dir():
        return path
    target = converted_gguf_dir(path, cache_dir)
    what = f"reading {path.name}'s config and tokenizer"
    if (target / "config.json").exists():
        startup.cached(what, target)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        with startup.phase(what, target):
            convert_gguf(path, tmp, weights=False)
        try:
            tmp.rename(target)
        except OSError:  # another process finished the same conversion first
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def convert_gguf(gguf_path: Path, out_dir: Path, weights: bool = True) -> None:
    """An HF directory of a GGUF file: config.json and tokenizer files, and either its
    weights dequantized into model.safetensors (float32: what transformers loads, for
    comparisons) or, with weights=False, a link to the file itself (GGUF_LINK), from
    which the engine reads them."""
    from gristmill.gguf_file import GGUFFile

    reader = GGUFFile(gguf_path)
    arch, config = model_config(reader)
    model_type = config["model_type"]
    # The tokenizer (Python and Rust: mostly holding the GIL) is built on a thread while the
    # weights (numpy and the file writes: mostly not) are converted here.
    tokenizer = concurrent.futures.ThreadPoolExecutor(1, "gristmill-gguf-tokenizer")
    from gristmill.model.loader.gguf_tokenizer import convert_gguf_tokenizer
    converting = tokenizer.submit(convert_gguf_tokenizer, reader.fields, model_type, out_dir, gguf_path)
    try:
        if weights:
            _convert_gguf_weights(reader, arch, config, out_dir)
        else:
            reader.tensors  # (every tensor's table entry is read: a truncated file fails here)
            os.symlink(Path(gguf_path).resolve(), out_dir / GGUF_LINK)
    finally:
        tokenizer.shutdown(wait=True)  # (out_dir is removed on an error: not while it writes there)
    converting.result()
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))


def _convert_gguf_weights(reader, arch: str, config: dict, out_dir: Path) -> None:
    """model.safetensors, each tensor dequantized and written a piece at a time through
    one reused buffer (no gigabyte of fresh memory to fault in)."""
    from gristmill.model.loader.safetensors_io import write_safetensors

    floats = []
    buffer = np.empty(_PIECE_BYTES, dtype=np.uint8)
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name, arch)
        if name is None:
            if tensor.name == "rope_freqs.weight":  # (in config.json: model_config)
                continue
            raise ValueError(f"GGUF tensor {tensor.name!r} has no place in a {arch} model")
        transform = hf_transform(arch, name, config)
        shape = tuple(reversed(tensor.shape))
        floats.append(_tensor_source(name, np.float32, shape, tensor.data, buffer, transform,
                                     lambda rows, out, t=tensor: dequantize(rows, t.tensor_type, out=out)))
    write_safetensors(out_dir / "model.safetensors", floats, metadata={"format": "pt"})  # as torch writes it


# The bytes of one piece of a tensor as it is converted (the buffer every piece reuses).
_PIECE_BYTES = 8 << 20


def _tensor_source(name: str, dtype, shape: tuple[int, ...], data: np.ndarray, buffer: np.ndarray,
                   transform, convert):
    """A tensor of the converted checkpoint: `convert(rows, out)` turns rows of the GGUF
    tensor's `data` into its values (written into `out`, a flat `dtype` array, when one
    is given). Pieces of whole rows that fit in `buffer`; the whole tensor at once where
    `transform` (a function of the whole tensor) applies."""
    from gristmill.model.loader.safetensors_io import TensorSource

    rows = data.reshape(-1, data.shape[-1])
    row_items = math.prod(shape) // len(rows)

    def pieces():
        if transform is not None:
            yield np.ascontiguousarray(transform(convert(rows, None).reshape(shape)), dtype=dtype)
            return
        out = buffer.view(dtype)
        step = max(1, len(out) // max(row_items, 1))
        for start in range(0, len(rows), step):
            chunk = rows[start:start + step]
            piece = convert(chunk, out if len(chunk) * row_items <= len(out) else None)
            yield np.ascontiguousarray(piece, dtype=dtype)

    return TensorSource(name, np.dtype(dtype), shape, pieces)


def load_weights(model: torch.nn.Module, checkpoint, skip: set[str] = frozenset()) -> None:
    """Copy every tensor of `checkpoint` (loader.tensors; a model directory opens one) into
    `model`, one tensor read at a time; all must be used, but those named in `skip`
    (weights the model holds in another form already)."""
    import torch

    from gristmill.model.loader.tensors import open_checkpoint

    if isinstance(checkpoint, Path):
        with contextlib.closing(open_checkpoint(checkpoint)) as opened:
            return load_weights(model, opened, skip)
    params = dict(model.named_parameters())
    # A family whose parameter names are not its checkpoints' maps them (None: a tensor it leaves out).
    rename = getattr(model, "checkpoint_name", None) or (lambda name: name.removeprefix("language_model."))
    loaded = set()
    with torch.no_grad():
        for name in checkpoint.names():
            target_name = rename(name)
            if target_name is None or target_name in skip:
                continue
            if target_name not in params:
                if "rotary_emb" in name:
                    continue
                raise ValueError(f"checkpoint tensor {name!r} does not fit this {type(model).__name__}")
            params[target_name].copy_(checkpoint.get(name))
            loaded.add(target_name)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    missing = set(params) - loaded - tied - set(skip)
    if missing:
        raise ValueError(f"the checkpoint lacks {sorted(missing)[:5]} ({len(missing)} tensors missing)")
