"""Pipeline schedules: for each rank, the ordered list of passes it runs in one step, and a simulator
that replays them on a logical clock.

An action is (kind, microbatch, chunk). A rank holds v model chunks (virtual stages); chunk c of rank
r is virtual stage s = c·p + r of the p·v stages, so consecutive virtual stages live on consecutive
ranks and the last rank hands on to the first (Megatron's interleaving). Kinds:

    F   forward of one microbatch through one chunk
    B   backward; in GPipe, 1F1B and interleaved it computes input *and* weight gradients,
        in ZB-H1 only the input gradients (what the previous stage waits for)
    W   ZB-H1 only: the weight gradients of an earlier B, from the activations B kept

Schedules, p ranks, m microbatches (unit costs F = 1, B = 2 when it includes W, else B = W = 1):

    gpipe        all F, then all B                              bubble (p−1)/(m+p−1), holds m microbatches
    1f1b         p−r−1 warm-up F, then F/B alternate            bubble (p−1)/(m+p−1), holds ≤ p−r
    interleaved  v chunks per rank, F in groups of p microbatches per chunk, (p−r−1)·2 + (v−1)·p
                 warm-up F, then F/B alternate (Narayanan et al. 2021)
                                                                bubble (p−1)/(v·m+p−1), i.e. (p−1)/(v·m) of
                                                                the ideal time; holds ≤ (p−r−1)·2 + (v−1)·p + 1
                                                                chunk-microbatches
    zb-h1        1F1B's order of F and B (input gradients only), each W placed where the rank would
                 otherwise wait for its next input, or to stay within 1F1B's peak activations (Qi et al. 2024)
                                                                with F = B = W and m ≥ p: bubble (p−1)/(3m+p−1),
                                                                a third of 1F1B's (p−1)·3 idle units; m < p:
                                                                makespan 2(m+p)−1; holds ≤ p on every rank

:func:`simulate` replays every rank's list: an F of virtual stage s > 0 waits for F of stage s−1, a B
waits for B of stage s+1 (the last stage's B for its own F), a W for its own B; each pass starts at
max(its rank's clock, the arrival of what it needs). It fails on a pass that runs twice or never,
or on a deadlock (no rank can proceed), and returns the makespan, the bubble and the peak number of
chunk-microbatches whose activations a rank holds (after F until its B — or W, when split).

Deep dive, with measurements: docs/pipeline.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

SCHEDULES = ("1f1b", "gpipe", "interleaved", "zb-h1")


class Action(NamedTuple):
    kind: str        # "F", "B" or "W"
    microbatch: int
    chunk: int       # local chunk index, 0 … v−1


def check_schedule(kind: str, p: int, m: int, v: int = 1) -> None:
    """Raise a clear error when ``kind`` cannot run with p ranks, m microbatches and v chunks per rank."""
    if kind not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {kind!r}: expected one of {SCHEDULES}")
    if v < 1:
        raise ValueError(f"--virtual-stages must be >= 1, got {v}")
    if kind != "interleaved" and v != 1:
        raise ValueError(f"--virtual-stages {v} needs --schedule interleaved")
    if kind == "interleaved" and p > 1 and m % p:
        raise ValueError(f"--schedule interleaved runs microbatches in groups of --pp: --microbatches {m} must be a "
                         f"multiple of --pp {p}")


def schedule(kind: str, p: int, rank: int, m: int, v: int = 1) -> list[Action]:
    """The passes rank ``rank`` of ``p`` runs, in order, for ``m`` microbatches (``v`` chunks per rank)."""
    check_schedule(kind, p, m, v)
    if kind == "gpipe":
        return [Action("F", i, 0) for i in range(m)] + [Action("B", i, 0) for i in range(m)]
    if kind == "interleaved":
        return _interleaved(p, rank, m, v)
    warmup = min(p - rank - 1, m)
    order = [Action("F", i, 0) for i in range(warmup)]
    for i in range(m - warmup):
        order += [Action("F", warmup + i, 0), Action("B", i, 0)]
    order += [Action("B", i, 0) for i in range(m - warmup, m)]
    return order if kind == "1f1b" else _zero_bubble_h1(p, m)[rank]


def _interleaved(p: int, rank: int, m: int, v: int) -> list[Action]:
    """Megatron's interleaved 1F1B. The k-th forward of a rank is microbatch (k // pv)·p + k % p through
    chunk (k // p) % v — p microbatches through chunk 0, the same p through chunk 1, … —, the k-th backward
    the same microbatch through chunk v − 1 − (k // p) % v."""
    total = m * v

    def pick(k: int, backward: bool) -> tuple[int, int]:
        chunk = (k // p) % v
        return (k // (p * v)) * p + k % p, (v - 1 - chunk if backward else chunk)

    warmup = min(total, (p - rank - 1) * 2 + (v - 1) * p) if v > 1 else min(total, p - rank - 1)
    order = [Action("F", *pick(k, False)) for k in range(warmup)]
    for k in range(total - warmup):
        order += [Action("F", *pick(warmup + k, False)), Action("B", *pick(k, True))]
    return order + [Action("B", *pick(k, True)) for k in range(total - warmup, total)]


def _dependency(a: Action, rank: int, p: int, v: int) -> tuple[str, int, int] | None:
    """The pass (kind, microbatch, virtual stage) whose result ``a`` on ``rank`` needs first (None: the batch)."""
    s, last = a.chunk * p + rank, p * v - 1
    if a.kind == "F":
        return ("F", a.microbatch, s - 1) if s > 0 else None
    if a.kind == "B":
        return ("B", a.microbatch, s + 1) if s < last else ("F", a.microbatch, s)
    return ("B", a.microbatch, s)


def _zero_bubble_h1(p: int, m: int) -> list[list[Action]]:
    """ZB-H1 for every rank: 1F1B's order of F and (input-gradient) B passes, with each W placed greedily on
    the unit-cost clock — a rank whose next F or B is still waiting for its input runs its oldest pending W
    instead of idling, and before an F that would hold more than p microbatches' activations (1F1B's peak,
    reached on its first stage) it runs one to free them; the W's left at the end close the step."""
    base = [[a for a in schedule("1f1b", p, r, m)] for r in range(p)]
    orders: list[list[Action]] = [[] for _ in range(p)]
    done: dict[tuple[str, int, int], float] = {}
    clock, position, pending, live = [0.0] * p, [0] * p, [[] for _ in range(p)], [0] * p

    def run(r: int, a: Action, start: float) -> None:
        orders[r].append(a)
        clock[r] = done[(a.kind, a.microbatch, r)] = start + 1.0
        live[r] += {"F": 1, "B": 0, "W": -1}[a.kind]
        if a.kind == "B":
            pending[r].append(Action("W", a.microbatch, 0))

    while any(position[r] < len(base[r]) or pending[r] for r in range(p)):
        ready = []  # (time this rank can next act, rank)
        for r in range(p):
            if position[r] == len(base[r]):
                ready.append((clock[r], r)) if pending[r] else None
                continue
            need = _dependency(base[r][position[r]], r, p, 1)
            arrives = 0.0 if need is None else done.get(need)
            ready.append((clock[r] if pending[r] else max(clock[r], arrives), r) if pending[r] or arrives is not None
                         else (float("inf"), r))
        t, r = min(ready)
        if t == float("inf"):
            raise AssertionError(f"zb-h1 p={p} m={m}: deadlock while building the schedule")
        nxt = base[r][position[r]] if position[r] < len(base[r]) else None
        need = _dependency(nxt, r, p, 1) if nxt else None
        arrives = (0.0 if need is None else done.get(need)) if nxt else None
        over = nxt is not None and nxt.kind == "F" and live[r] >= p
        if nxt is not None and arrives is not None and arrives <= clock[r] and not (over and pending[r]):
            run(r, nxt, clock[r])
            position[r] += 1
        elif pending[r]:
            run(r, pending[r].pop(0), clock[r])
        else:  # nothing to fill the wait with: idle until the input arrives
            run(r, nxt, arrives)
            position[r] += 1
    return orders


@dataclass
class Simulation:
    makespan: float
    busy: float             # work per rank (the same on every rank)
    bubble: float           # idle share of the makespan
    peak_in_flight: list[int]  # per rank: most chunk-microbatches holding activations at once
    passes: list[list[tuple[float, Action]]]  # per rank: (start time, action)


def costs(kind: str, v: int = 1) -> dict[str, float]:
    """Unit costs per pass of one chunk: the whole stage's F = 1 (B = 2 with W inside, B = W = 1 split)."""
    split = kind == "zb-h1"
    return {"F": 1.0 / v, "B": (1.0 if split else 2.0) / v, "W": 1.0 / v}


def simulate(kind: str, p: int, m: int, v: int = 1) -> Simulation:
    """Replay every rank's schedule with :func:`costs` and check it (see the module docstring)."""
    orders = [schedule(kind, p, r, m, v) for r in range(p)]
    cost, split, stages = costs(kind, v), kind == "zb-h1", p * v
    done: dict[tuple[str, int, int], float] = {}  # (kind, microbatch, virtual stage) -> finish time
    clock, position = [0.0] * p, [0] * p
    live, peak = [0] * p, [0] * p
    passes: list[list[tuple[float, Action]]] = [[] for _ in range(p)]
    for r, order in enumerate(orders):
        seen = [(a.kind, a.microbatch, a.chunk) for a in order]
        expected = {(k, i, c) for k in ("FBW" if split else "FB") for i in range(m) for c in range(v)}
        if len(seen) != len(set(seen)) or set(seen) != expected:
            raise AssertionError(f"{kind} p={p} m={m} v={v}: rank {r} does not run every pass exactly once")
    while any(position[r] < len(orders[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            while position[r] < len(orders[r]):
                a = orders[r][position[r]]
                s, need = a.chunk * p + r, _dependency(a, r, p, v)
                if a.kind == "B" and ("F", a.microbatch, s) not in done:
                    raise AssertionError(f"{kind}: rank {r} runs B before F of microbatch {a.microbatch}")
                if need is not None and need not in done:
                    break
                start = max(clock[r], done[need] if need else 0.0)
                clock[r] = done[(a.kind, a.microbatch, s)] = start + cost[a.kind]
                passes[r].append((start, a))
                live[r] += 1 if a.kind == "F" else (-1 if a.kind == ("W" if split else "B") else 0)
                peak[r] = max(peak[r], live[r])
                position[r] += 1
                progressed = True
        if not progressed:
            stuck = {r: orders[r][position[r]] for r in range(p) if position[r] < len(orders[r])}
            raise AssertionError(f"{kind} p={p} m={m} v={v}: deadlock, ranks waiting at {stuck}")
    makespan = max(clock)
    busy = m * sum(cost[k] * v for k in ("FBW" if split else "FB"))
    return Simulation(makespan, busy, 1.0 - busy / makespan, peak, passes)


def bubble_formula(kind: str, p: int, m: int, v: int = 1) -> float:
    """The idle share of a step under :func:`costs`, as the module docstring states it per schedule."""
    if kind == "interleaved":
        return (p - 1) / (v * m + p - 1)
    if kind == "zb-h1":
        idle = p - 1 + max(0, p - m)  # with fewer microbatches than stages not every wait can hold a W
        return idle / (3 * m + idle)
    return (p - 1) / (m + p - 1)


def peak_microbatches(kind: str, p: int, m: int, v: int = 1) -> float:
    """Activations the busiest rank (the first) holds at once, in whole-stage microbatches (a chunk is 1/v of
    a stage): the peaks :func:`simulate` counts, as formulas."""
    if kind == "gpipe":
        return float(m)
    if kind == "interleaved" and v > 1:
        return min((p - 1) * 2 + (v - 1) * p + 1, m * v) / v
    return float(min(p, m))


def timeline(kind: str, p: int, m: int, v: int = 1, width_per_unit: int = 2) -> str:
    """The schedule as ASCII on the logical clock, one row per rank: each pass is its kind and microbatch
    (lower case for chunks > 0 under interleaving), as wide as its cost; blanks are the bubble."""
    sim = simulate(kind, p, m, v)
    cost, scale = costs(kind, v), width_per_unit * v
    lines = []
    for r, passes in enumerate(sim.passes):
        cells = [" "] * int(round(sim.makespan * scale))
        for start, a in passes:
            width = int(round(cost[a.kind] * scale))
            label = (a.kind.lower() if a.chunk else a.kind) + str(a.microbatch % 10)
            cells[int(round(start * scale)):int(round(start * scale)) + width] = list((label + "·" * width)[:width])
        lines.append(f"rank {r} |{''.join(cells)}|")
    return "\n".join(lines)
