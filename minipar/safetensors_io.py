"""safetensors files with numpy alone, written atomically; Hugging Face's sharded weight directories.

This is file-format code at the bottom of the import graph (it imports numpy and nothing of minipar),
so the model, the pipeline, the tracer and the sharded training checkpoint can all use it.

Why not the ``safetensors`` package: the format is a length, a JSON header and raw bytes — forty
lines of numpy that a learner can read — while the package's numpy API cannot write bfloat16
from numpy nor stream chunks through :func:`atomic_write`, and would be one more dependency.

Layout: an 8-byte little-endian length N, then N bytes of JSON header
``{name: {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}, "__metadata__": {...}}``,
then the raw little-endian tensor bytes (offsets count from the end of the header). The tensors
tile the data section exactly: no gaps, no overlap, no trailing bytes (decoding refuses any of these).

A large model is stored as several files plus ``model.safetensors.index.json``
(``{"metadata": {"total_size": bytes}, "weight_map": {name: file}}``), as transformers writes it.
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
_ITEMSIZE = {**{k: np.dtype(v).itemsize for k, v in _TO_NUMPY.items()}, "BF16": 2}

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 50 * 10**9  # transformers' save_pretrained default, max_shard_size="50GB" (test_transformers)


def atomic_write(path: str, chunks: list[bytes | memoryview]) -> None:
    """Write to ``path.tmp-<pid>``, fsync, then rename: readers see the old file or the new, never half.
    On any error the temporary file is removed, so a failed write leaves nothing behind; an OSError names ``path``
    (its ``filename``: a failed ``write`` names no file, a failed open or rename the temporary)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.lexists(tmp) and not os.path.isdir(tmp):
            os.remove(tmp)
        if isinstance(e, OSError):
            e.filename, e.filename2 = path, None
        raise


