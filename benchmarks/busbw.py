"""What benchmarks/collectives.py and benchmarks/collectives_gloo.py share (no dependencies, so either runs
in any environment): nccl-tests' bus-bandwidth factors, the command-line sizes, and their labels.

busbw = algbw · F, with F = 2(p−1)/p for all-reduce, (p−1)/p for reduce-scatter, all-gather and all-to-all,
1 for broadcast: the bandwidth each link must sustain, comparable across p.
"""
from __future__ import annotations

import argparse

BUS_FACTOR = {"all_reduce": lambda p: 2 * (p - 1) / p, "reduce_scatter": lambda p: (p - 1) / p,
              "all_gather": lambda p: (p - 1) / p, "broadcast": lambda p: 1.0, "all_to_all": lambda p: (p - 1) / p}


def add_arguments(ap: argparse.ArgumentParser, ops: list[str]) -> None:
    ap.add_argument("--min-kib", type=int, default=1)
    ap.add_argument("--max-mib", type=int, default=64)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--ops", nargs="+", default=ops, choices=ops)


def sizes(args: argparse.Namespace) -> list[int]:
    """Bytes from --min-kib to --max-mib, ×4 each."""
    out, size = [], args.min_kib * 1024
    while size <= args.max_mib << 20:
        out.append(size)
        size *= 4
    return out


def label(nbytes: int) -> str:
    return f"{nbytes // 1024} KiB" if nbytes < 1 << 20 else f"{nbytes >> 20} MiB"
