"""Tutorial 4: ZeRO — shard the optimizer state, then the gradients, then the parameters.

    mpiexec -n 4 python tutorials/04_zero.py [--plot zero.svg]     (--plot: the model states per rank, drawn)

All-reduce = reduce-scatter + all-gather: ZeRO keeps the two halves apart so that each rank only
ever holds 1/p of what it does not need right now. For each stage this trains 5 float64 steps,
checks the losses and parameters against one process, and prints the counted model-state memory
and bytes sent.
"""
import sys

import numpy as np

from minipar.comm import Communicator
from minipar.data import Batches, load_tokens, shard_rows
from minipar.models.gpt import GPT, GPTConfig
from minipar.optim import AdamW
from minipar.parallel.data_parallel import DataParallel
from minipar.parallel.zero import ZeRO

comm = Communicator()
p, r = comm.size, comm.rank
say = print if r == 0 else (lambda *a, **k: None)
cfg = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=32, dtype="float64")
batches = Batches(load_tokens(), batch_size=2 * p, block_size=32, seed=0)

reference = GPT(cfg)
ref_opt = AdamW(reference.parameters(), lr=1e-3)
ref_losses = []
for step in range(5):
    _, loss = reference(*batches(step))
    loss.backward()
    ref_opt.clip_grad_norm(1.0)
    ref_opt.step()
    ref_opt.zero_grad()
    ref_losses.append(loss.item())
psi = reference.num_parameters()
say(f"GPT with Ψ = {psi:,} parameters on {p} ranks; float64 (8 bytes), so DP holds 4·8Ψ = {32 * psi:,} B")
say(f"{'stage':<7}{'params B':>10}{'grads B':>10}{'optim B':>10}{'total B':>10}{'vs DP':>7}{'sent/step B':>13}{'formula':>10}")
totals = {}
for stage in (0, 1, 2, 3):
    model = GPT(cfg)
    if stage:
        engine = opt = ZeRO(model, comm, stage, lr=1e-3)
    else:
        engine, opt = DataParallel(model, comm), AdamW(model.parameters(), lr=1e-3)
    for step in range(5):
        comm.reset_stats()
        x, y = batches(step)
        _, loss = engine(shard_rows(x, r, p), shard_rows(y, r, p))
        (loss * (1 / p)).backward()  # this rank's share of the global tokens: the ranks' gradients sum
        engine.sync_gradients()
        opt.clip_grad_norm(1.0)
        opt.step()
        state = engine.model_state_bytes(opt)
        opt.zero_grad()
        mean = comm.all_reduce(np.array([loss.item()]), op="avg", label="loss")[0]
        assert abs(mean - ref_losses[step]) <= 1e-9 * ref_losses[step], (stage, step)
    sent = comm.bytes_sent("grads") + comm.bytes_sent("params")
    groups = len(engine.shards) if stage else len(engine.buckets)
    assert abs(sent - engine.formula_bytes()) <= 8 * p * groups  # exact but for uneven last chunks
    full = engine.gathered_state_dict()
    for name, value in reference.state_dict().items():
        np.testing.assert_allclose(full[name], value, rtol=1e-9, atol=1e-12)
    totals[stage] = sum(state.values())
    say(f"{stage:<7}{state['params']:>10,}{state['grads']:>10,}{state['optimizer']:>10,}{totals[stage]:>10,}"
        f"{totals[stage] / totals[0]:>7.2f}{sent:>13,}{engine.formula_bytes():>10,.0f}")
say("every stage: the same 5 losses and final parameters as one process (rtol 1e-9)")
assert totals[3] <= 1.05 * totals[0] / p
say(f"ZeRO-3 holds {totals[3] / totals[0]:.3f} of DP's model state (1/p = {1 / p:.3f}); it sends 1.5× DP's bytes "
    f"(all-gather in forward, again in backward, reduce-scatter)")
if "--plot" in sys.argv and r == 0:  # --plot FILE.svg: DP and ZeRO-1/2/3's model states for this Ψ on p ranks
    from minipar.figures import draw_zero

    draw_zero(sys.argv[sys.argv.index("--plot") + 1], psi=psi, n=p, itemsize=8)  # float64
say("tutorial 4: all invariants hold")
