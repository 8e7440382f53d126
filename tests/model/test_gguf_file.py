"""gristmill.model.gguf_file against gguf.GGUFReader, on small files written by gguf.GGUFWriter."""

from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFValueType

from gristmill.gguf_file import GGUFFile, open_gguf

V = GGUFValueType
SCALARS = [
    ("test.u8", 200, V.UINT8), ("test.i8", -100, V.INT8), ("test.u16", 60000, V.UINT16),
    ("test.i16", -30000, V.INT16), ("test.u32", 4_000_000_000, V.UINT32), ("test.i32", -2_000_000_000, V.INT32),
    ("test.f32", 1e-6, V.FLOAT32), ("test.bool_true", True, V.BOOL), ("test.bool_false", False, V.BOOL),
    ("test.string", "héllo ▁wörld 日本語 🙂", V.STRING), ("test.u64", 2**63 + 5, V.UINT64),
    ("test.i64", -(2**62), V.INT64), ("test.f64", 3.141592653589793, V.FLOAT64),
]
ARRAYS = [
    ("test.arr_u8", [0, 1, 255], V.UINT8), ("test.arr_i8", [-128, 0, 127], V.INT8),
    ("test.arr_u16", [0, 65535], V.UINT16), ("test.arr_i16", [-32768, 32767], V.INT16),
    ("test.arr_u32", [1, 2**32 - 1], V.UINT32), ("test.arr_i32", [-(2**31), 7], V.INT32),
    ("test.arr_f32", [0.1, -2.5, 1e30], V.FLOAT32), ("test.arr_bool", [True, False, True], V.BOOL),
    ("test.arr_u64", [2**64 - 1, 0], V.UINT64), ("test.arr_i64", [-(2**63), 2**63 - 1], V.INT64),
    ("test.arr_f64", [1e-300, 2.0], V.FLOAT64),
    ("test.arr_str", ["", "a", "▁the", "  ", "\n", "<0x0A>", "日本", "🙂", "x" * 1000], V.STRING),
]


