"""A GGUF file's matrices reach the CPU kernels as they are stored: each linear layer of
the model (fused q/k/v and gate/up too, whose parts may be of different types, as in
Q4_K_M files) holds the file's blocks, and the weights it multiplies by are exactly those
the float path dequantizes (llama's q/k rows back in HF's rotary order). Nothing of the
weights is copied into the cache; a matrix type without a kernel runs in int8, and the
start says which type."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from torch import nn

from gristmill import EngineConfig
from gristmill.model.cpu.gguf_linear import GGUFEmbedding, GGUFLinear
from gristmill.model.cpu.qlinear import Int8Linear
from tests.model.test_loader import _add_byte_level_vocab, _add_sentencepiece_vocab, write_tiny_gguf

T = gguf.GGMLQuantizationType
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN = 256, 4, 2, 64, 512
# The types llama.cpp's Q4_K_M gives each matrix (v and down one step up), Q8_0 throughout,
# and the 32-block 4/5-bit types.
MIXES = {
    "q4_k_m": {"default": T.Q4_K, "attn_v": T.Q6_K, "ffn_down": T.Q6_K, "token_embd": T.Q6_K, "output": T.Q6_K},
    "q8_0": {"default": T.Q8_0},
    "q4_0-q5_0": {"default": T.Q4_0, "attn_v": T.Q5_0, "ffn_down": T.Q5_0, "token_embd": T.Q8_0,
                  "output": T.Q5_K},
}


def _blocks(rng, ggml_type, rows: int, cols: int) -> np.ndarray:
    """Random blocks of `ggml_type` for a (rows, cols) matrix whose weights have a spread of
    about 1 / sqrt(cols): made by gguf where it can quantize the type, else random codes
    under small fp16 scales."""
    if ggml_type in (T.Q8_0, T.Q4_0, T.Q5_0):
        return gguf.quantize((rng.standard_normal((rows, cols)) / math.sqrt(cols)).astype(np.float32), ggml_type)
    block_size, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
    blocks = rng.integers(0, 256, size=(rows, cols // block_size, type_size), dtype=np.uint8)
    scales = (np.abs(rng.standard_normal((rows, cols // block_size, 2))) * 0.3 / math.sqrt(cols) / 16)
    scales = scales.astype(np.float16)
    if ggml_type == T.Q6_K:
        blocks[:, :, 208:210] = scales[:, :, :1].view(np.uint8)
    else:  # Q4_K, Q5_K: d, then dmin
        blocks[:, :, 0:4] = scales.view(np.uint8)
    return blocks.reshape(rows, -1)


def write_quantized_gguf(path: Path, arch: str, mix: dict) -> Path:
    """A two-layer `arch` model whose matrices are of the types `mix` gives (by GGUF tensor
    kind, "default" for the rest); norms in F32."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(2)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    if arch == "gemma3":
        writer.add_sliding_window(128)
        n_vocab = _add_sentencepiece_vocab(writer, arch)
    else:
        n_vocab = _add_byte_level_vocab(writer, arch)
    rng = np.random.default_rng(7)

    def matrix(name: str, rows: int, cols: int) -> None:
        kind = name.split(".")[-2]
        ggml_type = mix.get(kind, mix["default"])
        writer.add_tensor(name, _blocks(rng, ggml_type, rows, cols), raw_dtype=ggml_type)

    def norm(name: str, size: int) -> None:
        writer.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(size)).astype(np.float32))

    matrix("token_embd.weight", n_vocab, HIDDEN)
    norm("output_norm.weight", HIDDEN)
    if arch != "gemma3":
        matrix("output.weight", n_vocab, HIDDEN)
    for layer in range(2):
        blk = f"blk.{layer}"
        matrix(f"{blk}.attn_q.weight", HEADS * HEAD_DIM, HIDDEN)
        matrix(f"{blk}.attn_k.weight", KV_HEADS * HEAD_DIM, HIDDEN)
        matrix(f"{blk}.attn_v.weight", KV_HEADS * HEAD_DIM, HIDDEN)
        matrix(f"{blk}.attn_output.weight", HIDDEN, HEADS * HEAD_DIM)
        matrix(f"{blk}.ffn_gate.weight", FFN, HIDDEN)
        matrix(f"{blk}.ffn_up.weight", FFN, HIDDEN)
        matrix(f"{blk}.ffn_down.weight", HIDDEN, FFN)
        for name in ("attn_norm", "ffn_norm") + (("post_attention_norm", "post_ffw_norm") if arch == "gemma3" else ()):
            norm(f"{blk}.{name}.weight", HIDDEN)
        if arch in ("qwen3", "gemma3"):
            norm(f"{blk}.attn_q_norm.weight", HEAD_DIM)
            norm(f"{blk}.attn_k_norm.weight", HEAD_DIM)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _runner(model: Path, cache: Path, quantization):
    from gristmill.model.runner import ModelRunner

    return ModelRunner(EngineConfig(model=str(model), device="cpu", quantization=quantization, num_kv_blocks=8,
                                    max_model_len=64, cache_dir=str(cache)))


CASES = [("llama", "q4_k_m"), ("qwen3", "q8_0"), ("gemma3", "q4_k_m"), ("llama", "q4_0-q5_0")]


