"""Tutorial 12: mixture of experts and expert parallelism over the hand-written all-to-all.

    mpiexec -n 4 python tutorials/12_experts.py

1. One MoE layer: the router's top-2 choices, the capacity per expert, and which assignments drop.
2. Expert parallelism over 4 ranks, one expert each: every rank routes its own tokens, sends them to the
   experts' owners (all-to-all of counts, then all-to-all-v of rows) and gets the outputs back. Outputs and
   gradients equal the single-process layer's on the same tokens (float64).
3. A data-parallel step of a MoE GPT with ep = 2: every gradient equals single-process training's (one process
   seeing the same token groups: one microbatch per data-parallel rank).
"""
import numpy as np

from minipar.autograd import Tensor
from minipar.comm import Communicator
from minipar.data import Batches, load_tokens, shard_rows
from minipar.models.gpt import GPT, GPTConfig
from minipar.models.moe import MoEMLP, route
from minipar.parallel.data_parallel import DataParallel
from minipar.parallel.expert_parallel import bytes_per_layer, expert_parallel
from minipar.parallel.mesh import Mesh

comm = Communicator()
N, r = comm.size, comm.rank
say = print if r == 0 else (lambda *a, **k: None)
E, k, C = N, 2, 8
rng = np.random.default_rng(0)
values = [rng.standard_normal(p.shape) * 0.5 for p in MoEMLP(C, E, k, 1.0, "float64").parameters()]


def layer(capacity_factor: float) -> MoEMLP:
    moe = MoEMLP(C, E, k, capacity_factor, "float64")
    for p, v in zip(moe.parameters(), values):
        p.data[...] = v
    return moe


tokens = [rng.standard_normal((1, 6, C)) for _ in range(N)]  # each rank's own 6 tokens
moe = layer(1.0)
logits = tokens[0].reshape(6, C) @ values[0]
probs = np.exp(logits - logits.max(1, keepdims=True))
probs /= probs.sum(1, keepdims=True)
capacity = moe.capacity(6)
chosen, slot, assigned = route(probs, k, capacity)
say(f"1. {E} experts, top-{k}, capacity ⌈1.0·{k}·6/{E}⌉ = {capacity} tokens per expert; rank 0's tokens:")
for n in range(6):
    picks = ", ".join(f"expert {chosen[n, j]} ({'slot ' + str(slot[n, j] % capacity) if slot[n, j] >= 0 else 'dropped'})"
                      for j in range(k))
    say(f"   token {n}: {picks}")
say("   first choices are placed before second choices; a dropped assignment adds nothing (the residual carries it)")

say(f"2. expert parallelism: rank j keeps expert j; tokens travel to it and back")
reference = layer(1.0)
want = []
for x in tokens:
    y = reference(Tensor(x))
    want.append(y.data)
    (y.sum() + reference.aux_loss).backward()  # the owners' expert gradients sum every rank's tokens
parallel = expert_parallel(layer(1.0), comm)
y = parallel(Tensor(tokens[r], requires_grad=True))  # as in a GPT: the inputs need gradients too
(y.sum() + parallel.aux_loss).backward()
np.testing.assert_allclose(y.data, want[r], rtol=1e-12, atol=1e-14)
np.testing.assert_allclose(parallel.c_fc.weight.grad, reference.c_fc.weight.grad[r:r + 1], rtol=1e-10)
rows_out, rows_in = parallel.tally["rows_out"], parallel.tally["rows_in"]
sent = {label: comm.stats[label].bytes for label in ("ep_counts", "ep_forward", "ep_backward")}
assert sent == bytes_per_layer(rows_out, rows_in, E, N, C, 8)
rows = comm.mpi.gather((rows_out, rows_in))
for rank, (out, into) in enumerate(rows or []):
    say(f"   rank {rank}: sent {out} rows to other experts, computed {into} rows from other ranks")
say(f"   bytes on rank 0 per layer: {sent} = the formula; outputs and gradients = single process")

say("3. one data-parallel step of a MoE GPT with ep = 2 (the engine `train --n-expert 4 --ep 2` uses):")
cfg = GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=16, n_expert=4, capacity_factor=0.75,
                dtype="float64")
x, y = Batches(load_tokens(), batch_size=2 * N, block_size=16, seed=0)(0)
mesh = Mesh(comm, dp=N, ep=2)
model = expert_parallel(GPT(cfg, seed=0), mesh.ep_comm)
engine = DataParallel(model, mesh.grad_comm, expert_comm=mesh.expert_grad_comm)
_, loss = engine(shard_rows(x, r, N), shard_rows(y, r, N))
(loss * (1.0 / N)).backward()  # its share of the global tokens: the gradients sum over the replicas
engine.sync_gradients()
reference = GPT(cfg, seed=0)  # one process, the same token groups: one microbatch per dp rank, mean of the losses
for rank in range(N):
    _, ref_loss = reference(shard_rows(x, rank, N), shard_rows(y, rank, N))
    (ref_loss * (1.0 / N)).backward()
mine = slice(mesh.ep_rank * 2, mesh.ep_rank * 2 + 2)
for (name, p), ref in zip(model.named_parameters(), reference.parameters()):
    np.testing.assert_allclose(p.grad, ref.grad[mine] if p.placement.experts else ref.grad,
                               rtol=1e-9, atol=1e-13, err_msg=name)
groups = comm.mpi.gather((sorted(mesh.ep_comm.mpi.allgather(r)), sorted(mesh.expert_grad_comm.mpi.allgather(r))))
for rank, (ep_group, replicas) in enumerate(groups or []):
    say(f"   rank {rank}: exchanges tokens with ranks {ep_group}, holds experts {2 * (rank % 2)}-{2 * (rank % 2) + 1}, "
        f"whose gradients it sums with ranks {replicas}")
say("   every gradient (dense: summed over all 4 ranks; experts: over their 2 holders) = single process")
say("all invariants hold")
