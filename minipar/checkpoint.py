"""Checkpoint files: safetensors read/write with numpy alone, always written atomically.

safetensors layout: an 8-byte little-endian length N, then N bytes of JSON header
``{name: {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}, "__metadata__": {...}}``,
then the raw little-endian tensor bytes (offsets count from the end of the header).
"""
from __future__ import annotations

import json
import os
import struct
from typing import Any

import numpy as np

_TO_NUMPY = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I16": "<i2",
             "I8": "i1", "U8": "u1", "BOOL": "?"}
_FROM_NUMPY = {np.dtype(v).str.lstrip("<|"): k for k, v in _TO_NUMPY.items()}


def atomic_write(path: str, chunks: list[bytes | memoryview]) -> None:
    """Write to ``path.tmp-<pid>``, fsync, then rename: readers see the old file or the new, never half."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        for chunk in chunks:
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_safetensors(path: str, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> None:
    atomic_write(path, encode_safetensors(tensors, metadata))


def read_safetensors(path: str) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Return ({name: array}, metadata). BF16 tensors are widened to float32."""
    with open(path, "rb") as f:
        blob = f.read()
    return decode_safetensors(blob, path)


def encode_safetensors(tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> list[bytes]:
    """The bytes of a safetensors file, as chunks (length, header, tensor data...)."""
    header: dict[str, Any] = {"__metadata__": metadata or {"format": "pt"}}
    payload, offset = [], 0
    for name, array in tensors.items():
        array = np.ascontiguousarray(array)
        code = _FROM_NUMPY.get(array.dtype.str.lstrip("<|="))
        if code is None:
            raise TypeError(f"{name}: dtype {array.dtype} cannot be stored in safetensors here")
        raw = array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()
        header[name] = {"dtype": code, "shape": list(array.shape), "data_offsets": [offset, offset + len(raw)]}
        payload.append(raw)
        offset += len(raw)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # pad so tensor data starts 8-byte aligned
    return [struct.pack("<Q", len(head)), head, *payload]


def decode_safetensors(blob: bytes, path: str = "<bytes>") -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Parse safetensors bytes; ``path`` only names the source in errors."""
    if len(blob) < 8:
        raise ValueError(f"{path}: not a safetensors file (only {len(blob)} bytes)")
    (n,) = struct.unpack("<Q", blob[:8])
    if 8 + n > len(blob):
        raise ValueError(f"{path}: truncated safetensors header (needs {n} bytes, file has {len(blob) - 8})")
    header = json.loads(blob[8:8 + n])
    metadata = header.pop("__metadata__", {}) or {}
    data = memoryview(blob)[8 + n:]
    tensors = {}
    for name, info in header.items():
        begin, end = info["data_offsets"]
        if end > len(data):
            raise ValueError(f"{path}: tensor {name} runs past the end of the file (truncated?)")
        dtype = info["dtype"]
        if dtype == "BF16":
            bits = np.frombuffer(data[begin:end], dtype="<u2").astype(np.uint32) << 16
            array = bits.view(np.float32)
        elif dtype in _TO_NUMPY:
            array = np.frombuffer(data[begin:end], dtype=_TO_NUMPY[dtype]).copy()
        else:
            raise TypeError(f"{path}: tensor {name} has unsupported dtype {dtype}")
        tensors[name] = array.reshape(info["shape"])
    return tensors, metadata
