"""Tutorial 11: splitting the sequence — Megatron sequence parallelism, ring attention (zigzag) and Ulysses.

    mpiexec -n 4 python tutorials/11_sequence_and_context.py

1. Where each rank's tokens sit under the zigzag and contiguous splits, and why causal attention needs zigzag.
2. Ring attention and Ulysses over 4 ranks: forward and gradients equal the unsplit model's (float64).
3. Sequence parallelism over 4 tp ranks: the layer-norm activations per rank are a quarter of TP's.
"""
import numpy as np

from minipar.comm import Communicator
from minipar.data import Batches, load_tokens
from minipar.models.gpt import GPT, GPTConfig
from minipar.parallel.context_parallel import chunk_positions, context_parallel, context_slice
from minipar.parallel.tensor_parallel import tensor_parallel

comm = Communicator()
N, r = comm.size, comm.rank
say = print if r == 0 else (lambda *a, **k: None)
T = 16
say(f"1. T = {T} positions over {N} ranks (digit = the rank that holds the position):")
for split in ("contiguous", "zigzag"):
    owner = np.empty(T, int)
    for rank in range(N):
        owner[chunk_positions(rank, N, T // N, split)] = rank
    say(f"   {split:<10} " + "".join(str(o) for o in owner))
    assert sorted(np.concatenate([chunk_positions(k, N, T // N, split) for k in range(N)])) == list(range(T))
say("   causal attention: position i attends to 0…i, so the rank holding the end of the sequence does the most")
say("   work; zigzag gives every rank one early and one late chunk.")

cfg = GPTConfig(vocab_size=256, block_size=T, n_layer=2, n_head=4, n_embd=16, dtype="float64")
x, y = Batches(load_tokens(), batch_size=2, block_size=T, seed=0)(0)
reference = GPT(cfg, seed=1)
_, full_loss = reference(x, y)
full_loss.backward()
want = {n: p.grad for n, p in reference.named_parameters()}
say("2. each rank computes its T/N tokens; attention gets the rest from the other ranks:")
for kind, split in (("ring", "zigzag"), ("ring", "contiguous"), ("ulysses", "contiguous")):
    model = context_parallel(GPT(cfg, seed=1), comm, kind, split)
    _, loss = model(context_slice(x, comm, split), context_slice(y, comm, split))
    loss.backward()
    total = comm.all_reduce(np.array([loss.item()]), op="avg")[0]  # equal token counts: the mean of the means
    assert abs(total - full_loss.item()) < 1e-12
    for name, p in model.named_parameters():  # each rank's gradient is its share of the mean over all tokens
        np.testing.assert_allclose(comm.all_reduce(p.grad.copy(), op="avg"), want[name], rtol=1e-9, atol=1e-12)
    balance = ""
    if kind == "ring":
        work = comm.mpi.allgather(model.context_work["pairs"])
        assert (max(work) == min(work)) == (split == "zigzag")
        balance = f"; (query, key) pairs scored per rank {work}, max/min {max(work) / min(work):.2f}"
    say(f"   {kind:<7} {split:<10} loss {total:.12f} = single process{balance}")

say("3. sequence parallelism: layer norms and residuals on T/tp shards (all-gather / reduce-scatter around the")
say("   tensor-parallel layers instead of all-reduces)")
sizes = {}
for sp in (False, True):
    model = tensor_parallel(GPT(cfg, seed=1), comm, sequence_parallel=sp)
    shapes = []
    model.transformer.h[0].ln_1.register_forward_hook(lambda module, out: shapes.append(out.shape) or out)
    _, loss = model(x, y)
    assert abs(loss.item() - full_loss.item()) < 1e-12
    sizes[sp] = shapes[0]
    say(f"   {'TP + SP' if sp else 'TP     '}: every layer norm sees {shapes[0]} on each rank; loss = single process")
assert sizes[True][1] * N == sizes[False][1]
say("all invariants hold")
