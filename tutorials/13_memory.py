"""Tutorial 13: memory — what a rank holds, and the three tools that shrink it: ZeRO, mixed precision and
activation recomputation. Every number printed is asserted.

    mpiexec -n 4 python tutorials/13_memory.py [--plot memory.svg]    (--plot: part 2's activations, drawn)

A rank's memory is model states (parameters, gradients, optimizer state) plus activations (what forward
keeps for backward).

1. Model states for Ψ parameters on N ranks (the ZeRO paper's table; optim.py, zero.py). In float32 AdamW
   holds 4 + 4 + 8 = 16 bytes per parameter. Mixed precision keeps 16-bit parameters and gradients but adds a
   float32 master copy: 2 + 2 + 12 = 16 bytes, the same — it is no model-state saving. ZeRO shards it:
   stage 1 the optimizer state (4Ψ + 12Ψ/N), stage 2 also the gradients (2Ψ + 14Ψ/N), stage 3 also the
   parameters (16Ψ/N). The bytes below are counted from the live arrays, not computed.
2. Activations (models/gpt.py, activation_elements): per block 24·s·b·h + a·s²·b elements (s = T, b = batch,
   h = width, a = heads). Selective recomputation drops the a·s²·b attention probabilities; full
   recomputation keeps only each block's input. Measured with tracemalloc: float32 against the accounting;
   bfloat16 keeps its block activations in 16 bits, about two thirds of float32's bytes here (some arrays
   stay float32, the cross-entropy's probabilities among them).
"""
import sys
import tracemalloc

import numpy as np

from minipar.comm import Communicator
from minipar.data import Batches, load_tokens, shard_rows
from minipar.models.gpt import GPT, GPTConfig, activation_elements
from minipar.optim import AdamW
from minipar.parallel.data_parallel import DataParallel
from minipar.parallel.zero import ZeRO

comm = Communicator()
n, r = comm.size, comm.rank
say = print if r == 0 else (lambda *a, **k: None)
cfg = GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=32)
x, y = Batches(load_tokens(), batch_size=2 * n, block_size=16, seed=0)(0)
psi = GPT(cfg).num_parameters()
assert psi % n == 0  # every shard exactly Ψ/N: the table holds with ==

say(f"1. Model states of Ψ = {psi:,} parameters on N = {n} ranks, bytes per rank (counted / the table):")
table = {("float32", 0): 16, ("bfloat16", 0): 16, ("bfloat16", 1): 4 + 12 / n, ("bfloat16", 2): 2 + 14 / n,
         ("bfloat16", 3): 16 / n}
for (dtype, stage), per_parameter in table.items():
    model = GPT(GPTConfig(**{**cfg.__dict__, "dtype": dtype}), seed=0)
    if stage:
        engine = optimizer = ZeRO(model, comm, stage, lr=1e-3)
    else:
        engine, optimizer = DataParallel(model, comm), AdamW(model.parameters(), lr=1e-3)
    _, loss = engine(shard_rows(x, r, n), shard_rows(y, r, n))
    (loss * (1 / n)).backward()
    engine.sync_gradients()
    optimizer.step()  # the optimizer state exists from the first step on
    counted = engine.model_state_bytes(optimizer)
    name = "fp32 DP" if dtype == "float32" else f"mixed ZeRO-{stage}" if stage else "mixed DP"
    say(f"   {name:<13} params {counted['params']:>8,}  grads {counted['grads']:>8,}  optimizer {counted['optimizer']:>8,}"
        f"  total {sum(counted.values()):>8,} = {per_parameter:g}Ψ")
    assert sum(counted.values()) == per_parameter * psi
    optimizer.zero_grad()

say("2. Activations one forward keeps for backward (one rank, batch 8), bytes (measured / accounted in float32):")
batch = np.random.default_rng(0).integers(0, 256, (8, cfg.block_size))
held = {}
for dtype in ("float32", "bfloat16"):
    for mode in ("none", "selective", "full"):
        model = GPT(GPTConfig(**{**cfg.__dict__, "dtype": dtype}), seed=0).set_recompute(mode)
        model(batch, batch)[1].backward()  # first-use caches (masks) out of the way
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        _, loss = model(batch, batch)
        held[dtype, mode] = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        accounted = activation_elements(cfg, 8, mode) * 4
        say(f"   {dtype:<9} recompute {mode:<10} {held[dtype, mode]:>9,}" + (f" / {accounted:>9,}" if dtype == "float32"
                                                                                 else ""))
        if dtype == "float32":  # the arrays within 2%, + up to 16 KiB of the graph's own Python objects (Tensors,
            # Contexts), which matter where full recomputation leaves few arrays
            assert abs(held[dtype, mode] - accounted) <= 0.02 * accounted + 16 * 1024
        del loss
blocks = {dtype: held[dtype, "none"] - held[dtype, "full"] for dtype in ("float32", "bfloat16")}
say(f"   what the blocks keep beyond their inputs: {blocks['float32']:,} B in float32, {blocks['bfloat16']:,} B in "
    "bfloat16")
assert blocks["bfloat16"] < 0.7 * blocks["float32"]
assert held["float32", "full"] < held["float32", "selective"] < held["float32", "none"]
if "--plot" in sys.argv and r == 0:  # --plot FILE.svg: what one forward kept, per dtype and recompute mode
    from minipar.figures import draw_bars

    draw_bars(sys.argv[sys.argv.index("--plot") + 1], {f"{d}, recompute {m}": b for (d, m), b in held.items()},
              "bytes one forward keeps for backward (tracemalloc)", f"GPT L=2 C=32, batch 8 × T {cfg.block_size}")
say("Mixed precision shrinks the activations and halves the bytes on the wire, not the model states; ZeRO-3 divides")
say("those by N; recomputation trades a second forward for the activations.")
say("tutorial 13: all invariants hold")
