"""Quantized weights (int8 and q4): the kernels' paths against the reference arithmetic,
quantized layers against float, and a quantized model end to end (cache included)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from gristmill import EngineConfig, RequestError
from gristmill.model.cpu import kernels
from gristmill.model.cpu.qlinear import (Int8Embedding, Int8Linear, Q4Linear, dequantize_q4, pack_q8_0,
                                     quantize_weight, quantize_weight_q4, unpack_blocks, unpack_weight,
                                     unpack_weight_q4)
from gristmill.model.cpu.quant import resolve_quantization
from tests.model.gelu_bound import assert_gelu_of

EXT = kernels.int8_extension()
BEST = EXT.best_isa() if EXT is not None else -1
# Every path: the portable one runs anywhere; a vector path is skipped, saying so, on a
# CPU that lacks it (this keeps the test honest on AVX2-only and on non-x86 machines).
PATHS = [pytest.param(isa, id=name, marks=pytest.mark.skipif(
    BEST < isa, reason=f"this CPU has no {name}")) for isa, name in kernels.ISA_NAMES.items()]
# (rows, in_features, out_features): odd sizes that need padding, the Gemma 3 270M
# shapes, and a slice of its LM head.
SHAPES = [(1, 7, 5), (3, 64, 64), (5, 130, 200), (1, 640, 1024), (17, 640, 2048), (64, 2048, 640),
          (4, 640, 16384)]


KINDS = [pytest.param(Int8Linear, id="int8"), pytest.param(Q4Linear, id="q4")]


def _layer(in_features: int, out_features: int, bias: bool = False, seed: int = 0,
           kind=Int8Linear) -> tuple[nn.Linear, Int8Linear | Q4Linear]:
    torch.manual_seed(seed)
    linear = nn.Linear(in_features, out_features, bias=bias)
    nn.init.normal_(linear.weight, std=in_features ** -0.5)
    return linear, kind.from_linear(linear)


def test_the_kernel_builds_here():
    assert EXT is not None, "the int8 kernel did not build: is a C++ compiler installed?"
    assert kernels.ISA_NAMES[BEST] in ("portable", "avx2", "avx512_vnni")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("rows,in_features,out_features", SHAPES)
def test_kernel_path_equals_reference_arithmetic(kind, isa, rows, in_features, out_features):
    _, layer = _layer(in_features, out_features, bias=True, kind=kind)
    x = torch.randn(rows, in_features) * 3
    x[0, : min(3, in_features)] = 40.0  # an outlier channel drives the row's scale
    layer.isa = isa
    out = layer(x)
    expected = layer.reference(x)
    assert out.shape == (rows, out_features)
    # Same int32 block sums; only the order of the float accumulation differs.
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("rows", [1, 5, 64, 130])
def test_int8_argmax_alone_is_the_argmax_of_the_outputs(isa, rows):
    # An LM head of 1,000 outputs (32 tiles), bias, rows split by tiles and by rows between
    # threads; outputs 5 and 900 (other tiles) and 7 (5's) equal and the largest, then a
    # NaN in the bias: the first of equal ones, and a NaN counting as the largest.
    linear, _ = _layer(256, 1000, bias=True)
    with torch.no_grad():
        linear.weight[[7, 900]] = linear.weight[5].clone()
        linear.bias[[7, 900]] = linear.bias[5].clone()
    layer = Int8Linear.from_linear(linear)
    layer.isa = isa
    x = torch.randn(rows, 256)
    x[0] = linear.weight[5].detach() * 50  # row 0: output 5 the largest
    expected = layer(x).argmax(-1)
    assert int(expected[0]) == 5 and torch.equal(layer(x)[0, 5], layer(x)[0, 900])
    assert torch.equal(layer.argmax(x), expected)
    layer.bias[300] = float("nan")
    assert layer.argmax(x).tolist() == [300] * rows == layer(x).argmax(-1).tolist()
    assert Q4Linear.from_linear(linear).argmax(x) is None  # (no such call: its heads are int8)


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_a_models_greedy_tokens_come_from_its_head_unless_a_softcap_rounds_the_logits(softcap):
    # Gemma's softcap rounds tanh(logit / cap) * cap, which can tie logits the head keeps
    # apart: such a model leaves the argmax to its logits (greedy_tokens: None).
    transformers = pytest.importorskip("transformers")
    from gristmill.model.models.gemma3 import Gemma3ForCausalLM
    config = transformers.Gemma3TextConfig(
        vocab_size=300, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, layer_types=["full_attention"], final_logit_softcapping=softcap)
    config.bidirectional = False  # (the loader's name for use_bidirectional_attention)
    model = Gemma3ForCausalLM(config, max_positions=64)
    model.lm_head = Int8Linear.from_linear(_layer(64, 300)[0])
    hidden = torch.randn(5, 64)
    tokens = model.greedy_tokens(hidden)
    if softcap:
        assert tokens is None
    else:
        assert torch.equal(tokens, model.compute_logits(hidden).argmax(-1))


# 7-bit activations (an encoder's layers): the AVX2 path multiplies them as unsigned
# bytes; from 64 rows (at 2 threads) the rows, not the output tiles, are split between
# threads. Odd sizes: rows not a multiple of the 4-row tile, K and N not of 32.
SHAPES_7BIT = [(1, 7, 5), (3, 64, 64), (5, 130, 200), (67, 384, 1152), (130, 1536, 388), (301, 97, 70)]


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("rows,in_features,out_features", SHAPES_7BIT)
def test_7bit_activations_kernel_path_equals_reference_arithmetic(isa, rows, in_features, out_features):
    _, layer = _layer(in_features, out_features, bias=True)
    layer.x_levels = 63
    x = torch.randn(rows, in_features) * 3
    x[0, : min(3, in_features)] = 40.0
    x[-1] = 0.0  # a zero row: zero scales, the padding's offset taken back out exactly
    layer.isa = isa
    torch.testing.assert_close(layer(x), layer.reference(x), rtol=1e-5, atol=1e-4)
    assert torch.equal(layer(x)[-1], layer.bias)
    together = layer(x)  # rows alone or among many (split between threads) come out the same
    for i in (0, rows // 2, rows - 1):
        assert torch.equal(layer(x[i:i + 1])[0], together[i])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("rows,in_features,out_features", [(1, 7, 5), (67, 384, 1536), (130, 97, 70)])
def test_gelu_in_the_kernels_output_step_equals_torch_gelu_after_it(kind, isa, rows, in_features, out_features):
    _, layer = _layer(in_features, out_features, bias=True, kind=kind)
    if kind is Int8Linear:
        layer.x_levels = 63
    x = torch.randn(rows, in_features) * 3
    layer.isa = isa
    plain = layer(x)
    assert plain.abs().max() > 5  # both tails of GELU are reached, not only its middle
    assert_gelu_of(layer(x, "gelu"), plain)
    torch.testing.assert_close(layer(x, "gelu"), layer.reference(x, "gelu"), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(layer(x, "silu"), torch.nn.functional.silu(plain))  # not fused: after the kernel


def test_7bit_activations_cost_little_against_float():
    linear, layer = _layer(384, 1536, bias=True, seed=1)
    layer.x_levels = 63
    x = torch.randn(200, 384)
    with torch.no_grad():
        expected = linear(x)
    assert (layer(x) - expected).norm() / expected.norm() < 0.03


# Relative error against float on Gaussian data, in blocks of 32: int8 rounds weights and
# activations to 8 bits (under 1%); q4 rounds weights to 16 levels (about 7%). The bounds
# loosen for tiny inner dimensions, where per-value errors average out less.
BOUNDS = {Int8Linear: (0.02, 0.04), Q4Linear: (0.09, 0.12)}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows,in_features,out_features", SHAPES)
def test_quantized_layer_stays_near_float(kind, rows, in_features, out_features):
    linear, layer = _layer(in_features, out_features, bias=True, seed=1, kind=kind)
    x = torch.randn(rows, in_features)
    with torch.no_grad():
        expected = linear(x)
    err = (layer(x) - expected).norm() / expected.norm()
    wide, narrow = BOUNDS[kind]
    assert err < (wide if in_features >= 64 else narrow), f"relative error {err:.4f}"


def test_weights_round_trip_through_the_packed_layout():
    weight = torch.randn(70, 45)
    packed, scale, qsum = quantize_weight(weight)
    assert packed.dtype == torch.int8 and packed.shape == (96 // 16, 64 // 4, 16, 4)
    assert scale.dtype == torch.float16 and scale.shape == qsum.shape == (96 // 16, 2, 16)
    q = unpack_weight(packed)
    assert q.shape == (96, 64) and q[70:].abs().sum() == 0 and q[:, 45:].abs().sum() == 0
    assert q.abs().max() <= 127
    blocks = q.view(96, 2, 32)
    assert torch.equal(unpack_blocks(qsum), blocks.sum(dim=2, dtype=torch.int16))
    scales = unpack_blocks(scale).float()
    restored = (blocks.float() * scales[:, :, None]).view(96, 64)[:70, :45]
    # Each value is within half a step of its block's scale.
    step = scales[:70].repeat_interleave(32, dim=1)[:, :45]
    assert ((restored - weight).abs() <= step / 2 + 1e-6).all()


def test_q4_weights_round_trip_through_the_packed_layout():
    weight = torch.randn(70, 45)
    weight[3, 7] = 25.0  # an outlier widens its block's range
    packed, scale, minimum = quantize_weight_q4(weight)
    assert packed.dtype == torch.uint8 and packed.shape == (96 // 16, 64 // 4, 32)
    assert scale.dtype == minimum.dtype == torch.float16 and scale.shape == minimum.shape == (96 // 16, 2, 16)
    q = unpack_weight_q4(packed)
    assert q.shape == (96, 64) and int(q.max()) <= 15
    restored = dequantize_q4(packed, scale, minimum)[:70, :45]
    # Every value within one step of its block (the least-squares fit may trade half a
    # step at the ends of a block for a closer fit in the middle).
    step = unpack_blocks(scale).float()[:70].repeat_interleave(32, dim=1)[:, :45]
    assert ((restored - weight).abs() <= step + 1e-3).all()
    # Channels 0-7 of a 16-channel block sit in the low nibbles, 8-15 in the high ones.
    assert torch.equal(packed[0, 0, :4] & 15, q[0, :4].to(torch.uint8))
    assert torch.equal(packed[0, 0, :4] >> 4, q[8, :4].to(torch.uint8))


def test_q4_least_squares_fit_beats_min_max():
    torch.manual_seed(0)
    weight = torch.randn(64, 256)
    errors = [(dequantize_q4(*quantize_weight_q4(weight, refinements=r)) - weight).norm() for r in (0, 4)]
    assert errors[1] < 0.97 * errors[0], errors


@pytest.mark.parametrize("kind", KINDS)
def test_zero_rows_batch_shape_and_dtype_are_kept(kind):
    _, layer = _layer(64, 32, bias=True, kind=kind)
    x = torch.randn(2, 3, 64)
    x[0, 1] = 0.0
    out = layer(x)
    assert out.shape == (2, 3, 32)
    torch.testing.assert_close(out[0, 1], layer.bias)  # a zero row gets exactly the bias
    assert layer(x.to(torch.bfloat16)).dtype == torch.bfloat16
    assert layer(torch.empty(0, 64)).shape == (0, 32)


@pytest.mark.parametrize("kind", KINDS)
def test_rows_do_not_change_with_the_batch_around_them(kind):
    # Per-token activation scales: a row's output is the same alone or among others,
    # which seeded sampling relies on.
    _, layer = _layer(640, 1024, kind=kind)
    x = torch.randn(9, 640)
    together = layer(x)
    for i in range(9):
        assert torch.equal(layer(x[i:i + 1])[0], together[i])


def test_quantization_option_is_validated_and_resolved():
    assert EngineConfig().quantization == "auto"
    assert EngineConfig(quantization="none").quantization is None
    with pytest.raises(RequestError, match="quantization") as info:
        EngineConfig(quantization="int4")
    assert info.value.param == "quantization"
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_quantization("auto", cuda) is None
    assert resolve_quantization("auto", cpu) == ("int8" if EXT is not None else None)
    assert resolve_quantization("auto", cpu, gguf=True) == ("gguf" if EXT is not None else None)  # a GGUF: as stored
    assert resolve_quantization(None, cpu) is None
    for scheme in ("int8", "q4"):
        assert resolve_quantization(scheme, cpu) == scheme
        with pytest.raises(ValueError, match="CPU only"):
            resolve_quantization(scheme, cuda)


def test_without_a_compiler_auto_is_float_and_int8_still_runs(tmp_path):
    # GRISTMILL_KERNELS=0 is how a machine without a compiler looks to gristmill.
    code = (
        "import torch; from torch import nn\n"
        "from gristmill.model.cpu.qlinear import Int8Linear, Q4Linear\n"
        "from gristmill.model.cpu.quant import resolve_quantization\n"
        "assert resolve_quantization('auto', torch.device('cpu')) is None\n"
        "for kind in (Int8Linear, Q4Linear):\n"
        "    layer = kind.from_linear(nn.Linear(40, 24)); x = torch.randn(3, 40)\n"
        "    assert torch.equal(layer(x), layer.reference(x))\n"
        "print('ok')\n")
    env = {**os.environ, "GRISTMILL_KERNELS": "0", "GRISTMILL_CACHE": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


@pytest.mark.skipif(EXT is None, reason="the C++ kernels are not built here")
@pytest.mark.parametrize("name", ["portable", "avx2"])
def test_max_isa_caps_the_path_the_kernels_pick(name):
    # As a machine without the instructions above `name` looks: the layers' own choice
    # (isa None) is that path, its floats those of the path pinned here.
    cap = min(BEST, {v: k for k, v in kernels.ISA_NAMES.items()}[name])
    make = "torch.manual_seed(0); layer = Int8Linear.from_linear(nn.Linear(640, 96)); x = torch.randn(5, 640) * 3\n"
    code = ("import torch; from torch import nn\n"
            "from gristmill.model.cpu import kernels\n"
            "from gristmill.model.cpu.qlinear import Int8Linear\n" + make +
            "print(kernels.int8_extension().best_isa(), layer(x).numpy().tobytes().hex())\n")
    env = {**os.environ, "GRISTMILL_MAX_ISA": name}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    namespace = {"torch": torch, "nn": nn, "Int8Linear": Int8Linear}
    exec(make, namespace)
    namespace["layer"].isa = cap
    assert done.stdout.split() == [str(cap), namespace["layer"](namespace["x"]).numpy().tobytes().hex()]


def test_max_isa_naming_no_path_is_refused_saying_the_names():
    code = "from gristmill.model.cpu import kernels\nkernels.int8_extension()\n"
    env = {**os.environ, "GRISTMILL_MAX_ISA": "AVX-512"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "GRISTMILL_MAX_ISA='AVX-512'" in done.stderr and "portable, avx2, avx512_vnni" in done.stderr


def test_cli_takes_quantization_flag():
    from gristmill.cli import build_parser
    from gristmill.engine_flags import engine_config
    args = build_parser().parse_args(["generate", "hi", "--quantization", "none"])
    assert engine_config(args).quantization is None
    for scheme in ("int8", "q4"):
        args = build_parser().parse_args(["generate", "hi", "--quantization", scheme])
        assert engine_config(args).quantization == scheme
    with pytest.raises(SystemExit, match="--quantization"):
        engine_config(build_parser().parse_args(["generate", "hi", "--quantization", "q3"]))



def _runner_factory(cache_dir: Path | None = None, model: Path | None = None):
    """ModelRunners of `model` (None: the bundled Gemma 3 270M) with their quantized weights
    cached under `cache_dir` (None: the machine's cache, shared with every other test and
    run, so the 270M model is quantized once per machine, not once per test)."""
    from gristmill.model.runner import ModelRunner

    def runner(quantization):
        return ModelRunner(EngineConfig(model=None if model is None else str(model), device="cpu",
                                        quantization=quantization, num_kv_blocks=8, max_model_len=64,
                                        cache_dir=None if cache_dir is None else str(cache_dir)))
    return runner


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory) -> Path:
    """A one-layer Gemma 3 GGUF with random weights: tied embeddings in Q8_0, as the bundled
    model has them. Quantizing it cold takes a blink (the 270M model: a minute for int8,
    two for q4), so the cold path and the cache's life are checked on it."""
    from tests.model.test_loader import write_tiny_gguf
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny-gemma") / "tiny.gguf", "gemma3", "llama")


