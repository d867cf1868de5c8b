"""Every figure of the docs (docs/index.md and the technique pages), drawn from the engine's own objects — so a figure cannot disagree with the code.

    python -m minipar figures [--out docs/figures]        # SVGs, through matplotlib (pip install 'minipar[plot]')

Each figure is two functions: one that computes its data from the engine (a schedule object's simulated passes, the
bytes the real ring collectives send, the planner's accounting, a mesh's coordinates), which tests check against the
engine and the papers, and one that draws that data. Nothing here invents a number.

    pipeline_<name>.svg    each rank's passes on the logical clock (Schedule.simulate), the bubble shaded and its share
                           — the schedule's own formula — in the title: GPipe, 1F1B, interleaved, ZB-H1, DualPipeV
    ring_<op>.svg          the ring reduce-scatter and all-gather step by step: which chunk each rank sends, with
                           whose contributions, read back from the bytes the real algorithm sent between p threads
    zero_memory.svg        model-state bytes per GPU for DP and ZeRO-1/2/3 (planner.model_state_bytes; the ZeRO
                           paper's Figure 1: Ψ = 7.5B, N = 64)
    mesh.svg               a 5-D layout: which rank holds which layers, heads, sequence chunks and experts
    planner_published.svg  the planner's predicted step time against 24 published Megatron-LM runs
    pipeline_measured.svg  a 2-stage 1F1B and ZB-H1 step as planned (the logical clock) and as measured (train --trace)
    loss_precision.svg     the same run's loss in float32, bf16 mixed precision and FP8 (tensorwise, rowwise)
    expert_load.svg        a MoE's busiest expert over the mean, step by step: no balancing, the auxiliary loss,
                           the sigmoid router's bias (auxiliary-loss-free)
    activation_memory.svg  a step's peak bytes against the sequence length for each --recompute mode (--peak-memory),
                           beside what activation_elements says a forward keeps
    communication.svg      bytes per layer along dp (and ZeRO-3), tp (and sp), cp (ring, Ulysses) and ep, from the step
                           records of 2-rank runs, beside the planner's closed forms (planner.communication_bytes)
    compression.svg        loss by step and by bytes sent for DP, the 16-bit and int8 wires, PowerSGD, top-k, local SGD

The measured figures run ``python -m minipar train`` on a tiny model (a few seconds each).
"""
from __future__ import annotations

import os
import queue
import re
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from minipar.comm.collectives import chunk_bounds, ring_all_gather, ring_reduce_scatter
from minipar.parallel.context_parallel import chunk_positions
from minipar.parallel.layout import Layout
from minipar.parallel.mesh import coordinates
from minipar.parallel.pipeline import stage_blocks
from minipar.parallel.planner import model_state_bytes
from minipar.parallel.schedules import Schedule, build
from minipar.plot import CATEGORIES, load_events, pyplot, save_figure
from minipar.testing import train_cli

KIND_COLOURS = {"F": CATEGORIES["forward"][1], "B": CATEGORIES["backward"][1], "W": CATEGORIES["weights"][1]}
SCHEDULE_FIGURES = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("dualpipev", 2))


# ------------------------------------------------------------------------------------------- pipelines


@dataclass(frozen=True)
class Cell:
    rank: int
    start: float
    width: float
    kind: str  # F, B or W
    microbatch: int
    chunk: int


def schedule_cells(schedule: Schedule) -> list[Cell]:
    """Every pass of one step, where :meth:`Schedule.simulate` places it on the logical clock."""
    cost, sim = schedule.costs(), schedule.simulate()
    return [Cell(rank, start, cost[a.kind], a.kind, a.microbatch, a.chunk)
            for rank, passes in enumerate(sim.passes) for start, a in passes]


def idle_share(cells: list[Cell], p: int) -> float:
    """The share of p ranks × the makespan in which no pass runs (the shaded area of the figure)."""
    makespan = max(c.start + c.width for c in cells)
    return 1.0 - sum(c.width for c in cells) / (p * makespan)


