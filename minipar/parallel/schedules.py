"""Pipeline schedules as objects: each says where the stages live, what every rank runs in one step and in
which order, and what that costs; a simulator replays them on a logical clock.

An action is (kind, microbatch, chunk). A rank holds v model chunks; ``stage(rank, chunk)`` is the virtual
stage of the p·v that a chunk is. Kinds:

    F   forward of one microbatch through one chunk
    B   backward; in GPipe, 1F1B and interleaved it computes input *and* weight gradients; in the
        split schedules (ZB-H1, DualPipeV) only the input gradients (what the previous stage waits for)
    W   split schedules only: the weight gradients of an earlier B, from the activations B kept

Schedules, p ranks, m microbatches (unit costs: a whole stage's F = 1, B = 2 with W inside, B = W = 1 split;
a chunk costs 1/v of that):

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
    dualpipev    2 chunks per rank in a V: rank r holds stages r and 2p−1−r, so a microbatch runs down the
                 ranks and back up, and rank 0 holds both the embedding and the head (DeepSeek-V3's DualPipe
                 cut in half, as torchtitan's ScheduleDualPipeV); m ≥ 2p. Eight phases per rank: warm-up
                 forwards of chunk 0, then F0 F1 pairs, B1 W1 F1, the steady state F0 B1 F1 B0, the drain
                 B1 F1 B0, B1 B0 (the second half split), W B0, the last W's
                                                                bubble (p−1)/(6m+p−1) with F = B = W per chunk:
                                                                DeepSeek's (PP/2 − 1)(F&B + B − 3W) idle with
                                                                PP = 2p stages and F&B = F + B + W (nothing
                                                                overlapped) is (p−1)·F of a chunk, F = 1/2, over
                                                                3m units of work — half ZB-H1's; holds 2p + 1
                                                                chunk-microbatches on every rank (DeepSeek: PP + 1)

:meth:`Schedule.simulate` replays every rank's list: an F of virtual stage s > 0 waits for F of stage s−1, a B
waits for B of stage s+1 (the last stage's B for its own F), a W for its own B; each pass starts at
max(its rank's clock, the arrival of what it needs). It fails on a pass that runs twice or never,
or on a deadlock (no rank can proceed), and returns the makespan, the bubble and the peak number of
chunk-microbatches whose activations a rank holds (after F until its B — or W, when split).

A new schedule is one class here: its placement (if not Megatron's chunk·p + rank), its actions, its bubble
and peak formulas; the engine (pipeline.py), the planner's cost, the bubble report and the timeline take it.

Deep dive, with measurements: docs/pipeline.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, NamedTuple


class Action(NamedTuple):
    kind: str        # "F", "B" or "W"
    microbatch: int
    chunk: int       # local chunk index, 0 … v−1


@dataclass
class Simulation:
    makespan: float
    busy: float             # work per rank (the same on every rank)
    bubble: float           # idle share of the makespan
    peak_in_flight: list[int]  # per rank: most chunk-microbatches holding activations at once
    passes: list[list[tuple[float, Action]]]  # per rank: (start time, action)


class Schedule:
    """p ranks, m microbatches, v chunks per rank; Megatron's placement: chunk c of rank r is stage c·p + r,
    so consecutive stages live on consecutive ranks and the last rank hands on to the first."""

    name: ClassVar[str]
    split_backward: ClassVar[bool] = False  # B computes input gradients only, W the weights' later

    def __init__(self, p: int, m: int, v: int = 1):
        if p < 1 or m < 1:
            raise ValueError(f"a pipeline needs >= 1 rank and >= 1 microbatch, got --pp {p} --microbatches {m}")
        if v < 1:
            raise ValueError(f"--virtual-stages must be >= 1, got {v}")
        self.p, self.m, self.v = p, m, v
        self.check()

    def check(self) -> None:
        """Raise a one-line error naming the flags when this schedule cannot run with (p, m, v)."""
        if self.v != 1:
            raise ValueError(f"--virtual-stages {self.v} needs --schedule interleaved")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(p={self.p}, m={self.m}, v={self.v})"

    # ------------------------------------------------------------------------------- placement
    @property
    def n_stages(self) -> int:
        return self.p * self.v

    def stage(self, rank: int, chunk: int) -> int:
        """The virtual stage that ``chunk`` of ``rank`` is."""
        return chunk * self.p + rank

    def rank_of(self, stage: int) -> int:
        """The rank that holds virtual ``stage`` (the inverse of :meth:`stage`)."""
        return next(r for r in range(self.p) for c in range(self.v) if self.stage(r, c) == stage)

    # ------------------------------------------------------------------------------- what runs
    def actions(self, rank: int) -> list[Action]:
        """The passes ``rank`` runs, in order, in one step."""
        raise NotImplementedError

    def costs(self) -> dict[str, float]:
        """Unit costs per pass of one chunk: the whole stage's F = 1 (B = 2 with W inside, B = W = 1 split)."""
        return {"F": 1.0 / self.v, "B": (1.0 if self.split_backward else 2.0) / self.v, "W": 1.0 / self.v}

    def bubble(self) -> float:
        """The idle share of a step under :meth:`costs`, as the module docstring states it."""
        raise NotImplementedError

    def peak_microbatches(self) -> float:
        """Activations the busiest rank holds at once, in whole-stage microbatches (a chunk is 1/v of a stage)."""
        raise NotImplementedError

    def dependency(self, a: Action, rank: int) -> tuple[str, int, int] | None:
        """The pass (kind, microbatch, virtual stage) whose result ``a`` on ``rank`` needs first (None: the batch)."""
        s, last = self.stage(rank, a.chunk), self.n_stages - 1
        if a.kind == "F":
            return ("F", a.microbatch, s - 1) if s > 0 else None
        if a.kind == "B":
            return ("B", a.microbatch, s + 1) if s < last else ("F", a.microbatch, s)
        return ("B", a.microbatch, s)

    # ------------------------------------------------------------------------------- checking and drawing
    def simulate(self) -> Simulation:
        """Replay every rank's actions with :meth:`costs` and check them (see the module docstring)."""
        p, m, v, split = self.p, self.m, self.v, self.split_backward
        orders = [self.actions(r) for r in range(p)]
        cost = self.costs()
        done: dict[tuple[str, int, int], float] = {}  # (kind, microbatch, virtual stage) -> finish time
        clock, position = [0.0] * p, [0] * p
        live, peak = [0] * p, [0] * p
        passes: list[list[tuple[float, Action]]] = [[] for _ in range(p)]
        for r, order in enumerate(orders):
            seen = [(a.kind, a.microbatch, a.chunk) for a in order]
            expected = {(k, i, c) for k in ("FBW" if split else "FB") for i in range(m) for c in range(v)}
            if len(seen) != len(set(seen)) or set(seen) != expected:
                raise AssertionError(f"{self}: rank {r} does not run every pass exactly once")
        while any(position[r] < len(orders[r]) for r in range(p)):
            progressed = False
            for r in range(p):
                while position[r] < len(orders[r]):
                    a = orders[r][position[r]]
                    s, need = self.stage(r, a.chunk), self.dependency(a, r)
                    if a.kind == "B" and ("F", a.microbatch, s) not in done:
                        raise AssertionError(f"{self}: rank {r} runs B before F of microbatch {a.microbatch}")
                    if a.kind == "W" and ("B", a.microbatch, s) not in done:
                        raise AssertionError(f"{self}: rank {r} runs W before B of microbatch {a.microbatch}")
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
                raise AssertionError(f"{self}: deadlock, ranks waiting at {stuck}")
        makespan = max(clock)
        busy = m * sum(cost[k] * v for k in ("FBW" if split else "FB"))
        return Simulation(makespan, busy, 1.0 - busy / makespan, peak, passes)

    def timeline(self, width_per_unit: int = 2) -> str:
        """The schedule as ASCII on the logical clock, one row per rank: each pass is its kind and microbatch
        (lower case for chunks > 0), as wide as its cost; blanks are the bubble."""
        sim, cost, scale = self.simulate(), self.costs(), width_per_unit * self.v
        lines = []
        for r, passes in enumerate(sim.passes):
            cells = [" "] * int(round(sim.makespan * scale))
            for start, a in passes:
                width = int(round(cost[a.kind] * scale))
                label = (a.kind.lower() if a.chunk else a.kind) + str(a.microbatch % 10)
                cells[int(round(start * scale)):int(round(start * scale)) + width] = list((label + "·" * width)[:width])
            lines.append(f"rank {r} |{''.join(cells)}|")
        return "\n".join(lines)


