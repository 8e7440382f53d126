"""ModelRunner set-up: the backend it picks, KV cache sizing options, and clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from gristmill.config import EngineConfig  # noqa: E402
from gristmill.errors import RequestError  # noqa: E402
from gristmill.model.runner import ModelRunner  # noqa: E402
from tests.mappings import vm_flags_at  # noqa: E402


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    path = tmp_path_factory.mktemp("tiny_llama")
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def test_cpu_runner_picks_the_cpu_backend_and_a_one_gib_cache_by_default(tiny_llama):
    runner = ModelRunner(EngineConfig(model=str(tiny_llama), device="cpu", quantization=None))
    assert runner.backend.name == "cpu" and runner.graphs is None
    per_block = 2 * 2 * 16 * 16 * 4  # k and v, 2 layers, 16 tokens, 1 kv head of 16, float32
    assert runner.num_blocks == 2**30 // per_block
    half = ModelRunner(EngineConfig(model=str(tiny_llama), device="cpu", quantization=None, kv_cache_memory_gb=0.5))
    assert half.num_blocks == runner.num_blocks // 2


def _rss_bytes() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def test_the_cpu_kv_cache_costs_memory_only_for_the_blocks_written(tiny_llama):
    # A 1 GiB cache on a laptop: its pages are mapped when a block is first written, so
    # a start (and a small job) does not hold a gigabyte it never touches.
    before = _rss_bytes()
    runner = ModelRunner(EngineConfig(model=str(tiny_llama), device="cpu", quantization=None))
    assert runner.kv_cache.numel() * runner.kv_cache.element_size() == 2**30
    assert _rss_bytes() - before < 2**30 // 4
    assert not runner.kv_cache[:, :, -8:].any()  # zeros, as a fresh cache must read
    runner.kv_cache[:, :, :runner.num_blocks // 4].fill_(1.0)  # a quarter of the blocks: those pages only
    grown = _rss_bytes() - before
    assert 200 * 2**20 <= grown < 2**30 // 2


@pytest.mark.skipif(not Path("/sys/kernel/mm/transparent_hugepage/enabled").exists(),
                    reason="transparent huge pages: Linux, built with them")
def test_the_cpu_kv_cache_does_not_ask_for_huge_pages(tiny_llama):
    # Each block is written for the first time in the middle of a step. Asked for 2 MiB
    # pages (VmFlags "hg", as numpy's large zeros are), a first write where the kernel
    # compacts memory to find one took ~5 ms a page on a 2-core VM: 15% of a 512-token
    # prompt. The cache's mapping asks for nothing; the system's page policy applies.
    runner = ModelRunner(EngineConfig(model=str(tiny_llama), device="cpu", quantization=None))
    for address in (runner.kv_cache.data_ptr(), runner.kv_cache[1, -1, -1].data_ptr()):
        assert "hg" not in vm_flags_at(address)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a machine without a GPU")
@pytest.mark.parametrize("kv_cache_dtype", ["float16", "bfloat16"])
def test_a_narrower_kv_cache_holds_twice_the_tokens_in_the_same_memory(tiny_llama, kv_cache_dtype):
    wide = ModelRunner(EngineConfig(model=str(tiny_llama), device="cpu", quantization=None, kv_cache_memory_gb=0.25))
    narrow = ModelRunner(EngineConfig(model=str(tiny_llama), device="cpu", quantization=None, kv_cache_memory_gb=0.25,
                                      kv_cache_dtype=kv_cache_dtype))
    assert wide.kv_cache.dtype == torch.float32 and narrow.kv_cache.dtype == getattr(torch, kv_cache_dtype)
    assert narrow.num_blocks == 2 * wide.num_blocks
    assert narrow.kv_cache.numel() * narrow.kv_cache.element_size() == 2**30 // 4
    explicit = ModelRunner(EngineConfig(model=str(tiny_llama), device="cpu", quantization=None,
                                        kv_cache_memory_gb=0.25, kv_cache_dtype="float32"))
    assert explicit.kv_cache.dtype == torch.float32 and explicit.num_blocks == wide.num_blocks


def test_a_narrower_kv_cache_on_cuda_is_a_clear_error():
    # (the rule itself, on a runner's fields: no GPU here) On CUDA the attention kernels
    # read the cache in the model's dtype; another is refused, naming the option.
    from types import SimpleNamespace

    def on_cuda(kv_cache_dtype):
        runner = SimpleNamespace(config=EngineConfig(kv_cache_dtype=kv_cache_dtype), dtype=torch.bfloat16,
                                 device=torch.device("cuda"))
        return ModelRunner.kv_dtype.fget(runner)

    assert on_cuda("auto") == on_cuda("bfloat16") == torch.bfloat16
    with pytest.raises(RequestError, match="kv_cache_dtype='float16' is for CPU.*leave it 'auto'") as info:
        on_cuda("float16")
    assert info.value.param == "kv_cache_dtype"


def test_cuda_without_a_gpu_is_a_clear_error(tiny_llama):
    with pytest.raises(RuntimeError, match="torch sees no CUDA GPU.*use device='cpu' or 'auto'"):
        ModelRunner(EngineConfig(model=str(tiny_llama), device="cuda"))


@pytest.mark.parametrize("field,value", [("gpu_memory_utilization", 0), ("gpu_memory_utilization", 1.5),
                                         ("gpu_memory_utilization", True), ("kv_cache_memory_gb", 0),
                                         ("kv_cache_memory_gb", -1.0), ("kv_cache_dtype", "fp8"),
                                         ("kv_cache_dtype", "half")])
def test_memory_options_are_validated(field, value):
    with pytest.raises(RequestError, match=f"EngineConfig.{field}") as info:
        EngineConfig(**{field: value})
    assert info.value.param == field
