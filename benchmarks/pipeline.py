"""Pipeline bubble: the formula, the schedule's logical clock, and the wall clock.

    mpiexec -n 2 python benchmarks/pipeline.py [--n-embd 128 --n-layer 4]

For m microbatches on p stages the idle share should be (p−1)/(m+p−1) (GPipe, 1F1B), (p−1)/(v·m+p−1)
(interleaved 1F1B, v = 2 chunks per rank), (p−1)/(3m+p−1) for m ≥ p (ZB-H1, with F = B = W on the
logical clock) and (p−1)/(6m+p−1) for m ≥ 2p (DualPipeV; schedules.py). The wall-clock figure is
1 − (time in forward/backward spans) / (step time), averaged over stages; it also contains the
point-to-point transfer time and any imbalance between stages (the last one runs the head too).
"""
import argparse
import time

import numpy as np
from mpi4py import MPI

from minipar import trace
from minipar.comm import Communicator
from minipar.models.gpt import GPT, GPTConfig
from minipar.parallel.data_parallel import DataParallel
from minipar.parallel.pipeline import Pipeline
from minipar.parallel.schedules import build


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--microbatch-rows", type=int, default=2)
    args = ap.parse_args()
    comm = Communicator()
    p = comm.size
    cfg = GPTConfig(block_size=args.block_size, n_layer=args.n_layer, n_head=4, n_embd=args.n_embd)
    if comm.rank == 0:
        print(f"p = {p} stages, GPT L={cfg.n_layer} C={cfg.n_embd} T={cfg.block_size}, {args.microbatch_rows} rows per microbatch")
        print(f"{'schedule':<15}{'m':>4}{'formula':>9}{'logical':>9}{'wall clock':>12}{'step ms':>9}")
    for kind, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("dualpipev", 2)):
        for m in (1, 2, 4, 8, 16):
            try:
                schedule = build(kind, p, m, v)
            except ValueError:  # interleaved: m a multiple of p; dualpipev: m >= 2p
                continue
            model = GPT(cfg)
            pipeline = Pipeline(model, comm, schedule)
            engine = DataParallel(model, comm.split(color=comm.rank))
            x = np.random.default_rng(0).integers(0, 256, (m * args.microbatch_rows, args.block_size))
            pipeline.run(engine, x, x)  # warm-up
            trace.start(comm)
            t0 = time.perf_counter()
            pipeline.run(engine, x, x)
            step = comm.mpi.allreduce(time.perf_counter() - t0, op=MPI.MAX)
            trace.tracer.enabled = False
            busy = sum(e["dur"] for e in trace.tracer.events if e["cat"] in ("forward", "backward", "weights")) / 1e6
            wall = comm.mpi.allreduce(1 - busy / step, op=MPI.SUM) / p
            if comm.rank == 0:
                label = f"{kind} v{v}" if v > 1 else kind
                print(f"{label:<15}{m:>4}{schedule.bubble():>9.3f}{pipeline.stats['bubble']:>9.3f}"
                      f"{wall:>12.3f}{step * 1e3:>9.1f}", flush=True)

if __name__ == "__main__":
    main()