class GPipe(Schedule):
    """Huang et al. 2019: every microbatch forward, then every backward."""
    name = "gpipe"

    def actions(self, rank: int) -> list[Action]:
        return [Action("F", i, 0) for i in range(self.m)] + [Action("B", i, 0) for i in range(self.m)]

    def bubble(self) -> float:
        return (self.p - 1) / (self.m + self.p - 1)

    def peak_microbatches(self) -> float:
        return float(self.m)


class OneFOneB(Schedule):
    """PipeDream-Flush (Narayanan et al. 2021): p − r − 1 warm-up forwards, then one forward, one backward."""
    name = "1f1b"

    def actions(self, rank: int) -> list[Action]:
        warmup, m = min(self.p - rank - 1, self.m), self.m
        order = [Action("F", i, 0) for i in range(warmup)]
        for i in range(m - warmup):
            order += [Action("F", warmup + i, 0), Action("B", i, 0)]
        return order + [Action("B", i, 0) for i in range(m - warmup, m)]

    def bubble(self) -> float:
        return (self.p - 1) / (self.m + self.p - 1)

    def peak_microbatches(self) -> float:
        return float(min(self.p, self.m))


class Interleaved(Schedule):
    """Megatron's interleaved 1F1B. The k-th forward of a rank is microbatch (k // pv)·p + k % p through
    chunk (k // p) % v — p microbatches through chunk 0, the same p through chunk 1, … —, the k-th backward
    the same microbatch through chunk v − 1 − (k // p) % v."""
    name = "interleaved"

    def check(self) -> None:
        if self.p < 2:
            raise ValueError(f"--schedule interleaved --virtual-stages {self.v} interleaves chunks over the "
                             "pipeline ranks: it needs --pp >= 2")
        if self.m % self.p:
            raise ValueError(f"--schedule interleaved runs microbatches in groups of --pp: --microbatches {self.m} "
                             f"must be a multiple of --pp {self.p}")

    def actions(self, rank: int) -> list[Action]:
        p, v, total = self.p, self.v, self.m * self.v

        def pick(k: int, backward: bool) -> tuple[int, int]:
            chunk = (k // p) % v
            return (k // (p * v)) * p + k % p, (v - 1 - chunk if backward else chunk)

        warmup = min(total, (p - rank - 1) * 2 + (v - 1) * p) if v > 1 else min(total, p - rank - 1)
        order = [Action("F", *pick(k, False)) for k in range(warmup)]
        for k in range(total - warmup):
            order += [Action("F", *pick(warmup + k, False)), Action("B", *pick(k, True))]
        return order + [Action("B", *pick(k, True)) for k in range(total - warmup, total)]

    def bubble(self) -> float:
        return (self.p - 1) / (self.v * self.m + self.p - 1)

    def peak_microbatches(self) -> float:
        if self.v == 1:
            return float(min(self.p, self.m))
        return min((self.p - 1) * 2 + (self.v - 1) * self.p + 1, self.m * self.v) / self.v


class ZeroBubbleH1(Schedule):
    """ZB-H1 (Qi et al. 2024) for every rank: 1F1B's order of F and (input-gradient) B passes, with each W placed
    greedily on the unit-cost clock — a rank whose next F or B is still waiting for its input runs its oldest
    pending W instead of idling, and before an F that would hold more than p microbatches' activations (1F1B's
    peak, reached on its first stage) it runs one to free them; the W's left at the end close the step."""
    name = "zb-h1"
    split_backward = True

    def actions(self, rank: int) -> list[Action]:
        return self._orders()[rank]

    def _orders(self) -> list[list[Action]]:
        p, base = self.p, [OneFOneB(self.p, self.m).actions(r) for r in range(self.p)]
        orders: list[list[Action]] = [[] for _ in range(p)]
        done: dict[tuple[str, int, int], float] = {}
        clock, position, pending, live = [0.0] * p, [0] * p, [[] for _ in range(p)], [0] * p

        def run(r: int, a: Action, start: float) -> None:
            orders[r].append(a)
            clock[r] = done[(a.kind, a.microbatch, r)] = start + 1.0
            live[r] += {"F": 1, "B": 0, "W": -1}[a.kind]
            if a.kind == "B":
                pending[r].append(Action("W", a.microbatch, 0))

        def arrival(r: int) -> float | None:  # when rank r's next 1F1B pass has its input (None: not yet)
            need = self.dependency(base[r][position[r]], r)
            return 0.0 if need is None else done.get(need)

        while any(position[r] < len(base[r]) or pending[r] for r in range(p)):
            ready = []  # (time this rank can next act, rank)
            for r in range(p):
                if position[r] == len(base[r]):
                    ready.append((clock[r], r)) if pending[r] else None
                    continue
                arrives = arrival(r)
                ready.append((clock[r] if pending[r] else max(clock[r], arrives), r) if pending[r] or arrives is not None
                             else (float("inf"), r))
            t, r = min(ready)
            if t == float("inf"):
                raise AssertionError(f"{self}: deadlock while building the schedule")
            nxt = base[r][position[r]] if position[r] < len(base[r]) else None
            arrives = arrival(r) if nxt else None
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

    def bubble(self) -> float:
        idle = self.p - 1 + max(0, self.p - self.m)  # with fewer microbatches than stages not every wait can hold a W
        return idle / (3 * self.m + idle)

    def peak_microbatches(self) -> float:
        return float(min(self.p, self.m))


class DualPipeV(Schedule):
    """DualPipeV: DeepSeek-V3's DualPipe cut in half (Qi et al.'s V-shape; torchtitan's ScheduleDualPipeV).
    Rank r holds chunk 0 = stage r and chunk 1 = stage 2p − 1 − r: the microbatches run down the ranks through
    the chunks 0 and back up through the chunks 1, so the last rank hands stage p − 1 to stage p locally and
    rank 0 computes both the embedding and the loss. Full backwards (B with its W) and split ones (W queued,
    run first-in first-out where a wait would otherwise be) follow DeepSeek's eight phases (module docstring)."""
    name = "dualpipev"
    split_backward = True

    def __init__(self, p: int, m: int, v: int = 2):
        super().__init__(p, m, 2 if v == 1 else v)  # the V is two chunks per rank; --virtual-stages may say so

    def check(self) -> None:
        if self.v != 2:
            raise ValueError(f"--schedule dualpipev holds 2 chunks per rank (the V): drop --virtual-stages {self.v}")
        if self.p < 2:
            raise ValueError("--schedule dualpipev folds the stages into a V over the pipeline ranks: it needs --pp >= 2")
        if self.m < 2 * self.p:
            raise ValueError(f"--schedule dualpipev needs at least 2·--pp microbatches to fill its V: --microbatches "
                             f"{self.m} < {2 * self.p}")

    def stage(self, rank: int, chunk: int) -> int:
        return rank if chunk == 0 else 2 * self.p - 1 - rank

    def actions(self, rank: int) -> list[Action]:
        p, m, r = self.p, self.m, rank
        order: list[Action] = []
        forwards, backwards, queued = [0, 0], [0, 0], []

        def F(c: int) -> None:
            order.append(Action("F", forwards[c], c))
            forwards[c] += 1

        def B(c: int, split: bool = False) -> None:  # split: the W waits in the queue; else it follows at once
            i = backwards[c]
            backwards[c] += 1
            order.append(Action("B", i, c))
            (queued if split else order).append(Action("W", i, c))

        def W() -> None:
            order.append(queued.pop(0))

        for _ in range(2 * (p - r - 1)):       # 1: chunk 0's warm-up, deeper for the early ranks
            F(0)
        for _ in range(r + 1):                 # 2: F0 F1 — the first microbatches turn at the V's tip
            F(0), F(1)
        for _ in range(p - r - 1):             # 3: B1 W1 F1
            B(1, split=True), W(), F(1)
        for _ in range(m - 2 * p + r + 1):     # 4: the steady state F0 B1 F1 B0 (DeepSeek overlaps each F with a B)
            F(0), B(1), F(1), B(0)
        for _ in range(p - r - 1):             # 5: B1 F1 B0, chunk 0 has no forwards left
            B(1), F(1), B(0)
        half = (r + 1) // 2
        for i in range(r + 1):                 # 6: B1 B0, the second half split to fill the drain
            B(1, split=i > half or (i == half and r % 2 == 1))
            B(0, split=i >= half)
        for _ in range(p - r - 1):             # 7: W B0
            W(), B(0, split=True)
        for _ in range(r + 1):                 # 8: the W's left
            W()
        return order

    def bubble(self) -> float:
        return (self.p - 1) / (6 * self.m + self.p - 1)

    def peak_microbatches(self) -> float:
        return (2 * self.p + 1) / 2


SCHEDULES: dict[str, type[Schedule]] = {cls.name: cls for cls in (OneFOneB, GPipe, Interleaved, ZeroBubbleH1, DualPipeV)}


def build(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """The schedule called ``name`` (``--schedule``) for p ranks, m microbatches and v chunks per rank."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}: expected one of {tuple(SCHEDULES)}")
    return SCHEDULES[name](p, m, v)