def _write(path, big_endian=False, alignment=None):
    """A GGUF with every value type, string arrays, a nested array and a few tensors."""
    endian = gguf.GGUFEndian.BIG if big_endian else gguf.GGUFEndian.LITTLE
    writer = gguf.GGUFWriter(str(path), "llama", endianess=endian)
    if alignment:
        writer.add_custom_alignment(alignment)
    for key, value, vtype in SCALARS:
        writer.add_key_value(key, value, vtype)
    for key, value, vtype in ARRAYS:
        writer.add_key_value(key, value, V.ARRAY, sub_type=vtype)
    writer.add_key_value("test.nested", [[1, 2], [3, 4, 5]], V.ARRAY, sub_type=V.ARRAY)
    writer.add_token_list([f"tok{i}" for i in range(300)])
    rng = np.random.default_rng(0)
    writer.add_tensor("f32.weight", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("f16.weight", rng.standard_normal((4, 8)).astype(np.float16))
    writer.add_tensor("i32.weight", np.arange(6, dtype=np.int32))
    for qtype in (GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0):
        block = gguf.GGML_QUANT_SIZES[qtype][0]
        values = rng.standard_normal((4, 2 * block)).astype(np.float32)
        writer.add_tensor(f"{qtype.name.lower()}.weight", gguf.quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    return _write(tmp_path_factory.mktemp("gguf") / "small.gguf")


def _plain(value):
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


@pytest.mark.parametrize("alignment", [None, 64])
def test_metadata_matches_gguf_reader(tmp_path, alignment):
    path = _write(tmp_path / "a.gguf", alignment=alignment)
    ours, ref = GGUFFile(path), gguf.GGUFReader(str(path))
    assert list(ours.fields) == [k for k in ref.fields if not k.startswith("GGUF.")]
    assert ours.version == 3 and ours.alignment == (alignment or 32)
    assert ours.data_offset == ref.data_offset
    for key, field in ref.fields.items():
        if key.startswith("GGUF.") or key == "test.nested":
            continue
        assert _plain(ours.fields[key]) == field.contents(), key
        assert type(_plain(ours.fields[key])) is type(field.contents()), key
        assert ours.field_types[key][0] == field.types[0], key
        if field.types[0] == V.ARRAY:
            assert ours.field_types[key][1] == field.types[1], key
    # gguf.GGUFReader flattens arrays of arrays; ours keeps them nested
    assert _plain(ours.fields["test.nested"]) == [[1, 2], [3, 4, 5]]
    assert ours.field_types["test.nested"] == (V.ARRAY, V.ARRAY)


def test_values_come_out_as_written(gguf_path):
    ours = GGUFFile(gguf_path)
    for key, value, vtype in SCALARS:
        expected = float(np.float32(value)) if vtype == V.FLOAT32 else value
        assert ours.get(key) == expected and type(ours.get(key)) is type(value), key
    for key, value, vtype in ARRAYS:
        got = ours.get(key)
        if vtype == V.STRING:
            assert got == value
        else:
            assert isinstance(got, np.ndarray) and got.tolist() == np.array(value, dtype=got.dtype).tolist()
    assert ours.get("general.architecture") == "llama"
    assert ours.get("missing.key", 7) == 7


def test_tensors_match_gguf_reader(gguf_path):
    ours, ref = GGUFFile(gguf_path), gguf.GGUFReader(str(gguf_path))
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for mine, theirs in zip(ours.tensors, ref.tensors):
        assert mine.tensor_type == theirs.tensor_type
        assert mine.shape == tuple(theirs.shape.tolist())
        assert (mine.n_elements, mine.n_bytes, mine.data_offset) == \
            (theirs.n_elements, theirs.n_bytes, theirs.data_offset)
        assert mine.data.shape == theirs.data.shape and mine.data.dtype == theirs.data.dtype
        np.testing.assert_array_equal(mine.data, theirs.data)
        if mine.tensor_type != GGMLQuantizationType.I32:  # gguf.dequantize has no integer types
            np.testing.assert_array_equal(gguf.dequantize(mine.data, mine.tensor_type),
                                          gguf.dequantize(theirs.data, theirs.tensor_type))
    types = {t.name: t.tensor_type for t in ours.tensors}
    assert types["q8_0.weight"] == GGMLQuantizationType.Q8_0 and types["f32.weight"] == GGMLQuantizationType.F32


def _data_end(path) -> int:
    """Where the last tensor's data ends (the writer pads the file past it)."""
    return max(t.data_offset + t.n_bytes for t in GGUFFile(path).tensors)


def test_open_gguf_shares_a_parse_until_the_file_changes(gguf_path, tmp_path):
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(gguf_path.read_bytes())
    first = open_gguf(copy)
    again = open_gguf(str(copy))  # the same file, unchanged: its header as parsed, mapped afresh
    fresh = GGUFFile(copy)
    assert again is not first and list(again.fields) == list(fresh.fields)
    assert {key: _plain(value) for key, value in again.fields.items()} == \
        {key: _plain(value) for key, value in fresh.fields.items()}
    assert [(t.name, t.shape, t.data_offset) for t in again.tensors] == [(t.name, t.shape, t.data_offset) for t in fresh.tensors]
    for kept, made in zip(again.tensors, fresh.tensors):
        assert np.array_equal(kept.data, made.data)
    # what is kept holds no view of a mapping (the model's pages go with the model)
    header_arrays = [v for v in _kept_fields(copy) if isinstance(v, np.ndarray)]
    assert header_arrays and all(a.base is None and a.flags.owndata for a in header_arrays)  # copies, not views
    other = tmp_path / "other.gguf"
    _write(other, alignment=64)
    assert open_gguf(other).fields["general.alignment"] == 64
    copy.write_bytes(other.read_bytes())  # rewritten in place
    assert open_gguf(copy).fields["general.alignment"] == 64
    copy.write_bytes(gguf_path.read_bytes()[:100])  # now truncated: read again, and refused
    with pytest.raises(ValueError, match="truncated"):
        open_gguf(copy)


def _kept_fields(path) -> list:
    from gristmill import gguf_file

    real = str(path.resolve())
    return [value for key, header in gguf_file._PARSED if key[0] == real for value in header[0].values()]


def test_every_truncation_is_a_value_error(gguf_path, tmp_path):
    data = gguf_path.read_bytes()
    cut = tmp_path / "cut.gguf"
    for size in range(0, _data_end(gguf_path), 3):
        cut.write_bytes(data[:size])
        with pytest.raises(ValueError) as info:
            GGUFFile(cut)
        message = str(info.value)
        assert str(cut) in message, message
        assert "empty" in message or "truncated" in message or "magic" in message, message


def test_truncated_tensor_data_names_the_tensor(gguf_path, tmp_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(gguf_path.read_bytes()[:_data_end(gguf_path) - 1])
    with pytest.raises(ValueError, match=r"data of tensor 'q4_0.weight'.*truncated"):
        GGUFFile(cut)


def _patched(tmp_path, data: bytes, offset: int, fmt: str, value) -> GGUFFile:
    raw = bytearray(data)
    struct.pack_into(fmt, raw, offset, value)
    path = tmp_path / "bad.gguf"
    path.write_bytes(bytes(raw))
    return GGUFFile(path)


def test_corrupt_headers_are_value_errors(gguf_path, tmp_path):
    data = gguf_path.read_bytes()
    with pytest.raises(ValueError, match="GGUF magic"):
        _patched(tmp_path, data, 0, "<4s", b"GGML")
    with pytest.raises(ValueError, match="version 7 is not supported"):
        _patched(tmp_path, data, 4, "<I", 7)
    with pytest.raises(ValueError, match="key/value count says"):
        _patched(tmp_path, data, 16, "<Q", 2**60)
    with pytest.raises(ValueError, match="tensor count says"):
        _patched(tmp_path, data, 8, "<Q", 2**40)
    # the first key's length, then its value type
    with pytest.raises(ValueError, match="truncated"):
        _patched(tmp_path, data, 24, "<Q", 2**62)
    key_length = struct.unpack_from("<Q", data, 24)[0]
    with pytest.raises(ValueError, match="unknown value type 99"):
        _patched(tmp_path, data, 32 + key_length, "<I", 99)


def test_corrupt_string_array_count_fails_fast(gguf_path, tmp_path):
    data = gguf_path.read_bytes()
    offset = data.index(b"tokenizer.ggml.tokens") + len("tokenizer.ggml.tokens") + 4 + 4  # the count
    with pytest.raises(ValueError, match="string array 'tokenizer.ggml.tokens' says"):
        _patched(tmp_path, data, offset, "<Q", 2**61)
    with pytest.raises(ValueError, match=r"tokenizer\.ggml\.tokens\[0\].*UTF-8"):
        _patched(tmp_path, data, offset + 8 + 8, "<2s", b"\xff\xfe")


def test_big_endian_file_is_refused(tmp_path):
    path = _write(tmp_path / "be.gguf", big_endian=True)
    with pytest.raises(ValueError, match="big-endian"):
        GGUFFile(path)


def test_empty_and_missing_files(tmp_path):
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="empty"):
        GGUFFile(empty)
    with pytest.raises(FileNotFoundError):
        GGUFFile(tmp_path / "missing.gguf")
