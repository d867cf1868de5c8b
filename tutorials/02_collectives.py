"""Tutorial 2: collectives from point-to-point messages, and the α-β-γ cost model.

    mpiexec -n 4 python tutorials/02_collectives.py [--plot DIR]   (--plot: the ring's steps for p ranks, drawn)

1. Watch a ring reduce-scatter + all-gather move chunks around (p − 1 steps each).
2. Calibrate α (latency), β (seconds/byte) and γ (seconds/byte to reduce) on this machine.
3. For each algorithm, compare counted bytes with the formula, and the model's time with the clock.
Every rank checks its result against MPI's own Allreduce.
"""
import os
import sys
import time

import numpy as np
from mpi4py import MPI

from minipar.comm import Communicator
from minipar.comm.collectives import chunk_bounds

comm = Communicator()
p, r = comm.size, comm.rank
say = print if r == 0 else (lambda *a, **k: None)

# 1. The ring schedule --------------------------------------------------------------------------
say(f"1. Ring reduce-scatter on {p} ranks: at step s rank r sends chunk (r-s-1) mod p right, "
    f"receives chunk (r-s-2) mod p from the left and adds it in.")
for s in range(p - 1):
    say("   step", s, " ".join(f"r{k}:send c{(k - s - 1) % p}/recv c{(k - s - 2) % p}" for k in range(p)))
say(f"   after {p - 1} steps rank r owns the full sum of chunk r; the all-gather then circulates the sums.")
x = np.arange(4 * p, dtype=np.float64) * (r + 1)
expected = np.arange(4 * p, dtype=np.float64) * p * (p + 1) / 2
comm.all_reduce(x, algorithm="ring")
assert np.array_equal(x, expected)

# 2. Calibrate α, β, γ --------------------------------------------------------------------------
def pingpong(nbytes: int, reps: int = 50) -> float:
    """One-way time of an nbytes message between ranks 0 and 1 (the others idle)."""
    buf = np.zeros(nbytes, np.uint8)
    comm.mpi.Barrier()
    t0 = time.perf_counter()
    for _ in range(reps):
        if r == 0:
            comm.mpi.Send(buf, 1)
            comm.mpi.Recv(buf, 1)
        elif r == 1:
            comm.mpi.Recv(buf, 0)
            comm.mpi.Send(buf, 0)
    return comm.mpi.bcast((time.perf_counter() - t0) / (2 * reps), root=0)

alpha = pingpong(8)
big = 8 << 20
beta = (pingpong(big, reps=5) - alpha) / big
a, b = np.ones(big // 8), np.ones(big // 8)
t0 = time.perf_counter()
for _ in range(5):
    np.add(a, b, out=a)
gamma = comm.mpi.allreduce((time.perf_counter() - t0) / 5 / big, op=MPI.MAX)
say(f"2. α = {alpha * 1e6:.1f} µs, β = {beta * 1e9:.3f} ns/B ({1 / beta / 1e9:.1f} GB/s), "
    f"γ = {gamma * 1e9:.3f} ns/B (numpy add)")

# 3. Model vs measurement -----------------------------------------------------------------------
log_p = (p - 1).bit_length()  # ⌈log₂p⌉
MODELS = {  # algorithm -> (bytes sent by one rank, predicted seconds), n = message bytes
    "ring": lambda n: (2 * (p - 1) / p * n, 2 * (p - 1) * alpha + 2 * (p - 1) / p * n * beta + (p - 1) / p * n * gamma),
    "recursive_doubling": lambda n: (log_p * n, log_p * (alpha + n * (beta + gamma))),
}
say(f"3. all-reduce, float64, p = {p} (counted bytes are rank 0's; times: median of 5, slowest rank)")
say(f"   {'algorithm':<20}{'size':>9}{'sent B':>11}{'formula B':>11}{'model ms':>10}{'measured ms':>12}")
for n_elems in (128, 8192, 1 << 20):
    n = n_elems * 8
    for algorithm, model in MODELS.items():
        if algorithm == "recursive_doubling" and p & (p - 1):
            continue  # the formula above is for powers of two
        x = np.random.default_rng(r).standard_normal(n_elems)
        reference = np.empty_like(x)
        comm.mpi.Allreduce(x, reference)
        times = []
        for _ in range(5):
            y = x.copy()
            comm.reset_stats()
            comm.mpi.Barrier()
            t0 = time.perf_counter()
            comm.all_reduce(y, algorithm=algorithm)
            times.append(comm.mpi.allreduce(time.perf_counter() - t0, op=MPI.MAX))
        assert np.allclose(y, reference, rtol=1e-12, atol=1e-12)
        sent = comm.stats["all_reduce"].bytes
        formula, predicted = model(n)
        if n_elems % p == 0:
            assert sent == formula, (sent, formula)
        say(f"   {algorithm:<20}{n // 1024:>7}KiB{sent:>11,}{formula:>11,.0f}{predicted * 1e3:>10.3f}"
            f"{sorted(times)[2] * 1e3:>12.3f}")
say("   Latency dominates small messages (recursive doubling's log₂p messages win);")
say("   bandwidth dominates large ones (the ring sends 2(p−1)/p·n instead of log₂p·n).")
bounds = chunk_bounds(10, p)
say(f"   (uneven sizes are fine: n = 10 on {p} ranks cuts into chunks {[bounds[i + 1] - bounds[i] for i in range(p)]})")
if "--plot" in sys.argv and r == 0:  # --plot DIR: each step of the ring as the real algorithm sent it
    from minipar.figures import draw_ring

    folder = sys.argv[sys.argv.index("--plot") + 1]
    os.makedirs(folder, exist_ok=True)
    for phase in ("reduce-scatter", "all-gather"):
        draw_ring(p, phase, os.path.join(folder, f"ring_{phase.replace('-', '_')}.svg"))
    say(f"drew the ring's steps into {folder}/")
say("tutorial 2: all invariants hold")
