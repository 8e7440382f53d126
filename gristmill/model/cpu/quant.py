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
from gristmill.model.cpu.qlinear import LAYERS, Int8Embedding, Int8Linear, QuantizedLinear
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
_FORMATS = {"int8": "int8-v4", "q4": "q4-v2"}


def planned_quantization(quantization: str | None, device: torch.device, gguf: bool = False) -> str | None:
    """What `quantization` means on `device` when the kernels build: "auto" is int8 on CPU
    (for a GGUF file, `gguf`: "gguf", its matrices as stored, int8 for the types no kernel
    multiplies as stored), float elsewhere. For a decoder int8 pays in decode steps, which
    wait on the weights' bytes; for an encoder (every step all prompt tokens, thousands of
    rows a matmul: compute-bound) it pays because its activations go in 7 bits, which the
    AVX2 kernel multiplies with fewer instructions than a float GEMM (all-MiniLM-L6-v2:
    docs/performance.md, "Embeddings")."""
    if quantization == "auto":
        return None if device.type != "cpu" else "gguf" if gguf else "int8"
    if quantization in LAYERS and device.type != "cpu":
        raise ValueError(f"quantization={quantization!r} runs on CPU only; use quantization=None (or 'auto') on CUDA")
    return quantization


def resolve_quantization(quantization: str | None, device: torch.device, gguf: bool = False) -> str | None:
    """What runs: `planned_quantization`, but float where "auto" finds no kernels (they
    could not be built: a warning says so). Waits for the kernels' build."""
    planned = planned_quantization(quantization, device, gguf)
    if quantization == "auto" and planned is not None and kernels.int8_extension() is None:
        logger.warning("quantization='auto': the int8 kernel is unavailable, so weights stay float")
        return None
    return planned


def quantize_model(model: nn.Module, scheme: str = "int8") -> None:
    """Fuse the projections of a loaded float `model` and replace each nn.Linear by a
    `scheme` ("int8" or "q4") layer quantized from its weights."""
    fuse_projections(model)
    for name, linear in _linears(model).items():
        bias = None if linear.bias is None else linear.bias.detach()
        _put(model, name, _quantized(scheme, name, linear, linear.weight.detach(), bias), linear)
    embed_from_head(model)


def quantize_from_checkpoint(model: nn.Module, checkpoint, scheme: str, cache_file: Path | None,
                             panel_budget: int = 0) -> set[str]:
    """Fill `model` (built on the meta device) with quantized linears, one at a time from
    `checkpoint` (loader.tensors): each from `cache_file` where it holds the layer, else
    as the checkpoint stores it where a kernel multiplies by that (scheme "gguf": a GGUF's
    blocks), else quantized to `scheme` from its float weights, which are then dropped.
    At no time is more than one layer's float weights in memory. Writes the cache when it
    lacked a layer (not for "gguf": the file is the cache; its layers' panels are packed
    once within `panel_budget` bytes: `pack_panels`). Returns the checkpoint names of the
    tensors the model now holds, to skip when the rest is loaded."""
    held = {f"{name}.{kind}" for name, module in model.named_modules()
            if isinstance(module, nn.Linear) for kind in ("weight", "bias")}
    fuse_projections(model)
    sources = _checkpoint_names(model, checkpoint)
    cached = _open_cache(cache_file) if scheme != "gguf" else None
    built_now, fallbacks, stored = False, {}, []
    what = f"quantizing the weights to {scheme}"
    with contextlib.ExitStack() as stack:
        if cached is not None:
            stack.callback(cached.close)
        for name, linear in _linears(model).items():
            layer = _cached_layer(cached, scheme, name, linear)
            if layer is None:
                if not built_now and scheme != "gguf":  # the first layer the cache lacks: say so once
                    stack.enter_context(startup.phase(what, cache_file))
                layer = _layer_from_checkpoint(checkpoint, scheme, name, linear, sources, fallbacks)
                built_now = True
            _put(model, name, layer, linear)
            if getattr(layer, "kernel", None) == "gguf_linear":
                stored.append((name, layer, [sources[p] for p in _parts(name, linear, "weight")]))
    if stored and panel_budget > 0:
        stored.sort(key=lambda entry: entry[0] != "lm_head")  # the head first, then in order
        pack_panels([(layer, names) for _, layer, names in stored], checkpoint, panel_budget)
    for type_name, tensors in fallbacks.items():
        are = "matrix is" if len(tensors) == 1 else "matrices are"
        startup.warn(f"{len(tensors)} {are} {type_name} (e.g. {tensors[0]}), which no kernel "
                     f"multiplies as stored yet: quantized to int8 at each start")
    if cache_file is not None and scheme != "gguf":
        if built_now:
            _save_layers(model, cache_file)
        else:
            startup.cached(f"{scheme} weights", cache_file)
    if embed_from_head(model) or (scheme == "gguf" and _embed_from_blocks(model, checkpoint, sources)):
        held.add("model.embed_tokens.weight")
    return held


