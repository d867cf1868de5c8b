"""Checkpoint files: safetensors read/write with numpy alone, always written atomically, and the
sharded training checkpoints (save in one parallel layout, load into any other).

safetensors layout: an 8-byte little-endian length N, then N bytes of JSON header
``{name: {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}, "__metadata__": {...}}``,
then the raw little-endian tensor bytes (offsets count from the end of the header).
"""
from __future__ import annotations

import dataclasses
import hashlib
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


# ------------------------------------------------------------------- sharded training checkpoints
#
#   DIR/step_000010/pp0-tp0.safetensors   one file per (pipeline stage, tensor-parallel rank), written by
#   DIR/step_000010/pp0-tp1.safetensors   data-parallel rank 0 of that group: the group's parameters and
#   ...                                   Adam moments ("param/<name>", "exp_avg/<name>", "exp_avg_sq/<name>"),
#   DIR/step_000010/manifest.json         whole over ZeRO shards, sliced as that tp rank holds them.
#   DIR/latest                            The manifest (size + sha256 of every file) is written last, then
#                                         `latest`: a step without a manifest is an interrupted save.
#
# Loading merges the slices into full tensors, so a checkpoint restarts in any dp/tp/pp/zero layout.

CHECKPOINT_FORMAT = "minipar-checkpoint-1"
STATE_KINDS = ("param", "exp_avg", "exp_avg_sq")


@dataclasses.dataclass
class Checkpoint:
    path: str
    step: int
    optimizer_step: int
    config: Any
    layout: dict[str, int]
    params: dict[str, np.ndarray]
    exp_avg: dict[str, np.ndarray]
    exp_avg_sq: dict[str, np.ndarray]

    @property
    def layout_name(self) -> str:
        lay = self.layout
        return f"dp{lay['dp']}·tp{lay['tp']}·pp{lay['pp']}" + (f" zero-{lay['zero']}" if lay["zero"] else "")


def save_checkpoint(root: str, step: int, state: dict[str, dict[str, np.ndarray]] | None, mesh: Any, config: Any,
                    zero: int, optimizer_step: int) -> str:
    """Write this rank's share of a checkpoint (``state`` is None on ranks that hold duplicates); all ranks call.

    ``state`` maps each of STATE_KINDS to this rank's tensors by global parameter name.
    """
    world = mesh.world
    step_dir = os.path.join(root, f"step_{step:06d}")
    os.makedirs(step_dir, exist_ok=True)
    record = b""
    if state is not None:
        name = f"pp{mesh.pp_rank}-tp{mesh.tp_rank}.safetensors"
        tensors = {f"{kind}/{n}": np.asarray(a) for kind in STATE_KINDS for n, a in state[kind].items()}
        chunks = encode_safetensors(tensors, {"pp_rank": str(mesh.pp_rank), "tp_rank": str(mesh.tp_rank)})
        atomic_write(os.path.join(step_dir, name), chunks)
        digest = hashlib.sha256()
        for chunk in chunks:
            digest.update(chunk)
        record = json.dumps({"file": name, "bytes": sum(len(c) for c in chunks), "sha256": digest.hexdigest(),
                             "pp_rank": mesh.pp_rank, "tp_rank": mesh.tp_rank}).encode()
    records = [json.loads(r) for r in world.all_gather_bytes(record, label="checkpoint") if r]
    if world.rank == 0:
        manifest = {"format": CHECKPOINT_FORMAT, "step": step, "optimizer_step": optimizer_step,
                    "config": dataclasses.asdict(config),
                    "layout": {"dp": mesh.dp, "tp": mesh.tp, "pp": mesh.pp, "zero": zero}, "files": records}
        atomic_write(os.path.join(step_dir, "manifest.json"), [json.dumps(manifest, indent=1).encode()])
        atomic_write(os.path.join(root, "latest"), [f"step_{step:06d}\n".encode()])
    world.barrier()
    return step_dir


def _resolve(path: str) -> str:
    if os.path.isfile(os.path.join(path, "manifest.json")):
        return path
    latest = os.path.join(path, "latest")
    if os.path.isfile(latest):
        with open(latest) as f:
            return os.path.join(path, f.read().strip())
    if os.path.isdir(path) and os.path.basename(os.path.normpath(path)).startswith("step_"):
        raise FileNotFoundError(f"{path}: incomplete checkpoint (no manifest.json): its save was interrupted")
    raise FileNotFoundError(f"{path}: no checkpoint here (expected DIR/latest or DIR/step_NNNNNN/manifest.json)")


def load_checkpoint(path: str) -> Checkpoint:
    """Read, verify (presence, size, sha256 of every shard) and merge a checkpoint into full tensors."""
    from minipar.models.gpt import GPTConfig
    from minipar.parallel.tensor_parallel import merge_state_dicts

    step_dir = _resolve(path)
    with open(os.path.join(step_dir, "manifest.json")) as f:
        manifest = json.load(f)
    if manifest.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{step_dir}: not a {CHECKPOINT_FORMAT} checkpoint (format {manifest.get('format')!r})")
    layout, config = manifest["layout"], GPTConfig(**manifest["config"])
    by_position = {}
    for entry in manifest["files"]:
        file = os.path.join(step_dir, entry["file"])
        if not os.path.isfile(file):
            raise FileNotFoundError(f"checkpoint {step_dir}: shard {entry['file']} is missing")
        with open(file, "rb") as f:
            blob = f.read()
        if len(blob) != entry["bytes"]:
            raise ValueError(f"checkpoint {step_dir}: shard {entry['file']} has {len(blob)} bytes, "
                             f"the manifest says {entry['bytes']} (truncated?)")
        if hashlib.sha256(blob).hexdigest() != entry["sha256"]:
            raise ValueError(f"checkpoint {step_dir}: shard {entry['file']} is corrupted (sha256 mismatch)")
        by_position[(entry["pp_rank"], entry["tp_rank"])] = decode_safetensors(blob, file)[0]
    expected = {(p, t) for p in range(layout["pp"]) for t in range(layout["tp"])}
    if set(by_position) != expected:
        raise FileNotFoundError(f"checkpoint {step_dir}: shards for {sorted(expected - set(by_position))} are missing")
    full: dict[str, dict[str, np.ndarray]] = {kind: {} for kind in STATE_KINDS}
    for kind in STATE_KINDS:
        prefix = kind + "/"
        for stage in range(layout["pp"]):
            slices = [{k[len(prefix):]: v for k, v in by_position[(stage, t)].items() if k.startswith(prefix)}
                      for t in range(layout["tp"])]
            full[kind].update(merge_state_dicts(slices, config) if layout["tp"] > 1 else slices[0])
    return Checkpoint(step_dir, manifest["step"], manifest["optimizer_step"], config, layout,
                      full["param"], full["exp_avg"], full["exp_avg_sq"])
