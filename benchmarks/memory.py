"""Peak memory per rank for every ZeRO stage against model state + activations, for a model of few large
blocks and one of many small blocks.

    python benchmarks/memory.py              # 4 ranks (mpiexec is spawned), float32

Each row is `python -m minipar train --peak-memory --json` (tracemalloc: numpy reports its allocations
there) on 4 data-parallel ranks, 2 sequences of T=64 per rank; "state" = the counted parameters, gradients
and Adam moments on the rank, "activations" = GPT.activation_elements, "peak" = the most traced bytes
allocated at once during the last step (max over ranks; the corpus is loaded before tracing starts).
"""
from __future__ import annotations

import argparse

from minipar.models.gpt import GPTConfig, activation_elements
from minipar.testing import train_cli

SHAPES = [(4, 256), (16, 128)]  # (layers, width)
T, PER_RANK = 64, 2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    args = ap.parse_args()
    p = args.ranks
    print(f"{'model':<18}{'stage':>6}{'state MB':>10}{'activations MB':>16}{'peak MB':>9}{'peak / (state + act.)':>23}")
    for layers, width in SHAPES:
        cfg = GPTConfig(block_size=T, n_layer=layers, n_head=4, n_embd=width)
        activations = activation_elements(cfg, PER_RANK) * 4
        for zero in range(4):
            records, _ = train_cli(["--n-layer", str(layers), "--n-embd", str(width), "--block-size", str(T),
                                    "--batch-size", str(PER_RANK * p), "--steps", "3", "--eval-interval", "0", "--json",
                                    "--peak-memory", "--dp", str(p), "--zero", str(zero)], p, timeout=600)
            state = sum(records[-1]["model_state_bytes"].values())
            peak = records[-1]["peak_bytes"]["max"]
            label = f"L={layers} C={width}"
            print(f"{label:<18}{zero:>6}{state / 1e6:>10.1f}{activations / 1e6:>16.1f}{peak / 1e6:>9.1f}"
                  f"{peak / (state + activations):>23.2f}", flush=True)


if __name__ == "__main__":
    main()
