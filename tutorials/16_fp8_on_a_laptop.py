"""Tutorial 16: FP8 on a laptop — what each scaling recipe does to the numbers, and to training.

    mpiexec -n 2 python tutorials/16_fp8_on_a_laptop.py

1. One tensor, one outlier row: quantize it to e4m3 under each recipe (minipar/precision.py) and print the
   error on the ordinary rows, in units of e4m3's unit roundoff u = 2^-4. One scale for the whole tensor maps the
   ordinary rows to e4m3's subnormals; a scale per row, per 1×16 tile or per 16 values (MX) does not.
2. A Linear's three GEMMs in FP8: the forward, input-gradient and weight-gradient products of quantized operands
   against the same products of the exact ones, per recipe.
3. Training: 30 steps of a small GPT on the default corpus in bf16-mixed and under each recipe (the two ranks share
   the five runs), the loss gap to bf16 printed; then a data-parallel FP8 step over both ranks equals one process
   whose two microbatches are the ranks' rows, bit for bit.
"""
import numpy as np

from minipar import precision
from minipar.autograd import Tensor
from minipar.comm import Communicator
from minipar.data import Batches, load_tokens, shard_rows
from minipar.models.gpt import GPT, GPTConfig
from minipar.optim import AdamW
from minipar.parallel.data_parallel import DataParallel

comm = Communicator()
p, r = comm.size, comm.rank
say = print if r == 0 else (lambda *a, **k: None)
RECIPES = {"tensorwise": precision.recipe("tensorwise"), "rowwise": precision.recipe("rowwise"),
           "blockwise": precision.recipe("blockwise", 16), "mxfp8": precision.recipe("mxfp8", 16)}
u = precision.FORMATS["e4m3"].unit_roundoff

# 1. One outlier row ------------------------------------------------------------------------------------------
x = np.random.default_rng(0).standard_normal((16, 64)).astype(np.float32)
x[7] *= 1e5
ordinary = np.arange(16) != 7
say("1. a 16×64 tensor, row 7 10^5 larger: error on the other rows, in units of e4m3's roundoff u = 2^-4")
errors = {}
for name, recipe in RECIPES.items():
    back = precision.fake_quantize(x, recipe, "input", 1)
    errors[name] = (np.abs(back - x)[ordinary].max(axis=1) / np.abs(x[ordinary]).max(axis=1)).max() / u
    say(f"   {name:<11} worst row {errors[name]:5.2f} u")
assert errors["tensorwise"] > 2 and errors["rowwise"] <= 1 and errors["blockwise"] <= 1 and errors["mxfp8"] <= 2

# 2. A Linear's three GEMMs -----------------------------------------------------------------------------------
rng = np.random.default_rng(1)
a, w, g = rng.standard_normal((64, 48)), rng.standard_normal((48, 32)) * 0.1, rng.standard_normal((64, 32)) * 1e-3
say("2. relative error of each FP8 GEMM against the exact product (float64 operands)")
for name, recipe in RECIPES.items():
    at, wt = Tensor(a.astype(np.float32), requires_grad=True), Tensor(w.astype(np.float32), requires_grad=True)
    out = precision.linear(at, wt, recipe)
    out.backward(g.astype(np.float32))
    rel = lambda got, want: np.linalg.norm(got - want) / np.linalg.norm(want)  # noqa: E731
    y, dx, dw = rel(out.data, a @ w), rel(at.grad, g @ w.T), rel(wt.grad, a.T @ g)
    say(f"   {name:<11} forward {y:.3f}   input gradient {dx:.3f}   weight gradient {dw:.3f}")
    assert max(y, dx, dw) < 4 * u  # a few units of roundoff: the operands' errors, averaged over K terms

# 3. Training ------------------------------------------------------------------------------------------------
cfg = dict(block_size=32, n_layer=2, n_head=2, n_embd=32)
batches = Batches(load_tokens(), batch_size=8, block_size=32, seed=0)


def train(recipe, steps=30):
    model = GPT(GPTConfig(**cfg, dtype="bfloat16"), seed=0)
    if recipe is not None:
        model.set_fp8(recipe)
    opt = AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(steps):
        _, loss = model(*batches(step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return float(np.mean(losses[-5:]))


runs = {"bf16-mixed": None, **RECIPES}
mine = {name: train(recipe) for i, (name, recipe) in enumerate(runs.items()) if i % p == r}
final = {k: v for part in comm.mpi.allgather(mine) for k, v in part.items()}
say("3. 30 steps of a 2-layer GPT (C=32) on the default corpus, mean loss of the last 5:")
for name in runs:
    say(f"   {name:<11} {final[name]:.4f}   {(final[name] / final['bf16-mixed'] - 1) * 100:+.2f}% vs bf16")
assert all(abs(final[name] / final["bf16-mixed"] - 1) < 0.02 for name in RECIPES)  # within 2% after 30 steps

# one data-parallel FP8 step equals one process with each rank's rows as a microbatch: the same operands
x_all, y_all = batches(99)
reference = GPT(GPTConfig(**cfg, dtype="bfloat16"), seed=0).set_fp8(RECIPES["mxfp8"])
for k in range(p):
    (reference(shard_rows(x_all, k, p), shard_rows(y_all, k, p))[1] * (1 / p)).backward()
model = DataParallel(GPT(GPTConfig(**cfg, dtype="bfloat16"), seed=0).set_fp8(RECIPES["mxfp8"]), comm)
(model(shard_rows(x_all, r, p), shard_rows(y_all, r, p))[1] * (1 / p)).backward()
model.sync_gradients()
for mine_p, ref_p in zip(model.parameters(), reference.parameters()):
    assert (np.asarray(mine_p.grad, np.float32) == np.asarray(ref_p.grad, np.float32)).all()
say(f"   one dp={p} MXFP8 step: every gradient equals one process's with the ranks' rows as microbatches, bit for bit")
say("tutorial 16: all invariants hold")
