"""Loss against bytes communicated: gradient compression and local SGD / DiLoCo vs synchronous DP.

    python benchmarks/communication.py [--ranks 2 --steps 300]

Runs ``mpiexec -n RANKS python -m minipar train --dp RANKS ...`` once per method on the default
corpus (same model, data, seed and schedule) and prints, per method, the bytes each rank sent for
gradients / parameters per step, the reduction against synchronous DP, and the final losses.
"""
import argparse
import json
import os
import subprocess
import sys

from minipar.testing import RANK_ENV, mpiexec

METHODS = {
    "synchronous DP": [],
    "fp16 wire": ["--compression", "fp16"],
    "bf16 wire": ["--compression", "bf16"],
    "int8": ["--compression", "int8"],
    "top-k 1%": ["--compression", "topk", "--topk-ratio", "0.01"],
    "PowerSGD r=4": ["--compression", "powersgd", "--powersgd-rank", "4"],
    "local SGD H=8 (avg)": ["--local-sgd", "8", "--outer-lr", "1", "--outer-momentum", "0"],
    "DiLoCo H=8": ["--local-sgd", "8"],
    "DiLoCo H=32": ["--local-sgd", "32"],
    "DiLoCo H=8, stale 1": ["--local-sgd", "8", "--staleness", "1"],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--model", default="--n-layer 2 --n-head 4 --n-embd 64 --block-size 64 --batch-size 16",
                    help="model and batch flags passed to train")
    args = ap.parse_args()
    print(f"{args.ranks} ranks, {args.steps} steps, {args.model}")
    print(f"{'method':<22}{'KB/step':>10}{'vs DP':>8}{'train loss':>12}{'val loss':>10}")
    base = None
    for name, extra in METHODS.items():
        command = [mpiexec(), "-n", str(args.ranks), sys.executable, "-m", "minipar", "train", "--dp", str(args.ranks),
                   "--steps", str(args.steps), "--eval-interval", str(args.steps), "--json", "--bucket-mb", "1",
                   *args.model.split(), *extra]
        out = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **RANK_ENV}, check=True).stdout
        records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        steps = [r for r in records if "loss" in r]
        per_step = sum(r["comm_bytes"] for r in steps) / len(steps)
        base = base or per_step
        train_loss = sum(r["loss"] for r in steps[-20:]) / 20
        val = next(r["val_loss"] for r in records if "val_loss" in r)
        print(f"{name:<22}{per_step / 1e3:>10.1f}{base / per_step:>7.1f}×{train_loss:>12.4f}{val:>10.4f}", flush=True)


if __name__ == "__main__":
    main()
