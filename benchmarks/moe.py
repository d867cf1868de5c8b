"""Mixture of experts on this machine: step time, bytes per step and model state per rank, dense GPT against
MoE models with the same active parameters per token (top-1 experts, each as wide as the dense MLP), over
data and expert parallelism.

    python benchmarks/moe.py                       # 4 ranks: dense dp4; E = 4 and 8 with ep = 1, 2, 4
    python benchmarks/moe.py --ranks 2 --steps 8
    python benchmarks/moe.py --gates               # the gate gather's backward: add.at against grouped rows
    python benchmarks/moe.py --balance --steps 300  # DeepSeek-V3's balancing: the loss, the bias, both, neither
    python benchmarks/moe.py --overlap --ranks 2     # the shared experts computing while the tokens travel

Each row is one ``python -m minipar train --json`` run under ``mpiexec -n RANKS`` (GPT L=2 H=4 C=128 T=64,
batch 16, float32, capacity factor 1.25); figures are medians over the steps after the first. "ep MB" counts
the token exchanges (counts, dispatch, combine, forward and backward), "dp MB" the gradient all-reduces
(dense over all ranks, experts over the ranks that hold the same ones), "state MB" the parameters,
gradients and Adam moments one rank holds.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from minipar.autograd import Context

from minipar.models.gpt import GPTConfig
from minipar.ops import GetItem
from minipar.testing import train_cli

L, H, C, T, B = 2, 4, 128, 64, 16
MODEL = ["--n-layer", str(L), "--n-head", str(H), "--n-embd", str(C), "--block-size", str(T), "--batch-size", str(B),
         "--eval-interval", "0", "--json", "--warmup", "1"]


def run(ranks: int, n_expert: int, ep: int, steps: int) -> list[dict]:
    """The step records after the first of one run."""
    experts = ["--n-expert", str(n_expert), "--expert-top-k", "1"] if n_expert else []  # top-1: as wide as dense
    args = [*MODEL, "--steps", str(steps), *experts, "--ep", str(ep)]
    return train_cli(args, ranks, timeout=900)[0][1:]


BALANCE = ["--arch", "llama", "--n-expert", "16", "--expert-top-k", "4", "--moe-inner", "128", "--n-shared-expert",
           "1", "--router", "sigmoid", "--capacity-factor", "0", "--json", "--eval-interval", "100",
           "--eval-batches", "8"]  # the default model (L=4 C=128 T=128), 16 fine-grained SwiGLU experts, top-4 + 1 shared
BALANCING = {"neither": ["--aux-loss-coef", "0"], "loss only (α = 0.01)": ["--aux-loss-coef", "0.01"],
             "bias only (γ = 0.001)": ["--aux-loss-coef", "0", "--bias-update", "0.001"],
             "both": ["--aux-loss-coef", "0.01", "--bias-update", "0.001"]}


def balance(steps: int) -> None:
    """One process, the default corpus: the final losses and the experts' max/mean load (1 = balanced: the mean
    over the MoE layers of the busiest expert's share over the average's, over the last 10% of the steps)."""
    print(f"{'balancing':<24}{'max/mean load':>14}{'train loss':>12}{'val loss':>10}{'bias range':>18}")
    for name, flags in BALANCING.items():
        records = train_cli([*BALANCE, *flags, "--steps", str(steps)], 1, timeout=3600)[0]
        train = [r for r in records if "loss" in r]
        tail = train[-max(1, steps // 10):]
        load = statistics.mean(statistics.mean(r["experts"]["load_max_over_mean"]) for r in tail)
        val = [r["val_loss"] for r in records if "val_loss" in r][-1]
        bias = train[-1]["experts"].get("bias_range")
        span = f"[{bias[0]:+.3f}, {bias[1]:+.3f}]" if bias else "-"
        print(f"{name:<24}{load:>14.2f}{statistics.mean(r['loss'] for r in tail):>12.4f}{val:>10.4f}{span:>18}",
              flush=True)


def overlap(ranks: int, steps: int) -> None:
    """dp = ep = ``ranks``, the balance model's experts: median step ms and the exposed exchange time (waiting for
    the dispatch and combine, forward and backward: the step record's ``exposed_all_to_all_ms``), with the shared
    experts computing while the tokens travel and with the exchanges blocking."""
    flags = [*BALANCE, "--bias-update", "0.001", "--dp", str(ranks), "--ep", str(ranks), "--steps", str(steps)]
    print(f"{'exchanges':<22}{'step ms':>9}{'exposed all-to-all ms':>23}")
    for name, extra in (("overlapped", []), ("blocking", ["--no-moe-overlap"])):
        records = [r for r in train_cli([*flags, *extra, "--eval-interval", "0"], ranks, timeout=3600)[0][1:]
                   if "loss" in r]
        print(f"{name:<22}{statistics.median(r['ms'] for r in records):>9.1f}"
              f"{statistics.median(r['experts']['exposed_all_to_all_ms'] for r in records):>23.2f}", flush=True)


def gate_gather(tokens: int, n_expert: int, k: int, repeat: int = 50) -> tuple[float, float]:
    """Best-of-``repeat`` ms of the backward of the MoE gates probs[rows, chosen] (N tokens, E experts, top-k): numpy's
    add.at with the tuple index (what GetItem's backward did before) and GetItem's backward now (a flat index)."""
    rng = np.random.default_rng(0)
    rows = np.arange(tokens)[:, None]
    chosen = np.argsort(-rng.random((tokens, n_expert)), axis=1)[:, :k]
    g = rng.standard_normal((tokens, k)).astype(np.float32)
    ctx = Context()
    GetItem.forward(ctx, np.zeros((tokens, n_expert), np.float32), (rows, chosen))

    def best(fn) -> float:
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times) * 1e3

    def add_at() -> None:
        np.add.at(np.zeros((tokens, n_expert), np.float32), (rows, chosen), g)
    return best(add_at), best(lambda: GetItem.backward(ctx, g))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--experts", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--gates", action="store_true", help="time the gate gather's backward only")
    ap.add_argument("--balance", action="store_true", help="DeepSeek-V3's load balancing, one process (--steps)")
    ap.add_argument("--overlap", action="store_true", help="overlapped against blocking expert exchanges (--ranks)")
    args = ap.parse_args()
    if args.balance:
        balance(args.steps)
        return
    if args.overlap:
        overlap(args.ranks, args.steps)
        return
    if args.gates:
        print(f"{'tokens':>8}{'E':>5}{'k':>3}{'add.at ms':>11}{'GetItem ms':>12}")
        for tokens, n_expert, k in ((1024, 8, 2), (16384, 16, 4), (65536, 64, 8)):
            before, now = gate_gather(tokens, n_expert, k)
            print(f"{tokens:>8}{n_expert:>5}{k:>3}{before:>11.3f}{now:>12.3f}", flush=True)
        return
    print(f"{'model':<22}{'params':>10}{'active/token':>13}{'step ms':>9}{'ep MB':>8}{'dp MB':>8}{'state MB':>10}"
          f"{'dropped':>9}")
    configs = [(0, 1)] + [(E, ep) for E in args.experts for ep in (1, 2, 4, 8)
                          if ep <= args.ranks and args.ranks % ep == 0 and E % ep == 0]
    for E, ep in configs:
        records = run(args.ranks, E, ep, args.steps)
        cfg = GPTConfig(block_size=T, n_layer=L, n_head=H, n_embd=C, n_expert=E, expert_top_k=1)
        active = cfg.num_parameters() - (L * (E - 1) * (8 * C * C + 5 * C) if E else 0)
        last = records[-1]
        ep_bytes = sum(v for k, v in last["comm_bytes_by_op"].items() if k.startswith("ep_"))
        label = f"dense, dp{args.ranks}" if not E else f"E={E} top-1, dp{args.ranks} ep{ep}"
        dropped = f"{last['experts']['dropped_fraction']:.1%}" if E else "-"
        print(f"{label:<22}{cfg.num_parameters() / 1e6:>9.2f}M{active / 1e6:>12.2f}M"
              f"{statistics.median(r['ms'] for r in records):>9.1f}{ep_bytes / 1e6:>8.2f}{last['comm_bytes'] / 1e6:>8.2f}"
              f"{sum(last['model_state_bytes'].values()) / 1e6:>10.2f}{dropped:>9}", flush=True)


if __name__ == "__main__":
    main()
