"""Pipeline schedules (schedules.py): every schedule for p ≤ 8, m ≤ 16, v ≤ 4 replays on the simulator — each
F, B, W exactly once, nothing used before it arrives, no deadlock — with the papers' bubble (closed_forms.py,
written apart from schedules.py) and the stated peak activations; the simulator itself catches broken
schedules; bad parameters are refused."""
import pytest

from closed_forms import pipeline_bubble

from minipar.parallel import schedules
from minipar.parallel.schedules import Action, bubble_formula, check_schedule, schedule, simulate, timeline


def _cases():
    for kind in schedules.SCHEDULES:
        for p in range(1, 9):
            for m in range(1, 17):
                for v in ((1, 2, 3, 4) if kind == "interleaved" else (1,)):
                    if kind != "interleaved" or m % p == 0:
                        yield kind, p, m, v


def test_every_schedule_replays_with_its_bubble_and_peak():
    count = 0
    for kind, p, m, v in _cases():
        sim = simulate(kind, p, m, v)
        assert sim.bubble == pytest.approx(bubble_formula(kind, p, m, v), abs=1e-12), (kind, p, m, v)
        if kind != "zb-h1" or m >= p:  # the paper's form; ZB-H1 with m < p: at least 1F1B's p−1 idle units
            assert sim.bubble == pytest.approx(pipeline_bubble(kind, p, m, v), abs=1e-12), (kind, p, m, v)
        else:
            assert sim.makespan - sim.busy >= p - 1
        peak = {"gpipe": [m] * p, "1f1b": [min(p - r, m) for r in range(p)],
                "interleaved": [min((p - r - 1) * 2 + (v - 1) * p + 1, m * v) if v > 1 else min(p - r, m)
                                for r in range(p)]}.get(kind)
        if kind == "zb-h1":
            assert max(sim.peak_in_flight) <= p  # 1F1B's peak (its first stage's), on every rank
        else:
            assert sim.peak_in_flight == peak, (kind, p, m, v)
        count += 1
    assert count == 552  # 8·16 each for gpipe, 1f1b, zb-h1; interleaved: v ∈ 1…4 where p | m


def test_the_cut_bubbles_against_1f1b():
    one = simulate("1f1b", 4, 8)
    idle = lambda s: s.makespan - s.busy  # noqa: E731  (per rank: every rank does the same work)
    assert idle(simulate("interleaved", 4, 8, 2)) == pytest.approx(idle(one) / 2)  # (p−1)/(v·m): halved with v = 2
    assert idle(simulate("zb-h1", 4, 8)) == pytest.approx(idle(one) / 3)          # a third with F = B = W


def test_the_simulator_rejects_broken_schedules(monkeypatch):
    good = schedule

    def swapped(kind, p, rank, m, v=1):  # the last stage runs B0 before F0
        order = good(kind, p, rank, m, v)
        return [order[1], order[0], *order[2:]] if rank == p - 1 else order
    monkeypatch.setattr(schedules, "schedule", swapped)
    with pytest.raises(AssertionError, match="B before F"):
        simulate("1f1b", 2, 2)

    def waits_forever(kind, p, rank, m, v=1):  # rank 0 wants B0 before it has sent F1, rank 1 wants F1 first
        return ([Action("F", 0, 0), Action("B", 0, 0), Action("F", 1, 0), Action("B", 1, 0)] if rank == 0 else
                [Action("F", 1, 0), Action("F", 0, 0), Action("B", 0, 0), Action("B", 1, 0)])
    monkeypatch.setattr(schedules, "schedule", waits_forever)
    with pytest.raises(AssertionError, match="deadlock"):
        simulate("1f1b", 2, 2)

    monkeypatch.setattr(schedules, "schedule", lambda kind, p, rank, m, v=1: good(kind, p, rank, m, v)[:-1])
    with pytest.raises(AssertionError, match="exactly once"):
        simulate("gpipe", 2, 2)


def test_timeline_and_errors():
    chart = timeline("zb-h1", 4, 8)
    assert chart.count("\n") == 3 and "W0" in chart and chart.startswith("rank 0 |F0F1F2F3")
    with pytest.raises(ValueError, match="must be a multiple of --pp 4"):
        check_schedule("interleaved", 4, 6, 2)
    with pytest.raises(ValueError, match="needs --schedule interleaved"):
        check_schedule("1f1b", 4, 8, 2)
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        schedule("zigzag", 2, 0, 2)
