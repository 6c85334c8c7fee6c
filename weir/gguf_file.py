"""Reads a GGUF file's header: chosen metadata values and the tensor index, without parsing the rest.

The layout is GGUF v2/v3's (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md): the magic
``GGUF``, the version (uint32), the tensor and key/value counts (uint64 each), the key/value pairs,
one tensor info per tensor (name, number of dimensions, dimensions, ggml type, offset), then the
tensor data from the next multiple of ``general.alignment`` (32 when absent). Little-endian only.

Why not ``gguf.GGUFReader``: it builds a numpy view for every part of every metadata value, one per
string of each array, before it can hand out a tensor. A vocabulary is such an array: Gemma 3's
262,144 tokens (with scores and types) took 17.8 s through ``GGUFReader`` on this repository's
2-core test machine, and SmolLM2's 49,152 took 3.5 s; this module skips arrays by their lengths. The
tensors it indexes are de-quantized with ``gguf``'s own ``dequantize`` (:mod:`weir.engine.weight_loader`).

Importing it is light (``struct`` only); numpy and ``gguf`` are imported when tensors are indexed.
"""

from __future__ import annotations

import contextlib
import os
import struct
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable, Iterator

GGUF_MAGIC = b"GGUF"
GGUF_DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4
"""ggml's ``GGML_MAX_DIMS``: a tensor info with more dimensions is a corrupt header."""
# GGUF metadata value types -> struct format of one scalar (8 = string, 9 = array are special).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file, as ``gguf.GGUFReader`` gives it.

    Attributes:
        name: the GGUF tensor name (``blk.0.attn_q.weight``).
        tensor_type: its ``gguf.GGMLQuantizationType``.
        shape: GGUF's dimension order (innermost first), as the file states it.
        data: a read-only view of the memory-mapped file: the elements in their numpy dtype, shaped
            ``reversed(shape)``, for F16/F32/F64/I8-I64; else uint8 bytes shaped by
            ``gguf.quant_shape_to_byte_shape`` (what ``gguf.quants.dequantize`` takes).
    """

    name: str
    tensor_type: Any
    shape: tuple[int, ...]
    data: Any


class _CorruptHeader(Exception):
    """The header contradicts itself or the file's size (reported as a ValueError naming the file)."""


def _read(f: BinaryIO, num_bytes: int, size: int) -> bytes:
    if num_bytes > size - f.tell():
        raise _CorruptHeader(f"{num_bytes} bytes asked for at offset {f.tell()} run past the end of the file")
    return f.read(num_bytes)


def _unpack(fmt: str, f: BinaryIO, size: int) -> tuple:
    return struct.unpack(fmt, _read(f, struct.calcsize(fmt), size))


def _read_value(f: BinaryIO, value_type: int, size: int) -> Any:
    """One metadata value; an array is skipped without decoding and stands as its length."""
    if value_type == _STRING:
        (length,) = _unpack("<Q", f, size)
        return _read(f, length, size).decode("utf-8", errors="replace")
    if value_type == _ARRAY:
        item_type, count = _unpack("<IQ", f, size)
        if item_type in _SCALARS:
            skip = count * struct.calcsize("<" + _SCALARS[item_type])
            if skip > size - f.tell():
                raise _CorruptHeader(f"an array of {count} values at offset {f.tell()} runs past the end of the file")
            f.seek(skip, os.SEEK_CUR)
        elif item_type == _STRING:
            for _ in range(count):
                (length,) = _unpack("<Q", f, size)
                if length > size - f.tell():
                    raise _CorruptHeader(f"a string of {length} bytes at offset {f.tell()} runs past the end of the file")
                f.seek(length, os.SEEK_CUR)
        else:
            for _ in range(count):
                _read_value(f, item_type, size)
        return count
    if value_type not in _SCALARS:
        raise _CorruptHeader(f"unknown metadata value type {value_type} at offset {f.tell() - 4}")
    return _unpack("<" + _SCALARS[value_type], f, size)[0]


