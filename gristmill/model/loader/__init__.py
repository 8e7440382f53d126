"""Find a model, read its config and weights: HF directories and GGUF files.

A GGUF file is converted once into an HF-style directory in the cache (config.json,
model.safetensors, tokenizer files) keyed by the file's path, size and mtime; later
loads read that directory, which takes seconds instead of a dequantize per start.
Where a model argument points and where its conversion is kept are gristmill.paths'.
Finding and converting a model import no torch (a client converts a GGUF before its
engine core starts); loading weights does.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import math
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from gristmill import startup
from gristmill.model.loader.config import ModelConfig, load_config  # noqa: F401 (the loader's API)
from gristmill.model.loader.gguf_model import (MODEL_TYPES as _GGUF_MODEL_TYPES, dequantize,  # noqa: F401
                                               hf_tensor_name, hf_transform, model_config)
from gristmill.model.loader.gguf_model import dequantize as _dequantize  # noqa: F401 (tests)
from gristmill.model.loader.gguf_model import unpermute_rotary as _unpermute_rotary  # noqa: F401 (tests)
from gristmill.paths import converted_gguf_dir, model_source

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

# A converted GGUF is an HF directory (float32 model.safetensors, which transformers
# loads too) plus, for its Q8_0 matrices, their own numbers in Q8_0_FILE: int8 values
# (rows, cols) and fp16 scales per block of 32 (rows, cols / 32), named by these
# suffixes. int8 quantization packs those as they are (quant.py) instead of quantizing
# their float32 dequantization again, which gives the same weights.
Q8_0_FILE = "gristmill-q8_0.safetensors"
Q8_0_VALUES, Q8_0_SCALES = ".q8_0", ".q8_0_scale"

def resolve_model(model: str | None, cache_dir: str | None = None) -> Path:
    """The HF-style directory of `model` (None = the bundled default); a GGUF file is
    converted into the cache the first time."""
    path = model_source(model, cache_dir)
    if path.is_dir():
        return path
    target = converted_gguf_dir(path, cache_dir)
    what = f"converting {path.name} to safetensors"
    if (target / "model.safetensors").exists():
        startup.cached(what, target)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        with startup.phase(what, target):
            convert_gguf(path, tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process finished the same conversion first
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Convert a GGUF file into config.json + model.safetensors (float32) + tokenizer
    files, and Q8_0_FILE with its Q8_0 matrices as they are."""
    from gristmill.model.loader.gguf_file import GGUFFile

    reader = GGUFFile(gguf_path)
    arch, config = model_config(reader)
    model_type = config["model_type"]
    # The tokenizer (Python and Rust: mostly holding the GIL) is built on a thread while the
    # weights (numpy and the file writes: mostly not) are converted here.
    tokenizer = concurrent.futures.ThreadPoolExecutor(1, "gristmill-gguf-tokenizer")
    from gristmill.model.loader.gguf_tokenizer import convert_gguf_tokenizer
    converting = tokenizer.submit(convert_gguf_tokenizer, reader.fields, model_type, out_dir, gguf_path)
    try:
        _convert_gguf_weights(reader, arch, config, out_dir)
    finally:
        tokenizer.shutdown(wait=True)  # (out_dir is removed on an error: not while it writes there)
    converting.result()
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))


def _convert_gguf_weights(reader, arch: str, config: dict, out_dir: Path) -> None:
    """model.safetensors and Q8_0_FILE, each tensor dequantized and written a piece at a
    time through one reused buffer (no gigabyte of fresh memory to fault in); sets
    config's tie_word_embeddings (and rope_scaling where the file holds llama3 rope
    factors)."""
    import gguf

    from gristmill.model.loader.safetensors_io import write_safetensors

    floats, blocks = [], []
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
        if tensor.tensor_type == gguf.GGMLQuantizationType.Q8_0 and len(shape) == 2:
            for suffix, dtype, columns, part in ((Q8_0_VALUES, np.int8, shape[1], _q8_0_values),
                                                 (Q8_0_SCALES, np.float16, shape[1] // 32, _q8_0_scales)):
                blocks.append(_tensor_source(name + suffix, dtype, (shape[0], columns), tensor.data, buffer,
                                             transform, part))
    write_safetensors(out_dir / "model.safetensors", floats, metadata={"format": "pt"})  # as torch writes it
    if blocks:
        write_safetensors(out_dir / Q8_0_FILE, blocks)


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


def _q8_0_values(rows: np.ndarray, out: np.ndarray | None) -> np.ndarray:
    """Rows of a Q8_0 matrix's own int8 values (rows, cols), from its blocks (per block: an
    fp16 scale, then 32 int8 values); written into `out` (flat int8) when given."""
    values = rows.reshape(-1, 34)[:, 2:].view(np.int8)
    if out is None:
        return np.ascontiguousarray(values).reshape(len(rows), -1)
    np.copyto(out[:values.size].reshape(values.shape), values)
    return out[:values.size].reshape(len(rows), -1)


def _q8_0_scales(rows: np.ndarray, out: np.ndarray | None) -> np.ndarray:
    """Rows of a Q8_0 matrix's fp16 block scales (rows, cols / 32)."""
    return np.ascontiguousarray(rows.reshape(-1, 34)[:, :2]).view(np.float16).reshape(len(rows), -1)


def load_weights(model: torch.nn.Module, model_dir: Path, skip: set[str] = frozenset(),
                 q8_0: bool = False) -> None:
    """Copy every `*.safetensors` tensor of `model_dir` into `model`; all must be used,
    but those named in `skip` (weights the model holds in another form already). With
    `q8_0`, a converted GGUF's Q8_0 matrices are given to their parameters as they are
    (`param.q8_0 = (values, scales)`), for int8 quantization."""
    import torch
    from safetensors import safe_open

    files = sorted(f for f in model_dir.glob("*.safetensors") if f.name != Q8_0_FILE)
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    params = dict(model.named_parameters())
    # A family whose parameter names are not its checkpoints' maps them (None: a tensor it leaves out).
    rename = getattr(model, "checkpoint_name", None) or (lambda name: name.removeprefix("language_model."))
    loaded = set()
    with torch.no_grad():
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    target_name = rename(name)
                    if target_name is None or target_name in skip:
                        continue
                    if target_name not in params:
                        if "rotary_emb" in name:
                            continue
                        raise ValueError(f"checkpoint tensor {name!r} in {file.name} does not fit "
                                         f"this {type(model).__name__}")
                    params[target_name].copy_(f.get_tensor(name))
                    loaded.add(target_name)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    missing = set(params) - loaded - tied
    if missing:
        raise ValueError(f"checkpoint in {model_dir} lacks {sorted(missing)[:5]} "
                         f"({len(missing)} tensors missing)")
    if q8_0 and (model_dir / Q8_0_FILE).exists():
        with safe_open(str(model_dir / Q8_0_FILE), framework="pt") as f:
            for name in f.keys():
                target_name = name.removesuffix(Q8_0_VALUES)
                if name.endswith(Q8_0_VALUES) and target_name in loaded:
                    params[target_name].q8_0 = (f.get_tensor(name), f.get_tensor(target_name + Q8_0_SCALES))
