"""Tutorial 3: data parallelism — same model everywhere, a slice of the batch each, summed gradients.

    mpiexec -n 4 python tutorials/03_data_parallel.py

Every rank also trains a single-process copy on the *whole* batch, and asserts that the
data-parallel model ends bit-for-bit close (rtol 1e-9, float64) to it. Each rank's loss is normalized by the
global batch's tokens (its mean times its share, 1/p), so the gradients sum over the ranks to the one process's.
"""
import numpy as np

from minipar.comm import Communicator
from minipar.data import Batches, load_tokens, shard_rows
from minipar.models.gpt import GPT, GPTConfig
from minipar.optim import AdamW
from minipar.parallel.data_parallel import DataParallel

comm = Communicator()
p, r = comm.size, comm.rank
say = print if r == 0 else (lambda *a, **k: None)
cfg = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=32, dtype="float64")
batches = Batches(load_tokens(), batch_size=4 * p, block_size=32, seed=0)

single = GPT(cfg, seed=100)                                 # the reference: one process, the whole batch
single_opt = AdamW(single.parameters(), lr=1e-3)
model = DataParallel(GPT(cfg, seed=100 + r), comm, bucket_mb=0.05)  # different seeds: wrapping broadcasts rank 0's
opt = AdamW(model.parameters(), lr=1e-3)
psi = sum(p_.size for p_ in model.parameters())
say(f"1. {p} ranks, GPT with Ψ = {psi:,} parameters in {len(model.buckets)} gradient buckets "
    f"(reverse layer order: {[len(b.params) for b in model.buckets]} parameters each)")

for step in range(5):
    x, y = batches(step)
    _, ref_loss = single(x, y)                              # single process: mean over all 4p rows
    ref_loss.backward()
    single_opt.step()
    single_opt.zero_grad()

    comm.reset_stats()
    _, loss = model(shard_rows(x, r, p), shard_rows(y, r, p))  # this rank: its 4 rows
    (loss * (1 / p)).backward()                              # its tokens / the global tokens; buckets all-reduce
                                                             # while backward runs
    launched = sum(b.handle is not None for b in model.buckets)
    model.sync_gradients()                                   # wait: p.grad = the sum over ranks
    opt.step()
    opt.zero_grad()
    mean_loss = comm.all_reduce(np.array([loss.item()]), op="avg", label="loss")[0]
    sent = comm.bytes_sent("grads")
    say(f"   step {step}: loss {mean_loss:.6f} (single process {ref_loss.item():.6f}); {launched}/{len(model.buckets)} "
        f"buckets were already in flight when backward returned; sent {sent:,} B vs 2(p−1)/p·Ψ·8 = {model.formula_bytes():,.0f}")
    assert abs(mean_loss - ref_loss.item()) <= 1e-9 * abs(ref_loss.item())
    assert launched == len(model.buckets)

for a, b in zip(model.parameters(), single.parameters()):
    np.testing.assert_allclose(a.data, b.data, rtol=1e-9, atol=1e-12)
say("2. after 5 steps every parameter equals the single-process one (rtol 1e-9)")

# Gradient accumulation: 2 microbatches per step; only the second backward communicates.
x, y = batches(99)
xs, ys = np.split(shard_rows(x, r, p), 2), np.split(shard_rows(y, r, p), 2)
comm.reset_stats()
with model.no_sync():
    (model(xs[0], ys[0])[1] * (0.5 / p)).backward()
assert comm.bytes_sent("grads") == 0
(model(xs[1], ys[1])[1] * (0.5 / p)).backward()
model.sync_gradients()
(single(x, y)[1]).backward()
for a, b in zip(model.parameters(), single.parameters()):
    np.testing.assert_allclose(a.grad, b.grad, rtol=1e-9, atol=1e-13)
say("3. two microbatches under no_sync() give the full-batch gradient; the first sent 0 bytes")
say("tutorial 3: all invariants hold")
