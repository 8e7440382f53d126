"""The model shapes GPU users run, checked on CPU before any GPU time: the configs in
benchmarks/gpu_shapes.py build, with our model classes and transformers', at the
parameter counts their publishers give; and `load_format="dummy"` (random weights made
where the model runs, no weight file read) that the GPU benchmark starts them with."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import gpu_shapes
from gristmill.config import EngineConfig
from gristmill.errors import RequestError
from gristmill.model.layers import RMSNorm
from gristmill.model.loader import load_config
from gristmill.model.models import model_class
from gristmill.model.runner import ModelRunner

# Parameters as published (embeddings counted once where tied).
PUBLISHED = {"gemma3-270m": 268e6, "qwen3-0.6b": 596e6, "llama3.2-1b": 1.236e9, "llama3.1-8b": 8.03e9}


def _count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


@pytest.mark.parametrize("shape", sorted(gpu_shapes.SHAPES))
def test_benchmark_shapes_have_their_published_sizes(shape, tmp_path):
    transformers = pytest.importorskip("transformers")
    path = gpu_shapes.model_dir(shape, tmp_path / "no-tokenizer", tmp_path)
    config = load_config(path)
    with torch.device("meta"):
        ours = model_class(config)(config, 4096)
        theirs = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(path))
    assert _count(ours) == _count(theirs)
    assert abs(_count(ours) - PUBLISHED[shape]) < 0.01 * PUBLISHED[shape], _count(ours)
    # the benchmark's own count (matrices only: the bounds it reports) is within the norms of it
    assert 0 <= _count(ours) - gpu_shapes.parameter_count(gpu_shapes.SHAPES[shape])["total"] < 0.001 * _count(ours)
    if shape.startswith("llama"):
        assert config.rope_parameters["rope_type"] == "llama3"


def _config_only(tmp_path) -> str:
    """A model directory holding config.json alone: a 2-layer Qwen3."""
    config = {**gpu_shapes.SHAPES["qwen3-0.6b"], "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "bos_token_id": 1, "eos_token_id": 2}
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def _dummy_runner(path, **overrides) -> ModelRunner:
    return ModelRunner(EngineConfig(**{"model": path, "device": "cpu", "load_format": "dummy", "quantization": None,
                                       "num_kv_blocks": 8, "max_model_len": 64, **overrides}))


def test_dummy_weights_need_no_weight_file(tmp_path):
    path = _config_only(tmp_path)
    runner = _dummy_runner(path, seed=3)
    params = dict(runner.model.named_parameters())
    assert all(torch.isfinite(p).all() for p in params.values())
    matrix = params["model.layers.0.self_attn.q_proj.weight"]
    assert 0.015 < matrix.std().item() < 0.025
    for module in runner.model.modules():  # every norm the identity
        if isinstance(module, RMSNorm):
            assert torch.all(module.weight + module.offset == 1.0)
    again, other = _dummy_runner(path, seed=3), _dummy_runner(path, seed=4)
    assert torch.equal(dict(again.model.named_parameters())["model.embed_tokens.weight"], params["model.embed_tokens.weight"])
    assert not torch.equal(dict(other.model.named_parameters())["model.embed_tokens.weight"], params["model.embed_tokens.weight"])


def test_dummy_weights_are_quantized_without_filling_the_cache(tmp_path):
    """A random model quantized to int8 runs, and leaves no int8 cache a later load of real
    weights from the same directory could read."""
    from gristmill.model.cpu import kernels

    if kernels.int8_extension() is None:
        pytest.skip("the int8 kernel does not build here")
    path = _config_only(tmp_path / "model")
    cache = tmp_path / "cache"
    runner = _dummy_runner(path, quantization="int8", cache_dir=str(cache))
    assert runner.quantization == "int8"
    assert not list(cache.rglob("*.safetensors"))


def test_a_real_load_still_needs_its_weights(tmp_path):
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors files"):
        _dummy_runner(_config_only(tmp_path), load_format="auto")


def test_unknown_load_format_is_refused():
    with pytest.raises(RequestError, match="load_format: must be 'auto' or 'dummy', got 'npz'") as info:
        EngineConfig(load_format="npz")
    assert info.value.param == "load_format"


def test_the_runner_reads_torch_as_the_module():
    """A function-level `import torch.x` makes `torch` a local name of the whole function,
    unbound on the paths that skip it: ModelRunner's CUDA path failed so on a GPU."""
    import inspect

    for name, member in inspect.getmembers(ModelRunner, inspect.isfunction):
        assert "torch" not in member.__code__.co_varnames, name
