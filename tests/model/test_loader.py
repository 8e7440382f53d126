"""Loader pieces that need no network and no real model file."""

from __future__ import annotations

import numpy as np
import pytest

from gristmill.model.loader import _unpermute_rotary, resolve_model


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py `LlamaModel.permute` of q_proj / k_proj."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("n_head, head_dim, cols", [(4, 16, 64), (2, 8, 24), (8, 64, 32), (1, 4, 3)])
def test_unpermute_rotary_inverts_llama_cpp_permute(n_head, head_dim, cols):
    rng = np.random.default_rng(n_head * 1000 + head_dim)
    w = rng.standard_normal((n_head * head_dim, cols)).astype(np.float32)
    permuted = _llama_cpp_permute(w, n_head)
    assert not np.array_equal(permuted, w)  # the permutation really moves rows
    restored = _unpermute_rotary(permuted, n_head)
    np.testing.assert_array_equal(restored, w)
    assert restored.flags["C_CONTIGUOUS"]


def test_unpermute_rotary_inverts_llama_cpp_permute_of_bias():
    # 1-D tensors (a q/k bias) go through the same permutation.
    b = np.arange(4 * 16, dtype=np.float32)
    np.testing.assert_array_equal(_unpermute_rotary(_llama_cpp_permute(b, 4), 4), b)


def test_unpermute_rotary_splits_interleaved_halves():
    # One head of dim 8: llama.cpp rows are (x0, y0, x1, y1, ...) pairs; HF wants (x..., y...).
    interleaved = np.array([0, 4, 1, 5, 2, 6, 3, 7], dtype=np.float32)[:, None]
    np.testing.assert_array_equal(_unpermute_rotary(interleaved, 1)[:, 0], np.arange(8))


def test_resolve_model_missing_path_says_what_to_pass(tmp_path):
    missing = tmp_path / "nonexistent"
    with pytest.raises(FileNotFoundError) as info:
        resolve_model(str(missing))
    message = str(info.value)
    assert str(missing) in message
    assert "HF model directory" in message and ".gguf" in message


def test_resolve_model_nonexistent_root():
    with pytest.raises(FileNotFoundError, match=r"pass an HF model directory or a \.gguf"):
        resolve_model("/nonexistent")


def test_resolve_model_directory_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model(str(tmp_path))


def test_resolve_model_accepts_hf_directory(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == tmp_path
