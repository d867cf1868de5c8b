"""minipar against its anchors in one run: the ratios of issue #33 and the table of docs/speed.md.

    python benchmarks/speed.py                 # needs torch for the PyTorch rows (pip install torch)
    python benchmarks/speed.py --rounds 5 --skip dp

Rows, each minipar's time over the anchor's, measured on this machine in this run:
  step      one GPT training step (forward, backward, AdamW), 1 thread: benchmarks/train_step.py against the
            same model in PyTorch eager, at L=4 H=4 C=256 and L=2 H=12 C=768 (T=128 B=8 V=256, float32);
            minipar and PyTorch take turns, --rounds times, and each keeps its best median.
  dp        data parallel, p = 2, 1 MiB buckets overlapped with backward: benchmarks/data_parallel.py's
            "dp, overlap" against PyTorch DDP over gloo (benchmarks/ddp.py); exposed comm = step − compute.
  allreduce all-reduce of 1–64 KiB float32 at p = 2 and 4: benchmarks/collectives.py's automatic choice
            against MPI_Allreduce of the MPI minipar runs on (the median of many calls each).
Each sub-benchmark runs in its own process(es), so one can be rerun alone with the command it prints.
"""
from __future__ import annotations

import argparse
import importlib.util
import math
import os
import re
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
HAS_TORCH = importlib.util.find_spec("torch") is not None
STEP_SHAPES = {"L=4 H=4 C=256": ["--n-layer", "4", "--n-head", "4", "--n-embd", "256"],
               "L=2 H=12 C=768": ["--n-layer", "2", "--n-head", "12", "--n-embd", "768"]}


def cpu_model() -> str:
    """The CPU's name and its widest vector unit, from /proc/cpuinfo (Linux), else the platform's word."""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        import platform

        return platform.processor() or platform.machine()
    name = re.search(r"model name\s*:\s*(.*)", info)
    flags = re.search(r"flags\s*:\s*(.*)", info)
    vector = next((v for v in ("avx512f", "avx2") if flags and v in flags.group(1).split()), "no AVX2")
    return f"{name.group(1).strip() if name else 'unknown CPU'} ({vector}, {os.cpu_count()} cores)"


def run(cmd: list[str]) -> str:
    print("  $", " ".join(cmd), flush=True)
    done = subprocess.run(cmd, cwd=HERE, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return done.stdout


def mpiexec(p: int, script: str, *args: str) -> list[str]:
    launcher = shutil.which("mpiexec", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    return [launcher or "mpiexec", "-n", str(p), sys.executable, script, *args]


Row = tuple[str, float, float, float]  # what, minipar, anchor, minipar/anchor (nan: no ratio to state)


def step_rows(rounds: int) -> list[Row]:
    rows = []
    for shape, flags in STEP_SHAPES.items():
        best = {"minipar": float("inf"), "torch": float("inf") if HAS_TORCH else math.nan}
        for _ in range(rounds):  # interleaved: a shared machine's slow spells hit both alike
            for framework in best if HAS_TORCH else ["minipar"]:
                out = run([sys.executable, "train_step.py", "--framework", framework, "--steps", "15", *flags])
                best[framework] = min(best[framework], float(re.search(r"median ([\d.]+) ms", out).group(1)))
        rows.append((f"step {shape} (ms, PyTorch eager)", best["minipar"], best["torch"], best["minipar"] / best["torch"]))
    return rows


def dp_rows(rounds: int) -> list[Row]:
    ours = run(mpiexec(2, "data_parallel.py", "--rounds", str(rounds), "--modes", "dp, overlap"))
    theirs = run(mpiexec(2, "ddp.py", "--rounds", str(rounds))) if HAS_TORCH else "ddp, overlap nan nan"

    def table(out: str) -> dict[str, tuple[float, float]]:
        return {m.group(1).strip(): (float(m.group(2)), float(m.group(3)))
                for m in re.finditer(r"^(\w[\w ,-]*?)\s+([\d.]+|nan)\s+([-\d.]+|nan)", out, re.M)}

    mine, anchor = table(ours), table(theirs)
    (step, exposed), (ddp_step, ddp_exposed) = mine["dp, overlap"], anchor["ddp, overlap"]
    return [("dp p=2 step (ms, DDP gloo)", step, ddp_step, step / ddp_step),
            ("dp p=2 exposed comm (ms, DDP gloo)", exposed, ddp_exposed, math.nan)]


def allreduce_rows() -> list[Row]:
    rows = []
    for p in (2, 4):
        out = run(mpiexec(p, "collectives.py", "--ops", "all_reduce", "--max-mib", "1"))
        pattern = r"^all_reduce\s+(\d+ KiB)\s+\S+\s+([\d.]+)\s+\S+\s+[\d.]+\s+([\d.]+)\s+([\d.]+)"
        for m in re.finditer(pattern, out, re.M):  # size, auto ms, MPI ms, auto/MPI (from unrounded times)
            if int(m.group(1).split()[0]) <= 64:
                rows.append((f"all-reduce {m.group(1)} p={p} (µs, MPI_Allreduce)", 1e3 * float(m.group(2)),
                             1e3 * float(m.group(3)), float(m.group(4))))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the step and dp comparisons")
    ap.add_argument("--skip", nargs="*", default=[], choices=["step", "dp", "allreduce"])
    args = ap.parse_args()
    print(f"CPU: {cpu_model()}")
    if not HAS_TORCH:
        print("torch is not installed: the PyTorch anchors are left out (pip install torch to measure them)")
    rows = []
    for name, measure in (("step", lambda: step_rows(args.rounds)), ("dp", lambda: dp_rows(args.rounds)),
                          ("allreduce", allreduce_rows)):
        if name not in args.skip:
            rows += measure()
    width = max(len(r[0]) for r in rows) + 2
    print(f"\n| {'measure':<{width}}| minipar | anchor | ratio |\n|{'-' * (width + 1)}|---|---|---|")
    for what, mine, anchor, ratio in rows:
        print(f"| {what:<{width}}| {mine:.1f} | {anchor:.1f} | {'–' if math.isnan(ratio) else f'{ratio:.2f}×'} |")


if __name__ == "__main__":
    main()
