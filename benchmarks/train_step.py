"""GPT training-step time: forward + backward + AdamW, prints ms/step and tokens/s.

    python benchmarks/train_step.py                      # minipar, L=4 H=4 C=256 T=128 B=8 V=256, float32, 1 thread
    python benchmarks/train_step.py --framework torch    # the same model in PyTorch eager (if torch is installed)
    python benchmarks/train_step.py --threads 2 --profile

The PyTorch model is written here to mirror minipar's GPT op for op (same shapes, tanh GELU,
tied head, AdamW), so the two numbers compare one engine with another. torch is not a minipar
dependency: install it yourself to run that half.

Deep dive, with measurements: docs/speed.md.
"""
from __future__ import annotations

import argparse
import os
import sys
import time


def add_model_arguments(p: argparse.ArgumentParser, per_rank: bool = False) -> None:
    """The GPT's shape and batch: the same flags here, in data_parallel.py and in ddp.py."""
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8, help="per rank" if per_rank else None)
    p.add_argument("--vocab-size", type=int, default=256)


def add_data_parallel_arguments(p: argparse.ArgumentParser) -> None:
    """What data_parallel.py and ddp.py share: the model, a batch per rank, buckets and interleaved rounds."""
    add_model_arguments(p, per_rank=True)
    p.add_argument("--bucket-mb", type=float, default=1.0)
    p.add_argument("--steps", type=int, default=3, help="steps per round")
    p.add_argument("--rounds", type=int, default=3)


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--framework", choices=["minipar", "torch"], default="minipar")
    p.add_argument("--threads", type=int, default=1, help="BLAS/intra-op threads (set before numpy/torch load)")
    add_model_arguments(p)
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--profile", action="store_true", help="print the hottest functions (cProfile)")
    return p.parse_args()


def minipar_step(args: argparse.Namespace):
    import numpy as np

    from minipar.models.gpt import GPT, GPTConfig
    from minipar.optim import AdamW

    cfg = GPTConfig(vocab_size=args.vocab_size, block_size=args.block_size, n_layer=args.n_layer,
                    n_head=args.n_head, n_embd=args.n_embd, dtype=args.dtype)
    model = GPT(cfg)
    opt = AdamW(model.parameters(), lr=1e-4)
    rng = np.random.default_rng(0)
    x = rng.integers(0, args.vocab_size, (args.batch_size, args.block_size))
    y = rng.integers(0, args.vocab_size, (args.batch_size, args.block_size))

    def step() -> None:
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()

    return step


def torch_causal_attention(qkv, n_head: int):
    """minipar's ops.causal_self_attention in PyTorch, op for op: packed (B, T, 3C) q|k|v, q·kᵀ/√D, causal mask,
    softmax, ·v, heads concatenated (B, T, C) — not the fused scaled_dot_product_attention."""
    import torch

    B, T, C = qkv.shape[0], qkv.shape[1], qkv.shape[2] // 3
    q, k, v = (t.view(B, T, n_head, C // n_head).transpose(1, 2) for t in qkv.split(C, dim=2))
    att = (q @ k.transpose(-2, -1)) / (C // n_head) ** 0.5
    att = att.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf")).softmax(-1)
    return (att @ v).transpose(1, 2).reshape(B, T, C)


def torch_step(args: argparse.Namespace, wrap=lambda model: model):
    """The PyTorch step; ``wrap`` puts the model in a wrapper first (benchmarks/ddp.py: DistributedDataParallel)."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    L, H, C, T, V = args.n_layer, args.n_head, args.n_embd, args.block_size, args.vocab_size

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln_1, self.ln_2 = torch.nn.LayerNorm(C), torch.nn.LayerNorm(C)
            self.c_attn, self.attn_proj = torch.nn.Linear(C, 3 * C), torch.nn.Linear(C, C)
            self.c_fc, self.mlp_proj = torch.nn.Linear(C, 4 * C), torch.nn.Linear(4 * C, C)

        def forward(self, x):
            x = x + self.attn_proj(torch_causal_attention(self.c_attn(self.ln_1(x)), H))
            return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))

    class GPT(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte, self.wpe = torch.nn.Embedding(V, C), torch.nn.Embedding(T, C)
            self.h = torch.nn.ModuleList([Block() for _ in range(L)])
            self.ln_f = torch.nn.LayerNorm(C)

        def forward(self, idx, targets):
            x = self.wte(idx) + self.wpe.weight[:T]
            for block in self.h:
                x = block(x)
            return F.cross_entropy((self.ln_f(x) @ self.wte.weight.T).view(-1, V), targets.view(-1))

    model = wrap(GPT().to(dtype))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    x = torch.randint(0, V, (args.batch_size, T))
    y = torch.randint(0, V, (args.batch_size, T))

    def step() -> None:
        model(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def main() -> None:
    args = parse()
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(args.threads)
    if args.framework == "torch":
        import torch

        torch.set_num_threads(args.threads)
        step = torch_step(args)
    else:
        step = minipar_step(args)
    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    times.sort()
    median = times[len(times) // 2]
    tokens = args.batch_size * args.block_size
    print(f"{args.framework}: L={args.n_layer} H={args.n_head} C={args.n_embd} T={args.block_size} B={args.batch_size} "
          f"V={args.vocab_size} {args.dtype}, {args.threads} thread(s): median {median * 1e3:.1f} ms/step "
          f"(min {times[0] * 1e3:.1f}), {tokens / median:,.0f} tokens/s")
    if args.profile:
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        profiler.runcall(lambda: [step() for _ in range(3)])
        pstats.Stats(profiler, stream=sys.stdout).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
