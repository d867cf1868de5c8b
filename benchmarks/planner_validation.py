"""The planner's predicted step time against the measured one, for every layout at 4 and 8 ranks.

    python benchmarks/planner_validation.py [--worlds 4 8]     # calibrates each world size first

Every dp·tp·pp·zero layout the engine accepts (microbatches: 2·pp with a pipeline; context and sequence
parallelism not yet validated here) is trained for a few steps through the CLI; the median step time is
compared with planner.predict.
"""
import argparse
import json
import os
import subprocess
import sys

import numpy as np

from minipar.models.gpt import GPTConfig
from minipar.parallel import planner
from minipar.testing import RANK_ENV, mpiexec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--profile", help="default: this machine's calibration")
    args = ap.parse_args()
    cfg = GPTConfig(vocab_size=256, block_size=64, n_layer=8, n_head=8, n_embd=128)
    batch = 16
    model = ["--n-layer", "8", "--n-head", "8", "--n-embd", "128", "--block-size", "64", "--batch-size", str(batch)]
    print(f"GPT L=8 H=8 C=128 T=64, batch {batch}, float32")
    print(f"{'world':>5}  {'layout':<30}{'predicted ms':>13}{'measured ms':>13}{'error':>8}")
    errors = []
    for world in args.worlds:
        pairs = []
        if not args.profile:
            subprocess.run([mpiexec(), "-n", str(world), sys.executable, "-m", "minipar", "plan", "--calibrate"],
                           check=True, capture_output=True, env={**os.environ, **RANK_ENV})
        profile = planner.load_profile(args.profile, world)
        layouts = [lay for lay in planner.enumerate_layouts(cfg, world, batch, context=False, schedules=("1f1b",))
                   if lay.microbatches == (2 * lay.pp if lay.pp > 1 else 1)]
        for lay in layouts:
            predicted = planner.predict(cfg, batch, lay, profile).step_time * 1e3
            command = [mpiexec(), "-n", str(world), sys.executable, "-m", "minipar", "train", *model, *lay.flags(),
                       "--steps", str(args.steps), "--eval-interval", "0", "--json"]
            out = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **RANK_ENV}, timeout=600)
            if out.returncode:
                print(f"{world:>5}  {str(lay):<30}  failed: {out.stderr.strip().splitlines()[-1]}")
                continue
            ms = [json.loads(line)["ms"] for line in out.stdout.splitlines() if line.startswith("{")][2:]
            measured = float(np.median(ms))
            errors.append(abs(predicted - measured) / measured)
            pairs.append((predicted, measured))
            print(f"{world:>5}  {str(lay):<30}{predicted:>13.1f}{measured:>13.1f}{(predicted - measured) / measured:>+8.0%}",
                  flush=True)
        if len(pairs) > 2:  # does the planner order the layouts as the machine does?
            ranks = [np.argsort(np.argsort([p[i] for p in pairs])) for i in (0, 1)]
            print(f"  world {world}: Spearman rank correlation predicted vs measured {np.corrcoef(*ranks)[0, 1]:.2f}")
    print(f"mean |error| {np.mean(errors):.0%}, median {np.median(errors):.0%} over {len(errors)} layouts")


if __name__ == "__main__":
    main()
