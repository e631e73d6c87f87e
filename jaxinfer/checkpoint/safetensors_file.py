"""Reading and writing the safetensors file format with numpy and ml_dtypes (memory-mapped,
never copied whole; errors name the file and the tensor). See docs/cli.md#model-directories.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping

import ml_dtypes
import numpy as np

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32), "I16": np.dtype(np.int16), "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
NAMES = {v: k for k, v in DTYPES.items()}
MAX_HEADER_BYTES = 100 * 1024 * 1024


class SafetensorsError(ValueError):
    """A safetensors file that cannot be read as written."""


def read_header(path: str | os.PathLike) -> tuple[dict[str, dict], int]:
    """The tensor entries of a file and the byte offset where its data starts."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise SafetensorsError(f"{path}: too short to be a safetensors file ({size} bytes)")
        (header_len,) = struct.unpack("<Q", raw)
        if header_len > min(size - 8, MAX_HEADER_BYTES):
            raise SafetensorsError(
                f"{path}: header length {header_len} does not fit in a {size}-byte file")
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise SafetensorsError(f"{path}: header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: header is not a JSON object")
    header.pop("__metadata__", None)
    data_start = 8 + header_len
    for name, entry in header.items():
        _check_entry(path, name, entry, size - data_start)
    return header, data_start


def _check_entry(path: str | os.PathLike, name: str, entry: dict, data_size: int) -> None:
    try:
        dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
    except (KeyError, TypeError, ValueError):
        raise SafetensorsError(f"{path}: tensor {name!r} has a malformed entry") from None
    if dtype not in DTYPES:
        raise SafetensorsError(
            f"{path}: tensor {name!r} has unsupported dtype {dtype!r}; known: {sorted(DTYPES)}")
    nbytes = int(np.prod(shape, dtype=np.int64)) * DTYPES[dtype].itemsize
    if not 0 <= begin <= end <= data_size or end - begin != nbytes:
        raise SafetensorsError(
            f"{path}: tensor {name!r} data [{begin}, {end}) does not hold {dtype}{shape} "
            f"within {data_size} data bytes (file truncated or corrupt?)")


def load(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """All tensors of a file as read-only memory-mapped numpy arrays."""
    header, data_start = read_header(path)
    if not header:
        return {}
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=data_start)
    out = {}
    for name, entry in header.items():
        begin, end = entry["data_offsets"]
        dtype = DTYPES[entry["dtype"]]
        out[name] = data[begin:end].view(dtype).reshape(entry["shape"])
    return out


def save(tensors: Mapping[str, np.ndarray], path: str | os.PathLike,
         metadata: Mapping[str, str] | None = None) -> None:
    """Write tensors (C order) to `path` in the safetensors format."""
    header: dict[str, dict] = {}
    arrays, offset = [], 0
    for name in sorted(tensors):
        array = np.ascontiguousarray(tensors[name])
        if array.dtype not in NAMES:
            raise SafetensorsError(f"tensor {name!r}: dtype {array.dtype} cannot be saved")
        header[name] = {"dtype": NAMES[array.dtype], "shape": list(array.shape),
                        "data_offsets": [offset, offset + array.nbytes]}
        arrays.append(array)
        offset += array.nbytes
    if metadata:
        header["__metadata__"] = dict(metadata)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for array in arrays:
            f.write(array.tobytes())
