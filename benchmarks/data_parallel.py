"""Data-parallel step time and exposed communication, overlap on vs off, and each ZeRO stage.

    mpiexec -n 2 python benchmarks/data_parallel.py [--n-embd 256 --n-layer 4 --batch-size 8]

"compute" is the same step on the same local batch with no communication (a 1-rank
communicator); "exposed comm" = step − compute: the communication the step had to wait for;
"param wait" (ZeRO-3): the time the step waited for whole parameters, with and without prefetch.
"""
import argparse
import time

import numpy as np
from mpi4py import MPI

from minipar.comm import Communicator
from minipar.models.gpt import GPT, GPTConfig
from minipar.optim import AdamW
from minipar.parallel.data_parallel import DataParallel
from minipar.parallel.zero import ZeRO
from train_step import add_data_parallel_arguments  # benchmarks/train_step.py


MODES = ["compute", "dp, overlap", "dp, no overlap", "zero-1", "zero-2", "zero-3", "zero-3, no prefetch"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_data_parallel_arguments(ap)
    ap.add_argument("--modes", nargs="+", default=MODES, choices=MODES, help="compute is always run")
    args = ap.parse_args()
    world = Communicator()
    alone = world.split(color=world.rank, name="alone")
    cfg = GPTConfig(vocab_size=args.vocab_size, block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head,
                    n_embd=args.n_embd)
    x = np.random.default_rng(world.rank).integers(0, args.vocab_size, (args.batch_size, args.block_size))

    def engine_for(name: str):
        model = GPT(cfg)
        comm = alone if name == "compute" else world
        if name.startswith("zero"):
            engine = ZeRO(model, comm, int(name[5]), bucket_mb=args.bucket_mb, prefetch="no prefetch" not in name)
            return engine, engine
        return DataParallel(model, comm, args.bucket_mb, overlap=name != "dp, no overlap"), AdamW(model.parameters())

    engines = {}

    waits = {}

    def step_ms(name: str) -> float:
        engine, opt = engines.setdefault(name, engine_for(name))
        times = []
        for _ in range(args.steps):
            engine.gather_wait_s = 0.0  # ZeRO-3: time spent waiting for whole parameters this step
            world.mpi.Barrier()
            t0 = time.perf_counter()
            _, loss = engine(x, x)
            loss.backward()
            engine.sync_gradients()
            opt.step()
            opt.zero_grad()
            times.append(world.mpi.allreduce(time.perf_counter() - t0, op=MPI.MAX))
            if name.startswith("zero-3"):
                waits[name] = min(waits.get(name, float("inf")), world.mpi.allreduce(engine.gather_wait_s, op=MPI.MAX))
        return 1e3 * min(times)

    names = ["compute"] + [m for m in args.modes if m != "compute"]
    step_ms(names[0])  # warm up the allocator and the BLAS
    results = {n: float("inf") for n in names}
    for _ in range(args.rounds):  # interleaved rounds: a shared machine's slow spells hit every mode alike
        for n in names:
            results[n] = min(results[n], step_ms(n))
    if world.rank == 0:
        psi = GPT(cfg).num_parameters()
        print(f"p = {world.size}, GPT {psi:,} params, local batch {args.batch_size}×{args.block_size}, "
              f"buckets {args.bucket_mb} MiB, best of {args.rounds}×{args.steps} steps")
        print(f"{'mode':<20}{'step ms':>9}{'exposed comm ms':>17}{'param wait ms':>15}")
        for n in names:
            wait = f"{waits[n] * 1e3:.1f}" if n in waits else "–"
            print(f"{n:<20}{results[n]:>9.1f}{results[n] - results['compute']:>17.1f}{wait:>15}")


if __name__ == "__main__":
    main()
