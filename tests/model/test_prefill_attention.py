"""Attention on CPU in chunks of queries (backends/cpu.py) against SDPA over the whole
sequence with its mask: causal prefill and bidirectional (EmbeddingGemma), sliding
windows, grouped heads, keys already in the paged cache, chunk edges."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from gristmill.model.backends.cpu import _CHUNK, CpuBackend, chunked_attention
from gristmill.model.backends.reference import Backend
from gristmill.model.layers import PagedAttention
from gristmill.model.layers.attention import BidirectionalAttention

EPS = torch.finfo(torch.float32).eps


def _sdpa(q, keys, values, scale, prior, window):
    n, total = q.shape[0], keys.shape[0]
    places = torch.arange(prior, total)[:, None]
    seen = torch.arange(total)[None] <= places
    if window is not None:
        seen &= torch.arange(total)[None] > places - window
    heads = [t.transpose(0, 1)[None] for t in (q, keys, values)]
    return F.scaled_dot_product_attention(*heads, attn_mask=seen, scale=scale, enable_gqa=True)[0].transpose(0, 1)


def _bound(keys, values, dim):
    # Both sides take an exact softmax in float32 and differ only in the order of their
    # sums: a score's dot product of `dim` terms, a row's sum over its keys and the
    # weighted sum of values, each within (terms) x eps of the sum of magnitudes; the
    # output is a convex combination of values, so it moves by at most that relative
    # error times the largest value (x 4: the score error enters through exp twice).
    return 4 * (keys.shape[0] + dim) * EPS * values.abs().max().item()


@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 1, 16), (6, 2, 8), (2, 2, 32)])
def test_chunks_equal_sdpa_with_the_whole_mask(heads, kv_heads, dim):
    torch.manual_seed(heads * 10 + kv_heads)
    for n, prior, window in itertools.product([1, _CHUNK - 1, _CHUNK, _CHUNK + 1, 3 * _CHUNK + 5], [0, 3, 130],
                                              [None, 1, 7, _CHUNK, 100]):
        total = prior + n
        q, keys, values = torch.randn(n, heads, dim), torch.randn(total, kv_heads, dim), torch.randn(total, kv_heads, dim)
        got = chunked_attention(q, keys, values, 0.3, prior, window)
        want = _sdpa(q, keys, values, 0.3, prior, window)
        assert got.shape == want.shape == (n, heads, dim)
        err = (got - want).abs().max().item()
        assert err <= _bound(keys, values, dim), (n, prior, window, err)


def test_a_window_of_one_sees_only_the_query_s_own_value():
    # The plainest check of the window masks: each query's output is its own value.
    n, prior = 2 * _CHUNK + 3, 70
    values = torch.randn(prior + n, 1, 8)
    out = chunked_attention(torch.randn(n, 3, 8), torch.randn(prior + n, 1, 8), values, 1.0, prior, 1)
    assert torch.equal(out, values[prior:].expand(n, 3, 8))


@pytest.mark.parametrize("window", [None, 40])
def test_the_cpu_backend_reads_earlier_keys_from_the_paged_cache(window):
    # A prompt's second chunk (or a prefix-cache hit): its keys so far lie in the cache's
    # blocks, in the order of the block table, this step's among them.
    torch.manual_seed(1)
    heads, kv_heads, dim, block, prior, n = 4, 2, 16, 16, 150, 2 * _CHUNK + 10
    layer = PagedAttention(heads, kv_heads, dim, 0.25, sliding_window=window)
    blocks = torch.randperm(24)[:-(-(prior + n) // block)]  # (scattered)
    layer.k_cache, layer.v_cache = torch.randn(24, block, kv_heads, dim), torch.randn(24, block, kv_heads, dim)
    flat = (-1, kv_heads, dim)
    keys = layer.k_cache[blocks].reshape(flat)[:prior + n]
    values = layer.v_cache[blocks].reshape(flat)[:prior + n]
    q = torch.randn(n, heads, dim)
    args = (layer, q, keys[prior:], values[prior:], prior + n, blocks, block)
    got = CpuBackend().prefill_attention(*args)
    want = Backend().prefill_attention(*args)
    assert (got - want).abs().max().item() <= _bound(keys, values, dim)
    assert torch.equal(got, chunked_attention(q, keys, values, 0.25, prior, window))


def _sdpa_both_ways(q, keys, values, scale, window):
    places = torch.arange(q.shape[0])
    seen = (places[:, None] - places[None, :]).abs() < window
    heads = [t.transpose(0, 1)[None] for t in (q, keys, values)]
    return F.scaled_dot_product_attention(*heads, attn_mask=seen, scale=scale, enable_gqa=True)[0].transpose(0, 1)


@pytest.mark.parametrize("heads,kv_heads,dim", [(3, 1, 16), (4, 2, 8)])
def test_bidirectional_chunks_equal_sdpa_with_the_window_s_mask(heads, kv_heads, dim):
    torch.manual_seed(heads)
    for n, window in itertools.product([1, _CHUNK - 1, _CHUNK + 1, 3 * _CHUNK + 5, 300], [1, 7, _CHUNK, 100, 1000]):
        q, keys, values = torch.randn(n, heads, dim), torch.randn(n, kv_heads, dim), torch.randn(n, kv_heads, dim)
        got = chunked_attention(q, keys, values, 0.3, 0, window, causal=False)
        err = (got - _sdpa_both_ways(q, keys, values, 0.3, window)).abs().max().item()
        assert err <= _bound(keys, values, dim), (n, window, err)
    values = torch.randn(200, 1, 8)  # a window of one: each query's own value
    out = chunked_attention(torch.randn(200, 2, 8), torch.randn(200, 1, 8), values, 1.0, 0, 1, causal=False)
    assert torch.equal(out, values.expand(200, 2, 8))


def test_the_cpu_backend_runs_a_long_windowed_sequence_in_chunks_and_short_ones_as_before():
    torch.manual_seed(2)
    layer = BidirectionalAttention(4, 2, 16, 0.25, sliding_window=20)
    for n in (15, 20 + _CHUNK + 30):  # within the window + a chunk (SDPA), and past it (chunks)
        q, k, v = torch.randn(n, 4, 16), torch.randn(n, 2, 16), torch.randn(n, 2, 16)
        got = CpuBackend().bidirectional_sequence(layer, q, k, v)
        assert (got - Backend().bidirectional_sequence(layer, q, k, v)).abs().max().item() <= _bound(k, v, 16)
        if n > 20 + _CHUNK:
            assert torch.equal(got, chunked_attention(q, k, v, 0.25, 0, 20, causal=False))