@pytest.mark.parametrize("arch, mix", CASES)
def test_every_matrix_runs_as_stored_with_the_weights_the_float_path_reads(arch, mix, tmp_path):
    path = write_quantized_gguf(tmp_path / f"{arch}.gguf", arch, MIXES[mix])
    stored, reference = _runner(path, tmp_path / "cache", "auto"), _runner(path, tmp_path / "cache", None)
    assert stored.quantization == "gguf"
    model = stored.model
    assert not any(isinstance(m, (nn.Linear, Int8Linear)) for m in model.modules())
    assert isinstance(model.model.embed_tokens, GGUFEmbedding)
    floats = dict(reference.model.named_parameters())
    for name, layer in model.named_modules():
        if isinstance(layer, GGUFLinear):
            # Each part's weights, in HF's order (llama's q/k rows unpermuted), fused as the float path's.
            parts = getattr(layer, "split_sizes", None)
            want = floats.get(f"{name}.weight")
            if name == "lm_head" and want is None:  # tied: the float path's head is its embedding
                want = floats["model.embed_tokens.weight"]
            if want is None:  # fused: the float model keeps the parts apart
                parent = name.rpartition(".")[0]
                names = ("q_proj", "k_proj", "v_proj") if name.endswith("qkv_proj") else ("gate_proj", "up_proj")
                want = torch.cat([floats[f"{parent}.{n}.weight"] for n in names])
                assert parts == [floats[f"{parent}.{n}.weight"].shape[0] for n in names]
            assert torch.equal(layer.dequantized(), want), name
    ids = torch.tensor([[5, 17, 99, 3, 250, 42, 7]])
    assert torch.equal(model.model.embed_tokens(ids), reference.model.model.embed_tokens(ids))
    # The whole model: only the activations' rounding (int8, blocks of 32) is between the two.
    scores = stored.score(list(range(2, 40))), reference.score(list(range(2, 40)))
    assert (scores[0] - scores[1]).abs().mean() < 0.05 * scores[1].abs().mean()


def test_nothing_of_the_weights_is_copied_into_the_cache(tmp_path):
    path = write_quantized_gguf(tmp_path / "llama.gguf", "llama", MIXES["q8_0"])
    _runner(path, tmp_path / "cache", "auto")
    cache = tmp_path / "cache"
    links = [f for f in cache.rglob("*") if f.is_symlink()]
    assert [f.resolve() for f in links] == [path.resolve()]  # where the weights are read from
    written = [f for f in cache.rglob("*") if f.is_file() and not f.is_symlink() and "kernels" not in f.parts]
    assert not [f for f in written if f.suffix == ".safetensors"]
    beyond_tokenizer = sum(f.stat().st_size for f in written if not f.name.startswith("tokenizer"))
    assert beyond_tokenizer <= 0.1 * path.stat().st_size, [(f.name, f.stat().st_size) for f in written]


def test_a_matrix_type_without_a_kernel_runs_in_int8_and_the_start_names_it(tmp_path, caplog):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "llama", "gpt2")  # F32 layers, an F16 output, Q8_0 embedding
    with caplog.at_level(logging.WARNING, logger="gristmill.startup"):
        runner = _runner(path, tmp_path / "cache", "auto")
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "are F32 (e.g. blk.0." in said and "1 matrix is F16 (e.g. output.weight)" in said and "int8" in said
    assert isinstance(runner.model.lm_head, Int8Linear) and isinstance(runner.model.model.layers[0].mlp.down_proj,
                                                                         Int8Linear)
    assert isinstance(runner.model.model.embed_tokens, GGUFEmbedding)  # Q8_0: read as stored


@pytest.mark.parametrize("arch, mix", [("qwen3", "q8_0"), ("llama", "q4_0-q5_0"), ("gemma3", "q4_k_m")])
def test_32_wide_matrices_get_their_panels_packed_at_load_and_give_the_same_floats(arch, mix, tmp_path, monkeypatch):
    from gristmill.model import memory
    from gristmill.model.cpu import kernels

    if kernels.int8_extension().best_isa() == 0:
        pytest.skip("this CPU has no vector path, which the panels are for")
    path = write_quantized_gguf(tmp_path / f"{arch}.gguf", arch, MIXES[mix])
    packed = _runner(path, tmp_path / "cache", "auto")
    monkeypatch.setattr(memory, "PANEL_BYTES", 0)  # no memory for panels: every call packs its own
    plain = _runner(path, tmp_path / "cache", "auto")
    layers = {name: m for name, m in packed.model.named_modules() if isinstance(m, GGUFLinear)}
    for name, layer in layers.items():  # Q8_0, Q4_0 and Q5_0 parts have them; the K types not
        assert len(layer.panels) == sum(t in (T.Q8_0, T.Q4_0, T.Q5_0) for t, _ in layer.parts), name
    assert any(layer.panels for layer in layers.values()) == (mix != "q4_k_m")
    assert not any(m.panels for m in plain.model.modules() if isinstance(m, GGUFLinear))
    ids = list(range(2, 40))
    assert torch.equal(packed.score(ids), plain.score(ids))
    for n in (1, 5):  # decode-sized calls: Q8_0 reads its panels at every row count
        x = torch.randn(n, HIDDEN)
        for name, layer in layers.items():
            if layer.in_features == HIDDEN:
                assert torch.equal(layer(x), plain.model.get_submodule(name)(x)), (name, n)
