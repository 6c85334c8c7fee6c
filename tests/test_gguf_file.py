"""The GGUF header reader: the same tensors as ``gguf.GGUFReader``, and clear errors on bad files."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import quantize

from weir.gguf_file import read_metadata, read_tensors
from weir.model_source import default_model_path


def _assert_same_tensors(path: str) -> int:
    general, tensors = read_tensors(path)
    reader = GGUFReader(path)
    assert general["general.architecture"] == reader.get_field("general.architecture").contents()
    assert [t.name for t in tensors] == [t.name for t in reader.tensors]
    for ours, theirs in zip(tensors, reader.tensors):
        assert ours.tensor_type == theirs.tensor_type, ours.name
        assert ours.shape == tuple(theirs.shape.tolist()), ours.name
        assert (ours.data.dtype, ours.data.shape) == (theirs.data.dtype, theirs.data.shape), ours.name
        assert np.array_equal(ours.data, theirs.data), ours.name
    return len(tensors)


def _write(path, alignment=None, truncate_bytes=0):
    rng = np.random.default_rng(0)
    writer = GGUFWriter(str(path), arch="llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_context_length(96)
    writer.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(300)])
    writer.add_tensor("a.weight", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("b.weight", rng.standard_normal((2, 7)).astype(np.float16))
    q8 = rng.standard_normal((4, 64)).astype(np.float32)
    writer.add_tensor("c.weight", quantize(q8, GGMLQuantizationType.Q8_0), raw_dtype=GGMLQuantizationType.Q8_0)
    writer.add_tensor("d.bias", np.arange(6, dtype=np.int32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if truncate_bytes:
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size - truncate_bytes)


@pytest.mark.parametrize("alignment", [None, 64])
def test_a_written_file_reads_as_gguf_reads_it(tmp_path, alignment):
    path = tmp_path / "m.gguf"
    _write(path, alignment)
    assert _assert_same_tensors(str(path)) == 4
    assert read_metadata(str(path), lambda key: key in ("llama.context_length", "tokenizer.ggml.tokens")) == {
        "llama.context_length": 96, "tokenizer.ggml.tokens": 300}


def test_the_packaged_model_reads_as_gguf_reads_it():
    assert _assert_same_tensors(default_model_path()) == 272


def test_a_truncated_file_is_refused_naming_the_tensor(tmp_path):
    path = tmp_path / "m.gguf"
    _write(path, truncate_bytes=16)  # the last tensor: 24 bytes, padded to 32
    with pytest.raises(ValueError, match=r"m\.gguf: tensor 'd\.bias' lies past the end of the file"):
        read_tensors(str(path))


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGML" + bytes(64))
    with pytest.raises(ValueError, match="is not a GGUF file"):
        read_tensors(str(path))
    path.write_bytes(b"GGUF" + (7).to_bytes(4, "little") + bytes(16))
    with pytest.raises(ValueError, match="GGUF version 7 is not read"):
        read_metadata(str(path), lambda key: True)


@pytest.mark.parametrize("cut", [30, 200, 700])  # inside a key, inside the token array, inside the tensor index
def test_a_header_cut_short_is_refused_naming_the_file(tmp_path, cut):
    path = tmp_path / "m.gguf"
    _write(path)
    with open(path, "r+b") as f:
        f.truncate(cut)
    for read in (read_tensors, lambda p: read_metadata(p, lambda key: True)):
        with pytest.raises(ValueError, match=r"m\.gguf: truncated or corrupt GGUF header \(.*past the end of the file"):
            read(str(path))


def test_a_corrupt_length_or_type_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "m.gguf"
    _write(path)
    data = bytearray(path.read_bytes())
    first_key_length = 24  # magic, version, tensor count, key/value count
    broken = data[:first_key_length] + struct.pack("<Q", 2 ** 40) + data[first_key_length + 8:]
    path.write_bytes(broken)
    with pytest.raises(ValueError, match=r"m\.gguf: truncated or corrupt GGUF header \(1099511627776 bytes"):
        read_metadata(str(path), lambda key: True)
    _write(path)
    assert len(read_tensors(str(path))[1]) == 4
    type_at = bytes(data).index(b"d.bias") + len(b"d.bias") + 4 + 8  # after the name, num_dims, one dim
    path.write_bytes(bytes(data[:type_at]) + struct.pack("<I", 99) + bytes(data[type_at + 4:]))
    with pytest.raises(ValueError, match=r"m\.gguf: truncated or corrupt GGUF header \(tensor 'd\.bias' has an "
                                         r"unknown ggml type 99\)"):
        read_tensors(str(path))


def test_a_half_downloaded_model_is_refused_before_transformers_reads_it(tmp_path):
    from weir.engine.loader import load_config
    from weir.model_source import resolve_model

    path = tmp_path / "half.gguf"
    with open(default_model_path(), "rb") as src, open(path, "wb") as dst:
        dst.write(src.read(os.path.getsize(default_model_path()) // 2))
    with pytest.raises(ValueError, match=r"half\.gguf: tensor '.*' lies past the end of the file \(truncated\?\)"):
        load_config(resolve_model(str(path)))
