"""Loading a model for an engine: the device and dtype, the model directory (a GGUF file
resolved to its config and tokenizer), the memory check before anything loads, the weights
(from the checkpoint, quantized layer by layer, or random for load_format "dummy") and the
pooler of a pooling task. `load_model` gives a `LoadedModel`; the runner (model/runner.py)
runs steps over it."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import torch

from gristmill import startup
from gristmill.config import EngineConfig
from gristmill.errors import RequestError
from gristmill.model.backends import pick_backend
from gristmill.model.cpu import kernels, quant
from gristmill.model.layers import RotaryEmbedding, clear_rotary_cache
from gristmill.model.loader import GGUF_LINK, load_config, load_weights, resolve_model, trained_length
from gristmill.model.loader.tensors import open_checkpoint
from gristmill.model.memory import MemoryNeed, cpu_memory_need
from gristmill.model.models import model_class
from gristmill.paths import cache_root
from gristmill.pooling_params import PoolerInfo
from gristmill.tasks import is_pooling, model_kind, resolve_task


@dataclass
class LoadedModel:
    """A model ready for steps, and what was decided on the way."""

    model_dir: Path
    hf_config: object
    max_model_len: int
    dtype: torch.dtype
    #: "int8", "q4", "gguf" (a GGUF's matrices as stored) or None (float).
    quantization: str | None
    backend: object
    model: torch.nn.Module
    #: "generate", or the pooling task the engine runs.
    task: str
    pooler: torch.nn.Module | None = None
    pooler_info: PoolerInfo | None = None
    #: On CUDA: the device's memory before the weights (what this engine takes is measured from it).
    memory_at_start: object = None
    #: On CPU: what the engine needs and what was available, as checked before the load.
    memory_need: MemoryNeed | None = None


def load_model(config: EngineConfig, device: torch.device, model_dir: Path | None = None) -> LoadedModel:
    """The model `config` names, loaded on `device` (`config` already for that device)."""
    dtype = pick_dtype(config.dtype, device)
    if device.type == "cpu":  # a first start compiles them while it converts the model
        if not kernels.is_built(q4=config.quantization == "q4"):
            # The build's imports (setuptools, distutils, packaging) come first, here:
            # the model load imports packaging too (transformers), and an engine core
            # whose two threads imported it at once failed to start ("No module named
            # 'packaging'"). A warm start imports the built module without them.
            import torch.utils.cpp_extension as _cpp_extension  # noqa: F401 (binds no local `torch`)
        kernels.build_in_background(q4=config.quantization == "q4")
    model_dir = model_dir or resolve_model(config.model, config.cache_dir)
    hf_config = load_config(model_dir)
    max_model_len = config.max_model_len or trained_length(model_dir, hf_config)
    if max_model_len > hf_config.max_position_embeddings:  # (positions it was never trained on)
        raise RequestError(f"EngineConfig.max_model_len: {max_model_len} is more than the "
                           f"{hf_config.max_position_embeddings} positions {model_dir.name} "
                           f"supports; lower it or leave it out", param="max_model_len")
    gguf = (model_dir / GGUF_LINK).exists()
    panel_budget, need = 0, None
    if device.type == "cpu":  # before anything loads: a model that cannot fit is refused with the figures
        need = cpu_memory_need(model_dir, hf_config, config, max_model_len,
                               quant.planned_quantization(config.quantization, device, gguf),
                               torch.finfo(dtype).bits // 8)
        need.check()
        panel_budget = need.panel_budget
    quantization = quant.resolve_quantization(config.quantization, device, gguf)
    backend = pick_backend(device, dtype)
    memory_at_start = None
    if device.type == "cuda":  # before the weights: what this engine takes is measured from here
        from gristmill.model.cuda.memory import MemoryAtStart
        memory_at_start = MemoryAtStart.read(device)
    weights = {"gguf": "weights as stored"}.get(quantization, quantization) or str(dtype).removeprefix("torch.")
    with startup.phase(f"loading {model_dir.name} ({weights}) on {device}"):
        model = build_model(config, hf_config, model_dir, max_model_len, dtype, device, quantization,
                            panel_budget)
    task = resolve_task(config.task, model_dir)
    loaded = LoadedModel(model_dir, hf_config, max_model_len, dtype, quantization, backend, model, task,
                         memory_at_start=memory_at_start, memory_need=need)
    if is_pooling(task):
        loaded.pooler, loaded.pooler_info = build_pooler(model, hf_config, model_dir, device)
    return loaded


def build_model(config: EngineConfig, hf_config, model_dir: Path, max_model_len: int, dtype: torch.dtype,
                device: torch.device, quantization: str | None, panel_budget: int = 0) -> torch.nn.Module:
    clear_rotary_cache()
    # Built where it runs, in the dtype it runs in: an 8B model on a GPU never passes
    # through host memory, and random weights are made on the device.
    with torch.device("meta"):
        model = model_class(hf_config)(hf_config, max_model_len)
    if config.load_format == "dummy":
        _materialize(model, dtype, device)
        _tie_weights(model)
        random_weights(model, config.seed)
        if quantization is not None:
            quant.quantize_model(model, "int8" if quantization == "gguf" else quantization)
        return model.eval()
    with contextlib.closing(open_checkpoint(model_dir)) as checkpoint:
        held = set()
        if quantization is not None:  # the linears one by one, never the float model
            cache_file = None if quantization == "gguf" else \
                quant.cache_file_for(model_dir, cache_root(config.cache_dir), quantization)
            held = quant.quantize_from_checkpoint(model, checkpoint, quantization, cache_file, panel_budget)
        _materialize(model, dtype, device)
        _tie_weights(model)
        load_weights(model, checkpoint, skip=held)
    return model.eval()


def build_pooler(model: torch.nn.Module, hf_config, model_dir: Path, device: torch.device):
    """(the model's pooler for its task, what the client is told of it)."""
    from gristmill.model.pooling import build_pooler as pooler_of

    head = "classify" if model_kind(model_dir)[0] == "classifier" else "embed"
    pooler = pooler_of(model, hf_config, model_dir, head).to(device)
    labels = getattr(pooler, "labels", None)
    matryoshka = getattr(pooler, "matryoshka_dimensions", None)
    info = PoolerInfo(head, pooler.dimensions, tuple(matryoshka) if matryoshka else None,
                      bool(getattr(pooler, "default_normalize", True)), tuple(labels) if labels else None)
    return pooler, info


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def _materialize(model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Give every parameter and buffer still on the meta device uninitialized memory on
    `device`, floating ones in `dtype`, with `torch.empty` (`Module.to_empty` would also
    do, but its meta path imports sympy: 1.2 s of every start). Rotary tables are then
    computed, in float32 whatever the dtype."""
    def empty(tensor: torch.Tensor) -> torch.Tensor:
        return torch.empty(tensor.shape, dtype=dtype if tensor.is_floating_point() else tensor.dtype, device=device)

    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param.is_meta:
                setattr(module, name, torch.nn.Parameter(empty(param), requires_grad=False))
        for name, buffer in list(module.named_buffers(recurse=False)):
            if buffer.is_meta:
                setattr(module, name, empty(buffer))
        if isinstance(module, RotaryEmbedding):
            module.reset()


def _tie_weights(model: torch.nn.Module) -> None:
    # Moving parameters between devices can replace them; tied ones must stay one tensor.
    # (A quantized head is the embedding's source instead: quant.embed_from_head.)
    if model.config.tie_word_embeddings and isinstance(getattr(model, "lm_head", None), torch.nn.Linear):
        model.lm_head.weight = model.model.embed_tokens.weight


@torch.no_grad()
def random_weights(model: torch.nn.Module, seed: int) -> None:
    """Fill a model's weights in place, on their device, as `load_format="dummy"` asks:
    matrices normal with std 0.02, biases zero, norms the identity (weight + offset = 1).
    The values matter only in that they are finite and the same for the same seed."""
    generator = torch.Generator(device=next(model.parameters()).device)
    generator.manual_seed(seed % 2**63)
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if param.ndim >= 2:
                param.normal_(0.0, 0.02, generator=generator)
            elif name == "weight" and hasattr(module, "offset"):
                param.fill_(1.0 - float(module.offset))
            elif name == "weight" and isinstance(module, torch.nn.LayerNorm):
                param.fill_(1.0)
            else:
                param.zero_()
