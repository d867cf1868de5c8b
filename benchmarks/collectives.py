"""Bandwidth of minipar's collectives against MPI's own, with nccl-tests' definitions.

    mpiexec -n 2 python benchmarks/collectives.py            # 1 KiB … 64 MiB, float32
    mpiexec -n 4 python benchmarks/collectives.py --max-mib 16 --ops all_reduce

algbw = S / t (S: the full buffer — all-reduce's vector, all-gather's output, reduce-scatter's input);
busbw = algbw · F with F = 2(p−1)/p for all-reduce, (p−1)/p for reduce-scatter and all-gather,
1 for broadcast: the bandwidth each link must sustain, comparable across p. Times are the median
of ``--iters`` runs, each started after a barrier, measured as the slowest rank's time.
"""
from __future__ import annotations

import argparse
import os
import time

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from minipar.comm import Communicator  # noqa: E402

BUS_FACTOR = {"all_reduce": lambda p: 2 * (p - 1) / p, "reduce_scatter": lambda p: (p - 1) / p,
              "all_gather": lambda p: (p - 1) / p, "broadcast": lambda p: 1.0}


def cases(comm: Communicator, n: int):
    """op -> (minipar call, MPI call) on an n-element float32 vector S."""
    p, mpi = comm.size, comm.mpi
    x, y = np.ones(n, np.float32), np.empty(n, np.float32)
    part = np.ones(n // p, np.float32)
    return {
        "all_reduce": (lambda: comm.all_reduce(x), lambda: mpi.Allreduce(x, y)),
        "reduce_scatter": (lambda: comm.reduce_scatter(x), lambda: mpi.Reduce_scatter_block(x, part)),
        "all_gather": (lambda: comm.all_gather(part), lambda: mpi.Allgather(part, y[:p * (n // p)])),
        "broadcast": (lambda: comm.broadcast(x), lambda: mpi.Bcast(x)),
    }


def timed(comm: Communicator, fn, iters: int) -> float:
    times = []
    for _ in range(iters):
        comm.mpi.Barrier()
        t0 = time.perf_counter()
        fn()
        times.append(comm.mpi.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--min-kib", type=int, default=1)
    ap.add_argument("--max-mib", type=int, default=64)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--ops", nargs="+", default=list(BUS_FACTOR), choices=list(BUS_FACTOR))
    args = ap.parse_args()
    comm = Communicator()
    p = comm.size
    sizes = []
    size = args.min_kib * 1024
    while size <= args.max_mib * 1024 * 1024:
        sizes.append(size)
        size *= 4
    if comm.rank == 0:
        print(f"p = {p}, float32, median of {args.iters}; GB/s = 1e9 bytes/s")
        print(f"{'op':<15}{'size':>10}{'minipar ms':>12}{'MPI ms':>10}{'ratio':>8}{'algbw':>8}{'busbw':>8}{'MPI busbw':>10}")
    for op in args.ops:
        for nbytes in sizes:
            ours, native = cases(comm, nbytes // 4)[op]
            ours(), native()  # warm up (allocations, connections)
            t_ours, t_mpi = timed(comm, ours, args.iters), timed(comm, native, args.iters)
            algbw = nbytes / t_ours / 1e9
            busbw, mpi_busbw = algbw * BUS_FACTOR[op](p), nbytes / t_mpi / 1e9 * BUS_FACTOR[op](p)
            if comm.rank == 0:
                label = f"{nbytes // 1024} KiB" if nbytes < 1 << 20 else f"{nbytes >> 20} MiB"
                print(f"{op:<15}{label:>10}{t_ours * 1e3:>12.3f}{t_mpi * 1e3:>10.3f}{t_ours / t_mpi:>8.2f}"
                      f"{algbw:>8.2f}{busbw:>8.2f}{mpi_busbw:>10.2f}", flush=True)


if __name__ == "__main__":
    main()
