"""Tutorial 18: today's mixture of experts — DeepSeek-V3's router, dropless experts over expert parallelism, and
balancing by a bias instead of a loss.

    mpiexec -n 2 python tutorials/18_todays_experts.py

1. The router: sigmoid scores, the choice ranked by score + bias within the best groups of experts (each token's
   experts span at most M of G groups), the gates renormalized and scaled — printed for three tokens.
2. Dropless dispatch over 2 expert-parallel ranks: every assignment is kept, the exchange sends variable counts
   (an all-to-all of counts, then the rows): the rows each rank sends and receives, and the layer's output equal
   to the unsplit layer's (float64).
3. Auxiliary-loss-free balancing: a layer whose router favours a few experts, trained 80 steps with the bias
   update and without (and without any balance loss): the busiest expert's load over the mean falls with the bias.
"""
import numpy as np

from minipar.autograd import Tensor
from minipar.comm import Communicator
from minipar.models.moe import MoEMLP
from minipar.optim import AdamW
from minipar.parallel.expert_parallel import expert_parallel

comm = Communicator()
r = comm.rank
say = print if r == 0 else (lambda *a, **k: None)
C, E, k = 16, 8, 2


def layer(bias_update: float = 0.0, seed: int = 0) -> MoEMLP:
    moe = MoEMLP(C, E, k, 0.0, "float64", inner=8, swiglu=True, n_shared=1, router="sigmoid", routed_scaling=2.5,
                 groups=4, topk_groups=2, bias_update=bias_update)
    rng = np.random.default_rng(seed)
    for p in moe.parameters():
        p.data = rng.standard_normal(p.shape) * 0.3
    return moe


# ---- 1. the router
moe = layer()
x = np.random.default_rng(1).standard_normal((1, 3, C))
scores, chosen, gates = moe.route(moe.router(Tensor(x.reshape(3, C))))
say("1. three tokens, 8 experts in 4 groups of 2, top-2 within the 2 best groups:")
for n in range(3):
    say(f"   token {n}: experts {chosen[n].tolist()} (groups {sorted(set((chosen[n] // 2).tolist()))}), "
        f"gates {np.round(gates.data[n], 3).tolist()} (sum {gates.data[n].sum():.2f} = the routed scaling)")
    assert len(set((chosen[n] // 2).tolist())) <= 2 and abs(gates.data[n].sum() - 2.5) < 1e-9

# ---- 2. dropless over expert parallelism
tokens = np.random.default_rng(2 + r).standard_normal((2, 8, C))  # each rank its own tokens
whole = layer(seed=3)
expected = whole(Tensor(tokens)).data
if comm.size > 1:
    split = expert_parallel(layer(seed=3), comm)  # this rank keeps E/2 experts; the tokens travel to their owners
    out = split(Tensor(tokens)).data
    sent, received = split.tally["rows_out"], split.tally["rows_in"]
    rows = comm.all_gather(np.array([sent, received]), label="tutorial").reshape(-1, 2)
    say(f"\n2. dropless dispatch over {comm.size} ranks: rows sent / received per rank {rows.tolist()} "
        f"(variable: each rank's tokens chose freely); largest output difference to the unsplit layer "
        f"{np.abs(out - expected).max():.1e}")
    assert np.abs(out - expected).max() < 1e-12 and rows[:, 0].sum() == rows[:, 1].sum()
    assert split.stats["dropped_fraction"] == 0

# ---- 3. balancing by the bias: rank r trains with γ = 0.01 (r = 1) or without (r = 0)
gamma = 0.01 if r == 1 or comm.size == 1 else 0.0
learner = layer(bias_update=gamma, seed=4)
learner.router.weight.data[:, :2] += 1.0  # a router that favours experts 0 and 1
optimizer = AdamW(learner.parameters(), lr=1e-3, weight_decay=0.0)
rng = np.random.default_rng(5)
imbalance = []
for step in range(80):
    learner.reset_tally()
    batch = rng.standard_normal((4, 16, C))
    y = learner(Tensor(batch))
    ((y - Tensor(batch)) ** 2).mean().backward()  # any objective: the routing is what we watch
    optimizer.step()
    optimizer.zero_grad()
    load = learner.tally["load"].astype(float)
    imbalance.append(load.max() / load.mean())
    if gamma:
        learner.update_bias(load)  # one rank's loads here; training all-reduces them over the replicas first
final = comm.all_gather(np.array([np.mean(imbalance[:10]), np.mean(imbalance[-10:])]), label="tutorial").reshape(-1, 2)
say(f"\n3. max/mean expert load, first 10 steps -> last 10: without the bias {final[0, 0]:.2f} -> {final[0, 1]:.2f}"
    + (f", with γ = 0.01 {final[-1, 0]:.2f} -> {final[-1, 1]:.2f}" if comm.size > 1 else ""))
assert comm.size == 1 or final[-1, 1] < final[0, 1]
say("\nall invariants hold")