def pack_panels(layers: list, checkpoint, budget: int) -> int:
    """Pack the panels of `layers`' parts once (GGUFLinear.pack_panels: what the kernel
    lays out afresh at every call of many rows), in the order given, each layer whose cost
    fits in what is left of `budget` bytes. The K types' panels are not packed: over
    twice their bytes, read from memory they took as long as packing them afresh
    (benchmarks/gguf_kernels.py --panels). A Q8_0 or Q4_0 part read where it lies in the
    file costs nothing: its panels are compact, the file's own size (34 and 18 bytes a row
    and block), the kernel reads them at every row count, and its pages of the file are
    released. `layers`: (GGUFLinear, the checkpoint's names of its parts). Returns the
    bytes spent."""
    from gguf import GGMLQuantizationType as T

    types = {T.Q8_0, T.Q4_0, T.Q5_0}
    spent = 0
    for layer, names in layers:
        sizes = layer.panel_bytes(types=types)
        freed = [data.numel() if replaces and size and checkpoint.in_file(name) else 0
                 for (_, data), name, size, replaces in zip(layer.parts, names, sizes, layer.panels_replace_bytes())]
        cost = sum(sizes) - sum(freed)
        if not any(sizes) or spent + cost > budget:
            continue
        layer.pack_panels(types=types)
        spent += cost
        for name, released in zip(names, freed):
            if released:
                checkpoint.release(name)
    return spent


def _linears(model: nn.Module) -> dict[str, nn.Linear]:
    return {name: module for name, module in model.named_modules() if isinstance(module, nn.Linear)}


def _checkpoint_names(model: nn.Module, checkpoint) -> dict[str, str]:
    """The model's parameter names -> the checkpoint's names of them (a family may name
    its checkpoint's tensors otherwise: its `checkpoint_name`)."""
    rename = getattr(model, "checkpoint_name", None) or (lambda name: name.removeprefix("language_model."))
    sources = {}
    for name in checkpoint.names():
        ours = rename(name)
        if ours is not None:
            sources[ours] = name
    if model.config.tie_word_embeddings and "model.embed_tokens.weight" in sources:
        sources.setdefault("lm_head.weight", sources["model.embed_tokens.weight"])
    return sources


def _parts(name: str, linear: nn.Linear, kind: str) -> list[str]:
    """The model's parameter names of a linear's `kind` ("weight" or "bias"), one per fused part."""
    parts = getattr(linear, "part_names", None)
    if parts is None:
        return [f"{name}.{kind}"]
    parent = name.rpartition(".")[0]
    return [f"{parent}.{part}.{kind}" for part in parts]


def _layer_from_checkpoint(checkpoint, scheme: str, name: str, linear: nn.Linear, sources: dict[str, str],
                           fallbacks: dict[str, list[str]]) -> nn.Module:
    def source(param: str) -> str:
        if param not in sources:
            raise ValueError(f"the checkpoint lacks {param!r} (for layer {name})")
        return sources[param]

    weights = [source(p) for p in _parts(name, linear, "weight")]
    bias = None
    if linear.bias is not None:
        bias = torch.cat([checkpoint.get(source(p)).float() for p in _parts(name, linear, "bias")])
    if scheme == "gguf":
        from gristmill.model.cpu.gguf_linear import GGUFLinear

        stored = [checkpoint.stored(w) for w in weights]
        if all(s is not None and GGUFLinear.supports(s[0]) for s in stored):
            return GGUFLinear(stored, linear.in_features, bias)
        for w, s in zip(weights, stored):  # (the parts fused beside them go to int8 with them)
            if s is None or not GGUFLinear.supports(s[0]):
                fallbacks.setdefault(_type_name(checkpoint.tensor_type(w)), []).append(checkpoint.gguf_name(w))
    weight = torch.cat([checkpoint.get(w) for w in weights]) if len(weights) > 1 else checkpoint.get(weights[0])
    return _quantized("int8" if scheme == "gguf" else scheme, name, linear, weight, bias)


def _type_name(ggml_type: int) -> str:
    import gguf

    return gguf.GGMLQuantizationType(ggml_type).name


