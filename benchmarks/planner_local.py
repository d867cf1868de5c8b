"""The planner on this machine: predicted against measured step time for the best predicted layouts.

    python benchmarks/planner_local.py [--worlds 1 2 4] [--widths 128 256] [--top 8] [--steps 30] [--cache FILE]

For each world size (calibrated first, as ``plan`` does on first use: each rank with its share of the cores for
BLAS) and each model — the default GPT (L=4 H=4 C=128 T=128, batch 16, float32) and a wider one (C=256) — the
``--top`` best layouts the planner predicts and plain data parallelism are each trained ``--steps`` steps through
the CLI, under mpiexec as a user runs it; measured is the median step time of the second half of its steps
(planner.steady_step_ms: a CPU run settles after a few steps), the fastest of ``--repeats`` runs (each a pass over
all the layouts of a world, so that a slow spell of the machine hits one run of a layout, not both).
Printed: a markdown table per model (for docs/planner.md, the CPU named), each world's largest error, and how much
slower the planner's first choice measured than the fastest measured layout. ``--cache``: measured times are kept
by world, model and layout, so a change to the cost model is re-checked against the same measurements
(``--remeasure`` ignores them).
"""
import argparse
import json
import os
import platform
import subprocess
import sys

from minipar.models.gpt import GPTConfig
from minipar.parallel import planner
from minipar.parallel.layout import Layout
from minipar.testing import mpiexec, rank_environment, train_cli


def cpu_name() -> str:
    with open("/proc/cpuinfo") as f:
        names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    return f"{names[0] if names else platform.processor()}, {os.cpu_count()} cores"


def measure(world: int, flags: list[str], steps: int) -> float:
    """The steady step time (ms) of ``train FLAGS`` on ``world`` ranks, BLAS threads as a user's run has them."""
    records = train_cli([*flags, "--steps", str(steps), "--warmup", "1", "--eval-interval", "0", "--json"], world,
                        timeout=900, one_thread=False)[0]
    return planner.steady_step_ms(records)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--widths", type=int, nargs="+", default=[128, 256])
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2, help="runs per layout; the fastest counts")
    ap.add_argument("--cache", default="planner_local.json", help="measured times, reused across runs")
    ap.add_argument("--remeasure", action="store_true", help="measure again what the cache holds")
    ap.add_argument("--no-calibrate", action="store_true", help="use the calibrations this machine has")
    args = ap.parse_args()
    cache = json.load(open(args.cache)) if os.path.exists(args.cache) and not args.remeasure else {}
    print(f"CPU: {cpu_name()}; batch {args.batch_size}, float32; measured: median of steps {args.steps // 2 + 1}-"
          f"{args.steps}, the fastest of {args.repeats} runs", flush=True)
    tables: dict[int, list[str]] = {width: [] for width in args.widths}
    summary = []
    for world in args.worlds:  # calibrated just before its runs: a shared VM's speed drifts by 20% over an hour
        if not args.no_calibrate:
            subprocess.run([mpiexec(), "-n", str(world), sys.executable, "-m", "minipar", "plan", "--calibrate"],
                           check=True, capture_output=True, env=rank_environment(one_thread=False), timeout=600)
        profile = planner.load_profile(None, world)
        for width in args.widths:
            cfg = GPTConfig(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=width)
            model = ["--n-layer", "4", "--n-head", "4", "--n-embd", str(width), "--block-size", "128", "--batch-size",
                     str(args.batch_size)]
            rows = []
            candidates = planner.shortlist(planner.plan(cfg, world, args.batch_size, profile), args.top, Layout(dp=world))
            keys = [f"{world}/{width}/{prediction.layout}" for prediction in candidates]
            for _ in range(args.repeats):  # each pass over every layout, the fastest run kept: a shared VM has slow
                for key, prediction in zip(keys, candidates):  # spells of seconds, which then hit one run of a layout
                    if len(cache.get(key, [])) < args.repeats:
                        cache.setdefault(key, []).append(measure(world, [*model, *prediction.layout.flags()],
                                                                 args.steps))
                        with open(args.cache, "w") as f:
                            json.dump(cache, f, indent=1)
            for key, prediction in zip(keys, candidates):
                measured, predicted = min(cache[key]), prediction.step_time * 1e3
                rows.append((prediction.layout, predicted, measured))
                tables[width].append(f"| {world} | {prediction.layout} | {predicted:.1f} | {measured:.1f} | "
                                     f"{(predicted - measured) / measured:+.0%} |")
                print(tables[width][-1], flush=True)
            worst = max(abs(p - m) / m for _, p, m in rows)
            best = min(m for _, _, m in rows)
            summary.append(f"C={width}, {world} rank(s): largest error {worst:.0%}; the first choice measures "
                           f"{rows[0][2] / best - 1:+.1%} against the fastest measured ({len(rows)} layouts)")
    for width, lines in tables.items():
        print(f"\nGPT L=4 H=4 C={width} T=128, batch {args.batch_size}, float32\n")
        print("| ranks | layout | predicted ms | measured ms | error |\n|---|---|---|---|---|")
        print("\n".join(lines))
    print()
    print("\n".join(summary))


if __name__ == "__main__":
    main()
