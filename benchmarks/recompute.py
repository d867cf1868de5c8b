"""Activation recomputation: bytes one forward keeps for backward (and the peak through backward) per rank,
for --recompute none / selective / full, with tensor parallelism and sequence parallelism, against the
accounting of minipar.models.gpt.activation_elements (one process) — and the step time each costs.

    python benchmarks/recompute.py                 # one process
    mpiexec -n 2 python benchmarks/recompute.py    # tp = 2, with and without --sp

GPT L=4 H=8 C=128 T=256, batch 4, float32; memory from tracemalloc (numpy reports its allocations there):
"kept" = allocated after the forward minus before it, "peak" = the most allocated at once during backward
above the same baseline; time = the best of 3 forward+backward passes.
"""
from __future__ import annotations

import time
import tracemalloc

import numpy as np

from minipar.comm import Communicator
from minipar.models.gpt import GPT, RECOMPUTE, GPTConfig, activation_elements
from minipar.parallel.tensor_parallel import tensor_parallel

L, H, C, T, B = 4, 8, 128, 256, 4


def measure(model: GPT, x: np.ndarray) -> tuple[int, int, float]:
    """(bytes kept after forward, peak bytes during backward, seconds per forward+backward)."""
    model(x, x)[1].backward()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        model(x, x)[1].backward()
        times.append(time.perf_counter() - t0)
    for p in model.parameters():
        p.grad = None
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    _, loss = model(x, x)
    kept = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.reset_peak()
    loss.backward()
    peak = tracemalloc.get_traced_memory()[1] - before
    tracemalloc.stop()
    return kept, peak, min(times)


def main() -> None:
    comm = Communicator()
    cfg = GPTConfig(block_size=T, n_layer=L, n_head=H, n_embd=C)
    x = np.random.default_rng(0).integers(0, 256, (B, T))
    if comm.rank == 0:
        print(f"GPT L={L} H={H} C={C} T={T}, batch {B}, float32, {comm.size} rank(s); MB per rank (rank 0)")
        print(f"{'layout':<10}{'recompute':<11}{'kept MB':>9}{'formula MB':>11}{'peak MB':>9}{'ms':>8}")
    for sp in ((False,) if comm.size == 1 else (False, True)):
        for mode in RECOMPUTE:
            model = GPT(cfg)
            if comm.size > 1:
                model = tensor_parallel(model, comm, sequence_parallel=sp)
            kept, peak, seconds = measure(model.set_recompute(mode), x)
            seconds = comm.mpi.allreduce(seconds, op=max) if comm.size > 1 else seconds
            formula = f"{activation_elements(cfg, B, mode) * 4 / 1e6:.2f}" if comm.size == 1 else "–"
            layout = "1 process" if comm.size == 1 else f"tp{comm.size}" + (" sp" if sp else "")
            if comm.rank == 0:
                print(f"{layout:<10}{mode:<11}{kept / 1e6:>9.2f}{formula:>11}{peak / 1e6:>9.2f}{seconds * 1e3:>8.1f}",
                      flush=True)


if __name__ == "__main__":
    main()
