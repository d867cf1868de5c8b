"""Data parallelism (DDP): every rank holds the whole model and a slice of the batch; gradients are
summed with all-reduce, bucket by bucket, while backward is still running.

    model = DataParallel(GPT(cfg), comm, bucket_mb=25)   # rank 0's parameters broadcast to all
    _, loss = model(x_local, y_local)                    # x_local: this rank's rows of the global batch
    (loss * (n_local / n_global)).backward()             # buckets all-reduce as soon as they fill
    model.sync_gradients()                               # wait; p.grad = the sum over ranks
    optimizer.step()

Why it equals single-process training — the global-token normalization (torchtitan's). Rank r's loss L_r is
the mean over its n_r tokens; its backward starts from n_r/N (N = Σ_r n_r, the global batch's tokens), so it
computes ∇ of (its token-sum of losses)/N, and the sum over ranks Σ_r (n_r/N)·∇L_r = ∇ (mean over all N
tokens) = the single-process gradient. Every activation gradient of rank r is then the one process's for the
same rows, elementwise — not p times it, as averaging the ranks' own means would make it — so an fp16 backward
overflows on a rank exactly where the one process's does (Pipeline.run seeds the backward this way).

Buckets. Parameters are grouped, in the order their gradients become final in backward (the
reverse of the forward order), into flat buffers of about ``bucket_mb``. A gradient hook copies
each final gradient into its bucket; the moment a bucket is complete its ring all-reduce starts on
the communication thread, overlapping with the backward of earlier layers. Each rank sends
2(p−1)/p·Ψ·itemsize bytes per step for Ψ parameters. Afterwards ``p.grad`` is a view of its
bucket (no extra copy).

Gradient accumulation: inside ``with model.no_sync():`` hooks do nothing and gradients simply
accumulate in ``p.grad``; the next backward outside it sums the accumulated gradients over the ranks.

Expert parameters (``p.placement.experts``, see models/moe.py) under expert parallelism differ between the
ranks of an ep group, so they reduce over ``expert_comm`` — the ranks holding the same experts —
instead of ``comm``. Their gradient on a rank already sums the contributions of the ep ranks whose
tokens it computed; summing over the dp/ep expert replicas adds the rest, so every parameter's gradient is
the same Σ_r (n_r/N)·∇L_r (:func:`replica_groups`).

Deep dive, with measurements: docs/data_parallel.md.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import numpy as np

from minipar.backend import xp
from minipar.comm import Communicator, Handle
from minipar.nn import Module, Parameter


class Bucket:
    """Parameters whose gradients travel together as one flat buffer of ``size`` elements of ``grad_dtype`` (the
    parameters' dtype, or float32 to reduce 16-bit gradients in full precision), summed over ``comm``."""

    def __init__(self, params: list[Parameter], comm: Communicator | None = None, grad_dtype: Any = None):
        self.params, self.comm = params, comm
        self.shapes = [p.shape for p in params]  # kept: ZeRO-3 empties the parameters themselves
        self.offsets = np.cumsum([0] + [p.size for p in params]).tolist()
        self.size = self.offsets[-1]
        self.dtype = params[0].dtype
        self.grad_dtype = np.dtype(grad_dtype or self.dtype)
        self.buffer: Any = None      # the flat gradient while it is being assembled / reduced
        self.handle: Handle | None = None
        self.ready = 0               # how many of its parameters have a final gradient

    def slot(self, flat: Any, i: int) -> Any:
        """The piece of a flat buffer that belongs to parameter i, shaped like it."""
        return flat[self.offsets[i]:self.offsets[i + 1]].reshape(self.shapes[i])

    def flatten(self, arrays: list[Any]) -> Any:
        return xp.concatenate([a.reshape(-1) for a in arrays]) if arrays else xp.zeros(0, self.dtype)


def rounded_to(reduced: Any, dtype: Any) -> Any:
    """A gradient reduced in float32 (``reduce_dtype``) rounded to its parameters' 16-bit ``dtype``, as the one
    process holds it: a float16 value beyond 65504 is inf there too, so an fp16 run overflows — and skips — where
    the one process does."""
    return reduced if reduced.dtype == dtype else reduced.astype(dtype)


def make_buckets(params: list[Parameter], bucket_bytes: float, comm: Communicator | None = None,
                 grad_dtype: Any = None) -> list[Bucket]:
    """Consecutive runs of ``params`` (already in gradient-ready order) of about ``bucket_bytes`` each."""
    buckets, current, size = [], [], 0
    for p in params:
        if current and (size + p.data.nbytes > bucket_bytes or p.dtype != current[0].dtype):
            buckets.append(Bucket(current, comm, grad_dtype))
            current, size = [], 0
        current.append(p)
        size += p.data.nbytes
    if current:
        buckets.append(Bucket(current, comm, grad_dtype))
    return buckets


def replica_groups(params: list[Parameter], comm: Communicator, expert_comm: Communicator | None
                   ) -> list[tuple[list[Parameter], Communicator]]:
    """(parameters, the ranks holding identical copies of them, over which their gradients sum).

    Dense parameters: ``comm``. Expert parameters (``p.placement.experts``) with an ``expert_comm``: the dp/ep
    ranks holding the same experts (their ep group already summed the other tokens' contributions).
    """
    if expert_comm is None or expert_comm is comm:
        return [(params, comm)]
    dense = [p for p in params if not p.placement.experts]
    experts = [p for p in params if p.placement.experts]
    return [(group, c) for group, c in ((dense, comm), (experts, expert_comm)) if group]


def gradient_ready_order(model: Module) -> list[Parameter]:
    """The order in which backward finalizes gradients: the reverse of the forward (registration) order."""
    return list(reversed(model.parameters()))


def live_bytes(arrays: list[Any]) -> int:
    """Bytes held by the distinct buffers behind ``arrays`` (views count their whole base once)."""
    bases = {}
    for a in arrays:
        if a is None:
            continue
        while getattr(a, "base", None) is not None:
            a = a.base
        bases[id(a)] = a.nbytes
    return sum(bases.values())


def broadcast_parameters(groups: list[tuple[list[Parameter], Communicator]]) -> None:
    """Each group's rank-0 parameters to the group, one flat buffer per dtype (binomial tree: ⌈log₂p⌉ rounds)."""
    for params, comm in groups:
        if comm.size == 1:
            continue
        for group in make_buckets(params, float("inf")):
            flat = comm.broadcast(group.flatten([p.data for p in group.params]), root=0, label="broadcast_params")
            for i, p in enumerate(group.params):
                p.data[...] = group.slot(flat, i)


class ReplicatedModel:
    """What DataParallel and ZeRO share: calling the model, its parameters, and ``no_sync()``."""

    def __init__(self, model: Module):
        self.module, self.params, self._sync = model, model.parameters(), True

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def parameters(self) -> list[Parameter]:
        return self.params

    def gathered_state_dict(self) -> dict[str, Any]:
        """Every parameter whole, by name (a replica already holds them all; ZeRO gathers its shards)."""
        return self.module.state_dict()

    def rank_state(self) -> dict[str, Any]:
        """What only this rank holds and a resumed run needs, for a checkpoint (here: nothing)."""
        return {}

    def load_rank_state(self, state: dict[str, Any]) -> None:
        """Take back what :meth:`rank_state` returned, in the same layout."""

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally, without communicating."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous


class DataParallel(ReplicatedModel):
    def __init__(self, model: Module, comm: Communicator, bucket_mb: float = 25.0, overlap: bool = True,
                 compression: Any = None, expert_comm: Communicator | None = None, reduce_dtype: Any = None):
        """``overlap=False`` starts every all-reduce only in ``sync_gradients`` (for measuring what overlap buys);
        ``compression`` (a minipar.parallel.compression.Compressor) replaces each bucket's all-reduce;
        ``expert_comm``: where expert parameters reduce under expert parallelism; ``reduce_dtype`` (float32)
        reduces 16-bit gradients in float32: twice the bytes, no rounding in the sum."""
        super().__init__(model)
        self.comm, self.overlap, self.compression = comm, overlap, compression
        self.loss_scale = 1.0
        groups = replica_groups(gradient_ready_order(model), comm, expert_comm)
        broadcast_parameters(groups)
        self.buckets = [b for params, c in groups for b in make_buckets(params, bucket_mb * 2**20, c, reduce_dtype)
                        if c.size > 1]
        for bucket in self.buckets:
            for i, p in enumerate(bucket.params):
                p.register_hook(lambda p, bucket=bucket, i=i: self._gradient_ready(bucket, i))

    @property
    def loss_scale(self) -> float:
        """The fp16 loss scale the gradients carry this step (what a compressor's error feedback divides out)."""
        return self._loss_scale

    @loss_scale.setter
    def loss_scale(self, scale: float) -> None:
        self._loss_scale = scale
        if self.compression:
            self.compression.loss_scale = scale

    def _gradient_ready(self, bucket: Bucket, i: int) -> None:
        if not self._sync:
            return
        if bucket.buffer is None:
            bucket.buffer = xp.empty(bucket.size, dtype=bucket.grad_dtype)
        bucket.slot(bucket.buffer, i)[...] = bucket.params[i].grad
        bucket.ready += 1
        if bucket.ready == len(bucket.params) and self.overlap:
            self._launch(bucket)

    def _launch(self, bucket: Bucket) -> None:
        if self.compression is None:
            bucket.handle = bucket.comm.all_reduce(bucket.buffer, async_op=True, algorithm="ring", label="grads")
        else:  # compress, communicate, decompress: all on the communication thread
            bucket.handle = bucket.comm.submit(lambda: self.compression.reduce(bucket.comm, bucket, bucket.buffer))

    def sync_gradients(self) -> None:
        """Wait for every bucket's all-reduce; afterwards each ``p.grad`` is the sum over ranks.

        A bucket some of whose parameters got no gradient (unused in this forward) is reduced here,
        with zeros for the missing ones, in bucket order — the same order on every rank.
        """
        for bucket in self.buckets:
            if bucket.handle is None:
                if bucket.buffer is None:
                    bucket.buffer = xp.zeros(bucket.size, dtype=bucket.grad_dtype)
                for i, p in enumerate(bucket.params):
                    if p.grad is None:
                        bucket.slot(bucket.buffer, i)[...] = 0
                self._launch(bucket)
        for bucket in self.buckets:
            bucket.handle.wait()
            reduced = rounded_to(bucket.buffer, bucket.dtype)
            for i, p in enumerate(bucket.params):
                p.grad = bucket.slot(reduced, i)
            bucket.handle, bucket.ready = None, 0
            if reduced is not bucket.buffer:  # the float32 buffer is refilled from scratch next step
                bucket.buffer = None

    def rank_state(self) -> dict[str, Any]:
        """The compressor's error feedback ({} without one)."""
        return self.compression.export_state(self.buckets) if self.compression else {}

    def load_rank_state(self, state: dict[str, Any]) -> None:
        if self.compression:
            self.compression.import_state(self.buckets, state)

    def formula_bytes(self) -> float:
        """Bytes one rank should send per synchronized step: ring all-reduce of Ψ elements, 2(p−1)/p·Ψ·itemsize
        (Ψ and p per replica group: the dense parameters over comm, the experts over expert_comm)."""
        return sum(2 * (b.comm.size - 1) / b.comm.size * b.size * b.grad_dtype.itemsize for b in self.buckets)

    def model_state_bytes(self, optimizer: Any) -> dict[str, int]:
        """Counted bytes of the live parameter, gradient and optimizer-state arrays on this rank."""
        grads = [p.grad for p in self.params] + [b.buffer for b in self.buckets]
        return {"params": live_bytes([p.data for p in self.params]), "grads": live_bytes(grads),
                "optimizer": live_bytes(optimizer.state_arrays())}
