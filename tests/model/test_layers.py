"""The compiled paged decode attention against the pure-torch path."""

from __future__ import annotations

import pytest
import torch

from gristmill.model.context import AttentionMetadata
from gristmill.model.kernels import paged_decode_attention
from gristmill.model.layers import PagedAttention


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (4, 1)])
def test_compiled_decode_matches_torch_path(heads, kv_heads, window):
    kernel = paged_decode_attention()
    if kernel is None:
        pytest.skip("C++ kernels could not be built on this machine")
    torch.manual_seed(0)
    head_dim, block_size, num_blocks = 32, 4, 40
    attn = PagedAttention(heads, kv_heads, head_dim, head_dim ** -0.5, sliding_window=window)
    attn.k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim)
    attn.v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim)
    lens = torch.tensor([1, 3, 9, 17, 12])
    tables = torch.zeros(len(lens), 5, dtype=torch.long)
    free = torch.randperm(num_blocks).tolist()  # blocks scattered over the cache
    for row, n in enumerate(lens.tolist()):
        for i in range(-(-n // block_size)):
            tables[row, i] = free.pop()
    ctx = AttentionMetadata(slot_mapping=torch.zeros(len(lens), dtype=torch.long), num_decodes=len(lens),
                            decode_block_tables=tables, decode_context_lens=lens, prefills=[],
                            block_size=block_size)
    q = torch.randn(len(lens), heads, head_dim)
    expected = attn.decode_reference(q, ctx)
    got = kernel(q, attn.k_cache, attn.v_cache, tables, lens, attn.scale, window or 0)
    assert (got - expected).abs().max().item() < 1e-5
