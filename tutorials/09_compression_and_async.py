"""Tutorial 9: sending fewer bytes — gradient compression, local SGD / DiLoCo, bounded staleness.

    mpiexec -n 4 python tutorials/09_compression_and_async.py [--plot bytes.svg]   (--plot: part 1's bytes, drawn)

1. Each compressor reduces one gradient bucket; we print its bytes on the wire, the ratio to the
   float32 ring all-reduce, and its error against MPI's exact sum.
2. Error feedback: what top-k does not send is not lost — it is sent later.
3. Local SGD with H = 1, inner SGD and plain averaging is synchronous data parallelism; with H = 8 it
   communicates 8× less; DiLoCo adds an outer Nesterov step; staleness lets the average arrive late.
"""
import sys

import numpy as np

from minipar.comm import Communicator
from minipar.comm.collectives import all_reduce_bytes_sent
from minipar.models.gpt import GPT, GPTConfig
from minipar.nn import Parameter
from minipar.optim import SGD
from minipar.parallel.compression import Cast, Int8, PowerSGD, TopK
from minipar.parallel.data_parallel import Bucket, DataParallel
from minipar.parallel.local_sgd import LocalSGD

comm = Communicator()
p, r = comm.size, comm.rank
say = print if r == 0 else (lambda *a, **k: None)

# 1. Compressors on one bucket: a 64×48 matrix and a bias, float32 ------------------------------------
shapes = [(64, 48), (48,)]
bucket = Bucket([Parameter(np.zeros(s, np.float32)) for s in shapes])
rng = np.random.default_rng(r)
low_rank = np.random.default_rng(7).standard_normal((64, 3)) @ rng.standard_normal((3, 48))  # gradients are ~low rank
g = np.concatenate([(low_rank + 0.05 * rng.standard_normal((64, 48))).ravel(), rng.standard_normal(48)]).astype(np.float32)
exact = np.empty_like(g)
comm.mpi.Allreduce(g, exact)  # the sum: each rank's gradient already carries its share of the global tokens
full = all_reduce_bytes_sent(g.size, 4, p, 0, "ring")
say(f"1. one bucket of {g.size:,} float32 on {p} ranks; the float32 ring all-reduce sends {full:,} B per rank")
wire = {"float32 ring": full}
for compressor in (Cast("float16"), Cast("bfloat16"), Int8(), TopK(0.05), PowerSGD(rank=4)):
    out = g.copy()
    comm.reset_stats()
    compressor.reduce(comm, bucket, out)
    sent = comm.bytes_sent("grads")
    error = np.linalg.norm(out - exact) / np.linalg.norm(exact)
    say(f"   {compressor.name:<16} sends {sent:>7,} B ({full / sent:5.1f}× fewer), relative error {error:.1e}")
    wire[f"{compressor.name} (error {error:.0e})"] = sent
    same = np.empty((p, out.size), np.float32)
    comm.mpi.Allgather(out, same)
    assert (same == out).all(), "replicas must stay identical"
if "--plot" in sys.argv and r == 0:  # --plot FILE.svg: the bytes each method put on the wire for this bucket
    from minipar.figures import draw_bars

    draw_bars(sys.argv[sys.argv.index("--plot") + 1], wire, "bytes rank 0 sent",
              f"one all-reduced bucket of {g.size:,} float32 on {p} ranks")

# 2. Error feedback --------------------------------------------------------------------------------
topk, sent_sum, grad_sum = TopK(0.02), np.zeros(g.size), np.zeros(g.size)
for step in range(10):
    grad = np.random.default_rng((r, step)).standard_normal(g.size).astype(np.float32)
    out = grad.copy()
    topk.reduce(comm, bucket, out)
    sent_sum += out
    grad_sum += grad
held = topk.residual[id(bucket)]
total = np.empty_like(grad_sum)
comm.mpi.Allreduce(grad_sum - held, total)
say(f"2. 10 steps of top-2%: Σ sent sums = sum over ranks of (Σ gradients − what is still held back), "
    f"max difference {np.abs(sent_sum - total).max():.1e}")
assert np.allclose(sent_sum, total, atol=1e-4)

# 3. Local SGD ----------------------------------------------------------------------------------------
cfg = GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16, dtype="float64")
alone = comm.split(color=r)
dp, local = GPT(cfg, seed=1), GPT(cfg, seed=1)
dp_engine, dp_opt = DataParallel(dp, comm), SGD(dp.parameters(), lr=0.1)
local_engine, local_opt = DataParallel(local, alone), SGD(local.parameters(), lr=0.1)
averager = LocalSGD(local, comm, sync_every=1, outer_lr=1.0, outer_momentum=0.0)
for step in range(5):
    x = np.random.default_rng((r, step)).integers(0, 32, (2, 8))
    for engine, opt, share in ((dp_engine, dp_opt, 1 / p), (local_engine, local_opt, 1.0)):
        (engine(x, x)[1] * share).backward()  # the tokens whose gradients sum: all p ranks', or its own
        engine.sync_gradients()
        opt.step()
        opt.zero_grad()
    averager.step()
worst = max(np.abs(a.data - b.data).max() for a, b in zip(dp.parameters(), local.parameters()))
say(f"3. local SGD, H = 1, SGD inside, averaging outside = synchronous DP: max parameter difference {worst:.1e}")
assert worst < 1e-12
model = GPT(cfg, seed=2)
comm.reset_stats()
diloco = LocalSGD(model, comm, sync_every=8, staleness=1)
opt = SGD(model.parameters(), lr=0.05)
for step in range(32):
    x = np.random.default_rng((r, step)).integers(0, 32, (2, 8))
    model(x, x)[1].backward()
    opt.step()
    opt.zero_grad()
    diloco.step()
diloco.finish()
say(f"   DiLoCo, H = 8, staleness 1: {diloco.rounds} rounds in 32 steps, {comm.bytes_sent('grads'):,} B sent "
    f"(synchronous DP: {32 * diloco.formula_bytes_per_round():,.0f} B); replicas agree after finish()")
mine = np.concatenate([q.data.ravel() for q in model.parameters()])
everyone = np.empty((p, mine.size))
comm.mpi.Allgather(mine, everyone)
assert (everyone == mine).all()
say("   (benchmarks/communication.py trains the default GPT with each method: loss against bytes)")
say("tutorial 9: all invariants hold")
