"""Tutorial 7: all three at once — a dp2 · tp2 · pp2 mesh of 8 ranks, checkpointed and resharded.

    mpiexec -n 8 python tutorials/07_hybrid.py

1. The mesh: which ranks form each tensor-, data- and pipeline-parallel group (tp fastest).
2. Five float64 training steps through the same loop `python -m minipar train` runs, with a
   timeline, and a sharded checkpoint.
3. The checkpoint, merged back into full tensors, equals five single-process steps (rtol 1e-9).
"""
import argparse
import os
import tempfile

import numpy as np

from minipar import plot
from minipar.checkpoint import load_checkpoint
from minipar.comm import Communicator
from minipar.data import Batches, load_tokens, split_tokens
from minipar.models.gpt import GPT, GPTConfig
from minipar.optim import AdamW, cosine_lr
from minipar.parallel.mesh import Mesh
from minipar.cli import add_arguments
from minipar.train import train

world = Communicator()
say = print if world.rank == 0 else (lambda *a, **k: None)
mesh = Mesh(world, dp=2, tp=2, pp=2)
rows = world.all_gather_bytes(f"rank {world.rank}: (pp, dp, cp, tp) = {mesh.coordinates(world.rank)}".encode())
say("1. " + "\n   ".join(r.decode() for r in rows))
say("   tp groups: consecutive ranks (the fast links); dp groups stride by tp = 2; pp stages by dp·tp = 4")
assert mesh.tp_comm.size == mesh.dp_comm.size == mesh.pp_comm.size == 2

work = os.path.join(tempfile.gettempdir(), "minipar_tutorial_07")
parser = argparse.ArgumentParser()
add_arguments(parser)
flags = ["--dp", "2", "--tp", "2", "--pp", "2", "--microbatches", "2", "--n-layer", "2", "--n-head", "2",
         "--n-embd", "16", "--block-size", "16", "--batch-size", "8", "--steps", "5", "--dtype", "float64",
         "--eval-interval", "0", "--warmup", "2", "--save", os.path.join(work, "ckpt"), "--trace", os.path.join(work, "t.json")]
records = train(parser.parse_args(flags))
say(f"2. losses: {[round(r['loss'], 6) for r in records]}")
if world.rank == 0:
    print(plot.ascii_chart(plot.load_events(os.path.join(work, "t.json")), width=96))
    ckpt = load_checkpoint(os.path.join(work, "ckpt"))
    print(f"3. checkpoint {ckpt.path}: {ckpt.layout}, merged to {len(ckpt.params)} full tensors")
    cfg = GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=16, dtype="float64")
    model = GPT(cfg, seed=0)
    opt = AdamW(model.parameters(), lr=2e-3, weight_decay=0.1)
    batches = Batches(split_tokens(load_tokens())[0], 8, 16, seed=0)
    for step in range(5):
        _, loss = model(*batches(step))
        loss.backward()
        opt.clip_grad_norm(1.0)
        opt.lr = cosine_lr(step, max_lr=2e-3, warmup_steps=2, total_steps=5, min_lr=2e-4)
        opt.step()
        opt.zero_grad()
        assert abs(loss.item() - records[step]["loss"]) <= 1e-9 * loss.item()
    for name, value in model.state_dict().items():
        np.testing.assert_allclose(ckpt.params[name], value, rtol=1e-9, atol=1e-12, err_msg=name)
    print("   the 8-rank run's losses and merged parameters equal 5 single-process steps (rtol 1e-9)")
    print("tutorial 7: all invariants hold")
