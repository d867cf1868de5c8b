"""PyTorch DistributedDataParallel (gloo) on the GPT of benchmarks/train_step.py: the anchor for the
"dp, overlap" row of benchmarks/data_parallel.py (optional: torch is not a minipar dependency).

    mpiexec -n 2 python benchmarks/ddp.py          # mpiexec only starts the processes; gloo connects them

Same model, local batch (--batch-size per rank) and bucket size (--bucket-mb, minipar's default 1 MiB) as
minipar's DataParallel. "compute" is the same step without DDP (no communication); exposed comm = step −
compute. Each time is the slowest rank's, after a barrier; best of --rounds × --steps, modes interleaved.
"""
from __future__ import annotations

import argparse
import os
import time

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from train_step import add_data_parallel_arguments, torch_step  # noqa: E402  (benchmarks/train_step.py)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_data_parallel_arguments(ap)
    args = ap.parse_args()
    args.dtype = "float32"
    rank = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
    world = int(os.environ.get("PMI_SIZE", os.environ.get("OMPI_COMM_WORLD_SIZE", "1")))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29519", rank=rank, world_size=world)
    steps = {"compute": torch_step(args),
             "ddp, overlap": torch_step(args, lambda m: torch.nn.parallel.DistributedDataParallel(
                 m, bucket_cap_mb=args.bucket_mb))}

    def step_ms(name: str) -> float:
        times = []
        for _ in range(args.steps):
            dist.barrier()
            t0 = time.perf_counter()
            steps[name]()
            slowest = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            times.append(float(slowest))
        return 1e3 * min(times)

    for name in steps:
        step_ms(name)  # warm up
    results = {name: float("inf") for name in steps}
    for _ in range(args.rounds):
        for name in steps:
            results[name] = min(results[name], step_ms(name))
    if rank == 0:
        print(f"p = {world}, PyTorch {torch.__version__} DDP (gloo), local batch {args.batch_size}×{args.block_size}, "
              f"buckets {args.bucket_mb} MiB, best of {args.rounds}×{args.steps} steps")
        print(f"{'mode':<20}{'step ms':>9}{'exposed comm ms':>17}")
        for name, ms in results.items():
            print(f"{name:<20}{ms:>9.1f}{ms - results['compute']:>17.1f}", flush=True)
    dist.barrier()
    os._exit(0)  # torch 2.14's gloo aborts ("terminate called without an active exception") when DDP is torn down


if __name__ == "__main__":
    main()
