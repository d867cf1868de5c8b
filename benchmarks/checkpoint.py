"""What checkpointing every step costs a step: asynchronous (the step waits for a copy into a reused staging buffer;
a writer thread writes, checksums and fsyncs) against synchronous (--sync-save: all of that inside the step), on a
disk folder and on /dev/shm (the --local-save tier), with BLAS on one core or on all of them.

    python benchmarks/checkpoint.py [--steps 30] [--repeats 3]

One process, GPT L=4 H=8 C=256 T=128, batch 8, float32 (3.2 M parameters: 38 MB of parameters and AdamW moments
a checkpoint). Each mode trains --steps steps with --save-interval 1; a step's cost is (the run's wall time − the
same run's without saving) / steps, the median of --repeats runs. The goal of the asynchronous save: ≤ 10% of the
synchronous save's cost. Writing is CPU work (the kernel's copy into the page cache, sha256): the writer thread can
hide it only in a core that training leaves idle.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from speed import cpu_model  # benchmarks/speed.py: the CPU named beside every figure

MODEL = ["--n-layer", "4", "--n-head", "8", "--n-embd", "256", "--block-size", "128", "--batch-size", "8",
         "--eval-interval", "0", "--log-interval", "1000", "--warmup", "2"]


def wall(flags: list[str], threads: str) -> float:
    """Seconds one ``python -m minipar train`` takes with ``threads`` BLAS threads ("all": the library's default)."""
    limit = {} if threads == "all" else {name: threads for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                                                                    "MKL_NUM_THREADS")}
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "minipar", "train", *MODEL, *flags], check=True, capture_output=True,
                   env={**os.environ, **limit})
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    steps = ["--steps", str(args.steps)]
    folders = {"disk": tempfile.mkdtemp(prefix="minipar-ckpt-", dir=os.getcwd())}
    if os.path.isdir("/dev/shm"):
        folders["/dev/shm"] = tempfile.mkdtemp(prefix="minipar-ckpt-", dir="/dev/shm")
    print(f"{cpu_model()}; {args.steps} steps, --save-interval 1, median of {args.repeats}")
    print(f"{'where':<10} {'BLAS threads':>12} {'step, no save (ms)':>19} {'sync save cost (ms)':>20} "
          f"{'async save cost (ms)':>21} {'async/sync':>11}")
    try:
        for where, folder in folders.items():
            for threads in ("1", "all"):
                runs = {mode: [] for mode in ("none", "sync", "async")}
                for _ in range(args.repeats):
                    for mode, extra in (("none", []), ("sync", ["--sync-save"]), ("async", [])):
                        save = os.path.join(folder, mode)
                        shutil.rmtree(save, ignore_errors=True)
                        flags = [*steps] if mode == "none" else [*steps, "--save", save, "--save-interval", "1", *extra]
                        runs[mode].append(wall(flags, threads) * 1e3 / args.steps)
                base, sync, asyn = (statistics.median(runs[m]) for m in ("none", "sync", "async"))
                print(f"{where:<10} {threads:>12} {base:>19.1f} {sync - base:>+20.1f} {asyn - base:>+21.1f} "
                      f"{(asyn - base) / (sync - base):>11.0%}", flush=True)
    finally:
        for folder in folders.values():
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
