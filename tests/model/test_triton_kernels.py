"""The CUDA backend's Triton kernels against the torch reference backend. Without a GPU
they run under TRITON_INTERPRET=1 on CPU tensors (float32); on a GPU machine, on it.

Also the CUDA-graph bookkeeping that needs no GPU: the batch-size ladder and how a
decode step fills the static input buffers."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from torch import nn

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from gristmill.model.backends.cuda import CudaBackend  # noqa: E402
from gristmill.model.backends.reference import Backend  # noqa: E402
from gristmill.model.cuda import triton_kernels  # noqa: E402
from gristmill.model.cuda.graphs import StaticInputs, graph_batch_sizes, padded_batch_size  # noqa: E402
from gristmill.model.layers import PagedAttention, RMSNorm, RotaryEmbedding  # noqa: E402
from gristmill.model.layers.linear import fuse_projections  # noqa: E402
from gristmill.model.layers.mlp import GatedMLP  # noqa: E402
from gristmill.model.metadata import build_host_step  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
REFERENCE = Backend(DEVICE)


def _backend(heads=4, kv_heads=2, head_dim=32) -> CudaBackend:
    backend = CudaBackend(DEVICE, torch.float32)
    backend.shape = triton_kernels.AttentionShape(heads, kv_heads, head_dim, torch.float32)
    return backend


def _norm(dim: int, offset: float, seed: int) -> RMSNorm:
    norm = RMSNorm(dim, 1e-6, offset=offset)
    norm.weight.data = torch.randn(dim, generator=torch.Generator().manual_seed(seed)) * 0.5 + (0 if offset else 1)
    return norm.to(DEVICE)


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm(offset):
    norm = _norm(96, offset, seed=1)
    x = torch.randn(5, 96, device=DEVICE) * 3
    torch.testing.assert_close(_backend().rms_norm(x, norm), REFERENCE.rms_norm(x, norm), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("delta_norm,out_norm", [(False, True), (True, True), (True, False)])
def test_residual_norm(delta_norm, out_norm):
    norms = (_norm(80, 1.0, 2) if delta_norm else None, _norm(80, 1.0, 3) if out_norm else None)
    x, delta = torch.randn(7, 80, device=DEVICE), torch.randn(7, 80, device=DEVICE) * 4
    got_x, got_h = _backend().residual_norm(x, delta, *norms)
    want_x, want_h = REFERENCE.residual_norm(x, delta, *norms)
    torch.testing.assert_close(got_x, want_x, rtol=1e-5, atol=1e-5)
    assert (got_h is None) == (want_h is None) == (not out_norm)
    if out_norm:
        torch.testing.assert_close(got_h, want_h, rtol=1e-5, atol=1e-5)


class _Attention(nn.Module):
    def __init__(self, heads: int, kv_heads: int, head_dim: int):
        super().__init__()
        hidden = 48
        self.num_heads, self.num_kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.rotary = RotaryEmbedding(head_dim, 64, {"rope_theta": 10000.0})
        self.q_proj = nn.Linear(hidden, heads * head_dim)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim)


@pytest.mark.parametrize("qk_norm", [None, 0.0, 1.0])  # none (Llama), Qwen3's, Gemma's (1 + w)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 1, 16), (4, 4, 24)])
def test_qkv_rotary(qk_norm, heads, kv_heads, head_dim):
    torch.manual_seed(0)
    module = _Attention(heads, kv_heads, head_dim).to(DEVICE)
    norms = (None, None) if qk_norm is None else (_norm(head_dim, qk_norm, 4), _norm(head_dim, qk_norm, 5))
    positions = torch.tensor([0, 7, 3, 63, 12], device=DEVICE)
    x = torch.randn(len(positions), 48, device=DEVICE)
    with torch.inference_mode():
        want = REFERENCE.attention_inputs(module, positions, x, *norms)
        fuse_projections(module)
        got = _backend().attention_inputs(module, positions.int(), x, *norms)
    for name, g, w in zip("qkv", got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_qkv_rotary_writes_k_and_v_into_the_paged_cache():
    """Within a forward the CUDA backend writes k, v straight into the cache (slot -1, a
    padding row, writes nothing): the cache then holds what the reference writes."""
    torch.manual_seed(0)
    heads, kv_heads, dim, n = 4, 2, 16, 5
    qkv = torch.randn(n, (heads + 2 * kv_heads) * dim, device=DEVICE)
    positions = torch.tensor([0, 7, 3, 63, 12], device=DEVICE, dtype=torch.int32)
    slots = torch.tensor([5, 0, 17, -1, 9], device=DEVICE, dtype=torch.int32)
    rotary = RotaryEmbedding(dim, 64, {"rope_theta": 10000.0}).to(DEVICE)
    norm = (torch.randn(dim, device=DEVICE), 1.0, 1e-6)
    args = (qkv, positions, heads, kv_heads, dim, norm, norm, rotary.cos, rotary.sin)
    q, k, v = triton_kernels.qkv_rotary(*args)
    caches = torch.zeros(2, 5, 4, kv_heads, dim, device=DEVICE)
    q2, k2, v2 = triton_kernels.qkv_rotary(*args, kv_cache=(slots, caches[0], caches[1]))
    assert k2 is None and v2 is None and torch.equal(q2, q)
    flat = caches.view(2, -1, kv_heads, dim)
    written = [0, 1, 2, 4]
    torch.testing.assert_close(flat[0, slots[written].long()], k[written])
    torch.testing.assert_close(flat[1, slots[written].long()], v[written])
    assert flat[:, [s for s in range(20) if s not in (5, 0, 17, 9)]].abs().sum() == 0


@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh", "gelu"])
def test_gated_activation(activation):
    torch.manual_seed(0)
    mlp = GatedMLP(32, 80, activation).to(DEVICE)
    x = torch.randn(6, 32, device=DEVICE)
    with torch.inference_mode():
        want = REFERENCE.gated_activation(mlp, x)
        fuse_projections(mlp)
        got = _backend().gated_activation(mlp, x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _scattered_tables(lens, block_size, num_blocks, seed=0):
    free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    return [[free.pop() for _ in range(-(-n // block_size))] for n in lens]


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 32), (4, 1, 24), (2, 2, 16)])
def test_paged_attention_mixed_step(heads, kv_heads, head_dim, window):
    """Decodes of 1 to 17 tokens of context, a prefill chunk after 9 cached tokens, and a
    fresh 13-token prompt, in one step: the KV write and both attention launches give
    the reference's outputs and cache contents."""
    torch.manual_seed(0)
    block_size, num_blocks = 4, 64
    # (cached tokens before the step, new tokens this step)
    shape = [(0, 1), (2, 1), (8, 1), (16, 1), (9, 6), (0, 13)]
    lens = [cached + new for cached, new in shape]
    tables = _scattered_tables(lens, block_size, num_blocks)
    sequences = [([0] * new, cached, table, True) for (cached, new), table in zip(shape, tables)]
    host = build_host_step(sequences, block_size)
    assert host.num_decodes == 4
    layer = PagedAttention(heads, kv_heads, head_dim, head_dim ** -0.5, sliding_window=window)
    caches = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, device=DEVICE)
    n = host.num_tokens
    q = torch.randn(n, heads, head_dim, device=DEVICE)
    k, v = torch.randn(n, kv_heads, head_dim, device=DEVICE), torch.randn(n, kv_heads, head_dim, device=DEVICE)

    results = {}
    for name, backend in (("reference", REFERENCE), ("triton", _backend(heads, kv_heads, head_dim))):
        layer.k_cache, layer.v_cache = caches[0].clone(), caches[1].clone()
        _, _, md, _ = backend.upload(host)
        results[name] = (backend.attention(layer, q, k, v, md), layer.k_cache, layer.v_cache)
    for want, got, what in zip(results["reference"], results["triton"], ("output", "k cache", "v cache")):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=lambda m: f"{what}: {m}")


