"""Where a training step's time goes, op by op: minipar's forward + backward against PyTorch eager's, same shapes.

    python benchmarks/ops.py                                   # L=4 H=4 C=256 T=128 B=8 V=256, float32, 1 thread
    python benchmarks/ops.py --n-layer 2 --n-head 12 --n-embd 768 --rounds 30

Each row runs one op of benchmarks/train_step.py's GPT on fresh inputs of the step's shapes, forward and backward
(AdamW: one update of as many parameters as the model has), minipar and PyTorch taking turns --rounds times; it
prints the median of each and their ratio. PyTorch's attention is the step's (train_step.torch_causal_attention:
q·kᵀ, mask, softmax, ·v, not the fused kernel), so that the rows compare one engine with another. Where the
step benchmark says minipar is behind, this says which op.
"""
from __future__ import annotations

import argparse
import os
import time

from speed import cpu_model  # benchmarks/speed.py
from train_step import add_model_arguments, torch_causal_attention  # benchmarks/train_step.py


def cases(args: argparse.Namespace) -> dict:
    """{op: (minipar fwd+bwd, torch fwd+bwd)} on the step's shapes."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    from minipar import ops
    from minipar.autograd import Tensor
    from minipar.optim import adamw_update

    B, T, C, H, V, L = args.batch_size, args.block_size, args.n_embd, args.n_head, args.vocab_size, args.n_layer
    rng = np.random.default_rng(0)

    def randn(*shape, scale=1.0):
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    x, w, b, h, qkv = randn(B, T, C), randn(C), randn(C), randn(B, T, 4 * C), randn(B, T, 3 * C, scale=0.1)
    rows, w_fc, logits = randn(B * T, C), randn(C, 4 * C, scale=0.02), randn(B * T, V)
    wte, idx, targets = randn(V, C), rng.integers(0, V, (B, T)), rng.integers(0, V, B * T)
    grads = {shape: randn(*shape) for shape in ((B, T, C), (B, T, 4 * C), (B * T, 4 * C))}

    def ours(fn, *arrays):
        inputs = [Tensor(a, requires_grad=True) for a in arrays]
        y = fn(*inputs)
        y.backward(grads.get(y.shape))

    def theirs(fn, *arrays):
        inputs = [torch.tensor(a, requires_grad=True) for a in arrays]
        y = fn(*inputs)
        y.backward(torch.tensor(grads[tuple(y.shape)]) if y.ndim else None)

    n_params = V * C + T * C + L * (12 * C * C + 13 * C) + 2 * C  # GPT-2's count: embeddings, blocks, final norm
    p, g, m, v2 = (np.zeros(n_params, np.float32) for _ in range(4))
    p_torch = torch.zeros(n_params, requires_grad=True)
    p_torch.grad = torch.zeros(n_params)
    adamw_torch = torch.optim.AdamW([p_torch], lr=1e-4, foreach=True)
    idx_torch, targets_torch = torch.tensor(idx), torch.tensor(targets)
    return {
        "layer norm": (lambda: ours(lambda a, c, d: ops.layer_norm(a, c, d), x, w, b),
                       lambda: theirs(lambda a, c, d: F.layer_norm(a, (C,), c, d), x, w, b)),
        "GELU": (lambda: ours(ops.gelu, h), lambda: theirs(lambda a: F.gelu(a, approximate="tanh"), h)),
        "attention (q·kᵀ, softmax, ·v)": (lambda: ours(lambda a: ops.causal_self_attention(a, H), qkv),
                                          lambda: theirs(lambda a: torch_causal_attention(a, H), qkv)),
        "linear C→4C": (lambda: ours(ops.linear, rows, w_fc), lambda: theirs(lambda a, c: a @ c, rows, w_fc)),
        "embedding": (lambda: ours(lambda e: ops.embedding(idx, e), wte),
                      lambda: theirs(lambda e: F.embedding(idx_torch, e), wte)),
        "cross-entropy": (lambda: ours(lambda z: ops.cross_entropy(z, targets), logits),
                          lambda: theirs(lambda z: F.cross_entropy(z, targets_torch), logits)),
        "AdamW (the model's parameters)": (
            lambda: adamw_update(p, g, m, v2, step=2, lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01),
            adamw_torch.step),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_arguments(ap)
    ap.add_argument("--rounds", type=int, default=20, help="interleaved runs of every op; the median is printed")
    args = ap.parse_args()
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = "1"
    import torch

    torch.set_num_threads(1)
    table = cases(args)
    times: dict = {name: ([], []) for name in table}
    for _ in range(args.rounds):
        for name, pair in table.items():
            for fn, record in zip(pair, times[name]):
                t0 = time.perf_counter()
                fn()
                record.append(time.perf_counter() - t0)
    median = lambda t: sorted(t)[len(t) // 2]  # noqa: E731
    print(f"{cpu_model()}; L={args.n_layer} H={args.n_head} C={args.n_embd} T={args.block_size} B={args.batch_size} "
          f"V={args.vocab_size} float32, 1 thread, median of {args.rounds}, PyTorch {torch.__version__}")
    print("| op (forward + backward) | minipar ms | PyTorch ms | ratio |\n|---|---|---|---|")
    for name, (ours, theirs) in times.items():
        a, b = median(ours), median(theirs)
        print(f"| {name} | {a * 1e3:.2f} | {b * 1e3:.2f} | {a / b:.2f}× |")


if __name__ == "__main__":
    main()
