"""Does communication overlap computation? Time compute alone, an async all-reduce alone, and both.

    mpiexec -n 2 python benchmarks/overlap.py [--mib 32]

With perfect overlap, both ≈ max(compute, comm); with none, both ≈ compute + comm. The async
all-reduce runs on minipar's communication thread while the main thread does matrix products.
"""
import argparse
import os
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from mpi4py import MPI  # noqa: E402

from minipar.comm import Communicator  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=32, help="all-reduce size")
    ap.add_argument("--matmuls", type=int, default=20, help="512×512 float64 products of compute")
    args = ap.parse_args()
    comm = Communicator()
    x = np.ones(args.mib * 2**20 // 8)
    a = np.random.default_rng(0).standard_normal((512, 512)) / 512

    def compute() -> None:
        b = a
        for _ in range(args.matmuls):
            b = a @ b

    def timed(fn) -> float:
        comm.mpi.Barrier()
        t0 = time.perf_counter()
        fn()
        return comm.mpi.allreduce(time.perf_counter() - t0, op=MPI.MAX)

    def both() -> None:
        handle = comm.all_reduce(x, async_op=True)
        compute()
        handle.wait()

    results = {name: min(timed(fn) for _ in range(3)) for name, fn in
               [("compute", compute), ("comm", lambda: comm.all_reduce(x)), ("both", both)]}
    if comm.rank == 0:
        c, m, b = results["compute"], results["comm"], results["both"]
        hidden = (c + m - b) / min(c, m)
        print(f"p={comm.size}: compute {c * 1e3:.1f} ms, all-reduce {args.mib} MiB {m * 1e3:.1f} ms, "
              f"overlapped {b * 1e3:.1f} ms (serial would be {(c + m) * 1e3:.1f}); "
              f"{100 * hidden:.0f}% of the shorter one hidden")


if __name__ == "__main__":
    main()