def draw_schedule(schedule: Schedule, path: str, span: float | None = None) -> None:
    """``span``: the time axis' length, shared by figures drawn to be compared (default: this makespan)."""
    plt = pyplot()
    cells = schedule_cells(schedule)
    makespan = max(c.start + c.width for c in cells)
    figure, ax = plt.subplots(figsize=(10, 0.7 + 0.42 * schedule.p))  # one width for all: the docs show them alike
    ax.barh(range(schedule.p), [makespan] * schedule.p, left=0, height=0.8, color="#eeeeee", hatch="//",
            edgecolor="#cccccc", linewidth=0)  # the bubble: whatever the passes leave uncovered
    from matplotlib.colors import to_rgb

    for c in cells:  # a second chunk's passes in a lighter shade of their kind's colour
        colour = np.array(to_rgb(KIND_COLOURS[c.kind]))
        ax.barh(c.rank, c.width, left=c.start, height=0.8, color=colour if c.chunk == 0 else 0.55 * colour + 0.45,
                edgecolor="white", linewidth=0.8)
        ax.text(c.start + c.width / 2, c.rank, f"{c.kind}{c.microbatch}" + ("'" * c.chunk), ha="center",
                va="center", fontsize=6 if makespan < 30 else 5, color="white")
    ax.set_yticks(range(schedule.p), [f"rank {r}" for r in range(schedule.p)])
    ax.invert_yaxis()
    ax.set_xlim(0, span or makespan)
    ax.set_xlabel("time (a stage's forward = 1)")
    chunks = f", v={schedule.v}" if schedule.v > 1 else ""
    ax.set_title(f"{schedule.name}: p={schedule.p}, m={schedule.m}{chunks} — bubble {schedule.bubble():.1%} "
                 "(shaded; F blue, B red, W purple; ' = a rank's second chunk)", fontsize=9)
    save_figure(figure, path)


# ------------------------------------------------------------------------------------------- ring collectives


@dataclass(frozen=True)
class Transfer:
    phase: str  # "reduce-scatter" or "all-gather"
    step: int
    src: int
    dst: int
    chunk: int
    contributors: tuple[int, ...]  # whose values the chunk carries summed


class _Wires:
    """Queues between p threads, one per (sender, receiver), and a record of every message sent."""

    def __init__(self, p: int):
        self.queues = {(a, b): queue.Queue() for a in range(p) for b in range(p)}
        self.sent: list[tuple[int, int, int, np.ndarray]] = []  # (rank, its call number, destination, copy)
        self.lock = threading.Lock()


class _ThreadRank:
    """Rank ``rank`` of p threads — as much of a communicator as the ring collectives use (size, rank, sendrecv)."""

    def __init__(self, wires: _Wires, rank: int, size: int):
        self.wires, self.rank, self.size, self.calls = wires, rank, size, 0

    def sendrecv(self, send: np.ndarray, dest: int, recv: np.ndarray, source: int, tag: int) -> None:
        with self.wires.lock:
            self.wires.sent.append((self.rank, self.calls, dest, np.array(send)))
        self.calls += 1
        self.wires.queues[(self.rank, dest)].put(np.array(send))
        recv[...] = self.wires.queues[(source, self.rank)].get(timeout=10)


