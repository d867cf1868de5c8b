"""Mixed precision and FP8 against float32 on the default corpus: final training and validation loss after N
steps, the gap to float32 and to bf16-mixed, skipped (overflowed) fp16 steps, and the step time.

    python benchmarks/precision.py                  # 300 steps of the default GPT (L=4 C=128 T=128, batch 16)
    python benchmarks/precision.py --steps 100
    python benchmarks/precision.py --n-embd 256 --only bf16-mixed fp8-tensorwise fp8-mxfp8   # a wider model

One ``python -m minipar train --json`` run per precision (one process, same seed and data); ``fp8-R`` is
``--precision fp8 --fp8-recipe R`` with the recipe's own block size.
"""
from __future__ import annotations

import argparse
import statistics

from speed import cpu_model  # benchmarks/speed.py: the CPU named beside every figure

from minipar.precision import RECIPES
from minipar.testing import train_cli

PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed", *(f"fp8-{name}" for name in RECIPES))


def flags(precision: str) -> list[str]:
    if precision.startswith("fp8-"):
        return ["--precision", "fp8", "--fp8-recipe", precision[4:]]
    return ["--precision", precision]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--n-embd", type=int, default=128, help="model width (the default GPT's is 128)")
    ap.add_argument("--only", nargs="+", choices=PRECISIONS, default=list(PRECISIONS), help="which precisions")
    args = ap.parse_args()
    print(f"# {args.steps} steps, GPT L=4 C={args.n_embd} T=128, batch 16, one process, {cpu_model()}")
    print(f"{'precision':<17}{'final loss':>11}{'val loss':>10}{'vs fp32':>9}{'vs bf16':>9}{'skipped':>9}{'ms/step':>9}")
    finals: dict[str, float] = {}
    for precision in args.only:
        records, _ = train_cli(["--steps", str(args.steps), "--json", "--eval-interval", str(args.steps),
                                "--n-embd", str(args.n_embd), *flags(precision)], 1, timeout=7200)
        steps = [r for r in records if "loss" in r]
        val = [r["val_loss"] for r in records if "val_loss" in r][-1]
        final = finals[precision] = statistics.mean(r["loss"] for r in steps[-10:])  # the last 10: less batch noise
        gap = lambda name: f"{(final / finals[name] - 1) * 100:>8.2f}%" if name in finals else f"{'-':>9}"  # noqa: E731
        skipped = sum(bool(r.get("skipped")) for r in steps)
        ms = statistics.median(r["ms"] for r in steps)
        print(f"{precision:<17}{final:>11.4f}{val:>10.4f}{gap('fp32')}{gap('bf16-mixed')}{skipped:>9}{ms:>9.1f}",
              flush=True)


if __name__ == "__main__":
    main()
