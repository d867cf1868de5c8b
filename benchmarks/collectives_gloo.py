"""PyTorch's gloo backend on the same collectives, for comparison with benchmarks/collectives.py (optional:
torch is not a dependency of minipar; install it in any environment to run this).

    mpiexec -n 2 python benchmarks/collectives_gloo.py          # mpiexec only starts the processes
    mpiexec -n 4 python benchmarks/collectives_gloo.py --max-mib 16

Ranks find each other through a TCP store on 127.0.0.1 (this machine). Same sizes, float32 and definitions as
collectives.py: S the full buffer, busbw = S/t · F (F = 2(p−1)/p all-reduce, (p−1)/p reduce-scatter and
all-gather, 1 broadcast), the median of ``--iters`` runs of the slowest rank, each after a barrier.
"""
from __future__ import annotations

import argparse
import os
import time
import warnings

import torch
import torch.distributed as dist

from busbw import BUS_FACTOR, add_arguments, label, sizes  # benchmarks/busbw.py

OPS = ["all_reduce", "reduce_scatter", "all_gather", "broadcast"]


def case(op: str, n: int, p: int):
    x = torch.ones(n, dtype=torch.float32)
    whole, part = torch.ones(p * (n // p)), torch.ones(n // p)
    return {"all_reduce": lambda: dist.all_reduce(x),
            "reduce_scatter": lambda: dist.reduce_scatter_tensor(part, whole),
            "all_gather": lambda: dist.all_gather_into_tensor(whole, part),
            "broadcast": lambda: dist.broadcast(x, 0)}[op]


def timed(fn, iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        slowest = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        times.append(float(slowest))
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(ap, OPS)
    args = ap.parse_args()
    rank = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
    world = int(os.environ.get("PMI_SIZE", os.environ.get("OMPI_COMM_WORLD_SIZE", "1")))
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning)  # the *_tensor spellings, deprecated in torch 2.13
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29517", rank=rank, world_size=world)
    if rank == 0:
        print(f"p = {world}, gloo (torch {torch.__version__}), float32, median of {args.iters}; GB/s = 1e9 bytes/s")
        print(f"{'op':<15}{'size':>9}{'gloo ms':>10}{'busbw':>8}")
    for op in args.ops:
        for nbytes in sizes(args):
            supported = True
            try:
                t = timed(case(op, nbytes // 4, world), args.iters)
            except RuntimeError:  # an operation this torch's gloo lacks
                supported = False
            if rank == 0:
                if supported:
                    print(f"{op:<15}{label(nbytes):>9}{t * 1e3:>10.3f}{BUS_FACTOR[op](world) * nbytes / t / 1e9:>8.2f}", flush=True)
                else:
                    print(f"{op:<15}{label(nbytes):>9}  not supported by gloo here", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
