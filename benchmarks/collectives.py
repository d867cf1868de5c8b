"""minipar's collectives against MPI's own, per size: the automatically chosen algorithm, every algorithm,
and nccl-tests' bandwidth definitions.

    mpiexec -n 2 python benchmarks/collectives.py                   # 1 KiB … 64 MiB, float32
    mpiexec -n 4 python benchmarks/collectives.py --max-mib 16 --ops all_reduce
    MINIPAR_RANKS_PER_NODE=2 mpiexec -n 4 python benchmarks/collectives.py --ops all_reduce   # two "nodes"

Per (op, size) it prints the algorithm the cost model chose and its time, the fastest algorithm and its
time, MPI's time, the ratio auto/MPI, and busbw of the automatic choice and of MPI.
algbw = S / t (S: the full buffer — all-reduce's vector, all-gather's output, reduce-scatter's input);
busbw = algbw · F with F = 2(p−1)/p for all-reduce, (p−1)/p for reduce-scatter, all-gather and
all-to-all, 1 for broadcast: the bandwidth each link must sustain, comparable across p. Times are the median
of ``--iters`` runs (more below 4 MiB), each started after a barrier, measured as the slowest rank's time;
the candidates (every algorithm, the automatic choice, MPI) take turns within each iteration. minipar's
reduce-scatter and all-gather write into preallocated outputs (``out=``), as MPI's do; all-gather runs in
place on both sides (this rank's block already in the output: ``MPI_IN_PLACE``), as ZeRO-3 and
sequence parallelism use it.
"""
from __future__ import annotations

import argparse
import os
import random
import time

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from minipar.comm import Communicator  # noqa: E402
from minipar.comm.tuning import ALGORITHMS  # noqa: E402
from busbw import BUS_FACTOR, add_arguments, label, sizes  # noqa: E402  (benchmarks/busbw.py)



def cases(comm: Communicator, op: str, n: int):
    """(minipar call taking algorithm=, MPI call) on an n-element float32 vector S."""
    p, mpi = comm.size, comm.mpi
    x, y = np.zeros(n, np.float32), np.empty(n, np.float32)  # zeros: summed in place again and again, they stay finite
    part, whole = np.ones(n // p, np.float32), np.ones(p * (n // p), np.float32)
    mine = whole[comm.rank * (n // p):(comm.rank + 1) * (n // p)]
    return {
        "all_reduce": (lambda alg: comm.all_reduce(x, algorithm=alg), lambda: mpi.Allreduce(x, y)),
        "reduce_scatter": (lambda alg: comm.reduce_scatter(whole, algorithm=alg, out=part),
                           lambda: mpi.Reduce_scatter_block(whole, part)),
        "all_gather": (lambda alg: comm.all_gather(mine, algorithm=alg, out=whole),
                       lambda: mpi.Allgather(MPI.IN_PLACE, whole)),
        "broadcast": (lambda alg: comm.broadcast(x, algorithm=alg), lambda: mpi.Bcast(x)),
        "all_to_all": (lambda alg: comm.all_to_all(whole, algorithm=alg), lambda: mpi.Alltoall(whole, x[:whole.size])),
    }[op]


def timed(comm: Communicator, candidates: dict, iters: int) -> dict:
    """Median seconds of each candidate (the slowest rank's time per run, each run after a barrier).
    The candidates take turns within every iteration, in an order shuffled alike on every rank, so
    that the machine's slow and fast phases fall on all of them alike, and so does the state the
    previous call leaves behind (which cache holds which lines of the buffers: a fixed order made
    the same algorithm 3× slower behind one predecessor than behind another)."""
    names = list(candidates)
    for fn in candidates.values():
        fn()  # warm up (allocations, connections)
    times: dict = {name: [] for name in names}
    order = random.Random(0)  # the same sequence on every rank
    for _ in range(iters):
        order.shuffle(names)
        for name in names:
            comm.mpi.Barrier()
            t0 = time.perf_counter()
            candidates[name]()
            times[name].append(comm.mpi.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(ap, list(BUS_FACTOR))
    args = ap.parse_args()
    comm = Communicator()
    p = comm.size
    if comm.rank == 0:
        model = comm.cost_model()
        print(f"p = {p} on {comm._node_count()} node(s), float32, median of {args.iters}; GB/s = 1e9 bytes/s; cost "
              f"model α = {model.alpha * 1e6:.1f} µs, 1/β = {1e-9 / max(model.beta, 1e-30):.1f} GB/s, "
              f"1/γ = {1e-9 / max(model.gamma, 1e-30):.1f} GB/s")
        print(f"{'op':<15}{'size':>9} {'auto':<19}{'ms':>8} {'fastest':<19}{'ms':>8}{'MPI ms':>8}{'auto/MPI':>9}"
              f"{'busbw':>7}{'MPI':>7}")
    else:
        comm.cost_model()
    for op in args.ops:
        for nbytes in sizes(args):
            ours, native = cases(comm, op, nbytes // 4)
            candidates = {alg: (lambda alg=alg: ours(alg)) for alg in ALGORITHMS[op]
                          if alg != "hierarchical" or comm._hierarchy() is not None}
            candidates.update({"auto": lambda: ours(None), "MPI": native})
            iters = min(args.iters * max(1, (4 << 20) // nbytes), 20 * args.iters)  # small calls: cheap and noisy
            t = timed(comm, candidates, iters)
            comm.reset_stats()
            ours(None)
            t_auto, t_mpi = t.pop("auto"), t.pop("MPI")
            t_alg = t
            chosen = comm.stats[op].algorithm
            fastest = min(t_alg, key=t_alg.get)
            if comm.rank == 0:
                bus = BUS_FACTOR[op](p) * nbytes / 1e9
                print(f"{op:<15}{label(nbytes):>9} {chosen:<19}{t_auto * 1e3:>8.4f} {fastest:<19}{t_alg[fastest] * 1e3:>8.4f}"
                      f"{t_mpi * 1e3:>8.4f}{t_auto / t_mpi:>9.2f}{bus / t_auto:>7.2f}{bus / t_mpi:>7.2f}", flush=True)


if __name__ == "__main__":
    main()
