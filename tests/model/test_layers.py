"""The compiled CPU ops against the torch reference backend: paged decode attention,
encoder attention, and the fused norms, residual adds and q/k/v preparation."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gristmill.model.backends.cpu import CpuBackend
from gristmill.model.metadata import StepMetadata
from gristmill.model.backends.reference import Backend
from gristmill.model.layers import PagedAttention, RMSNorm, RotaryEmbedding
from tests.model.gelu_bound import assert_gelu_of

REFERENCE = Backend()


def _cpu_backend() -> CpuBackend:
    backend = CpuBackend()
    if backend.ops is None:
        pytest.skip("C++ kernels could not be built on this machine")
    return backend


def _decode_case(heads, kv_heads, head_dim, window, lens, block_size=4):
    """A paged cache with blocks scattered over it, its step metadata and the queries."""
    torch.manual_seed(0)
    num_blocks = sum(-(-n // block_size) for n in lens) + 8
    attn = PagedAttention(heads, kv_heads, head_dim, head_dim ** -0.5, sliding_window=window)
    attn.k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim)
    attn.v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim)
    lens = torch.tensor(lens)
    tables = torch.zeros(len(lens), -(-int(lens.max()) // block_size), dtype=torch.long)
    free = torch.randperm(num_blocks).tolist()  # blocks scattered over the cache
    for row, n in enumerate(lens.tolist()):
        for i in range(-(-n // block_size)):
            tables[row, i] = free.pop()
    md = StepMetadata(slot_mapping=torch.zeros(len(lens), dtype=torch.long), query_start=torch.arange(len(lens) + 1),
                      seq_lens=lens, block_tables=tables, num_decodes=len(lens), block_size=block_size)
    return attn, md, torch.randn(len(lens), heads, head_dim)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (4, 1)])
def test_compiled_decode_matches_torch_path(heads, kv_heads, window):
    backend = _cpu_backend()
    attn, md, q = _decode_case(heads, kv_heads, 32, window, [1, 3, 9, 17, 12])
    expected = REFERENCE.decode_attention(attn, q, md)
    got = backend.decode_attention(attn, q, md)
    assert (got - expected).abs().max().item() < 1e-5


# Head sizes of the vector paths (multiples of 16 and 8) and of none (24 on avx512: avx2's;
# 20: portable's); groups of 1 to 7 query heads a KV head; one sequence (its KV heads split
# between threads) and many; contexts longer than a flush of 16 dot products.
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(32, 8, 64), (4, 1, 256), (14, 2, 128), (6, 2, 24), (3, 3, 20)])
@pytest.mark.parametrize("lens", [[77], [1, 2, 40, 33, 5, 16, 90]])
def test_every_code_path_of_the_decode_attention_matches_torch(heads, kv_heads, head_dim, lens):
    backend = _cpu_backend()
    attn, md, q = _decode_case(heads, kv_heads, head_dim, None, lens)
    expected = REFERENCE.decode_attention(attn, q, md)
    for isa in range(backend.ops.best_isa() + 1):
        got = backend.ops.paged_decode_attention(q, attn.k_cache, attn.v_cache, md.decode_block_tables,
                                                 md.decode_context_lens, attn.scale, 0, isa)
        # float32 sums of up to 90 terms of unit size, in another order than torch's
        assert (got - expected).abs().max().item() < 2e-5, isa


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 1, 256), (8, 2, 24), (3, 3, 20)])
def test_a_narrower_kv_cache_reads_as_the_float32_cache_of_its_values(cache_dtype, heads, kv_heads, head_dim):
    # EngineConfig.kv_cache_dtype: each key and value widens exactly to the float it stands
    # for, so every code path gives, bit for bit, what it gives over a float32 cache
    # holding the same values; and the torch path agrees with it.
    backend = _cpu_backend()
    attn, md, q = _decode_case(heads, kv_heads, head_dim, None, [1, 40, 17])
    narrow = (attn.k_cache.to(cache_dtype), attn.v_cache.to(cache_dtype))
    for window in (0, 6):
        for isa in range(backend.ops.best_isa() + 1):
            args = (md.decode_block_tables, md.decode_context_lens, attn.scale, window, isa)
            got = backend.ops.paged_decode_attention(q, *narrow, *args)
            assert torch.equal(got, backend.ops.paged_decode_attention(q, *(c.float() for c in narrow), *args)), isa
    attn.k_cache, attn.v_cache = narrow
    expected = REFERENCE.decode_attention(attn, q, md)
    assert (backend.decode_attention(attn, q, md) - expected).abs().max().item() < 2e-5


# -- the fused CPU ops (csrc/fused_ops.cpp) against the torch arithmetic they replace ----

def _norm(dim: int, offset: float, seed: int) -> RMSNorm:
    norm = RMSNorm(dim, 1e-6, offset=offset)
    norm.weight.data = torch.randn(dim, generator=torch.Generator().manual_seed(seed)) * 0.5 + (0 if offset else 1)
    return norm


@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("shape", [(1, 640), (3, 4, 32), (300, 96)])  # 300 rows: split across threads
def test_fused_rms_norm_matches_torch(offset, shape):
    backend = _cpu_backend()
    norm = _norm(shape[-1], offset, seed=1)
    x = torch.randn(*shape) * 3
    with torch.inference_mode():
        torch.testing.assert_close(backend.rms_norm(x, norm), REFERENCE.rms_norm(x, norm), rtol=1e-5, atol=1e-5)
        norm.weight.data.mul_(2)  # an in-place change to the weight is seen
        torch.testing.assert_close(backend.rms_norm(x, norm), REFERENCE.rms_norm(x, norm), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("delta_norm", [False, True])
@pytest.mark.parametrize("out_norm", [False, True])
def test_fused_residual_norm_matches_torch(delta_norm, out_norm):
    backend = _cpu_backend()
    dim = 64
    norms = (_norm(dim, 1.0, seed=2) if delta_norm else None, _norm(dim, 1.0, seed=3) if out_norm else None)
    for rows in (1, 700):
        x, delta = torch.randn(rows, dim), torch.randn(rows, dim) * 4
        with torch.inference_mode():
            got_x, got_h = backend.residual_norm(x, delta, *norms)
            want_x, want_h = REFERENCE.residual_norm(x, delta, *norms)
        torch.testing.assert_close(got_x, want_x, rtol=1e-5, atol=1e-5)
        assert (got_h is None) == (want_h is None) == (not out_norm)
        if out_norm:
            torch.testing.assert_close(got_h, want_h, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("with_delta", [False, True])
@pytest.mark.parametrize("shape", [(1, 384), (3, 5, 37), (301, 96)])  # 301 rows: split across threads
def test_fused_add_layer_norm_matches_torch(with_delta, shape):
    backend = _cpu_backend()
    torch.manual_seed(4)
    norm = nn.LayerNorm(shape[-1], eps=1e-12)
    nn.init.normal_(norm.weight, 1.0, 0.3)
    nn.init.normal_(norm.bias, 0.0, 0.3)
    x = torch.randn(*shape) * 3 + 5  # a large mean: the variance must not cancel it away
    delta = torch.randn(*shape) if with_delta else None
    x_before = x.clone()
    with torch.inference_mode():
        want = REFERENCE.add_layer_norm(x, delta, norm)
        got = backend.add_layer_norm(x, delta, norm)  # (may be written over delta)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(x, x_before) and got.shape == x.shape


def test_gelu_after_a_float_linear_matches_torch():
    backend = _cpu_backend()
    torch.manual_seed(5)
    linear = nn.Linear(37, 301)
    x = torch.randn(131, 37) * 4  # outputs from about -40 to 40: both tails and the middle
    with torch.inference_mode():
        got = backend.linear_activation(linear, x, "gelu")
        pre = linear(x)
    assert_gelu_of(got, pre)
    assert torch.equal(backend.linear_activation(linear, x, "silu"), REFERENCE.linear_activation(linear, x, "silu"))


class _Attention(nn.Module):
    """The attributes attention_inputs reads: head counts, rotary, q/k/v projections
    (one fused projection, as quantization makes it, or three)."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int, fused_qkv: bool):
        super().__init__()
        hidden = 48
        self.num_heads, self.num_kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.rotary = RotaryEmbedding(head_dim, 64, {"rope_theta": 10000.0})
        sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
        if fused_qkv:
            self.qkv_proj = nn.Linear(hidden, sum(sizes))
            self.qkv_proj.split_sizes = sizes
        else:
            self.q_proj, self.k_proj, self.v_proj = (nn.Linear(hidden, n) for n in sizes)


