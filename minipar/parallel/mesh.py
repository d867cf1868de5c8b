"""The device mesh: world = pp × dp × tp ranks, tp fastest (Megatron's order).

    rank = (pp_rank · dp + dp_rank) · tp + tp_rank

Tensor-parallel groups are runs of tp consecutive ranks — on a real cluster, the GPUs of one node
joined by NVLink, where TP's per-layer all-reduces belong. Data-parallel groups stride by tp, and
pipeline stages by dp·tp. Each group is an MPI sub-communicator (``MPI_Comm_split``).

    mesh = Mesh(Communicator(), dp=2, tp=2, pp=2)   # 8 ranks
    mesh.tp_comm, mesh.dp_comm, mesh.pp_comm        # this rank's three groups
"""
from __future__ import annotations

from minipar.comm import Communicator


class Mesh:
    def __init__(self, world: Communicator, dp: int = 1, tp: int = 1, pp: int = 1):
        for name, size in (("dp", dp), ("tp", tp), ("pp", pp)):
            if size < 1:
                raise ValueError(f"--{name} must be >= 1, got {size}")
        if dp * tp * pp != world.size:
            raise ValueError(f"world size {world.size} != dp·tp·pp = {dp}·{tp}·{pp}; launch with mpiexec -n {dp * tp * pp}")
        self.world, self.dp, self.tp, self.pp = world, dp, tp, pp
        self.pp_rank, self.dp_rank, self.tp_rank = self.coordinates(world.rank)
        # color = the coordinates the group members share; key = the rank's position within the group
        self.tp_comm = world.split(color=self.pp_rank * dp + self.dp_rank, key=self.tp_rank, name="tp")
        self.dp_comm = world.split(color=self.pp_rank * tp + self.tp_rank, key=self.dp_rank, name="dp")
        self.pp_comm = world.split(color=self.dp_rank * tp + self.tp_rank, key=self.pp_rank, name="pp")

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """(pp_rank, dp_rank, tp_rank) of a world rank."""
        return rank // (self.dp * self.tp), rank // self.tp % self.dp, rank % self.tp

    def __repr__(self) -> str:
        return f"Mesh(pp={self.pp}, dp={self.dp}, tp={self.tp}; rank {self.world.rank} = {self.coordinates(self.world.rank)})"
