"""Quantized weights on CPU: every linear layer, the tied LM head included, as int8 or
4-bit (`qlinear.py` has the layers and their formats). Embedding lookups, norms and
attention stay in float.

The quantized model is cached on disk next to other converted models, keyed by the
checkpoint files it came from, so a later start loads it instead of quantizing again.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import tempfile
from pathlib import Path

import torch
from torch import nn

from gristmill import startup
from gristmill.model.cpu import kernels
from gristmill.model.cpu.qlinear import LAYERS, Int8Embedding, Int8Linear
from gristmill.model.layers.linear import fuse_projections

logger = logging.getLogger(__name__)

# The LM head stays int8 under "q4": in 4 bits it doubled Gemma 3 270M's perplexity (21.8
# against 11.1), and llama.cpp's Q4_K_M keeps that model's token embedding at Q8_0 too.
_HEAD_SCHEMES = {"int8": "int8", "q4": "int8"}
# An encoder's steps are thousands of rows a matmul: compute-bound, where 7-bit
# activations let the AVX2 kernel skip the sign trick (all-MiniLM-L6-v2: min cosine to
# float 0.9985 against 0.9992 with int8 activations; docs/performance.md, "Embeddings").
ENCODER_X_LEVELS = 63
# Bump a scheme's version when its packed layout changes: old cache files are then ignored.
_FORMATS = {"int8": "int8-v3", "q4": "q4-v1"}


def resolve_quantization(quantization: str | None, device: torch.device) -> str | None:
    """What runs: "auto" is int8 on CPU when the kernel builds, float elsewhere. For a
    decoder int8 pays in decode steps, which wait on the weights' bytes; for an encoder
    (every step all prompt tokens, thousands of rows a matmul: compute-bound) it pays
    because its activations go in 7 bits, which the AVX2 kernel multiplies with fewer
    instructions than a float GEMM (all-MiniLM-L6-v2: docs/performance.md, "Embeddings")."""
    if quantization == "auto":
        if device.type != "cpu":
            return None
        if kernels.int8_extension() is None:
            logger.warning("quantization='auto': the int8 kernel is unavailable, so weights stay float")
            return None
        return "int8"
    if quantization in LAYERS and device.type != "cpu":
        raise ValueError(f"quantization={quantization!r} runs on CPU only; use quantization=None (or 'auto') on CUDA")
    return quantization


def quantize_model(model: nn.Module, scheme: str = "int8", cache_file: Path | None = None) -> None:
    """Fuse projections, then replace every nn.Linear of `model` by a quantized layer of
    `scheme` ("int8" or "q4"), from `cache_file` when it holds this model's quantized
    weights, else quantizing them (and writing the cache)."""
    from safetensors.torch import load_file, save_file

    fuse_projections(model)
    linears = {name: module for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    cached = {}
    if cache_file is not None and cache_file.exists():
        try:
            cached = load_file(str(cache_file))
        except Exception as exc:  # noqa: BLE001 - a damaged cache is rebuilt, not fatal
            logger.warning("ignoring unreadable quantized cache %s (%s)", cache_file, exc)
    state, quantized_now = {}, False
    what = f"quantizing the weights to {scheme}"
    with contextlib.ExitStack() as saying:
        for name, linear in linears.items():
            kind, layer = _empty_layer(scheme, name, linear)
            stored = {buf: cached.get(f"{name}.{buf}") for buf, _ in layer.named_buffers(recurse=False)}
            if all(t is not None and t.shape == getattr(layer, buf).shape for buf, t in stored.items()):
                layer.load_state_dict(stored)
            else:
                if not quantized_now:  # the first layer the cache lacks: say so once
                    saying.enter_context(startup.phase(what, cache_file))
                layer, quantized_now = kind.from_linear(linear), True
            state.update({f"{name}.{buf}": tensor for buf, tensor in layer.named_buffers(recurse=False)})
            _put(model, name, layer, linear)
        if cache_file is not None and (quantized_now or len(cached) != len(state)):
            _save_atomically(state, cache_file, save_file)
    embed_from_head(model)
    if not quantized_now and cache_file is not None:
        startup.cached(f"{scheme} weights", cache_file)


def load_quantized(model: nn.Module, scheme: str, cache_file: Path) -> set[str] | None:
    """A warm start without the float weights of the linears: fuse the projections of
    `model` (on the meta device) and put in each linear the `scheme` layer stored in
    `cache_file`. Returns the checkpoint tensors the model now holds in quantized form
    (to skip when loading the rest), or None when the cache lacks a layer (`model` is
    then unusable)."""
    from gristmill.model.loader.safetensors_io import SafetensorsReader

    if not cache_file.exists():
        return None
    held = {f"{name}.{kind}" for name, module in model.named_modules()
            if isinstance(module, nn.Linear) for kind in ("weight", "bias")}
    fuse_projections(model)
    linears = {name: module for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    layers = {}
    try:
        with SafetensorsReader(cache_file) as f:
            stored_names = set(f.keys())
            for name, linear in linears.items():
                # Built on the meta device, then given the stored tensors, each read into
                # memory of its own: no zero-filled buffers for the weights to be copied
                # into, and nothing of the file mapped (a cache file overwritten or
                # truncated in place would then crash the engine with SIGBUS).
                with torch.device("meta"):
                    _, layer = _empty_layer(scheme, name, linear)
                buffers = dict(layer.named_buffers(recurse=False))
                if any(f"{name}.{buf}" not in stored_names for buf in buffers):
                    return None
                stored = {buf: f.read(f"{name}.{buf}") for buf in buffers}
                if any(t.shape != buffers[buf].shape for buf, t in stored.items()):
                    return None
                for buf, tensor in stored.items():  # (a dtype the file differs in: cast, as load_state_dict did)
                    setattr(layer, buf, tensor.to(buffers[buf].dtype))
                layers[name] = layer
    except Exception as exc:  # noqa: BLE001 - a damaged cache: the cold path rebuilds it
        logger.warning("ignoring unreadable quantized cache %s (%s)", cache_file, exc)
        return None
    for name, layer in layers.items():
        _put(model, name, layer, linears[name])
    if embed_from_head(model):
        held.add("model.embed_tokens.weight")
    startup.cached(f"{scheme} weights", cache_file)
    return held


def embed_from_head(model: nn.Module) -> bool:
    """Tied embeddings and an int8 LM head: the embeddings are read from the head
    (`Int8Embedding`) and the float table goes. True when so."""
    head = getattr(model, "lm_head", None)
    if not (model.config.tie_word_embeddings and isinstance(head, Int8Linear)):
        return False
    model.model.embed_tokens = Int8Embedding(head)
    return True


def _empty_layer(scheme: str, name: str, linear: nn.Linear):
    """(layer class, an empty layer of it) to stand in for `linear`."""
    kind = LAYERS[_HEAD_SCHEMES[scheme] if name == "lm_head" else scheme]
    return kind, kind(linear.in_features, linear.out_features, linear.bias is not None)


def _put(model: nn.Module, name: str, layer: nn.Module, linear: nn.Linear) -> None:
    """Put quantized `layer` where `linear` (named `name`) was. An encoder's int8 layers
    quantize their activations to 7 bits (`Int8Linear.x_levels`)."""
    layer.split_sizes = getattr(linear, "split_sizes", None)
    layer.reuse_output = name == "lm_head"
    if isinstance(layer, Int8Linear) and getattr(model, "is_encoder", False):
        layer.x_levels = ENCODER_X_LEVELS
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, layer)


def _save_atomically(state: dict, path: Path, save_file) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".safetensors")
    os.close(fd)
    try:
        save_file({k: v.contiguous() for k, v in state.items()}, tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def cache_file_for(model_dir: Path, root: Path, scheme: str = "int8") -> Path:
    """Where the `scheme` weights of `model_dir` are cached: keyed by its checkpoint files'
    paths, sizes and modification times, so a changed checkpoint is quantized afresh."""
    files = sorted(model_dir.glob("*.safetensors"))
    parts = [_FORMATS[scheme], str(model_dir.resolve())]
    parts += [f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files]
    key = hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]
    return root / "quantized" / f"{model_dir.name}-{key}.safetensors"