@pytest.mark.parametrize("fused_qkv", [False, True])
@pytest.mark.parametrize("qk_norm", [None, 0.0, 1.0])  # none (Llama), Qwen3's, Gemma's (1 + w)
@pytest.mark.parametrize("heads,kv_heads", [(4, 1), (4, 4)])
def test_fused_attention_inputs_match_torch(fused_qkv, qk_norm, heads, kv_heads):
    backend = _cpu_backend()
    torch.manual_seed(0)
    head_dim = 16
    module = _Attention(heads, kv_heads, head_dim, fused_qkv)
    norms = (None, None) if qk_norm is None else (_norm(head_dim, qk_norm, 4), _norm(head_dim, qk_norm, 5))
    positions = torch.tensor([0, 7, 3, 63, 12])  # scattered, up to the table's last row
    x = torch.randn(len(positions), 48)
    with torch.inference_mode():
        got = backend.attention_inputs(module, positions, x, *norms)
        want = REFERENCE.attention_inputs(module, positions, x, *norms)
    for name, g, w in zip("qkv", got, want):
        assert g.shape == w.shape, name
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_fused_attention_inputs_refuse_a_position_past_the_table():
    backend = _cpu_backend()
    module = _Attention(2, 1, 16, fused_qkv=True)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="position 64 is past the rotary table"):
        backend.attention_inputs(module, torch.tensor([3, 64]), torch.randn(2, 48), None, None)


@pytest.mark.parametrize("lengths", [[1], [3, 70, 5, 129, 2], [17] * 5, list(range(1, 40, 3))])
def test_encoder_attention_matches_torch_from_fused_qkv_views(lengths):
    # q, k, v as an encoder layer hands them over: strided views of one fused projection.
    import numpy as np

    class Layer:
        num_heads, head_dim, scale = 6, 24, 24 ** -0.5

    backend = _cpu_backend()
    bounds = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    md = StepMetadata(slot_mapping=None, query_start=torch.tensor(bounds), seq_lens=torch.tensor(lengths),
                      block_tables=None, num_decodes=0, block_size=16, query_start_host=bounds,
                      seq_lens_host=list(lengths))
    torch.manual_seed(0)
    qkv = torch.randn(bounds[-1], 3 * 6 * 24) * 2
    q, k, v = (t.view(-1, 6, 24) for t in qkv.split(6 * 24, dim=1))
    out = backend.encoder_attention(Layer, q, k, v, md)
    torch.testing.assert_close(out, REFERENCE.encoder_attention(Layer, q, k, v, md), rtol=1e-5, atol=3e-5)
