"""Tutorial 1: reverse-mode autograd, then a GPT-2 built on it.

    python tutorials/01_autograd_and_gpt.py        (or: mpiexec -n 2 python tutorials/01_autograd_and_gpt.py)

Each section prints what it shows and asserts it, so a silent run is a correct run.
"""
import tempfile

import numpy as np

from minipar import Tensor, ops
from minipar.models.gpt import GPT, GPTConfig
from minipar.optim import AdamW

# 1. A graph and its chain rule -------------------------------------------------------------------
# f(x, w) = Σ tanh(x @ w)²; autograd walks the graph backward: d tanh = (1 - tanh²), d(a@b)/db = aᵀ g.
rng = np.random.default_rng(0)
x = Tensor(rng.standard_normal((4, 3)))
w = Tensor(rng.standard_normal((3, 2)), requires_grad=True)
f = (ops.tanh(x @ w) ** 2.0).sum()
f.backward()
t = np.tanh(x.data @ w.data)
by_hand = x.data.T @ (2 * t * (1 - t**2))
print(f"1. df/dw from autograd:\n{w.grad}\n   by hand: max difference {np.abs(w.grad - by_hand).max():.2e}")
assert np.allclose(w.grad, by_hand, rtol=1e-12)

# 2. Finite differences: the check every op in minipar passes (tests/test_ops.py) ------------------
eps, i = 1e-6, (1, 0)
w_plus, w_minus = w.data.copy(), w.data.copy()
w_plus[i] += eps
w_minus[i] -= eps
numeric = ((np.tanh(x.data @ w_plus) ** 2).sum() - (np.tanh(x.data @ w_minus) ** 2).sum()) / (2 * eps)
print(f"2. central difference for w{list(i)}: {numeric:.8f}, autograd: {w.grad[i]:.8f}")
assert abs(numeric - w.grad[i]) < 1e-7

# 3. Gradient hooks: a leaf's gradient is final the moment the backward walk reaches it -----------
# Data parallelism starts all-reducing the last layer's gradients here, while earlier layers are
# still being differentiated.
layers = [Tensor(np.eye(3) + 0.1 * rng.standard_normal((3, 3)), requires_grad=True) for _ in range(3)]
ready = []
for k, layer in enumerate(layers):
    layer.register_hook(lambda p, k=k: ready.append(k))
h = Tensor(np.ones((2, 3)))
for layer in layers:
    h = ops.gelu(h @ layer)
h.sum().backward()
print(f"3. gradients became final in layer order {ready} (last layer first)")
assert ready == [2, 1, 0]

# 4. GPT-2: Hugging Face names, tied head; overfit one batch -------------------------------------
cfg = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=32)
model = GPT(cfg, seed=0)
print(f"4. GPT with {model.num_parameters():,} parameters; first names: {[n for n, _ in model.named_parameters()][:3]}")
text = np.frombuffer(b"def add(a, b):\n    return a + b\n" * 4, dtype=np.uint8).astype(np.int64)
idx, targets = text[None, :32], text[None, 1:33]
opt = AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
losses = []
for step in range(60):
    _, loss = model(idx, targets)
    loss.backward()
    opt.step()
    opt.zero_grad()
    losses.append(loss.item())
print(f"   loss on one batch: {losses[0]:.3f} (≈ ln 256 = {np.log(256):.3f}) -> {losses[-1]:.3f} after 60 steps")
assert losses[0] > 5.0 and losses[-1] < 1.0

# 5. Checkpoints are Hugging Face GPT-2 directories -----------------------------------------------
with tempfile.TemporaryDirectory() as d:
    model.save_hf(d)
    again = GPT.from_hf(d)
    same = np.array_equal(again(idx)[0].data, model(idx)[0].data)
    print(f"5. save_hf -> from_hf round trip gives identical logits: {same}")
    assert same
print("tutorial 1: all invariants hold")