def _long_context_step(shape, heads, kv_heads, head_dim, window=None, block_size=16, seed=0):
    """A step of `shape` [(cached tokens, new tokens)] over a random paged cache, with its
    layer, queries, keys and values."""
    torch.manual_seed(seed)
    lens = [cached + new for cached, new in shape]
    num_blocks = sum(-(-n // block_size) for n in lens) + 4
    tables = _scattered_tables(lens, block_size, num_blocks, seed=seed)
    host = build_host_step([([0] * new, cached, table, True) for (cached, new), table in zip(shape, tables)],
                           block_size)
    layer = PagedAttention(heads, kv_heads, head_dim, head_dim ** -0.5, sliding_window=window)
    caches = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, device=DEVICE)
    n = host.num_tokens
    qkv = (torch.randn(n, heads, head_dim, device=DEVICE), torch.randn(n, kv_heads, head_dim, device=DEVICE),
           torch.randn(n, kv_heads, head_dim, device=DEVICE))
    return host, layer, caches, qkv


def _attend(backend, host, layer, caches, qkv, splits=None):
    layer.k_cache, layer.v_cache = caches[0].clone(), caches[1].clone()
    _, _, md, _ = backend.upload(host)
    if splits is not None:
        md.extras["decode_splits"] = splits
    return backend.attention(layer, *qkv, md)


@pytest.mark.parametrize("window", [None, 700])
def test_split_decode_over_long_contexts(window):
    """Decodes over up to 2,100 keys, split into partitions of 512 (flash-decoding), give
    the reference's outputs; a sequence's result depends on its own length alone: the
    same in a launch of more partitions (a graph captured for max_model_len), and bit for
    bit the unsplit launch's where it fits one partition."""
    heads, kv_heads, head_dim = 4, 2, 128
    backend = _backend(heads, kv_heads, head_dim)
    backend.shape = triton_kernels.AttentionShape(heads, kv_heads, head_dim, torch.float32, max_model_len=4096)
    assert backend.shape.partition == 512
    assert [backend.shape.decode_splits(n) for n in (1, 512, 513, 2100, 4096)] == [1, 1, 2, 5, 8]
    shape = [(0, 1), (300, 1), (511, 1), (900, 1), (2099, 1)]
    host, layer, caches, qkv = _long_context_step(shape, heads, kv_heads, head_dim, window)
    want = _attend(REFERENCE, host, layer, caches, qkv)
    split = _attend(backend, host, layer, caches, qkv)
    torch.testing.assert_close(split, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(_attend(backend, host, layer, caches, qkv, splits=8), split)  # the graph's launch
    unsplit = _attend(backend, host, layer, caches, qkv, splits=1)
    assert torch.equal(unsplit[:3], split[:3])  # one partition: the unsplit numbers exactly
    torch.testing.assert_close(unsplit, want, rtol=1e-4, atol=1e-4)


def test_split_decode_partitions_grow_with_max_model_len():
    """At most 32 partitions a sequence, so the partials stay small at 128k contexts."""
    sizes = {n: triton_kernels.AttentionShape(32, 8, 128, torch.bfloat16, n).partition
             for n in (2048, 16384, 32768, 131072)}
    assert sizes == {2048: 512, 16384: 512, 32768: 1024, 131072: 4096}


def test_prefill_chunk_at_8k_context():
    """A 96-token prefill chunk after 8,096 cached tokens (prefill at an 8k context), with
    GQA, beside a decode: the reference's outputs."""
    heads, kv_heads, head_dim = 4, 1, 64
    host, layer, caches, qkv = _long_context_step([(3000, 1), (8096, 96)], heads, kv_heads, head_dim)
    backend = _backend(heads, kv_heads, head_dim)
    backend.shape = triton_kernels.AttentionShape(heads, kv_heads, head_dim, torch.float32, max_model_len=8192)
    torch.testing.assert_close(_attend(backend, host, layer, caches, qkv),
                               _attend(REFERENCE, host, layer, caches, qkv), rtol=1e-4, atol=1e-4)


def test_prefill_programs_cover_every_query_block():
    # decodes (sequences 0, 1) are not in the prefill launch; 33 tokens in blocks of 16 -> 3.
    seqs, blocks = triton_kernels.prefill_programs(np.array([0, 1, 2, 35, 36, 52]), 2, 16)
    assert seqs.tolist() == [2, 2, 2, 3, 4] and blocks.tolist() == [0, 1, 2, 0, 0]
    seqs, blocks = triton_kernels.prefill_programs(np.array([0, 1, 2]), 2, 16)  # decodes only
    assert len(seqs) == len(blocks) == 0


# -- CUDA-graph bookkeeping ------------------------------------------------------------

def test_graph_batch_sizes_ladder():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(8) == [1, 2, 4, 8]
    assert graph_batch_sizes(128) == [1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 112, 128]
    assert graph_batch_sizes(100)[-3:] == [80, 96, 100]
    sizes = graph_batch_sizes(100)
    assert [padded_batch_size(n, sizes) for n in (1, 3, 8, 9, 17, 96, 97, 100)] == [1, 4, 8, 16, 32, 96, 100, 100]
    assert padded_batch_size(101, sizes) is None


def test_static_inputs_hold_a_padded_decode_step():
    inputs = StaticInputs(max_rows=8, max_blocks=6, device="cpu", pin=False)
    step = build_host_step([([7], 2, [3], True), ([1], 8, [4, 9, 2], True), ([2], 4, [7, 8], True)],
                           block_size=4)
    inputs.fill(step, rows=4)
    assert inputs.input_ids[:4].tolist() == [7, 1, 2, 0]
    assert inputs.ids(4).tolist() == [7, 1, 2, 0]  # every id from the host
    assert inputs.positions[:4].tolist() == [2, 8, 4, 0]
    assert inputs.slot_mapping[:4].tolist() == [3 * 4 + 2, 2 * 4 + 0, 8 * 4 + 0, -1]  # padding writes nothing
    assert inputs.seq_lens[:4].tolist() == [3, 9, 5, 0]  # and attends to nothing
    assert inputs.query_start[:5].tolist() == [0, 1, 2, 3, 4]
    assert inputs.block_tables[:4, :3].tolist() == [[3, 0, 0], [4, 9, 2], [7, 8, 0], [0, 0, 0]]
    # Async scheduling: the second row's id is a placeholder, sampled by the last step
    # into row 2 of `sampled`; the graph takes it from there, the others from the host.
    inputs.sampled[:3] = torch.tensor([70, 80, 90])
    inputs.fill(step, rows=4, source=np.array([-1, 2, -1]))
    assert inputs.ids(4).tolist() == [7, 90, 2, 0]
    inputs.fill(step, rows=4)  # and the next step without placeholders reads the host's again
    assert inputs.ids(4).tolist() == [7, 1, 2, 0]
    md = inputs.metadata(4, 4)
    assert md.num_decodes == md.num_seqs == 4 and md.block_tables.shape == (4, 6)
    # A smaller step next: the rows past it are padding again, whatever the last step left.
    inputs.fill(build_host_step([([4], 1, [5], True)], block_size=4), rows=2)
    assert inputs.slot_mapping[:2].tolist() == [5 * 4 + 1, -1] and inputs.seq_lens[:2].tolist() == [2, 0]
    too_wide = build_host_step([([0], 29, list(range(8)), True)], block_size=4)
    with pytest.raises(ValueError, match="8 KV blocks, more than the 6"):
        inputs.fill(too_wide, rows=1)
    span = inputs.span
    assert np.array_equal(inputs.host_buffer.numpy()[span:span + 2], [4, 0])  # a refused step writes nothing


# -- the whole model through the real scheduler ------------------------------------------

from tests.model.test_parity import _prompt, _randomize, _run_and_compare, _runner  # noqa: E402


@pytest.mark.skipif(DEVICE.type == "cuda", reason="tests/cuda runs every family through the CUDA backend")
def test_gemma3_parity_through_the_scheduler(tmp_path):
    """A two-layer Gemma 3 (a sliding-window and a global layer, q/k norms, softcap: the
    most the kernels must get right) on the Triton backend, q/k/v and gate/up fused as on
    CUDA, gives HF's logits at every sampled row: prompts prefilled in chunks of an
    8-token budget sharing steps with decodes, a prefix cache hit. Interpreted on CPU,
    so kept small; tests/cuda runs every family on a GPU."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Gemma3TextConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=24, final_logit_softcapping=30.0,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    _randomize(model, zero_centered_norms=True)
    model.save_pretrained(tmp_path)
    reference = model.float().eval()
    runner = _runner(tmp_path)
    runner.backend = _backend(2, 1, 16)
    runner.backend.prepare(runner.model)
    assert hasattr(runner.model.model.layers[0].self_attn, "qkv_proj")
    prompts = {"r3": _prompt(3, seed=3), "r11": _prompt(11, seed=11)}
    late = {1: {"shares11": prompts["r11"][:8] + _prompt(2, seed=77)}}
    result = _run_and_compare(runner, reference, prompts, max_num_seqs=8, max_num_batched_tokens=8,
                              max_tokens=2, late=late)
    facts = result.pop("_")
    assert result == {rid: 2 for rid in [*prompts, "shares11"]}
    assert facts["mixed_steps"] >= 1 and facts["hit_tokens"] == 8, facts
