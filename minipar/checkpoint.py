"""Sharded training checkpoints: save in one parallel layout, load into any other.

This module sits above the model and ``parallel/`` (it merges tensor-parallel slices); the file
format itself lives below everything, in :mod:`minipar.safetensors_io`.
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import hashlib
import json
import os
import shutil
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from minipar.models import config_from_dict
from minipar.parallel.layout import Layout
from minipar.parallel.tensor_parallel import merge_state_dicts
from minipar.placement import REPLICATED
from minipar.data import TOKENIZER_FILES, save_tokenizer
from minipar.safetensors_io import atomic_write, decode_safetensors, encode_into

if TYPE_CHECKING:  # annotations only
    from minipar.comm import Communicator
    from minipar.models.gpt import GPT
    from minipar.optim import LossScaler
    from minipar.parallel.local_sgd import LocalSGD
    from minipar.parallel.mesh import Mesh

# ------------------------------------------------------------------- sharded training checkpoints
#
#   DIR/step_000010/pp0-tp0.safetensors   one file per (pipeline stage, tensor-parallel rank), written by
#   DIR/step_000010/pp0-tp1.safetensors   data-parallel rank 0 of that group: the group's parameters and
#   ...                                   Adam moments ("param/<name>", "exp_avg/<name>", "exp_avg_sq/<name>"),
#   DIR/step_000010/manifest.json         whole over ZeRO shards and expert-parallel ranks, sliced as
#                                         that tp rank holds them.
#   DIR/step_000010/rank00003.safetensors state only that rank holds (error feedback of --compression), one
#                                         file per rank, when there is any; it resumes the same layout only.
#   DIR/latest                            The manifest (size + sha256 of every file) is written last, then
#                                         `latest` (for people and scripts): a step without a manifest is an
#                                         interrupted save. Loading a DIR takes its newest complete step.
#
# Loading merges the slices into full tensors, so a checkpoint restarts in any dp/tp/pp/zero layout.

CHECKPOINT_FORMAT = "minipar-checkpoint-1"
STATE_KINDS = ("param", "exp_avg", "exp_avg_sq")
LOCAL_KEEP = 2  # complete checkpoints kept in the --local-save tier


@dataclasses.dataclass
class Checkpoint:
    path: str
    step: int
    optimizer_step: int
    config: Any
    layout: Layout  # the layout it was written under
    params: dict[str, np.ndarray]
    exp_avg: dict[str, np.ndarray]
    exp_avg_sq: dict[str, np.ndarray]
    skipped: list[str] = dataclasses.field(default_factory=list)  # damaged newer checkpoints passed over
    training: dict[str, Any] = dataclasses.field(default_factory=dict)  # scalars: the fp16 loss scaler's state
    rank_files: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)  # world rank -> manifest entry

    def rank_state(self, rank: int) -> dict[str, np.ndarray]:
        """The state only world rank ``rank`` held when this was saved ({} if none), verified against the manifest."""
        entry = self.rank_files.get(rank)
        return _read_verified(os.path.join(self.path, entry["file"]), entry) if entry else {}


class CheckpointWriter:
    """Writes checkpoints one at a time, on a thread of its own unless ``background`` is False.

    ``submit(write)`` first waits for the previous write (so two saves never interleave, and a slow disk slows the
    run instead of piling up copies in memory), then starts ``write``; an error in a write is raised by the next
    ``submit`` or by ``wait``, on the rank it happened on. A job's ranks each hold one writer."""

    def __init__(self, background: bool = True):
        self.background = background
        self.buffers: dict[str, np.ndarray] = {}  # file name -> its staging buffer, reused from save to save
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def submit(self, write: Callable[[], None]) -> None:
        self.wait()
        if not self.background:
            write()
            return

        def run() -> None:
            try:
                write()
            except BaseException as e:  # noqa: BLE001 (handed to the training thread by wait)
                self._error = e

        self._thread = threading.Thread(target=run, name="minipar-checkpoint-writer", daemon=True)
        self._thread.start()

    def wait(self, raise_error: bool = True) -> None:
        """Block until the write in flight (if any) is done; raise its error (or drop it: a run ending on another)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None and raise_error:
            raise error


WRITE_DELAY_ENV = "MINIPAR_CHECKPOINT_WRITE_DELAY"  # seconds slept before each file: fault tests kill during a write


def save_checkpoint(root: str, step: int, state: dict[str, dict[str, np.ndarray]] | None, mesh: Any, config: Any,
                    layout: Layout, optimizer_step: int, training: dict[str, Any] | None = None,
                    rank_state: dict[str, Any] | None = None, extra_files: Callable[[str], tuple[str, ...]] | None = None,
                    writer: CheckpointWriter | None = None, keep_last: int = 0, timeout: float = 600.0) -> str:
    """Write this rank's share of a checkpoint (``state`` is None on ranks that hold duplicates); all ranks call.

    ``state`` maps each of STATE_KINDS to this rank's tensors by global parameter name; ``training`` holds
    scalars every rank shares (rank 0's are written); ``rank_state`` what only this rank holds; ``extra_files``
    (rank 0's) writes files into the step's directory (the tokenizer's) and returns their names, checksummed in the
    manifest like the shards.

    What the caller waits for: a copy of the tensors in host memory and one all-gather of the file names every rank
    will write (a few bytes each). The rest is ``writer``'s (default: written now, and every rank returns once the
    checkpoint is complete): each rank writes its files atomically, then a small ``.entry-<file>.json`` with the
    file's size and sha256; rank 0 waits (up to ``timeout`` seconds) for every rank's entries, writes the manifest
    and then ``latest``, removes the entries and what a killed earlier run left, and keeps the newest ``keep_last``
    complete checkpoints (0: all). A rank killed mid-write leaves a step without a manifest: an interrupted save,
    which loading passes over."""
    world = mesh.world
    step_dir = step_path(root, step)
    if writer is not None:
        writer.wait()  # its staging buffers hold the previous save until that is written
    buffers = writer.buffers if writer is not None else {}
    pieces = []  # (file name, its tensors, its safetensors metadata, its manifest fields)
    if state is not None:
        pieces.append((f"pp{mesh.pp_rank}-tp{mesh.tp_rank}.safetensors",
                       {f"{kind}/{n}": a for kind in STATE_KINDS for n, a in state[kind].items()},
                       {"pp_rank": str(mesh.pp_rank), "tp_rank": str(mesh.tp_rank)},
                       {"pp_rank": mesh.pp_rank, "tp_rank": mesh.tp_rank}))
    if rank_state:
        pieces.append((f"rank{world.rank:05d}.safetensors", rank_state, {"rank": str(world.rank)}, {"rank": world.rank}))
    files = []  # (file name, its bytes, its manifest fields)
    for name, tensors, metadata, position in pieces:
        # the one copy the step waits for: training goes on changing the live tensors while the writer writes
        buffers[name] = encode_into({k: np.asarray(a) for k, a in tensors.items()}, metadata, buffers.get(name))
        files.append((name, buffers[name], position))
    if world.rank == 0:  # a killed run's save of this step: its manifest and entries must not count for this one
        # (no writer of this step starts before the gather below, so none of this step's own is removed)
        for stale in glob.glob(os.path.join(glob.escape(step_dir), "manifest.json")) + \
                glob.glob(os.path.join(glob.escape(step_dir), ".entry-*")):
            os.remove(stale)
    expected = [name for names in world.all_gather_bytes(json.dumps([f[0] for f in files]).encode(), label="checkpoint")
                for name in json.loads(names)]
    training = dict(training or {})

    def write() -> None:
        try:
            write_files()
        except OSError as e:  # any file of the save (a shard, an entry, the tokenizer's, the manifest): a full disk
            if e.filename is None:  # not a file's (the wait for the other ranks' entries)
                raise
            raise OSError(f"checkpoint: cannot write {e.filename} ({e.strerror or e}); the checkpoints written before "
                          "it are kept") from None

    def write_files() -> None:
        os.makedirs(step_dir, exist_ok=True)
        for name, blob, position in files:
            entry = {**_write(step_dir, name, [blob]), **position}
            atomic_write(os.path.join(step_dir, f".entry-{name}.json"), [json.dumps(entry).encode()])
        if world.rank == 0:
            extras = [_write(step_dir, name, None) for name in (extra_files(step_dir) if extra_files else ())]
            entries = _wait_for_entries(step_dir, expected, timeout)
            manifest = {"format": CHECKPOINT_FORMAT, "step": step, "optimizer_step": optimizer_step,
                        "config": dataclasses.asdict(config), "layout": layout.as_dict(), "world": world.size,
                        "training": training, "files": [e for e in entries if "pp_rank" in e],
                        "rank_files": [e for e in entries if "rank" in e], "extra_files": extras}
            atomic_write(os.path.join(step_dir, "manifest.json"), [json.dumps(manifest, indent=1).encode()])
            atomic_write(os.path.join(root, "latest"), [f"step_{step:06d}\n".encode()])
            for folder, pattern in ((step_dir, ".entry-*.json"), (step_dir, "*.tmp-*"), (root, "*.tmp-*")):
                for leftover in glob.glob(os.path.join(glob.escape(folder), pattern)):  # every rank has written
                    os.remove(leftover)
            prune_checkpoints(root, keep_last)

    if writer is None:
        write()
        world.barrier()
    else:
        writer.submit(write)
    return step_dir


def _wait_for_entries(step_dir: str, names: list[str], timeout: float) -> list[dict[str, Any]]:
    """The entries every rank wrote for ``names`` (each appears, whole, by an atomic rename), waited for."""
    deadline = time.monotonic() + (timeout if timeout > 0 else float("inf"))
    entries = []
    for name in names:
        path = os.path.join(step_dir, f".entry-{name}.json")
        while not os.path.isfile(path):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{path}: the rank writing {name} did not finish within {timeout:g} s")
            time.sleep(0.01)
        with open(path, encoding="utf-8") as f:
            entries.append(json.load(f))
    return entries


def step_path(root: str, step: int) -> str:
    """Where the checkpoint of ``step`` lives under a --save ``root``."""
    return os.path.join(root, f"step_{step:06d}")


def _write(step_dir: str, name: str, chunks: list[bytes] | list[np.ndarray] | None) -> dict[str, Any]:
    """Write ``chunks`` atomically to a file of ``step_dir`` (None: the file is there already); its manifest entry
    (name, size, sha256)."""
    path = os.path.join(step_dir, name)
    if chunks is None:
        with open(path, "rb") as f:
            chunks = [f.read()]
    else:
        time.sleep(float(os.environ.get(WRITE_DELAY_ENV, 0)))
        atomic_write(path, chunks)
    digest = hashlib.sha256()
    for chunk in chunks:
        digest.update(chunk)
    return {"file": name, "bytes": sum(memoryview(c).nbytes for c in chunks), "sha256": digest.hexdigest()}


def _verified(file: str, entry: dict[str, Any]) -> bytes:
    """The bytes of a file the manifest lists, after checking its size and sha256."""
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{file} is missing")
    with open(file, "rb") as f:
        blob = f.read()
    if len(blob) != entry["bytes"]:
        raise ValueError(f"{file} has {len(blob)} bytes, the manifest says {entry['bytes']} (truncated?)")
    if hashlib.sha256(blob).hexdigest() != entry["sha256"]:
        raise ValueError(f"{file} is corrupted (sha256 differs from the manifest)")
    return blob


def _read_verified(file: str, entry: dict[str, Any]) -> dict[str, np.ndarray]:
    """The tensors of a safetensors file the manifest lists, verified."""
    return decode_safetensors(_verified(file, entry), file)[0]


def step_dirs(root: str) -> list[str]:
    """The ``step_NNNNNN`` directories under ``root``, newest first (complete or not)."""
    if not os.path.isdir(root):
        return []
    names = [n for n in os.listdir(root) if n.startswith("step_") and n[5:].isdigit()]
    return [os.path.join(root, n) for n in sorted(names, key=lambda n: int(n[5:]), reverse=True)]


def _candidates(path: str) -> tuple[list[str], bool]:
    """(step directories to try in order, whether ``path`` named one step explicitly).

    A ``--save`` root starts from the step its ``latest`` names — the newest checkpoint this run completed (it is
    written after the manifest, which is written after every shard) — then the older ones, newest first, in case
    it is damaged; step directories newer than it are another run's or an interrupted save, never taken. Without
    ``latest`` (written by hand, or an older minipar) every step directory is a candidate, newest first."""
    name = os.path.basename(os.path.normpath(path))
    if name.startswith("step_") and os.path.isdir(path):
        return [path], True
    found = step_dirs(path)
    if not found:
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path}: no such checkpoint directory")
        raise FileNotFoundError(f"{path}: no checkpoint here (expected DIR/step_NNNNNN/manifest.json)")
    try:
        with open(os.path.join(path, "latest"), encoding="utf-8") as f:
            latest = os.path.join(path, f.read().strip())
    except OSError:
        return found, False
    if latest not in found:
        return found, False
    return found[found.index(latest):], False


def load_checkpoint(path: str) -> Checkpoint:
    """Read, verify (presence, size, sha256 of every shard) and merge a checkpoint into full tensors.

    ``path`` is a ``--save`` directory (its newest complete checkpoint is loaded; damaged or interrupted
    ones are skipped and listed in ``Checkpoint.skipped``) or one ``step_NNNNNN`` directory (loaded or refused).
    """
    candidates, explicit = _candidates(path)
    skipped = []
    for step_dir in candidates:
        try:
            checkpoint = _load_step(step_dir)
        except (OSError, ValueError, KeyError, TypeError) as e:
            if explicit:
                raise
            skipped.append(f"{step_dir} ({e})")
            continue
        checkpoint.skipped = skipped
        return checkpoint
    raise FileNotFoundError(f"{path}: no complete checkpoint; " + "; ".join(skipped))


def _read_manifest(step_dir: str) -> tuple[dict[str, Any], Any, Layout]:
    """A step's manifest, its model config and the layout it was written under (refused if unreadable)."""
    manifest_path = os.path.join(step_dir, "manifest.json")
    if not os.path.isfile(manifest_path):
        raise FileNotFoundError(f"{manifest_path} is missing: the save was interrupted")
    try:
        with open(manifest_path, encoding="utf-8") as f:
            manifest = json.load(f)
        if manifest.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(f"not a {CHECKPOINT_FORMAT} checkpoint (format {manifest.get('format')!r})")
        config = config_from_dict(manifest["config"])
        # checkpoints before the Layout record stored only dp, ep, cp, tp, pp and zero: the rest take defaults
        layout = Layout(**{k: v for k, v in manifest["layout"].items() if k in Layout.__dataclass_fields__})
        for key in ("step", "optimizer_step"):
            int(manifest[key])
        if not isinstance(manifest["files"], list):
            raise TypeError("'files' is not a list")
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{manifest_path}: unreadable ({type(e).__name__}: {e})") from None
    return manifest, config, layout


def _load_step(step_dir: str) -> Checkpoint:
    manifest, config, layout = _read_manifest(step_dir)
    step, optimizer_step, entries = int(manifest["step"]), int(manifest["optimizer_step"]), manifest["files"]
    by_position = {(entry["pp_rank"], entry["tp_rank"]): _read_verified(os.path.join(step_dir, entry["file"]), entry)
                   for entry in entries}
    for entry in manifest.get("extra_files", []):  # the tokenizer: a damaged one would encode the data differently
        _verified(os.path.join(step_dir, entry["file"]), entry)
    expected = {(p, t) for p in range(layout.pp) for t in range(layout.tp)}
    if set(by_position) != expected:
        raise FileNotFoundError(f"checkpoint {step_dir}: shards for {sorted(expected - set(by_position))} are missing")
    full: dict[str, dict[str, np.ndarray]] = {kind: {} for kind in STATE_KINDS}
    for kind in STATE_KINDS:
        prefix = kind + "/"
        for stage in range(layout.pp):
            slices = [{k[len(prefix):]: v for k, v in by_position[(stage, t)].items() if k.startswith(prefix)}
                      for t in range(layout.tp)]
            full[kind].update(merge_state_dicts(slices, config) if layout.tp > 1 else slices[0])
    return Checkpoint(step_dir, step, optimizer_step, config, layout, full["param"], full["exp_avg"], full["exp_avg_sq"],
                      training=manifest.get("training", {}),
                      rank_files={e["rank"]: e for e in manifest.get("rank_files", [])})


@dataclasses.dataclass
class Complete:
    """A checkpoint every file of which is present and matches its manifest."""
    path: str
    step: int


def newest_complete(root: str) -> tuple[Complete | None, list[str]]:
    """The newest checkpoint under a --save ``root`` whose every file verifies (size and sha256 against the
    manifest), and the damaged or interrupted newer ones passed over — read without merging any tensor."""
    try:
        candidates, _ = _candidates(root)
    except FileNotFoundError:
        return None, []
    skipped = []
    for step_dir in candidates:
        try:
            manifest, _, _ = _read_manifest(step_dir)
            for entry in manifest["files"] + manifest.get("rank_files", []) + manifest.get("extra_files", []):
                _verified(os.path.join(step_dir, entry["file"]), entry)
        except (OSError, ValueError, KeyError, TypeError) as e:
            skipped.append(f"{step_dir} ({e})")
            continue
        return Complete(step_dir, int(manifest["step"])), skipped
    return None, skipped


def newest_checkpoint(durable: str, local: str | None) -> tuple[Complete | None, list[str]]:
    """The newer of the two tiers' newest complete checkpoints (the durable one on a tie), and what to say: the
    damaged ones passed over, and a local tier that has nothing (lost with its host, or not written yet)."""
    found, skipped = newest_complete(durable)
    notes = [f"skipped damaged checkpoint {s}" for s in skipped]
    if local:
        near, near_skipped = newest_complete(local)
        notes += [f"skipped damaged local checkpoint {s}" for s in near_skipped]
        if near is None and found is not None:
            notes.append(f"no complete local checkpoint under {local}: falling back to the durable {found.path}")
        elif near is not None and (found is None or near.step > found.step):
            found = near
    return found, notes


def prune_checkpoints(root: str, keep_last: int) -> list[str]:
    """Delete all but the newest ``keep_last`` complete checkpoints under ``root`` (0: keep all), and any
    interrupted one older than the newest complete; returns what was deleted. Run by one rank, after a save."""
    complete = [d for d in step_dirs(root) if os.path.isfile(os.path.join(d, "manifest.json"))]
    if not keep_last or not complete:
        return []
    newest = int(os.path.basename(complete[0])[5:])
    doomed = complete[keep_last:] + [d for d in step_dirs(root) if d not in complete and int(os.path.basename(d)[5:]) < newest]
    for directory in doomed:
        shutil.rmtree(directory)
    return doomed


# ------------------------------------------------------------------- a training run's checkpoints


def placements(model: GPT) -> dict[str, Any]:
    """Where each parameter lives; a buffer (a router's bias) is whole on every rank."""
    return {**{name: p.placement for name, p in model.named_parameters()},
            **{name: REPLICATED for name, _ in model.named_buffers()}}


def restore_optimizer(optimizer: Any, model: GPT, mesh: Mesh, resumed: Checkpoint) -> None:
    """Adam's moments from a checkpoint of any layout: this rank's pieces of the full tensors."""
    moments = [resumed.exp_avg, resumed.exp_avg_sq, resumed.params]  # params: the float32 masters of a 16-bit model
    moments = [mesh.local_state(m, placements(model)) for m in moments]
    optimizer.import_state(*moments[:2], {id(p): n for n, p in model.named_parameters()}, resumed.optimizer_step,
                           master=moments[2])


def lr_schedule(args: argparse.Namespace) -> dict[str, float]:
    """What decides the learning rate of every step: a checkpoint keeps it, a resumed run that differs says so."""
    return {"lr": args.lr, "min_lr": args.min_lr, "warmup": args.warmup, "decay_steps": args.decay_steps}


def restore_training_state(resumed: Checkpoint, layout: Layout, world: Communicator, model: GPT, engine: Any,
                           optimizer: Any, scaler: LossScaler | None, local_sgd: LocalSGD | None, progress: Any,
                           schedule: dict[str, float]) -> None:
    """The loss scaler's state, and each rank's own state when the layout is the one it was saved in (a
    compressor's error feedback belongs to its rank's buckets, local SGD's replica to its rank); in another
    layout that starts afresh, said once. A ``schedule`` (this run's learning rates) other than the saved one
    is said too."""
    if scaler and "loss_scale" in resumed.training:
        scaler.load_state(resumed.training)
    saved = {name: resumed.training[name] for name in schedule if name in resumed.training}
    if saved and saved != schedule:
        progress.note(f"{resumed.path} was trained on another learning-rate schedule: "
                      + ", ".join(f"--{n.replace('_', '-')} {saved[n]:g} there, {v:g} here"
                                  for n, v in schedule.items() if saved.get(n) != v)
                      + f" (the rate changes from step {resumed.step + 1})")
    if resumed.rank_files:
        if resumed.layout == layout and len(resumed.rank_files) == world.size:
            own = resumed.rank_state(world.rank)
            engine.load_rank_state(own)
            if local_sgd:
                local_sgd.import_state(own, optimizer, {id(p): n for n, p in model.named_parameters()})
        else:
            progress.note(f"{resumed.path} was saved as {resumed.layout}: the per-rank state (error feedback, local "
                          "SGD's replicas) starts afresh in this layout")


def checkpoint(args: argparse.Namespace, root: str, step: int, engine: Any, optimizer: Any, model: GPT, mesh: Mesh,
               layout: Layout, scaler: LossScaler | None, local_sgd: LocalSGD | None, tokenizer: str | None,
               writer: CheckpointWriter, keep_last: int) -> str:
    """Save parameters and AdamW state in this layout under ``root`` (the first replica of each (pp, tp) slice writes
    them), the loss scaler's state, what only each rank holds (a compressor's error feedback; local SGD's replica),
    and the tokenizer files (``tokenizer``'s BPE, or bytes), so that a resumed run, generate and export encode alike.
    The step waits for the gathers and the copy; ``writer`` writes (:func:`save_checkpoint`)."""
    names = {id(p): n for n, p in model.named_parameters()}
    own = {**engine.rank_state(), **(local_sgd.export_state(optimizer, names) if local_sgd else {})}
    params = {**engine.gathered_state_dict(), **optimizer.master_state(names),  # a 16-bit model's float32 masters
              **model.buffer_state()}
    state = {"param": params, **optimizer.export_state(names)}
    state = {kind: mesh.whole_state(tensors, placements(model), axes=("ep",))  # whole experts; tp slices as they are
             for kind, tensors in state.items()}

    def tokenizer_files(step_dir: str) -> tuple[str, ...]:
        save_tokenizer(step_dir, model.config.vocab_size, model.config.block_size, tokenizer)
        return tuple(name for name in TOKENIZER_FILES if os.path.isfile(os.path.join(step_dir, name)))

    return save_checkpoint(root, step, state if mesh.grad_comm.rank == 0 else None, mesh, model.config, layout,
                           optimizer.step_count, training={**lr_schedule(args), **(scaler.state() if scaler else {})},
                           rank_state=own, extra_files=tokenizer_files, writer=writer, keep_last=keep_last,
                           timeout=args.comm_timeout)
