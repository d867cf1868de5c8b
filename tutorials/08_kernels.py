"""Tutorial 8: GPU kernels — tiling and online softmax — run on the CPU through Triton's interpreter.

    python tutorials/08_kernels.py          (TRITON_INTERPRET=1 is set for you when there is no GPU)

1. A matmul is a loop over tiles: each program owns one output tile and walks K in blocks,
   accumulating in float32. Shown in numpy, then run as the Triton kernel (kernels/matmul.py).
2. Softmax can be computed in one streaming pass: keep the running max m and the running sum l,
   rescale by exp(m_old − m_new) when the max grows. That is what lets flash attention process
   keys block by block without ever holding the T × T matrix.
3. The flash-attention kernels (kernels/flash_attention.py) against plain numpy, forward and backward.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import numpy as np  # noqa: E402

from minipar.kernels.flash_attention import attention_backward, attention_forward  # noqa: E402
from minipar.kernels.matmul import matmul  # noqa: E402

rng = np.random.default_rng(0)

# 1. Tiling ----------------------------------------------------------------------------------------
M, K, N, BM, BN, BK = 40, 48, 24, 16, 16, 16
a, b = rng.standard_normal((M, K)).astype(np.float32), rng.standard_normal((K, N)).astype(np.float32)
c = np.zeros((M, N), np.float32)
programs = 0
for m0 in range(0, M, BM):          # one Triton program per (m0, n0) output tile
    for n0 in range(0, N, BN):
        acc = np.zeros((min(BM, M - m0), min(BN, N - n0)), np.float32)
        for k0 in range(0, K, BK):  # the loop inside the kernel: one BK-slice of A and B per step
            acc += a[m0:m0 + BM, k0:k0 + BK] @ b[k0:k0 + BK, n0:n0 + BN]
        c[m0:m0 + BM, n0:n0 + BN] = acc
        programs += 1
triton_c = matmul(a, b, config={"BLOCK_M": BM, "BLOCK_N": BN, "BLOCK_K": BK, "GROUP_M": 2})
print(f"1. {programs} tiles of {BM}×{BN}, {-(-K // BK)} K-steps each; numpy tiles vs a @ b: "
      f"{np.abs(c - a @ b).max():.1e}, Triton kernel vs a @ b: {np.abs(triton_c - a @ b).max():.1e}")
assert np.allclose(c, a @ b, atol=1e-4) and np.allclose(triton_c, a @ b, atol=1e-4)

# 2. Online softmax ------------------------------------------------------------------------------
scores = rng.standard_normal(1000) * 5
m, l = -np.inf, 0.0
for block in np.split(scores, 10):  # one pass, one block of "keys" at a time
    m_new = max(m, block.max())
    l = l * np.exp(m - m_new) + np.exp(block - m_new).sum()
    m = m_new
streamed = np.exp(scores - m) / l
exact = np.exp(scores - scores.max()) / np.exp(scores - scores.max()).sum()
print(f"2. streaming softmax over 10 blocks vs two-pass softmax: max difference {np.abs(streamed - exact).max():.1e}")
assert np.allclose(streamed, exact, rtol=1e-12)

# 3. Flash attention -------------------------------------------------------------------------------
B, H, T, D = 1, 2, 45, 32
q, k, v, grad = (rng.standard_normal((B, H, T, D)).astype(np.float32) for _ in range(4))
out = np.empty_like(q)
lse = attention_forward(q, k, v, out)
dq, dk, dv = (np.empty_like(q) for _ in range(3))
attention_backward(q, k, v, out, lse, grad, dq, dk, dv)
s = q @ k.swapaxes(-1, -2) / np.sqrt(D) + np.triu(np.full((T, T), -np.inf), 1)
p = np.exp(s - s.max(-1, keepdims=True))
p /= p.sum(-1, keepdims=True)
dp = grad @ v.swapaxes(-1, -2)
ds = p * (dp - (dp * p).sum(-1, keepdims=True)) / np.sqrt(D)
checks = {"out": (out, p @ v), "dq": (dq, ds @ k), "dk": (dk, ds.swapaxes(-1, -2) @ q), "dv": (dv, p.swapaxes(-1, -2) @ grad)}
print("3. flash attention vs numpy (T = 45: not a multiple of the 16-row blocks, causal): "
      + ", ".join(f"{n} {np.abs(x - y).max():.1e}" for n, (x, y) in checks.items()))
assert all(np.allclose(x, y, atol=1e-4) for x, y in checks.values())
print(f"   the kernel kept a {T}-element log-sum-exp per head for backward, not the {T}×{T} matrix P")
print("tutorial 8: all invariants hold")