def encode_safetensors(tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> list[bytes]:
    """The bytes of a safetensors file, as chunks (length, header, tensor data...)."""
    head, stored = _layout(tensors, metadata)
    payload = [array.view(np.uint16).astype("<u2", copy=False).tobytes() if code == "BF16"  # bfloat16's 16 bits
               else array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()
               for array, code in stored]
    return [struct.pack("<Q", len(head)), head, *payload]


def encode_into(tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None,
                buffer: np.ndarray | None = None) -> np.ndarray:
    """The bytes of a safetensors file as one uint8 array, written into ``buffer`` when it has the right size (a
    checkpoint's staging buffer, reused from save to save: no allocation, no page faults) — one copy of each
    tensor, and one write and one hash of the result."""
    head, stored = _layout(tensors, metadata)
    size = 8 + len(head) + sum(array.nbytes for array, _ in stored)
    out = buffer if buffer is not None and buffer.shape == (size,) else np.empty(size, np.uint8)
    out[:8] = np.frombuffer(struct.pack("<Q", len(head)), np.uint8)
    out[8:8 + len(head)] = np.frombuffer(head, np.uint8)
    offset = 8 + len(head)
    for array, code in stored:
        dtype = np.dtype("<u2") if code == "BF16" else array.dtype.newbyteorder("<")
        np.copyto(out[offset:offset + array.nbytes].view(dtype).reshape(array.shape),
                  array.view(np.uint16) if code == "BF16" else array)
        offset += array.nbytes
    return out


def _layout(tensors: dict[str, np.ndarray], metadata: dict[str, str] | None) -> tuple[bytes, list[tuple[np.ndarray, str]]]:
    """A safetensors header (padded to 8 bytes) and each tensor, contiguous, with its dtype code, in file order."""
    header: dict[str, Any] = {"__metadata__": metadata or {"format": "pt"}}
    stored, offset = [], 0
    for name, array in tensors.items():
        array = np.ascontiguousarray(array)
        code = "BF16" if array.dtype.name == "bfloat16" else _FROM_NUMPY.get(array.dtype.str.lstrip("<|="))
        if code is None:
            raise TypeError(f"{name}: dtype {array.dtype} cannot be stored in safetensors here")
        header[name] = {"dtype": code, "shape": list(array.shape), "data_offsets": [offset, offset + array.nbytes]}
        stored.append((array, code))
        offset += array.nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    return head + b" " * (-len(head) % 8), stored  # padded so tensor data starts 8-byte aligned


def decode_safetensors(blob: bytes, path: str = "<bytes>") -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Parse safetensors bytes into ({name: array}, metadata); BF16 is widened to float32.
    ``path`` names the source in every error, with the tensor concerned."""
    if len(blob) < 8:
        raise ValueError(f"{path}: not a safetensors file (only {len(blob)} bytes)")
    (n,) = struct.unpack("<Q", blob[:8])
    if 8 + n > len(blob):
        raise ValueError(f"{path}: truncated safetensors header (needs {n} bytes, file has {len(blob) - 8})")
    try:
        header = json.loads(blob[8:8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: unreadable safetensors header ({e})") from None
    metadata = header.pop("__metadata__", {}) or {}
    data = memoryview(blob)[8 + n:]
    tensors, spans = {}, []
    for name, info in header.items():
        dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
        if dtype not in _ITEMSIZE:
            raise ValueError(f"{path}: tensor {name} has unsupported dtype {dtype}")
        if end > len(data):
            raise ValueError(f"{path}: tensor {name} runs past the end of the file (truncated?)")
        expected = int(np.prod(shape, dtype=np.int64)) * _ITEMSIZE[dtype]
        if end - begin != expected:
            raise ValueError(f"{path}: tensor {name} is {dtype} {shape} ({expected} bytes) but its data_offsets "
                             f"span {end - begin} bytes")
        if dtype == "BF16":
            array = (np.frombuffer(data[begin:end], dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            array = np.frombuffer(data[begin:end], dtype=_TO_NUMPY[dtype]).copy()
        tensors[name] = array.reshape(shape)
        spans.append((begin, end, name))
    position = 0
    for begin, end, name in sorted(spans):
        if begin != position:
            raise ValueError(f"{path}: tensor {name} starts at byte {begin} of the data, expected {position} "
                             f"(overlapping or gapped offsets)")
        position = end
    if position != len(data):
        raise ValueError(f"{path}: {len(data) - position} trailing bytes after the last tensor")
    return tensors, metadata


def read_safetensors(path: str) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Return ({name: array}, metadata) of one file. BF16 tensors are widened to float32."""
    with open(path, "rb") as f:
        blob = f.read()
    return decode_safetensors(blob, path)


def write_safetensors(path: str, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> None:
    atomic_write(path, encode_safetensors(tensors, metadata))


# ------------------------------------------------------------------ Hugging Face weight directories


def read_hf_weights(directory: str) -> dict[str, np.ndarray]:
    """Every tensor of ``directory/model.safetensors``, or of the shards its ``.index.json`` lists."""
    single, index = os.path.join(directory, WEIGHTS_NAME), os.path.join(directory, INDEX_NAME)
    if os.path.isfile(single):
        return read_safetensors(single)[0]
    if not os.path.isfile(index):
        raise FileNotFoundError(f"{directory}: neither {WEIGHTS_NAME} nor {INDEX_NAME} (sharded) is there")
    try:
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{index}: not a safetensors index ({e!r})") from None
    tensors: dict[str, np.ndarray] = {}
    for file in sorted(set(weight_map.values())):
        path = os.path.join(directory, file)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{index}: lists {file}, which is missing")
        part = read_safetensors(path)[0]
        stray = [name for name in part if weight_map.get(name) != file]
        if stray:
            raise ValueError(f"{path}: holds {stray[0]}, which {INDEX_NAME} places elsewhere")
        tensors.update(part)
    missing = sorted(set(weight_map) - set(tensors))
    if missing:
        raise ValueError(f"{index}: {missing[0]} is listed but in none of the shards")
    return tensors


def stored_dtypes(directory: str) -> set[str]:
    """The safetensors dtype codes ("F32", "F64", "BF16", ...) of the weights in ``directory``, read from the headers
    alone (8 bytes of length, then the JSON): what a config without a dtype key was saved in. Empty if unreadable."""
    single, index = os.path.join(directory, WEIGHTS_NAME), os.path.join(directory, INDEX_NAME)
    try:
        if os.path.isfile(single):
            files = [single]
        else:
            with open(index, encoding="utf-8") as f:
                files = [os.path.join(directory, n) for n in sorted(set(json.load(f)["weight_map"].values()))]
        codes = set()
        for path in files:
            with open(path, "rb") as f:
                header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
            codes |= {info["dtype"] for name, info in header.items() if name != "__metadata__"}
        return codes
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return set()


def write_hf_weights(directory: str, tensors: dict[str, np.ndarray],
                     max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> list[str]:
    """Write ``model.safetensors``, or — when the tensors exceed ``max_shard_bytes`` — shards
    ``model-0000k-of-0000n.safetensors`` filled in order up to the limit, plus the index. Weight files
    of the other form left over from an earlier save are removed, so a reader never mixes the two.
    Returns the file names written."""
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, array in tensors.items():
        if shards[-1] and size + array.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = array
        size += array.nbytes
    if len(shards) == 1:
        names = [WEIGHTS_NAME]
    else:
        names = [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    for file, shard in zip(names, shards):
        write_safetensors(os.path.join(directory, file), shard)
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(a.nbytes for a in tensors.values())},
                 "weight_map": {name: file for file, shard in zip(names, shards) for name in shard}}
        atomic_write(os.path.join(directory, INDEX_NAME), [json.dumps(index, indent=2).encode()])
    for stale in os.listdir(directory):
        is_weights = stale == WEIGHTS_NAME or stale == INDEX_NAME or (stale.startswith("model-") and stale.endswith(".safetensors"))
        if is_weights and stale not in names and not (stale == INDEX_NAME and len(shards) > 1):
            os.remove(os.path.join(directory, stale))
    return names + ([INDEX_NAME] if len(shards) > 1 else [])
