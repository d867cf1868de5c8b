"""Pipeline schedules (schedules.py): every schedule object for p ≤ 8, m ≤ 16, v ≤ 4 replays on the simulator —
each F, B, W exactly once, nothing used before it arrives, no deadlock — with the papers' bubble (closed_forms.py,
written apart from schedules.py) and the stated peak activations; the simulator itself catches broken
schedules; bad parameters are refused with the flags named."""
import pytest

from closed_forms import pipeline_bubble

from minipar.parallel.schedules import SCHEDULES, Action, DualPipeV, OneFOneB, build


def _cases():
    for kind, cls in SCHEDULES.items():
        for p in range(1, 9):
            for m in range(1, 17):
                for v in ((1, 2, 3, 4) if kind == "interleaved" else (1,)):
                    try:
                        yield build(kind, p, m, v)
                    except ValueError:
                        assert (kind == "interleaved" and (m % p or p < 2)) or (kind == "dualpipev" and
                                                                                (m < 2 * p or p < 2)), (kind, p, m, v)


def test_every_schedule_replays_with_its_bubble_and_peak():
    count = 0
    for s in _cases():
        kind, p, m, v = s.name, s.p, s.m, s.v
        sim = s.simulate()
        assert sim.bubble == pytest.approx(s.bubble(), abs=1e-12), s
        if kind != "zb-h1" or m >= p:  # the paper's form; ZB-H1 with m < p: at least 1F1B's p−1 idle units
            assert sim.bubble == pytest.approx(pipeline_bubble(kind, p, m, v), abs=1e-12), s
        else:
            assert sim.makespan - sim.busy >= p - 1
        peak = {"gpipe": [m] * p, "1f1b": [min(p - r, m) for r in range(p)],
                "interleaved": [min((p - r - 1) * 2 + (v - 1) * p + 1, m * v) if v > 1 else min(p - r, m)
                                for r in range(p)],
                "dualpipev": [2 * p + 1] * p}.get(kind)  # DeepSeek's PP + 1 chunk-microbatches, PP = 2p stages
        if kind == "zb-h1":
            assert max(sim.peak_in_flight) <= p  # 1F1B's peak (its first stage's), on every rank
        else:
            assert sim.peak_in_flight == peak, s
        assert s.peak_microbatches() == max(sim.peak_in_flight) / v or kind == "zb-h1", s
        count += 1
    # 8·16 each for gpipe, 1f1b, zb-h1; interleaved: v ∈ 1…4 where p | m, p ≥ 2; dualpipev: p ≥ 2, m ≥ 2p
    assert count == 3 * 128 + 4 * sum(16 // p for p in range(2, 9)) + sum(17 - 2 * p for p in range(2, 9))


def test_the_cut_bubbles_against_1f1b():
    idle = lambda s: s.makespan - s.busy  # noqa: E731  (per rank: every rank does the same work)
    one = build("1f1b", 4, 8).simulate()
    assert idle(build("interleaved", 4, 8, 2).simulate()) == pytest.approx(idle(one) / 2)  # (p−1)/(v·m): halved
    assert idle(build("zb-h1", 4, 8).simulate()) == pytest.approx(idle(one) / 3)           # a third with F = B = W
    assert idle(build("dualpipev", 4, 8).simulate()) == pytest.approx(idle(one) / 6)       # half of ZB-H1's


def test_dualpipev_folds_the_stages_into_a_v():
    s = build("dualpipev", 4, 8)
    assert [[s.stage(r, c) for c in range(2)] for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert [s.rank_of(stage) for stage in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert s.actions(3)[:2] == [Action("F", 0, 0), Action("F", 0, 1)]  # the tip: stage 3 hands to stage 4 locally
    assert [a[:2] for a in build("1f1b", 4, 8).actions(0)[:5]] == [("F", 0), ("F", 1), ("F", 2), ("F", 3), ("B", 0)]
    assert build("1f1b", 4, 8).rank_of(3) == 3 and build("interleaved", 4, 8, 2).stage(1, 1) == 5


def test_the_simulator_rejects_broken_schedules(monkeypatch):
    good = OneFOneB.actions

    def swapped(self, rank):  # the last stage runs B0 before F0
        order = good(self, rank)
        return [order[1], order[0], *order[2:]] if rank == self.p - 1 else order
    monkeypatch.setattr(OneFOneB, "actions", swapped)
    with pytest.raises(AssertionError, match="B before F"):
        build("1f1b", 2, 2).simulate()

    def waits_forever(self, rank):  # rank 0 wants B0 before it has sent F1, rank 1 wants F1 first
        return ([Action("F", 0, 0), Action("B", 0, 0), Action("F", 1, 0), Action("B", 1, 0)] if rank == 0 else
                [Action("F", 1, 0), Action("F", 0, 0), Action("B", 0, 0), Action("B", 1, 0)])
    monkeypatch.setattr(OneFOneB, "actions", waits_forever)
    with pytest.raises(AssertionError, match="deadlock"):
        build("1f1b", 2, 2).simulate()

    monkeypatch.setattr(OneFOneB, "actions", lambda self, rank: good(self, rank)[:-1])
    with pytest.raises(AssertionError, match="exactly once"):
        build("1f1b", 2, 2).simulate()

    dual = DualPipeV.actions
    monkeypatch.setattr(DualPipeV, "actions", lambda self, rank: [a for a in dual(self, rank) if a.kind != "W"] +
                        [a for a in dual(self, rank) if a.kind == "W"][::-1] if rank == 0 else dual(self, rank))
    build("dualpipev", 2, 4).simulate()  # W's late and reversed: still valid, only slower
    monkeypatch.setattr(DualPipeV, "actions", lambda self, rank: [a for a in dual(self, rank) if a.kind == "W"] +
                        [a for a in dual(self, rank) if a.kind != "W"])
    with pytest.raises(AssertionError, match="W before B"):
        build("dualpipev", 2, 4).simulate()


def test_timeline_and_errors():
    chart = build("zb-h1", 4, 8).timeline()
    assert chart.count("\n") == 3 and "W0" in chart and chart.startswith("rank 0 |F0F1F2F3")
    assert build("dualpipev", 2, 4).timeline().startswith("rank 0 |F0F1F2f0b0w0")
    for name, p, m, v, message in [
            ("interleaved", 4, 6, 2, "--microbatches 6 must be a multiple of --pp 4"),
            ("interleaved", 1, 2, 2, "it needs --pp >= 2"),
            ("1f1b", 4, 8, 2, "--virtual-stages 2 needs --schedule interleaved"),
            ("dualpipev", 4, 7, 1, "at least 2·--pp microbatches to fill its V: --microbatches 7 < 8"),
            ("dualpipev", 1, 4, 1, "dualpipev folds the stages into a V over the pipeline ranks: it needs --pp >= 2"),
            ("dualpipev", 2, 4, 3, "holds 2 chunks per rank (the V): drop --virtual-stages 3"),
            ("1f1b", 2, 0, 1, "a pipeline needs >= 1 rank and >= 1 microbatch"),
            ("zigzag", 2, 2, 1, "unknown pipeline schedule 'zigzag'")]:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            build(name, p, m, v)
