"""Gradient compression for data parallelism: send fewer bytes per step, pay in gradient accuracy.

Plug one into DataParallel (``DataParallel(model, comm, compression=TopK(0.01))``, or
``train --compression topk``): each full gradient bucket is handed to ``reduce(comm, bucket, flat)``
on the communication thread, which must leave the sum over ranks (or its approximation) in
``flat`` (each rank's gradient already carries its share of the global tokens: data_parallel.py). Bytes per rank and step, for a bucket of n float32 values on p ranks (ring all-reduce:
8(p−1)/p·n):

    Cast("float16"/"bfloat16")  ring all-reduce with a 16-bit wire, float32 adds   4(p−1)/p·n      2×
    Int8()                      all-gather of int8 + one scale per rank and bucket  (p−1)(n + 4)   ≈ 8/p ×
    TopK(ratio)                 all-gather of the k = ratio·n largest |g| (+ error   8(p−1)·k      ≈ 1/(p·ratio) ×
                                feedback: what was not sent is added to the next step's gradient)
    PowerSGD(rank)              per matrix M (n×m): P = M Q, all-reduce P, orthonormalize,    8(p−1)/p·(n+m)·r
                                Q = Mᵀ P, all-reduce Q, M ≈ P Qᵀ (Vogels et al. 2019), Q warm-started
                                from the last step, error feedback; vectors are all-reduced as they are

All results are computed from the same received data in the same order on every rank, so the
replicas stay identical. Compressed buckets are reduced when full, like plain DP's, but the
compression arithmetic itself also runs on the communication thread.

Deep dive, with measurements: docs/compression.md.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from minipar.backend import is_low_precision, to_device, to_host, xp
from minipar.comm import Communicator
from minipar.parallel.data_parallel import Bucket


class Compressor:
    """``loss_scale``: the factor the gradients handed in carry (fp16 dynamic loss scaling; the training loop sets
    it every step). Error feedback is kept in unscaled units — divided by it when stored, multiplied when used —
    so a scale that changes between steps does not change what the residual means, and a step whose gradients
    are not finite on any rank (an fp16 overflow, which the loop then skips) leaves every rank's residual as it
    was: each compressor decides on what the exchange returned, which is the same on every rank."""
    name = "none"
    loss_scale = 1.0

    def reduce(self, comm: Communicator, bucket: Bucket, flat: Any) -> None:
        """Replace ``flat`` (this rank's gradient for ``bucket``) by the (approximate) sum over ranks."""
        raise NotImplementedError

    def export_state(self, buckets: list[Bucket]) -> dict[str, np.ndarray]:
        """This rank's error feedback (and warm starts) by position — "<kind>/<bucket>.<parameter>" — for a
        checkpoint: what a resumed run needs to continue the same trajectory. Stateless compressors: {}."""
        return {f"{kind}/{b}.{i}": to_host(store[key]) for kind, (store, _) in self._stores().items()
                for b, bucket in enumerate(buckets) for i, key in enumerate(self._keys(bucket)) if key in store}

    def import_state(self, buckets: list[Bucket], state: dict[str, np.ndarray]) -> None:
        """The inverse of :meth:`export_state` on the same layout's buckets."""
        for kind, (store, place) in self._stores().items():
            for b, bucket in enumerate(buckets):
                for i, key in enumerate(self._keys(bucket)):
                    if f"{kind}/{b}.{i}" in state:
                        store[key] = place(state[f"{kind}/{b}.{i}"])

    def _stores(self) -> dict[str, tuple[dict[int, Any], Any]]:
        """kind -> (its arrays by key, where an imported array goes: to_device, or the host as it is)."""
        return {}

    def _keys(self, bucket: Bucket) -> list[int]:
        """The keys a bucket's state is stored under (per bucket: one; per parameter: one each)."""
        return [id(bucket)]


class Cast(Compressor):
    """The ring all-reduce with 16-bit messages (float16 or bfloat16), accumulating in float32."""

    def __init__(self, wire: str = "bfloat16"):
        self.wire, self.name = wire, wire

    def reduce(self, comm: Communicator, bucket: Bucket, flat: Any) -> None:
        if not is_low_precision(flat.dtype):
            comm.all_reduce(flat, wire=self.wire, label="grads")
            return
        wide = flat.astype(xp.float32)  # 16-bit gradients (mixed precision): the same wire, float32 adds
        comm.all_reduce(wide, wire=self.wire, label="grads")
        flat[...] = wide


def _gather_payloads(comm: Communicator, payload: np.ndarray) -> list[np.ndarray]:
    """Every rank's equally long byte payload, in rank order (one ring all-gather)."""
    return np.split(comm.all_gather(payload, label="grads"), comm.size)


class Int8(Compressor):
    """q = round(127 · g / max|g|) per rank and bucket; ranks exchange (scale, q) and sum the dequantized values."""

    name = "int8"

    def reduce(self, comm: Communicator, bucket: Bucket, flat: Any) -> None:
        g = to_host(flat).astype(np.float32)
        scale = np.float32(np.abs(g).max() / 127.0) if g.size else np.float32(1.0)
        q = np.round(g / scale).astype(np.int8) if scale > 0 else np.zeros(g.size, np.int8)
        payload = np.concatenate([np.frombuffer(scale.tobytes(), np.uint8), q.view(np.uint8)])
        total = np.zeros(g.size, np.float32)
        for other in _gather_payloads(comm, payload):
            total += other[4:].view(np.int8).astype(np.float32) * other[:4].view(np.float32)[0]
        flat[...] = to_device(total, dtype=flat.dtype)


class TopK(Compressor):
    """Send the ``ratio`` share of largest-magnitude entries (with error feedback); sum them densely."""

    def __init__(self, ratio: float = 0.01):
        if not 0 < ratio <= 1:
            raise ValueError(f"--topk-ratio must be in (0, 1], got {ratio}")
        self.ratio, self.name = ratio, f"topk({ratio:g})"
        self.residual: dict[int, np.ndarray] = {}  # per bucket: what earlier steps did not send

    def _stores(self) -> dict[str, tuple[dict[int, Any], Any]]:
        return {"topk_residual": (self.residual, np.asarray)}  # top-k selects on the host

    def reduce(self, comm: Communicator, bucket: Bucket, flat: Any) -> None:
        e = to_host(flat).astype(np.float32) + self.residual.get(id(bucket), 0.0) * self.loss_scale
        k = max(1, int(self.ratio * e.size)) if e.size else 0
        top = np.sort(np.argpartition(np.abs(e), e.size - k)[e.size - k:]).astype(np.int32) if k else np.zeros(0, np.int32)
        values = e[top]
        payload = np.concatenate([top.view(np.uint8), values.view(np.uint8)])
        dense = np.zeros(e.size, np.float32)
        for other in _gather_payloads(comm, payload):
            dense[other[:4 * k].view(np.int32)] += other[4 * k:].view(np.float32)  # one rank's indices are distinct
        # an overflow on any rank is among its largest entries, so in every rank's sum: all skip the step alike
        if np.isfinite(dense).all():  # error feedback keeps only what was not sent, unscaled (class Compressor)
            residual = e / self.loss_scale
            residual[top] = 0.0
            self.residual[id(bucket)] = residual
        flat[...] = to_device(dense, dtype=flat.dtype)


class PowerSGD(Compressor):
    """Rank-``rank`` approximation of every gradient matrix, by one warm-started power iteration."""

    def __init__(self, rank: int = 4, seed: int = 0):
        if rank < 1:
            raise ValueError(f"--powersgd-rank must be >= 1, got {rank}")
        self.rank, self.seed, self.name = rank, seed, f"powersgd(r={rank})"
        self.q: dict[int, Any] = {}         # per parameter: the Q of the last step (warm start)
        self.residual: dict[int, Any] = {}  # per parameter: error feedback

    def _stores(self) -> dict[str, tuple[dict[int, Any], Any]]:
        return {"powersgd_residual": (self.residual, to_device), "powersgd_q": (self.q, to_device)}

    def _keys(self, bucket: Bucket) -> list[int]:
        return [id(p) for p in bucket.params]

    def _compressible(self, shape: tuple[int, ...]) -> bool:
        return len(shape) == 2 and min(shape) > self.rank

    def reduce(self, comm: Communicator, bucket: Bucket, flat: Any) -> None:
        matrices, vectors = [], []
        for i, (p, shape) in enumerate(zip(bucket.params, bucket.shapes)):
            (matrices if self._compressible(shape) else vectors).append(i)
        if vectors:  # biases and layer norms: too small to compress
            rest = xp.concatenate([bucket.slot(flat, i).reshape(-1) for i in vectors])
            comm.all_reduce(rest, algorithm="ring", label="grads")
            offset = 0
            for i in vectors:
                n = int(np.prod(bucket.shapes[i]))
                bucket.slot(flat, i)[...] = rest[offset:offset + n].reshape(bucket.shapes[i])
                offset += n
        if not matrices:
            return
        ms = []
        for i in matrices:  # in float32 for 16-bit gradients (no 16-bit QR; factors and residuals stay float32)
            key, g = id(bucket.params[i]), bucket.slot(flat, i)
            m = (g.astype(xp.float32) if is_low_precision(g.dtype) else g) + self.residual.get(key, 0.0) * self.loss_scale
            if key not in self.q:  # the same random start on every rank
                rng = np.random.default_rng((self.seed, i, *m.shape))
                self.q[key] = to_device(rng.standard_normal((m.shape[1], self.rank)), dtype=m.dtype)
            ms.append((key, m))
        ps = self._all_sum(comm, [m @ self.q[key] for key, m in ms])
        ps = [xp.linalg.qr(p)[0] for p in ps]  # orthonormal columns, identical on every rank
        qs = self._all_sum(comm, [m.T @ p for (_, m), p in zip(ms, ps)])
        for i, (key, m), p, q in zip(matrices, ms, ps, qs):
            approx = p @ q.T  # from the summed factors: the same on every rank, non-finite if any rank overflowed
            if bool(xp.isfinite(approx).all()):  # an overflowed step leaves the residual and the warm start alone
                # this rank's share of the sum is approx/p: what its own m lacks of it is held back (the residuals
                # sum to Σ m − approx, the compression's whole error, sent again next step)
                self.residual[key], self.q[key] = (m - approx / comm.size) / self.loss_scale, q
            bucket.slot(flat, i)[...] = approx

    @staticmethod
    def _all_sum(comm: Communicator, arrays: list[Any]) -> list[Any]:
        """One ring all-reduce (sum) of several small matrices, concatenated."""
        flat = xp.concatenate([a.reshape(-1) for a in arrays])
        comm.all_reduce(flat, algorithm="ring", label="grads")
        out, offset = [], 0
        for a in arrays:
            out.append(flat[offset:offset + a.size].reshape(a.shape))
            offset += a.size
        return out


def make_compressor(name: str, topk_ratio: float = 0.01, powersgd_rank: int = 4) -> Compressor | None:
    """The compressor called ``name`` on the command line ("none" -> None)."""
    choices = {"none": lambda: None, "fp16": lambda: Cast("float16"), "bf16": lambda: Cast("bfloat16"),
               "int8": Int8, "topk": lambda: TopK(topk_ratio), "powersgd": lambda: PowerSGD(powersgd_rank)}
    if name not in choices:
        raise ValueError(f"unknown compression {name!r}: expected one of {sorted(choices)}")
    return choices[name]()


COMPRESSIONS = ("none", "fp16", "bf16", "int8", "topk", "powersgd")
