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

import os
import struct
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable

GGUF_MAGIC = b"GGUF"
GGUF_DEFAULT_ALIGNMENT = 32
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


def _read_value(f: BinaryIO, value_type: int) -> Any:
    """One metadata value; an array is skipped without decoding and stands as its length."""
    if value_type == _STRING:
        (length,) = struct.unpack("<Q", f.read(8))
        return f.read(length).decode("utf-8", errors="replace")
    if value_type == _ARRAY:
        item_type, count = struct.unpack("<IQ", f.read(12))
        if item_type in _SCALARS:
            f.seek(count * struct.calcsize("<" + _SCALARS[item_type]), os.SEEK_CUR)
        elif item_type == _STRING:
            for _ in range(count):
                (length,) = struct.unpack("<Q", f.read(8))
                f.seek(length, os.SEEK_CUR)
        else:
            for _ in range(count):
                _read_value(f, item_type)
        return count
    if value_type not in _SCALARS:
        raise ValueError(f"unknown GGUF metadata value type {value_type}")
    fmt = "<" + _SCALARS[value_type]
    return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]


def _read_header(f: BinaryIO, path: str, wanted: Callable[[str], bool]) -> tuple[dict[str, Any], int]:
    """The wanted metadata values and the number of tensors; ``f`` is left at the tensor infos."""
    if f.read(4) != GGUF_MAGIC:
        raise ValueError(f"{path} is not a GGUF file")
    version, num_tensors, num_kv = struct.unpack("<IQQ", f.read(20))
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not read (versions 2 and 3 are)")
    found = {}
    for _ in range(num_kv):
        key = _read_value(f, _STRING)
        (value_type,) = struct.unpack("<I", f.read(4))
        value = _read_value(f, value_type)
        if wanted(key):
            found[key] = value
    return found, num_tensors


def read_metadata(path: str, wanted: Callable[[str], bool]) -> dict[str, Any]:
    """The metadata values whose keys ``wanted`` accepts (an array as its length).

    Raises:
        ValueError: the file is not GGUF v2/v3.
    """
    with open(path, "rb") as f:
        return _read_header(f, path, wanted)[0]


def read_tensors(path: str) -> tuple[dict[str, Any], list[GGUFTensor]]:
    """The file's ``general.*`` metadata and its tensors, in the file's order, each a view of the
    memory-mapped file (nothing is read until a tensor's data is).

    Raises:
        ValueError: the file is not GGUF v2/v3, its alignment is not a power of two, a tensor name
            repeats, or a tensor lies past the end of the file.
    """
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quant_shape_to_byte_shape

    plain = {GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
             GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
             GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
             GGMLQuantizationType.I64: np.int64}
    infos = []
    with open(path, "rb") as f:
        general, num_tensors = _read_header(f, path, lambda key: key.startswith("general."))
        for _ in range(num_tensors):
            name = _read_value(f, _STRING)
            (num_dims,) = struct.unpack("<I", f.read(4))
            shape = struct.unpack(f"<{num_dims}Q", f.read(8 * num_dims))
            tensor_type, offset = struct.unpack("<IQ", f.read(12))
            infos.append((name, shape, GGMLQuantizationType(tensor_type), offset))
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
            np_shape = quant_shape_to_byte_shape(np_shape, tensor_type)
        start = data_start + offset
        if start + num_bytes > len(file_bytes):
            raise ValueError(f"{path}: tensor {name!r} lies past the end of the file (truncated?)")
        data = file_bytes[start:start + num_bytes].view(dtype).reshape(np_shape)
        tensors.append(GGUFTensor(name, tensor_type, shape, data))
    return general, tensors
