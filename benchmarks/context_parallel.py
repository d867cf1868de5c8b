"""Context parallelism on this machine: step time, layer-norm activation bytes per rank, attention work balance
and the ring's exposed communication, against the sequence length T.

    python benchmarks/context_parallel.py                 # T = 64, 128, 256; cp = 1, 2, 4
    python benchmarks/context_parallel.py --lengths 128 256 512 --steps 6

Each configuration is one ``python -m minipar train --json`` run (under ``mpiexec -n cp``), GPT L=2 H=8 C=64,
batch 4, float32; the figures are medians over the steps after the first. "work max/min" is the ratio of
the most to the fewest (query, key) pairs a rank scored (1.00: balanced); "ring wait" the forward's time
spent waiting for K/V blocks that the attention of the block in hand did not hide (slowest rank).
"""
from __future__ import annotations

import argparse
import statistics

from minipar.testing import train_cli

MODEL = ["--n-layer", "2", "--n-head", "8", "--n-embd", "64", "--batch-size", "4", "--eval-interval", "0", "--json",
         "--warmup", "1"]
CONFIGS = [(1, None, None), (2, "ring", "zigzag"), (2, "ring", "contiguous"), (2, "ulysses", "contiguous"),
           (4, "ring", "zigzag"), (4, "ring", "contiguous"), (4, "ulysses", "contiguous")]


def run(cp: int, kind: str | None, split: str | None, T: int, steps: int) -> list[dict]:
    """The step records after the first of one run."""
    args = [*MODEL, "--block-size", str(T), "--steps", str(steps)]
    if cp > 1:
        args += ["--cp", str(cp), "--cp-kind", kind, "--cp-split", split]
    return train_cli(args, cp, timeout=900)[0][1:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    print(f"{'T':>5} {'layout':<24}{'step ms':>9}{'LN act. KB/rank':>16}{'cp MB/step':>11}{'work max/min':>13}"
          f"{'ring wait ms':>13}")
    for T in args.lengths:
        for cp, kind, split in CONFIGS:
            records = run(cp, kind, split, T, args.steps)
            ms = statistics.median(r["ms"] for r in records)
            activations = records[-1]["activation_bytes"]["layer_norm"] / 1e3
            cp_bytes = sum(v for k, v in records[-1]["comm_bytes_by_op"].items() if k in ("cp_forward", "cp_backward"))
            context = records[-1].get("context")
            balance = f"{context['attention_pairs_max'] / context['attention_pairs_min']:.2f}" if context else "-"
            wait = f"{statistics.median(r['context']['ring_wait_ms'] for r in records):.2f}" if context else "-"
            label = "single process" if cp == 1 else f"cp {cp} {kind} {split}"
            print(f"{T:>5} {label:<24}{ms:>9.1f}{activations:>16.1f}{cp_bytes / 1e6:>11.2f}{balance:>13}{wait:>13}",
                  flush=True)


if __name__ == "__main__":
    main()
