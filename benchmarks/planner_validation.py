"""The planner's predicted step time and memory against the measured ones, for layouts at 4 and 8 ranks.

    python benchmarks/planner_validation.py [--worlds 4 8] [--all]     # calibrates each world size first

Layouts: every dp·tp·pp·zero layout the engine accepts with 1F1B (microbatches: 2·pp with a pipeline), plus
one of each further kind — sequence parallelism, ring and Ulysses context parallelism, the interleaved and
ZB-H1 schedules — where the world allows (``--all``: every layout with 2·pp microbatches). Each is trained
for a few steps through the CLI (float32), and for two more with ``--peak-memory`` (tracemalloc slows
every allocation, so those are not timed); printed per layout: predicted and measured median step time, the planner's model-state bytes against the counted ones of rank 0 (the step JSON's
``model_state_bytes``), and the planner's states + activations against rank 0's traced peak.
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


def layouts_for(cfg: GPTConfig, world: int, batch: int, every: bool) -> list[planner.Layout]:
    candidates = [lay for lay in planner.enumerate_layouts(cfg, world, batch)
                  if lay.microbatches == (2 * lay.pp if lay.pp > 1 else 1) and not lay.shard_group]
    base = [lay for lay in candidates if lay.cp == 1 and not lay.sp and lay.schedule == "1f1b"]
    if every:
        return candidates
    kinds = [lambda lay: lay.sp and lay.cp == 1, lambda lay: lay.cp > 1 and lay.cp_kind == "ring",
             lambda lay: lay.cp > 1 and lay.cp_kind == "ulysses", lambda lay: lay.schedule == "interleaved",
             lambda lay: lay.schedule == "zb-h1"]
    return base + [next(lay for lay in candidates if kind(lay) and lay.zero == 0) for kind in kinds
                   if any(kind(lay) and lay.zero == 0 for lay in candidates)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--all", action="store_true", help="every layout (hundreds of runs), not one per further kind")
    ap.add_argument("--profile", help="default: this machine's calibration")
    args = ap.parse_args()
    cfg = GPTConfig(vocab_size=256, block_size=64, n_layer=8, n_head=8, n_embd=128)
    batch = 16
    model = ["--n-layer", "8", "--n-head", "8", "--n-embd", "128", "--block-size", "64", "--batch-size", str(batch)]
    print(f"GPT L=8 H=8 C=128 T=64, batch {batch}, float32")
    print(f"{'world':>5}  {'layout':<40}{'pred ms':>9}{'meas ms':>9}{'error':>7}{'pred states MB':>16}{'counted MB':>12}"
          f"{'error':>7}{'pred total MB':>15}{'peak MB':>9}{'error':>7}")
    errors, memory_errors = [], []
    for world in args.worlds:
        pairs = []
        if not args.profile:
            subprocess.run([mpiexec(), "-n", str(world), sys.executable, "-m", "minipar", "plan", "--calibrate"],
                           check=True, capture_output=True, env={**os.environ, **RANK_ENV})
        profile = planner.load_profile(args.profile, world)
        for lay in layouts_for(cfg, world, batch, args.all):
            predicted = planner.predict(cfg, batch, lay, profile)
            command = [mpiexec(), "-n", str(world), sys.executable, "-m", "minipar", "train", *model, *lay.flags(),
                       "--eval-interval", "0", "--json"]
            runs = [subprocess.run([*command, *extra], capture_output=True, text=True, env={**os.environ, **RANK_ENV},
                                   timeout=600)  # timed without tracemalloc, which slows every allocation
                    for extra in (["--steps", str(args.steps)], ["--steps", "2", "--peak-memory"])]
            if any(out.returncode for out in runs):
                print(f"{world:>5}  {str(lay):<40}  failed: "
                      f"{next(o for o in runs if o.returncode).stderr.strip().splitlines()[-1]}")
                continue
            timed, traced = ([json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")] for out in runs)
            measured = float(np.median([r["ms"] for r in timed[2:]]))
            counted = sum(traced[-1]["model_state_bytes"].values())
            peak = traced[-1]["peak_bytes"]["rank0"]
            states, total = predicted.breakdown["model_states"], predicted.memory
            errors.append(abs(predicted.step_time * 1e3 - measured) / measured)
            memory_errors.append(abs(states - counted) / counted)
            pairs.append((predicted.step_time, measured))
            print(f"{world:>5}  {str(lay):<40}{predicted.step_time * 1e3:>9.1f}{measured:>9.1f}"
                  f"{predicted.step_time * 1e3 / measured - 1:>+7.0%}{states / 1e6:>16.2f}{counted / 1e6:>12.2f}"
                  f"{states / counted - 1:>+7.1%}{total / 1e6:>15.2f}{peak / 1e6:>9.2f}{total / peak - 1:>+7.0%}",
                  flush=True)
        if len(pairs) > 2:  # does the planner order the layouts as the machine does?
            ranks = [np.argsort(np.argsort([p[i] for p in pairs])) for i in (0, 1)]
            print(f"  world {world}: Spearman rank correlation predicted vs measured {np.corrcoef(*ranks)[0, 1]:.2f}")
    print(f"step time: mean |error| {np.mean(errors):.0%}, median {np.median(errors):.0%}; model states: max |error| "
          f"{np.max(memory_errors):.1%} over {len(errors)} layouts")


if __name__ == "__main__":
    main()