def ring_transfers(p: int, chunk: int = 2) -> list[Transfer]:
    """Run the real ring reduce-scatter and all-gather on p threads and read each transfer back from its bytes.

    Rank r's input has chunk c filled with c + 2**(r + 8): a partial sum over a set S of ranks then holds
    |S|·c + Σ_{r∈S} 2**(r + 8), so the chunk index and its contributors are read from the values sent alone."""
    wires = _Wires(p)
    bounds = chunk_bounds(p * chunk, p)
    buffers = [np.repeat(np.arange(p, dtype=np.float64), chunk) + 2.0 ** (r + 8) for r in range(p)]

    def run(r: int) -> None:
        comm = _ThreadRank(wires, r, p)
        ring_reduce_scatter(comm, buffers[r], "sum", 0, bounds)
        ring_all_gather(comm, buffers[r], 0, bounds)

    workers = [threading.Thread(target=run, args=(r,)) for r in range(p)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    expected = np.repeat(p * np.arange(p, dtype=np.float64), chunk) + sum(2.0 ** (r + 8) for r in range(p))
    if not all(np.array_equal(b, expected) for b in buffers):
        raise AssertionError("the ring did not compute the sum")
    transfers = []
    for r, call, dest, data in sorted(wires.sent, key=lambda t: (t[1], t[0])):
        value = int(data[0])
        ranks = tuple(q for q in range(p) if value >> (q + 8) & 1)
        phase = "reduce-scatter" if call < p - 1 else "all-gather"
        transfers.append(Transfer(phase, call % (p - 1), r, dest, (value & 0xFF) // len(ranks), ranks))
    return transfers


def draw_ring(p: int, phase: str, path: str) -> None:
    plt = pyplot()
    steps = [t for t in ring_transfers(p) if t.phase == phase]
    figure, axes = plt.subplots(1, p - 1, figsize=(3.2 * (p - 1), 3.4))
    angle = [np.pi / 2 - 2 * np.pi * r / p for r in range(p)]
    xy = [(np.cos(a), np.sin(a)) for a in angle]
    for s, ax in enumerate(np.atleast_1d(axes)):
        ax.set_aspect("equal")
        ax.axis("off")
        ax.set_xlim(-1.5, 1.5)
        ax.set_ylim(-1.5, 1.5)
        for r, (x, y) in enumerate(xy):
            ax.add_patch(plt.Circle((x, y), 0.22, color="#4285f4"))
            ax.text(x, y, str(r), ha="center", va="center", color="white", fontsize=10)
        for t in (t for t in steps if t.step == s):
            (x0, y0), (x1, y1) = xy[t.src], xy[t.dst]
            ax.annotate("", (x1 * 0.75 + x0 * 0.25, y1 * 0.75 + y0 * 0.25), (x0 * 0.75 + x1 * 0.25, y0 * 0.75 + y1 * 0.25),
                        arrowprops={"arrowstyle": "->", "color": "#db4437"})
            label = f"c{t.chunk}" + (f" Σ{{{','.join(map(str, t.contributors))}}}" if phase == "reduce-scatter" else "")
            ax.text((x0 + x1) / 2 * 1.45, (y0 + y1) / 2 * 1.45, label, ha="center", va="center", fontsize=7)
        ax.set_title(f"step {s + 1} of {p - 1}", fontsize=9)
    figure.suptitle(f"ring {phase}, p = {p}: chunk c of each rank's buffer; Σ{{…}}: the ranks whose values it carries",
                    fontsize=9)
    save_figure(figure, path)


# ------------------------------------------------------------------------------------------- ZeRO


def zero_memory(psi: float, n: int, itemsize: int = 2) -> dict[str, float]:
    """Model-state bytes per GPU for plain data parallelism and ZeRO stages 1-3 (the planner's accounting)."""
    return {name: model_state_bytes(psi, n, stage, itemsize)
            for stage, name in enumerate(("DP", "ZeRO-1", "ZeRO-2", "ZeRO-3"))}


def draw_zero(path: str, psi: float = 7.5e9, n: int = 64, itemsize: int = 2) -> None:
    """``itemsize`` 2: mixed precision (the paper's); 4 or 8: pure float32 / float64 (Adam's moments alike)."""
    plt = pyplot()
    bars = zero_memory(psi, n, itemsize)
    div, unit = next((d, u) for d, u in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB"), (1, "B")) if max(bars.values()) >= d)
    figure, ax = plt.subplots(figsize=(6, 3.2))
    ax.bar(list(bars), [b / div for b in bars.values()], color=["#9e9e9e", "#4285f4", "#ab47bc", "#db4437"])
    for i, b in enumerate(bars.values()):
        ax.text(i, b / div, f"{b / div:.1f} {unit}", ha="center", va="bottom", fontsize=9)
    ax.set_ylabel(f"model states per rank ({unit})")
    ax.set_ylim(0, max(bars.values()) / div * 1.15)  # room for the largest bar's label
    what = "mixed-precision Adam: 16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N" if itemsize == 2 else \
        f"Adam, {8 * itemsize}-bit parameters"
    ax.set_title(f"{what}; Ψ = {f'{psi / 1e9:g}B' if psi >= 1e9 else f'{psi:,.0f}'} parameters, N = {n} ranks",
                 fontsize=8)
    save_figure(figure, path)


# ------------------------------------------------------------------------------------------- the mesh


@dataclass(frozen=True)
class Holding:
    rank: int
    pp: int
    dp: int
    cp: int
    tp: int
    ep: int
    layers: tuple[int, ...]
    heads: tuple[int, ...]
    positions: tuple[int, ...]  # the chunks of each sequence (of 2·cp zigzag chunks, or cp contiguous)
    experts: tuple[int, ...]


def mesh_holdings(layout: Layout, n_layer: int, n_head: int, n_expert: int) -> list[Holding]:
    """What every rank of ``layout`` holds: its mesh coordinates (Mesh's order: tp fastest, then cp, dp, pp) and
    the layers (its pipeline stages' blocks), attention heads (tp), sequence chunks (cp) and experts (ep) of it."""
    schedule = layout.pipeline_schedule()
    out = []
    for rank in range(layout.world):
        pp, dp, cp, tp = coordinates(rank, layout.dp, layout.cp, layout.tp)
        ep = (dp * layout.cp + cp) % layout.ep
        layers = tuple(b for c in range(schedule.v) for b in stage_blocks(n_layer, schedule.n_stages, schedule.stage(pp, c)))
        per = n_head // layout.tp
        split = layout.cp_split if layout.cp > 1 else "contiguous"
        chunks = 2 * layout.cp if split == "zigzag" else layout.cp
        positions = tuple(int(x) for x in chunk_positions(cp, layout.cp, chunks // layout.cp, split))
        experts = tuple(int(e) for e in np.array_split(np.arange(n_expert), layout.ep)[ep]) if n_expert else ()
        out.append(Holding(rank, pp, dp, cp, tp, ep, layers, tuple(range(tp * per, (tp + 1) * per)), positions, experts))
    return out


def _span(values: tuple[int, ...]) -> str:
    """0–3 for a run of consecutive numbers, else 0,3."""
    run = len(values) > 1 and values[-1] - values[0] == len(values) - 1
    return f"{values[0]}–{values[-1]}" if run else ",".join(map(str, values))


def draw_mesh(path: str, layout: Layout | None = None, n_layer: int = 4, n_head: int = 4, n_expert: int = 4) -> None:
    """One box per rank: pipeline stages down, data-parallel replicas across, cp then tp inside a replica."""
    plt = pyplot()
    layout = layout or Layout(dp=2, tp=2, pp=2, cp=2, ep=2, sp=True, schedule="1f1b", microbatches=2)
    rows = mesh_holdings(layout, n_layer, n_head, n_expert)
    inner = layout.cp * layout.tp
    figure, ax = plt.subplots(figsize=(1.15 * layout.dp * inner + 1, 1.3 * layout.pp + 0.8))
    colours = ["#bbdefb", "#f8bbd0", "#c8e6c9", "#ffe0b2", "#d1c4e9", "#b2ebf2", "#fff9c4", "#ffccbc"]
    for h in rows:
        x, y = h.dp * (inner + 0.4) + h.cp * layout.tp + h.tp, h.pp * 1.3
        ax.add_patch(plt.Rectangle((x, y), 0.92, 1.1, facecolor=colours[h.ep % len(colours)], edgecolor="#555555"))
        ax.text(x + 0.46, y + 0.55, f"rank {h.rank}\nlayers {_span(h.layers)}\nheads {_span(h.heads)}\n"
                f"seq {_span(h.positions)}" + (f"\nexperts {_span(h.experts)}" if h.experts else ""),
                ha="center", va="center", fontsize=7)
    for dp in range(layout.dp):
        ax.text(dp * (inner + 0.4) + inner / 2, -0.25, f"data-parallel replica {dp}", ha="center", fontsize=8)
    for pp in range(layout.pp):
        ax.text(-0.15, pp * 1.3 + 0.55, f"stage {pp}", ha="right", va="center", fontsize=8)
    ax.set_xlim(-1.2, layout.dp * (inner + 0.4))
    ax.set_ylim(layout.pp * 1.3, -0.5)
    ax.axis("off")
    ax.set_title(f"{layout} on {layout.world} ranks: L={n_layer}, H={n_head}, E={n_expert}; a sequence in "
                 f"{2 * layout.cp if layout.cp_split == 'zigzag' else layout.cp} {layout.cp_split} chunks; "
                 "colour: the expert-parallel rank", fontsize=8)
    save_figure(figure, path)


# ------------------------------------------------------------------------------------------- the planner


def published_predictions() -> list[tuple[str, float, float]]:
    """(run, published seconds per step, the planner's prediction) for the published Megatron-LM runs, with the
    efficiency constant per code base fitted as ``plan --validate`` fits it."""
    from minipar.parallel import validation
    from minipar.parallel.planner import BUILTIN_PROFILES

    profile = BUILTIN_PROFILES["a100-80gb"]
    efficiency = validation.fit(profile, validation.PUBLISHED_RUNS)
    return [(run.name, run.published_seconds(),
             validation.predict_run(run, validation.run_profile(run, profile, efficiency)).step_time)
            for run in validation.PUBLISHED_RUNS]


def draw_planner(path: str) -> None:
    plt = pyplot()
    runs = published_predictions()
    figure, ax = plt.subplots(figsize=(5, 5))
    published, predicted = np.array([r[1] for r in runs]), np.array([r[2] for r in runs])
    ax.loglog(published, predicted, "o", color="#4285f4")
    top = max(published.max(), predicted.max()) * 1.3
    bottom = min(published.min(), predicted.min()) / 1.3
    ax.plot([bottom, top], [bottom, top], color="#9e9e9e", linewidth=0.8)
    ax.set_xlabel("published step time (s)")
    ax.set_ylabel("predicted step time (s)")
    errors = np.abs(predicted / published - 1)
    ax.set_title(f"{len(runs)} published runs: max error {errors.max():.1%}, mean {errors.mean():.1%}", fontsize=9)
    save_figure(figure, path)


# ------------------------------------------------------------------------------------------- measured runs

def config_flags(fields: dict[str, Any]) -> list[str]:
    """train's flags for config fields: {"n_layer": 4} -> ["--n-layer", "4"]."""
    return [flag for name, value in fields.items() for flag in (f"--{name.replace('_', '-')}", str(value))]


TINY_MODEL = {"n_layer": 4, "n_head": 2, "n_embd": 32, "vocab_size": 256}  # the embedded corpus' bytes
TINY = [*config_flags({k: v for k, v in TINY_MODEL.items() if k != "vocab_size"}),
        "--block-size", "32", "--batch-size", "8", "--eval-interval", "0", "--warmup", "2", "--seed", "0"]


def train_records(flags: list[str], ranks: int = 1) -> list[dict[str, Any]]:
    """The step records of ``python -m minipar train --json FLAGS`` on ``ranks`` ranks (testing.train_cli)."""
    return train_cli(["--json", *flags], ranks, timeout=600)[0]


def measured_passes(trace: str) -> dict[int, list[tuple[float, float, str, int, int]]]:
    """Per rank, the forward/backward/weight passes of the last step of a ``--trace`` file: (start ms, duration ms,
    kind, microbatch, chunk), in the order they ran, the start relative to that step's first pass."""
    passes: dict[int, list[tuple[float, float, str, int, int]]] = {}
    for event in sorted(load_events(trace), key=lambda e: e["ts"]):
        found = re.fullmatch(r"([FBW])(\d+)(?:\.(\d+))?", event["name"])
        if found and event["cat"] in ("forward", "backward", "weights"):
            passes.setdefault(event["pid"], []).append((event["ts"] / 1e3, event["dur"] / 1e3, found.group(1),
                                                        int(found.group(2)), int(found.group(3) or 0)))
    return passes


def traced_pipeline(name: str, p: int = 2, m: int = 4, steps: int = 3) -> tuple[Schedule, dict[int, list]]:
    """Run a p-stage pipeline under ``--trace`` and keep each rank's passes of its last step."""
    schedule = build(name, p, m)
    per_step = len(schedule.actions(0))
    with tempfile.TemporaryDirectory() as folder:
        trace = os.path.join(folder, "trace.json")
        train_records([*TINY, "--pp", str(p), "--microbatches", str(m), "--schedule", name, "--steps", str(steps),
                       "--trace", trace], ranks=p)
        passes = measured_passes(trace)
    last = {r: rows[-per_step:] for r, rows in passes.items()}
    origin = min(rows[0][0] for rows in last.values())
    return schedule, {r: [(t - origin, d, k, i, c) for t, d, k, i, c in rows] for r, rows in last.items()}


def draw_trace_vs_plan(path: str, names: tuple[str, ...] = ("1f1b", "zb-h1")) -> None:
    plt = pyplot()
    figure, axes = plt.subplots(len(names), 2, figsize=(11, 1.3 * len(names) + 0.8), squeeze=False)
    for row, name in enumerate(names):
        schedule, measured = traced_pipeline(name)
        panels = ((axes[row][0], [(c.rank, c.start, c.width, c.kind, c.microbatch) for c in schedule_cells(schedule)],
                   "planned (a stage's forward = 1)"),
                  (axes[row][1], [(r, t, d, k, i) for r, rows in measured.items() for t, d, k, i, _ in rows],
                   "measured by --trace (ms)"))
        for ax, cells, unit in panels:
            for rank, start, width, kind, microbatch in cells:
                ax.barh(rank, width, left=start, height=0.8, color=KIND_COLOURS[kind], edgecolor="white")
                ax.text(start + width / 2, rank, f"{kind}{microbatch}", ha="center", va="center", fontsize=6,
                        color="white")
            ax.set_yticks(range(schedule.p), [f"rank {r}" for r in range(schedule.p)])
            ax.invert_yaxis()
            ax.set_title(f"{schedule.name}, p={schedule.p}, m={schedule.m}: {unit}", fontsize=8)
    figure.tight_layout()
    save_figure(figure, path)


PRECISIONS = (("float32", []), ("bf16 mixed", ["--precision", "bf16-mixed"]),
              ("fp8 tensorwise", ["--precision", "fp8", "--fp8-recipe", "tensorwise"]),
              ("fp8 rowwise", ["--precision", "fp8", "--fp8-recipe", "rowwise"]))


def precision_losses(steps: int = 60) -> dict[str, list[float]]:
    """The training loss of one run (same seed, same batches) in each precision."""
    return {label: [r["loss"] for r in train_records([*TINY, "--steps", str(steps), *flags]) if "loss" in r]
            for label, flags in PRECISIONS}


def draw_precision(path: str) -> None:
    plt = pyplot()
    losses = precision_losses()
    reference = np.array(losses["float32"])
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5), sharex=True, height_ratios=(2, 1))
    for label, curve in losses.items():
        steps = range(1, len(curve) + 1)
        top.plot(steps, curve, label=label, linewidth=1)
        bottom.plot(steps, np.array(curve) - reference, label=label, linewidth=1)
    top.set_ylabel("training loss")
    top.legend(fontsize=8)
    top.set_title("one run in four precisions (GPT L=4 C=32, same seed and batches): the curves overlap", fontsize=9)
    bottom.set_ylabel("loss − float32's")
    bottom.set_xlabel("step")
    save_figure(figure, path)


BALANCING = (("no balancing", ["--aux-loss-coef", "0"]), ("auxiliary loss 0.01", ["--aux-loss-coef", "0.01"]),
             ("sigmoid router + bias (γ = 0.01)", ["--router", "sigmoid", "--aux-loss-coef", "0", "--bias-update",
                                                  "0.01"]))


def expert_loads(steps: int = 60) -> dict[str, list[float]]:
    """Per balancing method, each step's busiest expert's load over the mean, averaged over the MoE layers (the
    step record's ``load_max_over_mean``, one value per layer), 8 experts, top-2, dropless."""
    moe = ["--n-expert", "8", "--expert-top-k", "2", "--capacity-factor", "0", "--steps", str(steps)]
    return {label: [float(np.mean(r["experts"]["load_max_over_mean"])) for r in train_records([*TINY, *moe, *flags])
                    if "loss" in r] for label, flags in BALANCING}


def draw_expert_load(path: str) -> None:
    plt = pyplot()
    loads = expert_loads()
    figure, ax = plt.subplots(figsize=(7, 3.5))
    for label, curve in loads.items():
        ax.plot(range(1, len(curve) + 1), curve, label=label, linewidth=1)
    ax.axhline(1.0, color="#9e9e9e", linewidth=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("busiest expert's tokens / mean\n(mean over the 4 layers)")
    ax.legend(fontsize=8)
    ax.set_title("expert load, 8 experts, top-2, dropless (1.0: perfectly balanced)", fontsize=9)
    save_figure(figure, path)


RECOMPUTE_MODES = ("none", "selective", "full")


def activation_peaks(lengths: tuple[int, ...] = (32, 64, 128, 256), batch: int = 4) -> dict[str, list[int]]:
    """Per --recompute mode, each sequence length's peak host bytes in a training step, as ``--peak-memory``
    measures it (tracemalloc; the model states included): one process, the tiny GPT, batch 4, float32."""
    peaks: dict[str, list[int]] = {}
    for mode in RECOMPUTE_MODES:
        for t in lengths:
            flags = [*TINY, "--block-size", str(t), "--batch-size", str(batch), "--recompute", mode, "--steps", "3",
                     "--peak-memory"]
            peaks.setdefault(mode, []).append(max(r["peak_bytes"]["max"] for r in train_records(flags) if "loss" in r))
    return peaks


def draw_activation_memory(path: str, lengths: tuple[int, ...] = (32, 64, 128, 256), batch: int = 4) -> None:
    from minipar.models.gpt import GPTConfig, activation_elements

    plt = pyplot()
    peaks = activation_peaks(lengths, batch)
    figure, ax = plt.subplots(figsize=(7, 3.8))
    for (mode, curve), colour in zip(peaks.items(), ("#db4437", "#4285f4", "#0f9d58")):
        ax.plot(lengths, [b / 1e6 for b in curve], "o-", color=colour, label=f"--recompute {mode}: measured peak")
        kept = [activation_elements(GPTConfig(block_size=t, **TINY_MODEL), batch, mode) * 4 / 1e6 for t in lengths]
        ax.plot(lengths, kept, "--", color=colour, label=f"{mode}: kept for backward (activation_elements)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [str(t) for t in lengths])
    ax.set_xlabel("sequence length T")
    ax.set_ylabel("MB")
    ax.legend(fontsize=7)
    ax.set_title(f"one process, GPT L=4 C=32 H=2, batch {batch}, float32: train --peak-memory", fontsize=9)
    save_figure(figure, path)


AXIS_RUNS = (  # (label, the layout trained (its flags: Layout.flags), the axis, the step record's labels of its exchanges)
    ("dp 2", Layout(dp=2), "dp", ("grads", "params")),
    ("dp 2, ZeRO-3", Layout(dp=2, zero=3), "dp", ("grads", "params")),
    ("tp 2", Layout(tp=2), "tp", ("tp_forward", "tp_backward")),
    ("tp 2 + sp", Layout(tp=2, sp=True), "tp", ("sp_forward", "sp_backward")),
    ("cp 2, ring", Layout(cp=2), "cp", ("cp_forward", "cp_backward")),
    ("cp 2, Ulysses", Layout(cp=2, cp_kind="ulysses"), "cp", ("cp_forward", "cp_backward")),
    ("ep 2 (dp 2)", Layout(dp=2, ep=2), "ep", ("ep_counts", "ep_forward", "ep_backward")),
)
MOE = {"n_expert": 4, "expert_top_k": 2, "capacity_factor": 0.0}  # the ep run's MLPs: 4 experts, top-2, dropless


def communication_per_layer() -> list[tuple[str, float, float]]:
    """Per run of :data:`AXIS_RUNS` (2 ranks, the tiny GPT, batch 8, T = 32, float32): (label, the bytes rank 0
    sent along the run's axis in its last step, the planner's closed form, planner.communication_bytes), each
    ÷ n_layer — the per-layer share (dp's include the embedding's gradients; ep's closed form assumes balanced
    routing, the measured bytes are the rows the router actually sent to the other rank)."""
    from minipar.models.gpt import GPTConfig
    from minipar.parallel.planner import communication_bytes

    rows = []
    for label, layout, axis, ops in AXIS_RUNS:
        moe = MOE if axis == "ep" else {}
        flags = [*TINY, *config_flags(moe), *layout.flags(), "--steps", "2"]
        record = [r for r in train_records(flags, 2) if "loss" in r][-1]
        measured = sum(record["comm_bytes_by_op"].get(op, 0) for op in ops)
        cfg = GPTConfig(block_size=32, **TINY_MODEL, **moe)
        closed = communication_bytes(cfg, 8, layout, itemsize=4)[axis]
        rows.append((label, measured / cfg.n_layer, closed / cfg.n_layer))
    return rows


def draw_communication(path: str) -> None:
    plt = pyplot()
    rows = communication_per_layer()
    figure, ax = plt.subplots(figsize=(7, 3.6))
    y = np.arange(len(rows))
    ax.barh(y - 0.2, [r[1] / 1e3 for r in rows], 0.4, color="#4285f4", label="measured (the step record's bytes)")
    ax.barh(y + 0.2, [r[2] / 1e3 for r in rows], 0.4, color="#9e9e9e", label="closed form (planner)")
    for i, (_, measured, closed) in enumerate(rows):
        ax.text(max(measured, closed) / 1e3, i, f" {measured / 1e3:.1f} / {closed / 1e3:.1f}", va="center", fontsize=7)
    ax.set_yticks(y, [r[0] for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel("kB a rank sends per step, per layer")
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title("communication per layer: GPT L=4 C=32, batch 8 × T 32, float32, 2 ranks", fontsize=9)
    ax.margins(x=0.2)
    save_figure(figure, path)


COMPRESSION_RUNS = (("synchronous DP", []), ("bf16 wire", ["--compression", "bf16"]),
                    ("int8", ["--compression", "int8"]), ("PowerSGD r=4", ["--compression", "powersgd"]),
                    ("top-k 1%", ["--compression", "topk"]),
                    ("local SGD H=8", ["--local-sgd", "8", "--outer-lr", "1", "--outer-momentum", "0"]))


def compression_curves(steps: int = 60, runs: tuple[tuple[str, list[str]], ...] = COMPRESSION_RUNS
                       ) -> dict[str, tuple[list[float], list[int]]]:
    """Per method, 2 data-parallel ranks of the tiny GPT: (each step's loss, the gradient and parameter bytes rank 0
    sent in it — the step record's ``comm_bytes``)."""
    curves = {}
    for label, flags in runs:
        records = [r for r in train_records([*TINY, "--dp", "2", "--steps", str(steps), *flags], 2) if "loss" in r]
        curves[label] = ([r["loss"] for r in records], [r["comm_bytes"] for r in records])
    return curves


def draw_compression(path: str) -> None:
    plt = pyplot()
    curves = compression_curves()
    figure, (by_step, by_bytes) = plt.subplots(1, 2, figsize=(9, 3.6), sharey=True)
    for label, (losses, sent) in curves.items():
        by_step.plot(range(1, len(losses) + 1), losses, linewidth=1, label=label)
        by_bytes.plot(np.cumsum(sent) / 1e6, losses, linewidth=1, label=label)
    by_step.set_xlabel("step")
    by_step.set_ylabel("training loss")
    by_bytes.set_xscale("log")
    by_bytes.set_xlabel("MB rank 0 has sent (gradients and parameters)")
    by_bytes.legend(fontsize=7)
    figure.suptitle("gradient compression and local SGD: 2 data-parallel ranks, GPT L=4 C=32, batch 8 × T 32", fontsize=9)
    save_figure(figure, path)


def draw_bars(path: str, values: dict[str, float], xlabel: str, title: str) -> None:
    """A horizontal bar per label, its value written beside it: what a tutorial measured (its ``--plot``)."""
    plt = pyplot()
    figure, ax = plt.subplots(figsize=(7, 0.45 * len(values) + 1.2))
    y = np.arange(len(values))
    ax.barh(y, list(values.values()), 0.6, color="#4285f4")
    for i, v in enumerate(values.values()):
        ax.text(v, i, f" {v:,.0f}", va="center", fontsize=7)
    ax.set_yticks(y, list(values))
    ax.invert_yaxis()
    ax.margins(x=0.15)
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=9)
    save_figure(figure, path)


# ------------------------------------------------------------------------------------------- all of them


def make_all(out: str, say: Any = print, only: tuple[str, ...] = ()) -> list[str]:
    """Draw every figure (or those named in ``only``) into ``out``; returns the files written."""
    os.makedirs(out, exist_ok=True)
    span = max(build(name, 4, 8, v).simulate().makespan for name, v in SCHEDULE_FIGURES)  # one time axis for all
    jobs = [(f"pipeline_{name}.svg", lambda path, n=name, v=v: draw_schedule(build(n, 4, 8, v), path, span))
            for name, v in SCHEDULE_FIGURES]
    jobs += [(f"ring_{phase.replace('-', '_')}.svg", lambda path, ph=phase: draw_ring(4, ph, path))
             for phase in ("reduce-scatter", "all-gather")]
    jobs += [("zero_memory.svg", draw_zero), ("mesh.svg", draw_mesh), ("planner_published.svg", draw_planner),
             ("pipeline_measured.svg", draw_trace_vs_plan), ("loss_precision.svg", draw_precision),
             ("expert_load.svg", draw_expert_load), ("activation_memory.svg", draw_activation_memory),
             ("communication.svg", draw_communication), ("compression.svg", draw_compression)]
    unknown = set(only or ()) - {name for name, _ in jobs}
    if unknown:
        raise ValueError(f"no figure called {', '.join(sorted(unknown))}: the figures are "
                         f"{', '.join(name for name, _ in jobs)}")
    jobs = [(name, draw) for name, draw in jobs if not only or name in only]
    written = []
    for name, draw in jobs:
        started = time.perf_counter()
        draw(os.path.join(out, name))
        written.append(os.path.join(out, name))
        say(f"{written[-1]} ({time.perf_counter() - started:.1f} s)")
    return written