def _embeddings_equal(a, b, vocab_size: int) -> bool:
    return all(torch.equal(a.model.model.embed_tokens(ids), b.model.model.embed_tokens(ids))
               for ids in torch.arange(vocab_size).split(1 << 15))


def test_int8_model_is_quantized_once_and_cached_on_disk(tmp_path, tiny_gemma):
    from tests.model.test_loader import HEAD_DIM, HEADS, KV_HEADS

    runner = _runner_factory(tmp_path, tiny_gemma)

    first = runner("int8")  # a cold start: quantized here, and written to the cache
    assert first.quantization == "int8"
    assert not any(isinstance(m, nn.Linear) for m in first.model.modules())
    linears = [m for m in first.model.modules() if isinstance(m, Int8Linear)]
    assert len(linears) == 1 * 4 + 1  # fused qkv, o, fused gate_up, down per layer, and the LM head
    attention = first.model.model.layers[0].self_attn
    qkv = [HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM]
    assert attention.qkv_proj.split_sizes == qkv and not hasattr(attention, "q_proj")
    [cache] = (tmp_path / "quantized").glob("*.safetensors")
    written = cache.stat().st_mtime_ns
    second = runner("int8")  # a warm start: the linears come from the cache, never made in float
    assert cache.stat().st_mtime_ns == written  # loaded, not quantized and written again
    assert second.model.model.layers[0].self_attn.qkv_proj.split_sizes == qkv
    assert isinstance(second.model.lm_head, Int8Linear) and second.model.lm_head.reuse_output
    cache.write_bytes(b"not a safetensors file")  # a damaged cache is rebuilt, not fatal
    rebuilt = runner("int8")
    from safetensors.torch import load_file
    assert len(load_file(str(cache))) == 3 * len(linears)  # qweight, scale, qsum per layer
    reference = runner(None)
    assert any(isinstance(m, nn.Linear) for m in reference.model.modules())
    # The embeddings are read from the tied int8 head (no float table is kept): the
    # GGUF's Q8_0 table comes back exactly, row for row.
    for model in (first.model, second.model, rebuilt.model):
        assert isinstance(model.model.embed_tokens, Int8Embedding)
        assert not any(p.numel() >= first.vocab_size for p in model.parameters())
    # The cold start packed the GGUF's Q8_0 table as it is: the very weights quantizing its
    # float32 dequantization gives, without making them.
    packed = quantize_weight(reference.model.model.embed_tokens.weight)
    assert all(torch.equal(getattr(first.model.lm_head, name), tensor)
               for name, tensor in zip(("qweight", "scale", "qsum"), packed))
    assert _embeddings_equal(first, reference, first.vocab_size)
    assert _embeddings_equal(second, reference, first.vocab_size)
    ids = list(range(2, 40))
    scores = [r.score(ids) for r in (first, second, rebuilt, reference)]
    assert torch.equal(scores[0], scores[1]) and torch.equal(scores[0], scores[2])
    assert (scores[0] - scores[3]).abs().mean() < 0.1 * scores[3].abs().mean()
    data = cache.read_bytes()
    cache.write_bytes(data[:len(data) // 2])  # cut short: rebuilt too, not read as far as it goes
    assert torch.equal(runner("int8").score(ids), scores[0])
    assert cache.stat().st_size == len(data)


def test_q4_model_has_4bit_layers_an_int8_lm_head_and_its_own_cache(tmp_path, tiny_gemma):
    runner = _runner_factory(tmp_path, tiny_gemma)

    q4 = runner("q4")  # cold
    assert q4.quantization == "q4"
    assert sum(isinstance(m, Q4Linear) for m in q4.model.modules()) == 1 * 4
    assert isinstance(q4.model.lm_head, Int8Linear)  # 4 bits there doubled perplexity
    assert len(list((tmp_path / "quantized").glob("*.safetensors"))) == 1
    int8 = runner("int8")  # a cache file of its own, next to q4's
    assert len(list((tmp_path / "quantized").glob("*.safetensors"))) == 2
    again, reference = runner("q4"), runner(None)
    ids = list(range(2, 40))
    scores = {name: r.score(ids) for name, r in (("q4", q4), ("again", again), ("int8", int8), ("float", reference))}
    assert torch.equal(scores["q4"], scores["again"])  # loaded from its cache: the same weights
    # q4 is further from float than int8, but still the same model.
    q4_error = (scores["q4"] - scores["float"]).abs().mean()
    int8_error = (scores["int8"] - scores["float"]).abs().mean()
    assert int8_error < q4_error < 0.5 * scores["float"].abs().mean(), (int8_error, q4_error)


def test_the_bundled_model_int8_and_q4_from_the_shared_cache():
    """The 270M model's own shapes and numbers, its quantized weights from the machine's
    cache (quantized on this machine's first run; the cold path: the tests above)."""
    from gristmill.model.cpu.quant import cache_file_for
    from gristmill.paths import cache_root

    runner = _runner_factory()
    int8, q4, reference = runner("int8"), runner("q4"), runner(None)
    assert int8.quantization == "int8" and q4.quantization == "q4"
    assert not any(isinstance(m, nn.Linear) for m in int8.model.modules())
    assert sum(isinstance(m, Int8Linear) for m in int8.model.modules()) == 18 * 4 + 1
    assert sum(isinstance(m, Q4Linear) for m in q4.model.modules()) == 18 * 4
    assert isinstance(q4.model.lm_head, Int8Linear)  # 4 bits there doubled perplexity
    attention = int8.model.model.layers[0].self_attn
    assert attention.qkv_proj.split_sizes == [4 * 256, 256, 256] and not hasattr(attention, "q_proj")
    assert isinstance(int8.model.lm_head, Int8Linear) and int8.model.lm_head.reuse_output
    files = {scheme: cache_file_for(int8.model_dir, cache_root(), scheme) for scheme in ("int8", "q4")}
    assert files["int8"] != files["q4"] and all(f.exists() for f in files.values())  # a file each
    assert any(isinstance(m, nn.Linear) for m in reference.model.modules())
    for model in (int8.model, q4.model):  # the embeddings are read from the tied int8 head
        assert isinstance(model.model.embed_tokens, Int8Embedding)
        assert not any(p.numel() >= int8.vocab_size for p in model.parameters())
    # The cached head is the GGUF's Q8_0 table packed as it is: what quantizing its float32
    # dequantization gives; so the embeddings come back exactly, row for row.
    packed = quantize_weight(reference.model.model.embed_tokens.weight)
    assert all(torch.equal(getattr(int8.model.lm_head, name), tensor)
               for name, tensor in zip(("qweight", "scale", "qsum"), packed))
    assert _embeddings_equal(int8, reference, int8.vocab_size)
    ids = list(range(2, 40))
    scores = {name: r.score(ids) for name, r in (("q4", q4), ("int8", int8), ("float", reference))}
    # q4 is further from float than int8, but still the same model.
    q4_error = (scores["q4"] - scores["float"]).abs().mean()
    int8_error = (scores["int8"] - scores["float"]).abs().mean()
    assert int8_error < 0.1 * scores["float"].abs().mean()
    assert int8_error < q4_error < 0.5 * scores["float"].abs().mean(), (int8_error, q4_error)


def test_fused_projections_equal_separate_ones():
    # Fusing q/k/v (or gate/up) changes nothing in int8: each output channel is its own sum.
    from gristmill.model.layers import QKV, project
    from gristmill.model.layers import fuse_projections

    torch.manual_seed(0)
    module = nn.Module()
    for name, out in zip(QKV[1], (96, 32, 32)):
        setattr(module, name, nn.Linear(80, out, bias=True))
    x = torch.randn(5, 80)
    separate = [Int8Linear.from_linear(getattr(module, name))(x) for name in QKV[1]]
    fuse_projections(module)
    assert not hasattr(module, "q_proj") and module.qkv_proj.split_sizes == [96, 32, 32]
    module.qkv_proj = Int8Linear.from_linear(module.qkv_proj)
    module.qkv_proj.split_sizes = [96, 32, 32]
    fused = project(module, x, *QKV)
    for a, b in zip(fused, separate):
        assert torch.equal(a, b)


def test_lm_head_output_buffer_is_reused_and_correct():
    linear, layer = _layer(64, 4096)
    layer.reuse_output = True
    x = torch.randn(3, 64)
    first = layer(x)
    expected = layer.reference(x)
    torch.testing.assert_close(first, expected, rtol=1e-5, atol=1e-5)
    second = layer(x[:2] * 2)
    assert second.data_ptr() == first.data_ptr()  # the same memory, no fresh allocation
    torch.testing.assert_close(second, layer.reference(x[:2] * 2), rtol=1e-5, atol=1e-5)
    assert layer(torch.randn(5, 64)).shape == (5, 4096)  # more rows than before: a larger buffer


@pytest.mark.parametrize("vocab", [1000, 262144])
def test_greedy_is_argmax_with_first_index_on_ties(vocab):
    from gristmill.model.sampler import greedy_tokens as greedy
    torch.manual_seed(0)
    logits = torch.randn(7, vocab)
    logits[1, [5, vocab - 3]] = 100.0  # a tie: the first index wins, as argmax gives it
    logits[2] = 0.0
    logits[3, [vocab // 2, vocab - 1]] = float("nan")  # a NaN counts as the largest, as argmax has it
    logits[4, -5:] = float("inf")
    assert torch.equal(greedy(logits), logits.argmax(dim=-1))
    assert greedy(logits)[1] == 5 and greedy(logits)[2] == 0 and greedy(logits)[3] == vocab // 2
    assert greedy(logits)[4] == vocab - 5
    assert torch.equal(greedy(logits[5:6]), logits[5:6].argmax(dim=-1))  # one row


def test_a_build_lock_left_by_a_killed_builder_does_not_hang_the_next_start(tmp_path):
    # torch's build lock is a plain file: a builder killed mid-build leaves it behind, and
    # torch alone would wait on it forever. Here the built kernel plus such a stale lock
    # sit in a fresh cache; loading must finish (in seconds: nothing needs rebuilding).
    built = Path(EXT.__file__).parent
    shutil.copytree(built, tmp_path / "kernels" / built.name)
    (tmp_path / "kernels" / built.name / "lock").write_text("")
    # A warm start imports the built module as it is: not torch's build machinery
    # (torch.utils.cpp_extension pulls in setuptools, seconds of every start).
    code = ("import sys; from gristmill.model.cpu import kernels; print(kernels.int8_extension() is not None, "
            "'torch.utils.cpp_extension' in sys.modules)")
    env = {**os.environ, "GRISTMILL_CACHE": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.split() == ["True", "False"], (done.stdout, done.stderr)
    assert not (tmp_path / "kernels" / built.name / "lock").exists()


def test_the_4bit_kernel_is_built_only_for_4bit_models_and_checking_needs_no_torch():
    # What a first start compiles follows the quantization: the int8 default leaves the
    # q4 kernel out; a client asks whether anything must compile without importing torch.
    # In a fresh interpreter, one for all such checks (tests/test_layering.py).
    from tests.test_layering import fresh_imports

    report = fresh_imports()["kernels"]
    assert report["built"] is True and report["torch_before_loading"] == []
    assert report["int8_has"] == [True, False]  # the int8 build has no 4-bit kernel
    assert report["q4_has_q4"] is True and report["one_module_after_q4"] is True


@pytest.mark.parametrize("out_features", [64, 50])  # 50: padded to 64 rows
def test_q8_0_blocks_pack_into_the_weights_their_dequantization_quantizes_to(out_features):
    # llama.cpp's Q8_0: d = absmax / 127 stored in fp16, q = round(x / d). Packing q and d
    # as they are must give what quantize_weight gives for q * d, bit for bit.
    import gguf
    import numpy as np

    from tests.model.test_loader import dequantize_q8_0

    rng = np.random.default_rng(0)
    weights = rng.standard_normal((out_features, 96)).astype(np.float32)
    weights[3, :32] = 0.0  # an all-zero block: scale 0
    raw = gguf.quantize(weights, gguf.GGMLQuantizationType.Q8_0).reshape(-1, 34)
    scales = torch.from_numpy(raw[:, :2].copy().view(np.float16).reshape(out_features, 3))
    values = torch.from_numpy(raw[:, 2:].copy().view(np.int8).reshape(out_features, 96))
    direct, requantized = pack_q8_0(values, scales), quantize_weight(dequantize_q8_0(values, scales))
    assert all(torch.equal(a, b) for a, b in zip(direct, requantized))
