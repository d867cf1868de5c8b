"""Choosing a collective's algorithm: the α-β-γ cost model, measured once per machine and world size.

    α  seconds per message                    measured: one exchange step of 8 bytes between two ranks,
                                              from Python (latency + the per-step software cost)
    β  seconds per byte on the wire           measured: the same step with 4 MiB, minus α and γ
    γ  seconds per byte reduced or copied     measured: numpy adds of 1 MiB buffers

For a communicator spanning several nodes, the flat algorithms are charged the links between nodes
(α_inter, β_inter: the same ping-pong between ranks on different nodes) — a flat ring is as slow as
its slowest hop — and the hierarchical all-reduce pays them only on the n/q bytes that cross.

The parameters are measured by the first communicator that needs them, cached in
``~/.cache/minipar/collectives-<host>-<world>ranks-<nodes>nodes.json`` and, on every first use in a communicator,
broadcast from its rank 0: every rank must pick the same algorithm, so every rank must hold the same
numbers. With each algorithm's cost formula (in its docstring in ``collectives.py``) :meth:`CostModel.best`
picks the fastest for (collective, bytes, p, nodes); ``algorithm=`` on a call overrides it.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import socket
import time
from typing import Any

import numpy as np
from mpi4py import MPI

from minipar.safetensors_io import atomic_write

ALGORITHMS = {
    "all_reduce": ("ring", "recursive_doubling", "rabenseifner", "hierarchical"),
    "reduce_scatter": ("ring", "recursive_halving"),
    "all_gather": ("ring", "recursive_doubling", "bruck"),
    "broadcast": ("binomial", "segmented"),
    "all_to_all": ("pairwise", "bruck"),
}
SEGMENT_CHOICES = (16 << 10, 64 << 10, 256 << 10, 1 << 20)


@dataclasses.dataclass(frozen=True)
class CostModel:
    alpha: float        # s per message inside a node
    beta: float         # s per byte inside a node
    gamma: float        # s per byte reduced (one add) or copied
    alpha_inter: float  # across nodes (equal to the above on one machine)
    beta_inter: float

    def time(self, collective: str, algorithm: str, n: float, p: int, nodes: int = 1) -> float:
        """Predicted seconds of one call on ``n`` bytes over ``p`` ranks on ``nodes`` nodes (inf: not applicable)."""
        if p == 1:
            return 0.0
        a, b, g = (self.alpha, self.beta, self.gamma) if nodes == 1 else (self.alpha_inter, self.beta_inter, self.gamma)
        pof2 = 1 << (p.bit_length() - 1)
        fold = 1 if p != pof2 else 0
        lg, lg_up = math.log2(pof2), math.ceil(math.log2(p))
        share = (pof2 - 1) / pof2
        if collective == "all_reduce":
            if algorithm == "ring":
                return 2 * (p - 1) * a + 2 * (p - 1) / p * n * b + (p - 1) / p * n * g
            if algorithm == "recursive_doubling":
                return (lg + 2 * fold) * (a + n * b) + (lg + fold) * n * g
            if algorithm == "rabenseifner":
                return (2 * lg + 2 * fold) * a + (2 * share + 2 * fold) * n * b + (share + fold) * n * g
            if algorithm == "hierarchical":
                if nodes == 1 or p % nodes:
                    return math.inf
                q = p // nodes
                inside = CostModel(self.alpha, self.beta, self.gamma, self.alpha, self.beta)
                across = CostModel(self.alpha_inter, self.beta_inter, self.gamma, self.alpha_inter, self.beta_inter)
                cross = min(across.time("all_reduce", alg, n / q, nodes) for alg in ("ring", "recursive_doubling"))
                return (inside.time("reduce_scatter", "ring", n, q) + cross + inside.time("all_gather", "ring", n, q))
        if collective == "reduce_scatter":
            if algorithm == "ring":
                return (p - 1) * a + (p - 1) / p * n * (b + g)
            if algorithm == "recursive_halving":
                return (lg + 2 * fold) * a + (share + fold) * n * (b + g)
        if collective == "all_gather":
            if algorithm == "ring":
                return (p - 1) * a + (p - 1) / p * n * b
            if algorithm == "recursive_doubling":
                return (lg + 2 * fold) * a + (share + fold) * n * b
            if algorithm == "bruck":
                return lg_up * a + (p - 1) / p * n * b + n * g
        if collective == "all_to_all":
            if algorithm == "pairwise":
                return (p - 1) * a + (p - 1) / p * n * b
            if algorithm == "bruck":  # each round also gathers and scatters its blocks: about a second α
                return 2 * lg_up * a + lg_up * n / 2 * (b + 2 * g) + 2 * n * g
        if collective == "broadcast":
            if algorithm == "binomial":
                return lg_up * (a + n * b)
            if algorithm == "segmented":
                return min(self._segmented(n, lg_up, s, a, b) for s in SEGMENT_CHOICES)
        return math.inf

    @staticmethod
    def _segmented(n: float, depth: int, segment: int, a: float, b: float) -> float:
        k = max(1, math.ceil(n / segment))
        return (depth + k - 1) * (a + min(segment, n) * b)

    def segment_bytes(self, n: float, p: int, nodes: int = 1) -> int:
        a, b = (self.alpha, self.beta) if nodes == 1 else (self.alpha_inter, self.beta_inter)
        depth = math.ceil(math.log2(max(p, 2)))
        return min(SEGMENT_CHOICES, key=lambda s: self._segmented(n, depth, s, a, b))

    def best(self, collective: str, n: float, p: int, nodes: int = 1, exclude: tuple[str, ...] = ()) -> str:
        """The algorithm with the lowest predicted time (ties: the first listed in ALGORITHMS), of those that can run
        (``exclude``: those that cannot, e.g. the hierarchical all-reduce on nodes of unequal size)."""
        return min((alg for alg in ALGORITHMS[collective] if alg not in exclude),
                   key=lambda alg: self.time(collective, alg, n, p, nodes))


def cache_path(world: int, nodes: int = 1) -> str:
    """Where this host keeps the model measured by a communicator spanning ``nodes`` nodes in a world of
    ``world`` ranks. The node count is part of the name because only a communicator across nodes measures
    the links between them (a one-node model holds the node's own numbers there); nodes emulated with
    ``MINIPAR_RANKS_PER_NODE`` get their own file, their "links between nodes" being shared memory."""
    emulated = "-emulated" if nodes > 1 and os.environ.get("MINIPAR_RANKS_PER_NODE") else ""
    return os.path.join(os.path.expanduser("~"), ".cache", "minipar",
                        f"collectives-{socket.gethostname()}-{world}ranks-{nodes}nodes{emulated}.json")


def _load(path: str) -> CostModel | None:
    try:
        with open(path) as f:
            return CostModel(**json.load(f))
    except (OSError, ValueError, TypeError):
        return None


def _exchange(mpi: Any, a: int, b: int, nbytes: int, reps: int) -> float:
    """The median time of one algorithm step between ranks a and b of ``mpi`` — a Sendrecv of ``nbytes``
    each way plus adding what arrived, from Python as the algorithms do it — on rank a (0 elsewhere).
    So α includes the per-message software cost an algorithm pays, not only the wire's latency."""
    send, recv = np.zeros(nbytes // 4, np.float32), np.zeros(nbytes // 4, np.float32)
    r = mpi.Get_rank()
    if r not in (a, b):
        return 0.0
    other = b if r == a else a
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        mpi.Sendrecv([send, MPI.BYTE], other, 7, [recv, MPI.BYTE], other, 7)
        np.add(send, recv, out=recv)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def _quiet_barrier(mpi: Any) -> None:
    """A barrier that sleeps while it waits: the ranks not being measured leave the cores to those that are
    (MPI's own barrier spins, and with more ranks than cores the spinning halves what is measured)."""
    request = mpi.Ibarrier()
    while not request.Test():
        time.sleep(50e-6)


def measure(mpi: Any, node_of: list[int]) -> CostModel:
    """γ on rank 0, then α, β between ranks 0 and its nearest neighbour on its node, then between rank 0
    and the first rank on another node, one measurement at a time while every other rank of ``mpi``
    sleeps in a barrier; rank 0's numbers are returned everywhere."""
    probe = mpi.Dup()
    try:
        far = next((r for r, node in enumerate(node_of) if node != node_of[0]), None)
        near = next((r for r, node in enumerate(node_of) if r and node == node_of[0]), None)

        def link(partner: int | None) -> tuple[float, float]:
            if partner is None:
                return 0.0, 0.0
            alpha = _exchange(probe, 0, partner, 8, 50)
            big = 4 << 20
            beta = max(_exchange(probe, 0, partner, big, 7) - alpha - big * gamma, 0.0) / big
            _quiet_barrier(probe)
            return alpha, beta

        gamma = 0.0
        if probe.Get_rank() == 0:
            x, y = np.ones(1 << 18, np.float32), np.ones(1 << 18, np.float32)
            times = []
            for _ in range(31):
                t0 = time.perf_counter()
                np.add(x, y, out=x)
                times.append(time.perf_counter() - t0)
            gamma = sorted(times)[len(times) // 2] / x.nbytes  # the median: one preemption must not count
        _quiet_barrier(probe)
        alpha, beta = link(near)
        alpha_inter, beta_inter = link(far)
        if near is None:  # every rank on its own node: the inter-node link is the only one
            alpha, beta = alpha_inter, beta_inter
        if far is None:
            alpha_inter, beta_inter = alpha, beta
        return probe.bcast(CostModel(alpha, beta, gamma, alpha_inter, beta_inter) if probe.Get_rank() == 0 else None)
    finally:
        probe.Free()


def agree(mpi: Any, node_of: list[int]) -> CostModel:
    """The cost model every rank of ``mpi`` will use: the cached one if every rank has a cache, else
    measured now (and cached); in both cases rank 0's copy. A collective call on ``mpi``."""
    path = cache_path(MPI.COMM_WORLD.Get_size(), len(set(node_of)))
    cached = _load(path)
    if mpi.allreduce(cached is not None, op=MPI.LAND):
        return mpi.bcast(cached if mpi.Get_rank() == 0 else None)
    model = measure(mpi, node_of)
    first_on_node = node_of.index(node_of[mpi.Get_rank()]) == mpi.Get_rank()
    if first_on_node:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        atomic_write(path, [json.dumps(dataclasses.asdict(model), indent=1).encode()])
    return model
