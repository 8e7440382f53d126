"""GGUF blocks multiplied as they lie (cpu/gguf_linear.py, csrc/gguf_linear.cpp): the
weights the kernel multiplies by are gguf.dequantize's bit for bit, and its outputs are
x @ W^T within what rounding the activations to int8 can move them, on every code path.

Tensors come from the bundled Gemma 3 270M GGUF (Q4_K, Q5_0, Q6_K, Q8_0) and are made
here for the rest: gguf.quantize where it can, random block bytes with finite fp16
scales where it cannot (Q5_K, and the K types at the shapes the file lacks)."""

from __future__ import annotations

import functools
import math
import mmap
import warnings
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from gristmill.model.cpu import kernels
from gristmill.model.cpu.gguf_linear import SUPPORTED_TYPES, GGUFEmbedding, GGUFLinear
from gristmill.gguf_file import GGUFFile
from gristmill.paths import default_model_path
from tests.mappings import mappings, vm_flags_at
from tests.model.gelu_bound import assert_gelu_of

T = gguf.GGMLQuantizationType
EXT = kernels.int8_extension()
BEST = EXT.best_isa() if EXT is not None else -1
# Every code path: portable runs anywhere; a vector path is skipped, saying so, on a CPU
# that lacks it.
PATHS = [pytest.param(isa, id=name, marks=pytest.mark.skipif(BEST < isa, reason=f"this CPU has no {name}"))
         for isa, name in kernels.ISA_NAMES.items()]
TYPES = [pytest.param(t, id=t.name) for t in (T.Q8_0, T.Q4_0, T.Q5_0, T.Q4_K, T.Q5_K, T.Q6_K)]
ROWS = [1, 3, 4, 5, 17, 64, 130]  # one tile row, partial and whole 4-row tiles, rows split between threads
# The file's tensor of each type (ggml's "rows, inputs": Q4_K attn_output is 640 x 1024).
REAL = {T.Q4_K: "blk.0.attn_output.weight", T.Q5_0: "blk.0.attn_q.weight",
        T.Q6_K: "blk.0.ffn_down.weight", T.Q8_0: "blk.0.attn_v.weight"}
_U = 2.0 ** -24  # float32's unit roundoff


def setup_module():
    assert EXT is not None, "the kernels did not build: is a C++ compiler installed?"


def _tensor(array: np.ndarray) -> torch.Tensor:
    with warnings.catch_warnings():  # a read-only mapping: the kernels only read it
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)


@functools.cache
def _file_tensors() -> dict:
    return {t.name: t for t in GGUFFile(default_model_path()).tensors}


def _real(ggml_type) -> tuple[torch.Tensor, int]:
    """(blocks as they lie in the mapped file, in_features)."""
    tensor = _file_tensors()[REAL[ggml_type]]
    assert tensor.tensor_type == ggml_type
    return _tensor(tensor.data), tensor.shape[0]