def _read_header(f: BinaryIO, path: str, wanted: Callable[[str], bool]) -> tuple[dict[str, Any], int, int]:
    """The wanted metadata values, the number of tensors and the file's size; ``f`` is left at the
    tensor infos."""
    size = os.fstat(f.fileno()).st_size
    if f.read(4) != GGUF_MAGIC:
        raise ValueError(f"{path} is not a GGUF file")
    version, num_tensors, num_kv = _unpack("<IQQ", f, size)
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not read (versions 2 and 3 are, little-endian)")
    found = {}
    for _ in range(num_kv):
        key = _read_value(f, _STRING, size)
        (value_type,) = _unpack("<I", f, size)
        value = _read_value(f, value_type, size)
        if wanted(key):
            found[key] = value
    return found, num_tensors, size


@contextlib.contextmanager
def _named_errors(path: str) -> Iterator[None]:
    """A header that runs past the end of the file or contradicts itself, as one ValueError naming it."""
    try:
        yield
    except (_CorruptHeader, struct.error, OverflowError, MemoryError) as e:
        raise ValueError(f"{path}: truncated or corrupt GGUF header ({e or type(e).__name__})") from None


def read_metadata(path: str, wanted: Callable[[str], bool]) -> dict[str, Any]:
    """The metadata values whose keys ``wanted`` accepts (an array as its length).

    Raises:
        ValueError: the file is not GGUF v2/v3, or its header is truncated or corrupt (naming it).
    """
    with open(path, "rb") as f, _named_errors(path):
        return _read_header(f, path, wanted)[0]


def read_tensors(path: str) -> tuple[dict[str, Any], list[GGUFTensor]]:
    """The file's ``general.*`` metadata and its tensors, in the file's order, each a view of the
    memory-mapped file (nothing is read until a tensor's data is).

    Raises:
        ValueError: naming the file: it is not GGUF v2/v3, its header is truncated or corrupt, its
            alignment is not a power of two, a tensor name repeats, or a tensor lies past the end
            of the file.
    """
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quant_shape_to_byte_shape

    plain = {GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
             GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
             GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
             GGMLQuantizationType.I64: np.int64}
    infos = []
    with open(path, "rb") as f, _named_errors(path):
        general, num_tensors, size = _read_header(f, path, lambda key: key.startswith("general."))
        for _ in range(num_tensors):
            name = _read_value(f, _STRING, size)
            (num_dims,) = _unpack("<I", f, size)
            if num_dims > MAX_DIMS:
                raise _CorruptHeader(f"tensor {name!r} has {num_dims} dimensions (at most {MAX_DIMS})")
            shape = _unpack(f"<{num_dims}Q", f, size)
            tensor_type, offset = _unpack("<IQ", f, size)
            try:
                infos.append((name, shape, GGMLQuantizationType(tensor_type), offset))
            except ValueError:
                raise _CorruptHeader(f"tensor {name!r} has an unknown ggml type {tensor_type}") from None
        position = f.tell()
    alignment = int(general.get("general.alignment", GGUF_DEFAULT_ALIGNMENT))
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"{path}: general.alignment={alignment} is not a power of two")
    data_start = -(-position // alignment) * alignment
    file_bytes = np.memmap(path, mode="r")
    tensors, names = [], set()
    for name, shape, tensor_type, offset in infos:
        if name in names:
            raise ValueError(f"{path}: tensor {name!r} appears twice")
        names.add(name)
        num_elements = 1
        for dim in shape:
            num_elements *= dim
        np_shape = tuple(reversed(shape))
        if tensor_type in plain:
            dtype = np.dtype(plain[tensor_type])
            num_bytes = num_elements * dtype.itemsize
        else:
            block_size, type_size = GGML_QUANT_SIZES[tensor_type]
            dtype, num_bytes = np.dtype(np.uint8), num_elements * type_size // block_size
            try:
                np_shape = quant_shape_to_byte_shape(np_shape, tensor_type)
            except ValueError as e:
                raise ValueError(f"{path}: tensor {name!r}: {e}") from None
        start = data_start + offset
        if start + num_bytes > len(file_bytes):
            raise ValueError(f"{path}: tensor {name!r} lies past the end of the file (truncated?)")
        data = file_bytes[start:start + num_bytes].view(dtype).reshape(np_shape)
        tensors.append(GGUFTensor(name, tensor_type, shape, data))
    return general, tensors