def _quantized(scheme: str, name: str, linear: nn.Linear, weight: torch.Tensor, bias: torch.Tensor | None):
    """A `scheme` layer for `linear` (named `name`) quantized from float `weight`."""
    return LAYERS[_HEAD_SCHEMES[scheme] if name == "lm_head" else scheme].from_weight(weight, bias)


def _open_cache(cache_file: Path | None):
    from gristmill.model.loader.safetensors_io import SafetensorsReader

    if cache_file is None or not cache_file.exists():
        return None
    try:
        return SafetensorsReader(cache_file)
    except Exception as exc:  # noqa: BLE001 - a damaged cache is rebuilt, not fatal
        logger.warning("ignoring unreadable quantized cache %s (%s)", cache_file, exc)
        return None


def _cached_layer(cached, scheme: str, name: str, linear: nn.Linear) -> nn.Module | None:
    """`linear`'s quantized layer as the cache holds it, or None where it does not (whole)."""
    if cached is None:
        return None
    # Built on the meta device, then given the stored tensors, each read into memory of
    # its own: nothing of the file stays mapped (a cache file rewritten in place would
    # crash the engine with SIGBUS).
    with torch.device("meta"):
        _, layer = _empty_layer(scheme, name, linear)
    buffers = dict(layer.named_buffers(recurse=False))
    stored_names = set(cached.keys())
    if any(f"{name}.{buf}" not in stored_names for buf in buffers):
        return None
    try:
        stored = {buf: cached.read(f"{name}.{buf}") for buf in buffers}
    except ValueError as exc:
        logger.warning("ignoring unreadable quantized cache %s (%s)", cached.path, exc)
        return None
    if any(t.shape != buffers[buf].shape for buf, t in stored.items()):
        return None
    for buf, tensor in stored.items():  # (a dtype the file differs in: cast, as load_state_dict did)
        setattr(layer, buf, tensor.to(buffers[buf].dtype))
    return layer


def _save_layers(model: nn.Module, cache_file: Path) -> None:
    """Every quantized layer's buffers into `cache_file`, tensor by tensor (no second copy
    of the model in memory), atomically."""
    from gristmill.model.loader.safetensors_io import TensorSource, write_safetensors

    sources = []
    for name, module in model.named_modules():
        if isinstance(module, QuantizedLinear):
            for buf, tensor in module.named_buffers(recurse=False):
                array = tensor.contiguous().numpy()
                sources.append(TensorSource(f"{name}.{buf}", array.dtype, array.shape, lambda a=array: [a]))
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=cache_file.parent, prefix=".tmp-", suffix=".safetensors")
    os.close(fd)
    try:
        write_safetensors(Path(tmp), sources)
        os.replace(tmp, cache_file)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def embed_from_head(model: nn.Module) -> bool:
    """Tied embeddings and an int8 LM head: the embeddings are read from the head
    (`Int8Embedding`) and the float table goes. True when so."""
    head = getattr(model, "lm_head", None)
    if not (model.config.tie_word_embeddings and isinstance(head, Int8Linear)):
        return False
    model.model.embed_tokens = Int8Embedding(head)
    return True


def _embed_from_blocks(model: nn.Module, checkpoint, sources: dict[str, str]) -> bool:
    """A GGUF's embedding read from its blocks where a kernel reads their type: the tied
    LM head's (`GGUFEmbedding`), or an untied table's own. True when so."""
    from gristmill.model.cpu.gguf_linear import GGUFEmbedding, GGUFLinear

    head = getattr(model, "lm_head", None)
    if model.config.tie_word_embeddings and isinstance(head, GGUFLinear):
        model.model.embed_tokens = GGUFEmbedding(head)
        return True
    name = sources.get("model.embed_tokens.weight")
    stored = None if name is None else checkpoint.stored(name)
    if model.config.tie_word_embeddings or stored is None or not GGUFLinear.supports(stored[0]):
        return False
    model.model.embed_tokens = GGUFEmbedding(GGUFLinear([stored], checkpoint.shape(name)[1], None))
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


def cache_file_for(model_dir: Path, root: Path, scheme: str = "int8") -> Path:
    """Where the `scheme` weights of `model_dir` are cached: keyed by its checkpoint files'
    paths, sizes and modification times (a GGUF's through its link), so a changed
    checkpoint is quantized afresh."""
    from gristmill.model.loader.tensors import GGUF_LINK

    files = sorted(model_dir.glob("*.safetensors"))
    if (model_dir / GGUF_LINK).exists():
        files.append((model_dir / GGUF_LINK).resolve())
    parts = [_FORMATS[scheme], str(model_dir.resolve())]
    parts += [f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files]
    key = hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]
    return root / "quantized" / f"{model_dir.name}-{key}.safetensors"
