"""Tutorial 5: tensor parallelism — one model split across ranks, layer by layer (Megatron-LM).

    mpiexec -n 4 python tutorials/05_tensor_parallel.py

Each rank holds 1/tp of every matrix: attention by heads, the MLP by its hidden columns, the
vocabulary by rows. The f/g operators put an all-reduce where a layer's partial results meet.
Every rank also keeps the unsplit model and checks forward, backward and 3 AdamW steps against it.
"""
import numpy as np

from minipar.comm import Communicator
from minipar.data import Batches, load_tokens
from minipar.models.gpt import GPT, GPTConfig
from minipar.optim import AdamW
from minipar.parallel.tensor_parallel import gather_tensor_parallel_state, tensor_parallel

comm = Communicator()
tp, r = comm.size, comm.rank
say = print if r == 0 else (lambda *a, **k: None)
cfg = GPTConfig(vocab_size=257, block_size=32, n_layer=2, n_head=4, n_embd=32, dtype="float64")  # 257: not divisible
full, split = GPT(cfg, seed=0), tensor_parallel(GPT(cfg, seed=0), comm)
block = split.transformer.h[0]
say(f"1. tp = {tp}: rank 0 holds c_attn {block.attn.c_attn.weight.shape} of (32, 96) = q, k, v of its {cfg.n_head // tp} head(s); "
    f"c_fc {block.mlp.c_fc.weight.shape} of (32, 128); wte {split.transformer.wte.weight.shape} of (257, 32), padded")

batches = Batches(load_tokens(), batch_size=4, block_size=32, seed=0)
opt_full, opt_split = AdamW(full.parameters(), lr=1e-3), AdamW(split.parameters(), lr=1e-3)
for step in range(3):
    x, y = batches(step)
    comm.reset_stats()
    logits, loss = split(x, y)
    loss.backward()
    _, ref = full(x, y)
    ref.backward()
    calls = {k: v.calls for k, v in comm.stats.items()}
    say(f"   step {step}: loss {loss.item():.10f} vs unsplit {ref.item():.10f}; local logits {logits.shape} "
        f"(never the full (4, 32, 257)); all-reduces: {calls}")
    assert abs(loss.item() - ref.item()) <= 1e-9 * ref.item()
    assert calls["tp_forward"] == calls["tp_backward"] == 2 * cfg.n_layer  # 2 per layer each way
    assert calls["tp_cross_entropy"] == 3 and calls["tp_embedding"] == calls["tp_head"] == 1
    opt_full.clip_grad_norm(1.0)
    opt_split.clip_grad_norm(1.0, lambda s: float(comm.all_reduce(np.array([s]))[0]))
    for opt in (opt_full, opt_split):
        opt.step()
        opt.zero_grad()

gathered = gather_tensor_parallel_state(split.state_dict(), cfg, comm)
for name, value in full.state_dict().items():
    np.testing.assert_allclose(gathered[name], value, rtol=1e-9, atol=1e-12)
say("2. after 3 AdamW steps the gathered tensor-parallel parameters equal the unsplit ones (rtol 1e-9)")
say(f"3. per layer and step: 2 forward + 2 backward all-reduces of B·T·C = {4 * 32 * 32:,} values; "
    f"the loss adds 3 of B·T = {4 * 32} (max, Σexp, target logit)")
say("tutorial 5: all invariants hold")
