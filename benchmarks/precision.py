"""Mixed precision against float32 on the default corpus: final training and validation loss after N steps,
skipped (overflowed) fp16 steps, and the step time.

    python benchmarks/precision.py                  # 300 steps of the default GPT (L=4 C=128 T=128, batch 16)
    python benchmarks/precision.py --steps 100

One ``python -m minipar train --json`` run per precision (one process, same seed and data).
"""
from __future__ import annotations

import argparse
import statistics

from minipar.testing import train_cli


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    print(f"{'precision':<12}{'final loss':>11}{'val loss':>10}{'vs fp32':>9}{'skipped':>9}{'ms/step':>9}")
    reference = None
    for precision in ("fp32", "bf16-mixed", "fp16-mixed"):
        records, _ = train_cli(["--steps", str(args.steps), "--json", "--eval-interval", str(args.steps),
                                "--precision", precision], 1, timeout=3600)
        steps = [r for r in records if "loss" in r]
        val = [r["val_loss"] for r in records if "val_loss" in r][-1]
        final = statistics.mean(r["loss"] for r in steps[-10:])  # the last 10 steps: less batch noise
        reference = reference or final
        skipped = sum(bool(r.get("skipped")) for r in steps)
        ms = statistics.median(r["ms"] for r in steps)
        print(f"{precision:<12}{final:>11.4f}{val:>10.4f}{(final / reference - 1) * 100:>8.2f}%{skipped:>9}{ms:>9.1f}",
              flush=True)


if __name__ == "__main__":
    main()
