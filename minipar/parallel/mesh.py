"""The device mesh: world = pp × dp × cp × tp ranks, tp fastest, then cp (Megatron's order).

    rank = ((pp_rank · dp + dp_rank) · cp + cp_rank) · tp + tp_rank

Tensor-parallel groups are runs of tp consecutive ranks — on a real cluster, the GPUs of one node
joined by NVLink, where TP's per-layer all-reduces belong. Context-parallel groups (the ranks that
split each sequence) stride by tp, data-parallel groups by cp·tp, pipeline stages by dp·cp·tp. Each
group is an MPI sub-communicator (``MPI_Comm_split``); the mesh owns all of them and hands each
engine the ones it needs.

Parameters are replicated over dp and cp alike (cp ranks hold the same weights and see different
tokens), so gradients reduce — and ZeRO shards — over ``grad_comm``, the dp × cp ranks with this
rank's (pp, tp) coordinates. With cp = 1 it is the dp group itself.

Expert parallelism is carved out of the dp × cp replicas (DeepSpeed-MoE, Megatron-core): the replica index
q = dp_rank · cp + cp_rank (grad_comm's order) splits as q = (q // ep) · ep + ep_rank, so runs of ep
consecutive replicas form an ``ep_comm`` that exchanges tokens and holds E/ep experts each — the pieces of
one sequence under cp may go to different experts' owners, as any tokens do. A rank's experts are
replicated only over the replicas with the same ep_rank — ``expert_grad_comm``, dp·cp/ep ranks — where their
gradients reduce. With ep = 1 it is ``grad_comm``; with cp = 1, ep_rank = dp_rank mod ep.

Hybrid sharding (``shard_group`` K, FSDP's HYBRID_SHARD): ZeRO shards within runs of K consecutive
grad_comm ranks (``shard_comm``) and replicates across the N/K runs (``shard_replica_comm``, the ranks
with the same position in their run). Without it ZeRO shards over all of grad_comm. Expert parameters
shard among the ranks of a run that hold the same experts (``expert_shard_comm``) and replicate across
the expert_grad_comm ranks with the same position there (``expert_shard_replica_comm``).

    mesh = Mesh(Communicator(), dp=2, tp=2, pp=2)   # 8 ranks
    mesh.tp_comm, mesh.dp_comm, mesh.pp_comm        # this rank's groups (and cp_comm, grad_comm, ep_comm, ...)

Deep dive, with measurements: docs/pipeline.md.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from minipar.backend import to_host
from minipar.comm import Communicator
from minipar.placement import Placement

AXES = ("pp", "dp", "cp", "tp")  # slowest to fastest


def coordinates(rank: int, dp: int, cp: int, tp: int) -> tuple[int, int, int, int]:
    """(pp_rank, dp_rank, cp_rank, tp_rank) of a world rank: tp fastest, then cp, dp, pp (Megatron's order)."""
    return rank // (dp * cp * tp), rank // (cp * tp) % dp, rank // tp % cp, rank % tp


class Mesh:
    def __init__(self, world: Communicator, dp: int = 1, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1,
                 shard_group: int | None = None):
        sizes = {"pp": pp, "dp": dp, "cp": cp, "tp": tp, "ep": ep}
        for name, size in sizes.items():
            if size < 1:
                raise ValueError(f"--{name} must be >= 1, got {size}")
        if (dp * cp) % ep:
            raise ValueError(f"--ep {ep} must divide dp·cp = {dp * cp}: expert parallelism is carved out of the "
                             "data-parallel replicas")
        total = pp * dp * cp * tp
        if total != world.size:
            raise ValueError(f"world size {world.size} != pp·dp·cp·tp = {pp}·{dp}·{cp}·{tp}; launch with mpiexec -n {total}")
        self.world, self.sizes = world, sizes
        self.dp, self.tp, self.pp, self.cp, self.ep = dp, tp, pp, cp, ep
        coords = dict(zip(AXES, self.coordinates(world.rank)))
        self.pp_rank, self.dp_rank, self.cp_rank, self.tp_rank = (coords[a] for a in AXES)
        replicas, replica = dp * cp, self.dp_rank * cp + self.cp_rank
        self.ep_rank = replica % ep
        # one group per axis: the ranks that share every other coordinate, ordered along the axis
        self.pp_comm = self._group(["pp"], coords)
        self.dp_comm = self._group(["dp"], coords)
        self.cp_comm = self._group(["cp"], coords)
        self.tp_comm = self._group(["tp"], coords)
        self.grad_comm = self.dp_comm if cp == 1 else self._group(["dp", "cp"], coords, "dp·cp")
        stage = self.pp_rank * tp + self.tp_rank  # the (pp, tp) coordinates the expert groups share
        self.ep_comm = world.split(color=stage * (replicas // ep) + replica // ep, key=self.ep_rank, name="ep")
        self.expert_grad_comm = self.grad_comm if ep == 1 else world.split(
            color=stage * ep + self.ep_rank, key=replica // ep, name="expert dp")
        k = shard_group or replicas
        if k < 1 or replicas % k:
            raise ValueError(f"--shard-group {k} must divide the {replicas} data-parallel replicas (dp·cp)")
        self.shard_comm = self.grad_comm if k == replicas else self.grad_comm.split(
            color=self.grad_comm.rank // k, name="shard")
        self.shard_replica_comm = self.grad_comm.split(color=self.grad_comm.rank % k, name="shard replicas") \
            if k < replicas else None
        self.expert_shard_comm, self.expert_shard_replica_comm = self.expert_grad_comm, None
        if k < replicas and ep > 1:  # experts shard among the ranks of this shard group that hold the same experts
            self.expert_shard_comm = self.shard_comm.split(color=self.ep_rank, name="expert shard")
            self.expert_shard_replica_comm = self.expert_grad_comm.split(color=self.expert_shard_comm.rank,
                                                                         name="expert shard replicas")

    def communicators(self) -> list[Communicator]:
        """Every distinct group of this rank, the world first (a step's byte report sums their counters)."""
        groups = [self.world, self.dp_comm, self.cp_comm, self.tp_comm, self.pp_comm, self.grad_comm, self.ep_comm,
                  self.expert_grad_comm, self.shard_comm, self.shard_replica_comm, self.expert_shard_comm,
                  self.expert_shard_replica_comm]
        return list(dict.fromkeys(g for g in groups if g is not None))

    def _group(self, axes: list[str], coords: dict[str, int], name: str | None = None) -> Communicator:
        """The ranks whose coordinates differ from this rank's only along ``axes`` (key: their order there)."""
        color, key = 0, 0
        for axis in AXES:
            if axis in axes:
                key = key * self.sizes[axis] + coords[axis]
            else:
                color = color * self.sizes[axis] + coords[axis]
        return self.world.split(color=color, key=key, name=name or axes[0])

    # ---- moving state between whole tensors and this rank's pieces, as each parameter's placement says
    def local_state(self, full: dict[str, np.ndarray], placements: dict[str, Placement]) -> dict[str, np.ndarray]:
        """This rank's piece of every tensor of ``full`` named in ``placements`` (its tp split, its experts)."""
        out = {}
        for name, placement in placements.items():
            value = full[name]
            if placement.tp is not None and self.tp > 1:
                value = placement.tp.local(value, self.tp, self.tp_rank)
            if placement.experts and self.ep > 1:
                value = np.ascontiguousarray(np.array_split(value, self.ep)[self.ep_rank])
            out[name] = value
        return out

    def whole_state(self, local: dict[str, Any], placements: dict[str, Placement], axes: tuple[str, ...] = ("tp", "ep")
                    ) -> dict[str, Any]:
        """The whole tensors from every rank's piece over ``axes`` — one all-gather per split tensor and axis (in
        name order, the same on every rank); a tensor no axis splits is returned as it is."""
        out = dict(local)
        for name in sorted(local):
            placement, value = placements[name], np.ascontiguousarray(to_host(local[name]))
            if "tp" in axes and placement.tp is not None and self.tp > 1:
                pieces = self.tp_comm.all_gather(value.reshape(-1), label="checkpoint").reshape(self.tp, *value.shape)
                value = placement.tp.merge(list(pieces))
            if "ep" in axes and placement.experts and self.ep > 1:
                value = self.ep_comm.all_gather(value.reshape(-1), label="checkpoint").reshape(
                    self.ep * value.shape[0], *value.shape[1:])
            out[name] = value
        return out

    def coordinates(self, rank: int) -> tuple[int, int, int, int]:
        """(pp_rank, dp_rank, cp_rank, tp_rank) of a world rank."""
        return coordinates(rank, self.dp, self.cp, self.tp)

    def __repr__(self) -> str:
        shape = ", ".join(f"{a}={self.sizes[a]}" for a in (*AXES, "ep"))
        return f"Mesh({shape}; rank {self.world.rank} = {self.coordinates(self.world.rank)})"