def _made(ggml_type, rows: int, in_features: int, seed: int = 0) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    if ggml_type in (T.Q8_0, T.Q4_0, T.Q5_0):
        weight = rng.standard_normal((rows, in_features)).astype(np.float32) / math.sqrt(in_features)
        return torch.from_numpy(gguf.quantize(weight, ggml_type))
    block_size, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
    blocks = rng.integers(0, 256, size=(rows, in_features // block_size, type_size), dtype=np.uint8)
    scales = (rng.standard_normal((rows, in_features // block_size, 2)) * 3e-3).astype(np.float16)
    if ggml_type == T.Q6_K:
        blocks[:, :, 208:210] = scales[:, :, :1].view(np.uint8)
    else:  # Q4_K, Q5_K: d, then dmin
        blocks[:, :, 0:4] = scales.view(np.uint8)
    return torch.from_numpy(blocks.reshape(rows, -1))


def _dequantize(ggml_type, blocks: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(gguf.dequantize(blocks.numpy(), ggml_type))


def _magnitude(ggml_type, blocks: torch.Tensor) -> torch.Tensor:
    """Per weight, |scale * q| + |min|: with the minimum's sign flipped, gguf.dequantize
    gives scale * q + min, and |a| + |b| is the larger of |a - b| and |a + b|."""
    w = _dequantize(ggml_type, blocks).abs()
    if ggml_type not in (T.Q4_K, T.Q5_K):
        return w
    _, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
    flipped = blocks.clone().view(blocks.shape[0], -1, type_size)
    flipped[:, :, 3] ^= 0x80  # dmin's sign bit
    return torch.maximum(w, _dequantize(ggml_type, flipped.view(blocks.shape)).abs())


def _inputs(rows: int, in_features: int, seed: int = 0) -> torch.Tensor:
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(seed)) * 2
    x[0, : min(3, in_features)] = 30.0  # an outlier drives its blocks' scales
    return x


def _half_steps(x: torch.Tensor) -> torch.Tensor:
    """(m, K / 32): half the rounding step of each block of x, absmax / 254 (times 1 + 4u
    for the float scale and product): the most rounding x to int8 moves a value."""
    m, k = x.shape
    return x.double().view(m, k // 32, 32).abs().amax(dim=2) / 254 * (1 + 4 * _U)


def _float_step_bound(x: torch.Tensor, magnitude: torch.Tensor) -> torch.Tensor:
    """The kernel's float step adds (d * x_scale) * S and subtracts min * (x_scale * sum x_q)
    per block, a few roundings each, into accumulators of at most K / 32 terms: under
    (K / 32 + 8) u times the sum of |rounded x| (|scale q| + |min|). This also covers the
    kernel taking scale q - min exactly where gguf rounds it once."""
    k = x.shape[1]
    x_abs = x.double().abs() + _half_steps(x).repeat_interleave(32, dim=1)
    return (k / 32 + 8) * _U * (x_abs @ magnitude.double().T)


def _error_bound(x: torch.Tensor, w: torch.Tensor, magnitude: torch.Tensor, bias: torch.Tensor | None):
    """(bound, exact): per output, the most the kernel's y may differ from the exact
    x @ w^T + bias (float64): rounding x moves block b's part by at most
    half_step_b * sum_(k in b) |w_k|; then the float step; then one rounding of the output."""
    w_abs = w.double().abs().view(w.shape[0], -1, 32).sum(dim=2)  # (N, K / 32)
    exact = x.double() @ w.double().T + (0 if bias is None else bias.double())
    return _half_steps(x) @ w_abs.T + _float_step_bound(x, magnitude) + 2 * _U * exact.abs(), exact


def _assert_within_bound(y: torch.Tensor, x, w, magnitude, bias=None):
    bound, exact = _error_bound(x, w, magnitude, bias)
    excess = (y.double() - exact).abs() - bound
    worst = int(excess.argmax())
    assert excess.max() <= 0, (f"output {worst} off by {float((y.double() - exact).flatten()[worst]):.3g}, "
                               f"beyond its bound {float(bound.flatten()[worst]):.3g}")


def _layer(parts, in_features, bias=None, isa=None) -> GGUFLinear:
    layer = GGUFLinear(parts, in_features, bias)
    layer.isa = isa
    return layer


# ---- the weights ----------------------------------------------------------------------

@pytest.mark.parametrize("ggml_type", [pytest.param(t, id=t.name) for t in REAL])
def test_weights_of_the_files_blocks_equal_gguf_dequantize(ggml_type):
    blocks, k = _real(ggml_type)
    layer = _layer([(ggml_type, blocks)], k)
    assert layer.parts[0][1].data_ptr() == blocks.data_ptr()  # the file's bytes, not a copy
    assert torch.equal(layer.dequantized(), _dequantize(ggml_type, blocks))


@pytest.mark.parametrize("ggml_type", TYPES)
@pytest.mark.parametrize("rows,in_features", [(37, 512), (5, 1024)])
def test_weights_of_made_blocks_equal_gguf_dequantize(ggml_type, rows, in_features):
    blocks = _made(ggml_type, rows, in_features, seed=rows)
    expected = _dequantize(ggml_type, blocks)
    assert torch.isfinite(expected).all() and expected.abs().max() > 0
    assert torch.equal(_layer([(ggml_type, blocks)], in_features).dequantized(), expected)


def test_weights_of_mixed_parts_are_the_parts_stacked():
    parts = [(T.Q4_K, _made(T.Q4_K, 33, 256)), (T.Q6_K, _made(T.Q6_K, 7, 256)), (T.Q5_0, _made(T.Q5_0, 20, 256))]
    layer = _layer(parts, 256)
    assert layer.out_features == 60 and layer.split_sizes == [33, 7, 20]
    assert torch.equal(layer.dequantized(), torch.cat([_dequantize(t, b) for t, b in parts]))


# ---- the kernel against x @ W^T -------------------------------------------------------

@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("ggml_type", [pytest.param(t, id=t.name) for t in REAL])
@pytest.mark.parametrize("rows", ROWS)
def test_kernel_on_the_files_blocks_within_the_activation_rounding_bound(isa, ggml_type, rows):
    blocks, k = _real(ggml_type)
    layer = _layer([(ggml_type, blocks)], k, isa=isa)
    x = _inputs(rows, k, seed=rows)
    _assert_within_bound(layer(x), x, _dequantize(ggml_type, blocks), _magnitude(ggml_type, blocks))


# K = 256 k for every type; K = 96 and 672 (a short last group of 3 and 5 blocks) for the
# 32-wide ones. N = 45: not a multiple of the 16- and 32-row tiles.
MADE = [pytest.param(t, 45, k, id=f"{t.name}-45x{k}") for t in SUPPORTED_TYPES for k in (256, 768, 96, 672)
        if k % gguf.GGML_QUANT_SIZES[t][0] == 0]


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("ggml_type,out_features,in_features", MADE)
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_kernel_on_made_blocks_within_the_activation_rounding_bound(isa, ggml_type, out_features, in_features,
                                                                     rows):
    blocks = _made(ggml_type, out_features, in_features, seed=in_features)
    bias = torch.randn(out_features)
    layer = _layer([(ggml_type, blocks)], in_features, bias, isa=isa)
    x = _inputs(rows, in_features)
    _assert_within_bound(layer(x), x, _dequantize(ggml_type, blocks), _magnitude(ggml_type, blocks), bias)


def _mixed_parts(in_features: int) -> list:
    """Every type in one layer, parts of odd sizes (a Q4_K_M file mixes Q4_K and Q6_K)."""
    sizes = {T.Q4_K: 37, T.Q6_K: 29, T.Q8_0: 40, T.Q5_K: 7, T.Q4_0: 3, T.Q5_0: 19}
    return [(t, _made(t, n, in_features, seed=n)) for t, n in sizes.items()]


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("rows", ROWS)
def test_kernel_on_mixed_parts_with_bias_within_the_bound(isa, rows):
    parts = _mixed_parts(512)
    bias = torch.randn(135)
    layer = _layer(parts, 512, bias, isa=isa)
    x = _inputs(rows, 512, seed=rows)
    w = torch.cat([_dequantize(t, b) for t, b in parts])
    magnitude = torch.cat([_magnitude(t, b) for t, b in parts])
    _assert_within_bound(layer(x), x, w, magnitude, bias)


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("rows", [1, 5, 130])
def test_kernel_equals_its_reference_arithmetic_but_for_float_accumulation(isa, rows):
    # The reference rounds x as the kernel does and sums exactly (float64): what is left is
    # the kernel's float step alone, far tighter than the bound against float x.
    parts = _mixed_parts(512)
    layer = _layer(parts, 512, torch.randn(135), isa=isa)
    x = _inputs(rows, 512)
    magnitude = torch.cat([_magnitude(t, b) for t, b in parts])
    expected = layer.reference(x)
    bound = _float_step_bound(x, magnitude) + 2 * _U * expected.double().abs()
    assert ((layer(x) - expected).double().abs() <= bound).all()


@pytest.mark.parametrize("rows", ROWS)
def test_every_path_gives_the_same_floats(rows):
    parts = _mixed_parts(768)
    x = _inputs(rows, 768, seed=rows)
    bias = torch.randn(135)
    portable, *vector = (_layer(parts, 768, bias, isa=isa) for isa in range(BEST + 1))
    if not vector:
        pytest.skip("this CPU has no vector path")
    # the same int32 lane sums, and a float step of the same operations in the same order
    for layer in vector:
        assert torch.equal(layer(x), portable(x)), kernels.ISA_NAMES[layer.isa]
        assert torch.equal(layer(x, "gelu"), portable(x, "gelu")), kernels.ISA_NAMES[layer.isa]


@pytest.mark.parametrize("ggml_type", TYPES)
def test_every_path_gives_the_same_floats_from_whole_panels(ggml_type):
    # 48 rows: whole vectors of rows, which the panels take from the blocks as they lie
    # (the odd parts above go through the decoded way); 736 inputs: a short last group
    in_features = 736 if gguf.GGML_QUANT_SIZES[ggml_type][0] == 32 else 768
    parts = [(ggml_type, _made(ggml_type, 48, in_features, seed=3))]
    x = _inputs(40, in_features)
    portable, *vector = (_layer(parts, in_features, isa=isa) for isa in range(BEST + 1))
    if not vector:
        pytest.skip("this CPU has no vector path")
    for layer in vector:
        assert torch.equal(layer(x), portable(x)), kernels.ISA_NAMES[layer.isa]


VECTOR_PATHS = [p for p in PATHS if p.values[0] > 0]


def _packed(layer: GGUFLinear) -> GGUFLinear:
    assert layer.pack_panels() == sum(layer.panel_bytes()) > 0
    return layer


@pytest.mark.parametrize("isa", VECTOR_PATHS)
@pytest.mark.parametrize("ggml_type", TYPES)
def test_panels_packed_once_give_the_same_floats(isa, ggml_type):
    # 70 rows: two whole panels (32 on avx512_vnni, 16 on avx2) and a short last one; each
    # row count of ROWS (below kPrepackedRows Q5_0 and the K types read their bytes, Q8_0 and
    # Q4_0 their panels)
    in_features = 736 if gguf.GGML_QUANT_SIZES[ggml_type][0] == 32 else 768
    parts = [(ggml_type, _made(ggml_type, 70, in_features, seed=5))]
    bias = torch.randn(70)
    plain, packed = _layer(parts, in_features, bias, isa=isa), _packed(_layer(parts, in_features, bias, isa=isa))
    for rows in ROWS:
        x = _inputs(rows, in_features, seed=rows)
        assert torch.equal(packed(x), plain(x)), rows
        assert torch.equal(packed(x, "gelu"), plain(x, "gelu")), rows


@pytest.mark.parametrize("isa", VECTOR_PATHS)
@pytest.mark.parametrize("ggml_type", [T.Q4_0, T.Q8_0], ids=["Q4_0", "Q8_0"])
def test_panels_are_compact_the_files_size_and_read_from_one_row(isa, ggml_type):
    # Q4_0's and Q8_0's panels packed once hold the fp16 scales, and Q4_0's codes two a
    # byte: the file's own 18 and 34 bytes a row and block, so every row count reads them
    # and the loader releases the part's pages of the file (the others' panels are twice
    # their bytes)
    blocks = _made(ggml_type, 96, 2048, seed=7)
    plain, layer = _layer([(ggml_type, blocks)], 2048, isa=isa), _layer([(ggml_type, blocks)], 2048, isa=isa)
    assert layer.panels_replace_bytes() == [True]
    assert layer.pack_panels() == blocks.numel()
    for other, replaces in ((T.Q5_0, False), (T.Q4_K, False), (T.Q5_K, False), (T.Q6_K, False)):
        assert _layer([(other, _made(other, 32, 2048))], 2048, isa=isa).panels_replace_bytes() == [replaces], other
    for rows in (1, 2, 16, 64):
        x = _inputs(rows, 2048, seed=rows)
        assert torch.equal(layer(x), plain(x)), rows


@pytest.mark.parametrize("isa", VECTOR_PATHS)
def test_panels_packed_once_of_odd_parts_give_the_same_floats(isa):
    # parts that start inside a tile: their runs there do not line up with their panels,
    # and are packed (or read) as before; the rest read the panels
    parts = _mixed_parts(512)
    plain, packed = _layer(parts, 512, isa=isa), _packed(_layer(parts, 512, isa=isa))
    for rows in ROWS:
        x = _inputs(rows, 512, seed=rows)
        assert torch.equal(packed(x), plain(x)), rows


# Each type's code bytes within its block (every other byte holds scales): set to 0xff
# they make every code its largest (Q8_0's 0x80: -128, the largest |code|).
CODE_BYTES = {T.Q8_0: (2, 34, 0x80), T.Q4_0: (2, 18, 0xFF), T.Q5_0: (2, 22, 0xFF), T.Q4_K: (16, 144, 0xFF),
              T.Q5_K: (16, 176, 0xFF), T.Q6_K: (0, 192, 0xFF)}


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("ggml_type", TYPES)
def test_the_largest_codes_against_the_largest_activations(isa, ggml_type):
    # Every code at its largest and every activation at 127 (or -127): the largest integer
    # sums any block gives, which the vector paths add in 16 bits where they fit (avx2's
    # panels) and must never wrap
    blocks = _made(ggml_type, 70, 768, seed=11)
    start, end, code = CODE_BYTES[ggml_type]
    type_size = gguf.GGML_QUANT_SIZES[ggml_type][1]
    blocks.view(70, -1, type_size)[:, :, start:end] = code
    w, magnitude = _dequantize(ggml_type, blocks), _magnitude(ggml_type, blocks)
    layers = [_layer([(ggml_type, blocks)], 768, isa=isa)]
    if isa > 0:
        layers.append(_packed(_layer([(ggml_type, blocks)], 768, isa=isa)))
    for rows in (1, 5, 64):
        for sign in (1.0, -1.0):
            x = torch.full((rows, 768), sign * 0.5)
            for layer in layers:
                _assert_within_bound(layer(x), x, w, magnitude)


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("in_features", [96, 672])
def test_a_short_last_group_adds_nothing_from_the_next_rows_blocks(isa, in_features):
    # A row of 32-wide blocks whose count is not a multiple of 8 ends in a short group,
    # which the kernels read on into the next row's blocks: there every odd row's scales
    # are NaN (its own outputs NaN, as gguf's), which must not reach the even rows' outputs
    blocks = _made(T.Q8_0, 40, in_features, seed=13)
    blocks.view(40, -1, 34)[1::2, :, 0:2] = torch.tensor([0x00, 0x7E], dtype=torch.uint8)  # fp16 NaN
    w = _dequantize(T.Q8_0, blocks)
    assert w[1::2].isnan().all() and w[0::2].isfinite().all()
    layer = _layer([(T.Q8_0, blocks)], in_features, isa=isa)
    for rows in (1, 5):
        x = _inputs(rows, in_features, seed=rows)
        y = layer(x)
        assert y[:, 1::2].isnan().all()
        _assert_within_bound(y[:, 0::2], x, w[0::2], _magnitude(T.Q8_0, blocks)[0::2])


def test_panels_packed_for_another_path_are_not_read():
    if BEST < 2:
        pytest.skip("this CPU has one vector path")
    parts = [(T.Q8_0, _made(T.Q8_0, 64, 512))]
    layer = _layer(parts, 512, isa=2)
    assert layer.pack_panels() > 0 and layer.panels_isa == 2
    x = _inputs(17, 512)
    for isa in range(BEST + 1):  # avx2 and portable read the bytes; the same floats
        layer.isa = isa
        assert torch.equal(layer(x), _layer(parts, 512, isa=isa)(x)), isa
    assert _layer(parts, 512, isa=0).pack_panels() == 0  # the portable path has no panels
    assert "panels for avx512_vnni" in repr(layer)


HUGE = 2 << 20


@pytest.mark.skipif(not Path("/sys/kernel/mm/transparent_hugepage/enabled").exists(),
                    reason="transparent huge pages: Linux, built with them")
def test_panels_and_the_mapped_file_ask_for_huge_pages():
    # A decode step streams every weight once; over 4 KiB pages that ran at ~0.73x the
    # rate over 2 MiB pages. The advice (madvise MADV_HUGEPAGE, VmFlags "hg") is given for
    # the panels' whole 2 MiB stretches before they are written, and for the file's mapping.
    mapped = GGUFFile(default_model_path())
    assert "hg" in vm_flags_at(np.asarray(mapped.tensors[0].data).ctypes.data)
    if BEST == 0:
        pytest.skip("this CPU has no vector path, which the panels are for")
    blocks = _made(T.Q8_0, 4096, 1024)  # panels of ~4.7 MB: at least one whole 2 MiB stretch
    layer = _layer([(T.Q8_0, blocks)], 1024)
    assert layer.pack_panels() > 2 * HUGE
    panel = layer.panels[0]
    inner = -(-panel.data_ptr() // HUGE) * HUGE  # the first whole stretch
    assert inner + HUGE <= panel.data_ptr() + panel.numel()
    assert "hg" in vm_flags_at(inner)
    x = _inputs(3, 1024)
    assert torch.equal(layer(x), _layer([(T.Q8_0, blocks)], 1024)(x))  # the same floats as without panels


def _resident_bytes_of(path) -> int:
    """This process's resident bytes of its mappings of `path`."""
    real = str(Path(path).resolve())
    return sum(int(fields["Rss"][0]) * 1024 for _, _, name, fields in mappings() if name == real)


def test_the_loader_packs_panels_within_its_budget_and_releases_q8_0_pages():
    from gristmill.model.cpu.quant import pack_panels
    from gristmill.model.loader.tensors import GGUFTensors

    if BEST == 0:
        pytest.skip("this CPU has no vector path, which the panels are for")
    checkpoint = GGUFTensors(default_model_path())
    names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.v_proj.weight"]  # Q5_0, Q8_0
    (q_type, q_rows), (v_type, v_rows) = (checkpoint.stored(n) for n in names)
    assert (q_type, v_type) == (T.Q5_0, T.Q8_0) and checkpoint.in_file(names[1])
    q, v = GGUFLinear([(q_type, q_rows)], 640), GGUFLinear([(v_type, v_rows)], 640)
    x = _inputs(5, 640)
    before = q(x), v(x)  # (v's pages of the file now resident)
    resident = _resident_bytes_of(default_model_path())
    # q's panels do not fit in the budget; v's cost nothing: compact, they take its bytes' place
    assert sum(v.panel_bytes()) == v_rows.numel()
    spent = pack_panels([(q, names[:1]), (v, names[1:])], checkpoint, budget=sum(q.panel_bytes()) - 1)
    assert spent == 0 and q.panels == () and len(v.panels) == 1
    assert resident - _resident_bytes_of(default_model_path()) >= v_rows.numel() - 2 * mmap.PAGESIZE
    assert torch.equal(q(x), before[0]) and torch.equal(v(x), before[1])
    assert pack_panels([(q, names[:1])], checkpoint, budget=0) == 0 and q.panels == ()
    checkpoint.close()


@pytest.mark.parametrize("isa", PATHS)
def test_gelu_in_the_output_step_is_gelu_of_the_output(isa):
    layer = _layer(_mixed_parts(256), 256, torch.randn(135), isa=isa)
    x = _inputs(67, 256)
    x *= 10 / layer(x).abs().max()  # outputs to +-10: both tails of GELU, short of float32's tiny values
    plain = layer(x)
    assert plain.min() < -4 and plain.max() > 4
    assert_gelu_of(layer(x, "gelu"), plain)
    torch.testing.assert_close(layer(x, "silu"), torch.nn.functional.silu(plain))  # not fused: after the kernel


@pytest.mark.parametrize("isa", PATHS)
def test_rows_do_not_change_with_the_batch_around_them(isa):
    # 130 rows a thread are split between threads by rows (from 128) and meet the weights
    # packed into panels; one row reads them from the blocks, and its tiles are split
    # between threads: the same numbers, for every type (seeded sampling relies on it).
    layer = _layer(_mixed_parts(512), 512, torch.randn(135), isa=isa)
    rows = 130 * torch.get_num_threads()
    x = _inputs(rows, 512)
    together = layer(x)
    for i in (0, 63, 64, rows - 1):
        assert torch.equal(layer(x[i:i + 1])[0], together[i])
        assert torch.equal(layer(x[i:i + 5])[0], together[i])


def test_batch_shape_dtype_zero_rows_and_the_reused_output():
    layer = _layer(_mixed_parts(256), 256, torch.randn(135))
    x = torch.randn(2, 3, 256)
    x[0, 1] = 0.0
    out = layer(x)
    assert out.shape == (2, 3, 135)
    assert torch.equal(out[0, 1], layer.bias)  # a zero row gets exactly the bias
    assert layer(x.to(torch.bfloat16)).dtype == torch.bfloat16
    assert layer(torch.empty(0, 256)).shape == (0, 135)
    layer.reuse_output = True
    first = layer(x[0])
    assert torch.equal(first, out[0]) and layer(x[1]).data_ptr() == first.data_ptr()


def test_without_the_compiled_kernels_the_layer_computes_the_same(monkeypatch):
    parts = _mixed_parts(256)
    layer = _layer(parts, 256, torch.randn(135))
    x = _inputs(5, 256)
    compiled, weights = layer(x), layer.dequantized()
    monkeypatch.setattr(kernels, "int8_extension", lambda: None)
    plain = _layer(parts, 256, layer.bias)
    assert torch.equal(plain.dequantized(), weights)  # gguf's own dequantization
    magnitude = torch.cat([_magnitude(t, b) for t, b in parts])
    bound = _float_step_bound(x, magnitude) + 2 * _U * compiled.double().abs()
    assert ((plain(x) - compiled).double().abs() <= bound).all()


def test_unsupported_blocks_are_refused_saying_why():
    assert GGUFLinear.supports(T.Q4_K) and GGUFLinear.supports(int(T.Q6_K)) and not GGUFLinear.supports(T.Q4_1)
    assert {t.name for t in SUPPORTED_TYPES} == {"Q8_0", "Q4_0", "Q5_0", "Q4_K", "Q5_K", "Q6_K"}
    with pytest.raises(ValueError, match="Q4_1"):
        GGUFLinear([(T.Q4_1, torch.zeros(4, 20, dtype=torch.uint8))], 32)
    with pytest.raises(ValueError, match="multiple of Q4_K's block of 256"):
        GGUFLinear([(T.Q4_K, torch.zeros(4, 144, dtype=torch.uint8))], 128)
    with pytest.raises(ValueError, match=r"\(rows, 34\)"):
        GGUFLinear([(T.Q8_0, torch.zeros(4, 35, dtype=torch.uint8))], 32)
    layout = torch.tensor([[int(T.Q4_1), 4, 1]])
    with pytest.raises(RuntimeError, match="ggml type 3 is not supported"):
        EXT.gguf_linear(torch.zeros(1, 32), layout, torch.empty(0), 32, 0, 0, torch.empty(0))


# ---- embeddings -----------------------------------------------------------------------

def test_embedding_rows_of_the_files_table_equal_gguf_dequantize():
    table = _file_tensors()["token_embd.weight"]  # Q8_0, 262144 x 640
    blocks = _tensor(table.data)
    embedding = GGUFEmbedding(_layer([(table.tensor_type, blocks)], table.shape[0]))
    ids = torch.tensor([[0, 2, 262143], [17, 17, 100_000]])
    expected = _dequantize(table.tensor_type, blocks[ids.flatten()]).view(2, 3, 640)
    assert torch.equal(embedding(ids), expected)


def test_embedding_rows_across_mixed_parts_equal_gguf_dequantize():
    parts = _mixed_parts(256)
    embedding = GGUFEmbedding(_layer(parts, 256))
    weights = torch.cat([_dequantize(t, b) for t, b in parts])
    ids = torch.tensor([0, 36, 37, 65, 66, 105, 112, 115, 134, 3])
    assert torch.equal(embedding(ids), weights[ids])
    with pytest.raises(IndexError):
        embedding(torch.tensor([135]))
    with pytest.raises(IndexError):
        embedding(torch.tensor([-1]))


# ---- the decode stack -------------------------------------------------------------------

def _gguf_layers(model) -> None:
    """Layer 0's projections all GGUF (q/k/v and gate/up of mixed types); layer 1's
    q/k/v and down GGUF, its o and gate/up left int8: the stack takes each linear's kind."""
    first, second = model.model.layers[0], model.model.layers[1]
    attn, mlp = first.self_attn, first.mlp
    attn.qkv_proj = _gguf_like(attn.qkv_proj, [T.Q4_K, T.Q6_K, T.Q8_0])
    attn.o_proj = _gguf_like(attn.o_proj, [T.Q4_0])
    mlp.gate_up_proj = _gguf_like(mlp.gate_up_proj, [T.Q4_K, T.Q5_K])
    mlp.down_proj = _gguf_like(mlp.down_proj, [T.Q6_K])
    second.self_attn.qkv_proj = _gguf_like(second.self_attn.qkv_proj, [T.Q5_0, T.Q5_0, T.Q8_0])
    second.mlp.down_proj = _gguf_like(second.mlp.down_proj, [T.Q8_0])


def _gguf_like(linear, types) -> GGUFLinear:
    sizes = linear.split_sizes or [linear.out_features]
    parts = [(t, _made(t, n, linear.in_features, seed=i)) for i, (t, n) in enumerate(zip(types, sizes))]
    layer = GGUFLinear(parts, linear.in_features, linear.bias)
    layer.split_sizes = linear.split_sizes
    return layer


def test_decode_stack_with_gguf_layers_equals_layer_by_layer(tmp_path):
    """The decode stack (cpu/decode_stack.py) runs GGUF linears as kind 3 beside int8 ones:
    at every decode-only step its hidden states are bit-identical to the layers run one
    by one."""
    transformers = pytest.importorskip("transformers")
    from gristmill.config import EngineConfig
    from gristmill.engine.kv_blocks import BlockManager
    from gristmill.engine.request import Request
    from gristmill.engine.scheduler import Scheduler
    from gristmill.model.runner import ModelRunner
    from gristmill.sampling import SamplingParams
    from tests.model.decode_stack_check import run_comparing_stack_and_layers

    config = transformers.LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                      max_position_embeddings=128, attention_bias=True)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    runner = ModelRunner(EngineConfig(model=str(tmp_path), device="cpu", dtype="float32", quantization="int8",
                                      block_size=4, num_kv_blocks=64, max_model_len=128, max_num_seqs=4,
                                      max_num_batched_tokens=64))
    _gguf_layers(runner.model)
    sched = Scheduler(BlockManager(runner.num_blocks, 4, True), 4, 64, runner.max_model_len)
    for rid, n in (("a", 3), ("b", 9)):
        prompt = torch.randint(256, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        sched.add_request(Request(rid, prompt, SamplingParams(max_tokens=5, temperature=0)))
    stacked_steps, _ = run_comparing_stack_and_layers(runner, sched)
    assert stacked_steps >= 3


# ---- the argmax alone (greedy decoding through an LM head) ----------------------------

@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("rows", ROWS)
def test_argmax_alone_is_the_argmax_of_the_outputs(isa, rows):
    # Every type in five tiles, a bias, from the bytes and from panels packed once: each
    # tile's maxima are the outputs' own floats, so the index is torch's argmax of them.
    layer = _layer(_mixed_parts(512), 512, torch.randn(135), isa=isa)
    x = _inputs(rows, 512, seed=rows)
    expected = layer(x).argmax(-1)
    assert torch.equal(layer.argmax(x), expected)
    if layer.pack_panels(isa):
        assert torch.equal(layer.argmax(x), expected)


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_argmax_alone_takes_the_first_of_equal_outputs_and_the_first_nan(isa, rows):
    blocks = _made(T.Q8_0, 100, 256)
    for copy in (9, 70):  # rows 3 and 9 in one tile, 70 in a later one: equal outputs
        blocks[copy] = blocks[3]
    layer = _layer([(T.Q8_0, blocks)], 256, isa=isa)
    x = layer.dequantized()[3].repeat(rows, 1)  # row 3's own direction: its output is the largest
    y = layer(x)
    assert torch.equal(y[:, 3], y[:, 70]) and bool((y[:, 3] > y[:, 4]).all())
    assert layer.argmax(x).tolist() == [3] * rows == y.argmax(-1).tolist()
    bias = torch.zeros(100)
    bias[20], bias[50], bias[80] = float("inf"), float("nan"), float("nan")  # a NaN counts as the largest
    layer = _layer([(T.Q8_0, blocks)], 256, bias, isa=isa)
    assert layer.argmax(x).tolist() == [50] * rows == layer(x).argmax(-1).tolist()
