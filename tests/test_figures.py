"""The figures' data come from the engine and agree with it and with the papers; no test looks at pixels."""
import os

import numpy as np
import pytest
from mpi4py import MPI

from minipar import figures
from minipar.parallel.layout import Layout
from minipar.parallel.schedules import build
from minipar.testing import run_ranks


@pytest.mark.parametrize("name,v", figures.SCHEDULE_FIGURES)
def test_schedule_cells_are_the_action_lists_and_the_bubble_is_the_formula(name, v):
    schedule = build(name, 4, 8, v)
    cells = figures.schedule_cells(schedule)
    for rank in range(schedule.p):
        drawn = [(c.kind, c.microbatch, c.chunk) for c in sorted((c for c in cells if c.rank == rank),
                                                                  key=lambda c: c.start)]
        assert drawn == [tuple(a) for a in schedule.actions(rank)]
    for rank in range(schedule.p):  # no two passes of a rank overlap
        mine = sorted((c for c in cells if c.rank == rank), key=lambda c: c.start)
        assert all(a.start + a.width <= b.start + 1e-12 for a, b in zip(mine, mine[1:]))
    assert abs(figures.idle_share(cells, schedule.p) - schedule.bubble()) < 1e-12  # float sums of unit costs


@pytest.mark.parametrize("p", [2, 3, 4, 5])
def test_ring_transfers_follow_the_documented_plan(p):
    """ring_reduce_scatter's docstring: at step s rank r sends chunk r−s−1 to r+1, holding the sum of ranks
    r−s … r; ring_all_gather's: at step s rank r sends the finished chunk r−s. Read back from the bytes sent."""
    got = {(t.phase, t.step, t.src): t for t in figures.ring_transfers(p)}
    assert len(got) == 2 * p * (p - 1)
    for s in range(p - 1):
        for r in range(p):
            rs, ag = got[("reduce-scatter", s, r)], got[("all-gather", s, r)]
            assert (rs.dst, rs.chunk, set(rs.contributors)) == ((r + 1) % p, (r - s - 1) % p,
                                                                {(r - k) % p for k in range(s + 1)})
            assert (ag.dst, ag.chunk, ag.contributors) == ((r + 1) % p, (r - s) % p, tuple(range(p)))


def test_zero_bars_are_the_zero_papers_figure_1():
    """Rajbhandari et al. 2020, Figure 1: Ψ = 7.5B, N_d = 64 — 120 GB, 31.4 GB, 16.6 GB, 1.9 GB per device."""
    bars = figures.zero_memory(7.5e9, 64)
    assert [round(b / 1e9, 1) for b in bars.values()] == [120.0, 31.4, 16.6, 1.9]


def _mesh_matches_the_holdings():
    from minipar.comm import Communicator
    from minipar.parallel.mesh import Mesh

    layout = Layout(pp=2, cp=2, tp=2, ep=2, microbatches=2)
    mesh = Mesh(Communicator(), dp=1, tp=2, pp=2, cp=2, ep=2)
    row = figures.mesh_holdings(layout, n_layer=4, n_head=4, n_expert=4)[MPI.COMM_WORLD.Get_rank()]
    assert (row.pp, row.dp, row.cp, row.tp, row.ep) == (mesh.pp_rank, mesh.dp_rank, mesh.cp_rank, mesh.tp_rank,
                                                        mesh.ep_rank)
    assert row.layers == ((0, 1) if mesh.pp_rank == 0 else (2, 3))
    assert row.experts == ((0, 1) if mesh.ep_rank == 0 else (2, 3))
    assert row.positions == ((0, 3) if mesh.cp_rank == 0 else (1, 2))  # zigzag: an early and a late chunk


@pytest.mark.slow  # 8 ranks
def test_mesh_figure_is_what_each_rank_of_a_real_mesh_holds():
    run_ranks(8, _mesh_matches_the_holdings, timeout=120)


@pytest.mark.slow  # 1 s: fits the validation's constants; tests/test_planner.py checks the validation itself
def test_planner_figure_is_the_validation():
    from minipar.parallel import validation
    from minipar.parallel.planner import BUILTIN_PROFILES

    runs = figures.published_predictions()
    assert len(runs) == len(validation.PUBLISHED_RUNS) == 24
    errors = np.array([pred / pub - 1 for _, pub, pred in runs])
    profile = BUILTIN_PROFILES["a100-80gb"]
    expected = validation.errors(profile, validation.fit(profile, validation.PUBLISHED_RUNS), validation.PUBLISHED_RUNS)
    np.testing.assert_allclose(np.abs(errors), np.abs(expected), rtol=1e-12)
    assert np.abs(errors).max() <= 0.081


def test_the_figures_command_draws_what_it_is_asked(tmp_path, capsys):
    """`figures --only` draws the figures named (the measured ones are drawn by their own tests' runs), as SVG; an
    unknown name is refused in one line naming the figures there are."""
    from minipar.__main__ import main

    static = ["ring_all_gather.svg", "zero_memory.svg", "mesh.svg", "pipeline_dualpipev.svg"]
    assert main(["figures", "--out", str(tmp_path), "--only", *static]) == 0
    assert sorted(os.listdir(tmp_path)) == sorted(static)
    assert all((tmp_path / n).read_text().lstrip().startswith("<?xml") for n in static)
    assert main(["figures", "--out", str(tmp_path), "--only", "nope.svg"]) == 2
    err = capsys.readouterr().err
    assert "no figure called nope.svg: the figures are pipeline_gpipe.svg" in err and "activation_memory.svg" in err


@pytest.mark.slow  # two 2-rank runs
@pytest.mark.parametrize("name", ["1f1b", "zb-h1"])
def test_the_measured_pipeline_ran_the_planned_passes(name):
    """The --trace of a real 2-stage step lists each rank's passes in the order of the schedule's action list."""
    schedule, measured = figures.traced_pipeline(name)
    for rank in range(schedule.p):
        assert [(k, i, c) for _, _, k, i, c in measured[rank]] == [tuple(a) for a in schedule.actions(rank)]
        starts = [t for t, *_ in measured[rank]]
        assert starts == sorted(starts) and starts[0] >= 0


@pytest.mark.slow  # four 60-step runs
def test_low_precision_curves_stay_on_float32s():
    """Same seed, same batches: bf16 mixed and FP8 follow the float32 loss (within 0.01 — rounding of 8 to 16-bit
    operands moves each step's loss by ~1e-3 on this model, it does not drift)."""
    losses = figures.precision_losses(steps=40)
    assert list(losses) == [label for label, _ in figures.PRECISIONS]
    reference = np.array(losses["float32"])
    assert len(reference) == 40 and reference[-1] < reference[0] - 1.0  # it trains
    for label, curve in losses.items():
        assert np.abs(np.array(curve) - reference).max() < 0.01, label


@pytest.mark.slow  # three 60-step MoE runs
def test_balancing_lowers_the_busiest_experts_load():
    """Over the last 20 of 40 steps the auxiliary loss and the sigmoid router's bias each keep the busiest expert nearer
    the mean than no balancing does; no load is below the mean's (max/mean ≥ 1)."""
    loads = {label: np.array(curve) for label, curve in figures.expert_loads(steps=40).items()}
    unbalanced = loads.pop("no balancing")
    assert (unbalanced >= 1).all()
    for label, curve in loads.items():
        assert (curve >= 1).all() and curve[-20:].mean() < unbalanced[-20:].mean(), label


@pytest.mark.slow  # six short runs
def test_recomputation_lowers_the_measured_peak():
    """--peak-memory: at each length full recomputation peaks below selective, selective below none; every mode's
    peak grows with T and holds at least what activation_elements says a forward keeps."""
    from minipar.models.gpt import GPTConfig, activation_elements

    lengths = (32, 128)
    peaks = figures.activation_peaks(lengths)
    assert list(peaks) == list(figures.RECOMPUTE_MODES)
    for i, t in enumerate(lengths):
        assert peaks["full"][i] < peaks["selective"][i] < peaks["none"][i], t
        for mode, curve in peaks.items():
            cfg = GPTConfig(vocab_size=256, block_size=t, n_layer=4, n_head=2, n_embd=32)
            assert curve[i] >= activation_elements(cfg, 4, mode) * 4, (mode, t)
    assert all(curve[1] > curve[0] for curve in peaks.values())


@pytest.mark.slow  # seven 2-rank runs
def test_communication_bars_are_the_step_records_and_the_closed_forms():
    """Each bar pair: the bytes rank 0's step record counts along the axis, and the planner's closed form, per layer;
    both equal the textbook count written out here (2 ranks: a ring all-reduce of n sends n, a reduce-scatter or
    all-gather n/2, an all-to-all half its buffer). GPT L=4 C=32 T=32, batch 8, float32: 8·32 = 256 tokens."""
    from minipar.models.gpt import GPTConfig

    C, itemsize, L = 32, 4, 4
    psi = GPTConfig(vocab_size=256, block_size=32, n_layer=4, n_head=2, n_embd=32).num_parameters()
    whole, half = 256 * C * itemsize, 128 * C * itemsize  # t·C·itemsize on one rank: all tokens, or half
    expected = {"dp 2": psi * itemsize / L,                 # all-reduce of the gradients: RS + AG, Ψ/2 each
                "dp 2, ZeRO-3": 1.5 * psi * itemsize / L,   # + the forward's and the backward's parameter gathers
                "tp 2": 4 * whole,                          # 2 all-reduces forward, 2 backward
                "tp 2 + sp": 4 * whole,                     # as 4 all-gathers + 4 reduce-scatters of half each
                "cp 2, ring": 1 * 2 * half + 2 * 4 * half,  # K|V once forward; K|V|dK|dV twice backward
                "cp 2, Ulysses": 2 * 4 * half / 2,          # q|k|v and the output, each way, half sent
                "ep 2 (dp 2)": 4 * 2 * half / 2 + 4 * 8 / 2}  # top-2 rows out and back, each way; E = 4 counts
    rows = figures.communication_per_layer()
    assert [label for label, _, _ in rows] == [label for label, *_ in figures.AXIS_RUNS]
    for label, measured, closed in rows:
        assert closed == expected[label], label
        if label.startswith("ep"):  # the rows the router sent: data-dependent, near balanced on this seed
            assert measured == pytest.approx(closed, rel=0.1) and measured != closed
        else:
            assert measured == closed, label


@pytest.mark.slow  # six 2-rank runs
def test_compression_curves_send_what_each_method_promises():
    """Same seed: every method starts from the same loss and trains; per step the bf16 wire sends exactly half of
    synchronous DP's bytes, int8 a quarter (+ a scale per bucket), PowerSGD and top-k less than a fifth; local SGD
    sends nothing for 7 steps and DP's bytes (the parameters' all-reduce) on the 8th."""
    curves = figures.compression_curves(steps=8)
    assert list(curves) == [label for label, _ in figures.COMPRESSION_RUNS]
    losses, dp = curves.pop("synchronous DP")
    assert len(dp) == 8 and min(dp) == max(dp) > 0
    for label, (curve, sent) in curves.items():
        assert curve[0] == losses[0] and curve[-1] < curve[0], label
    assert curves["bf16 wire"][1] == [dp[0] // 2] * 8
    assert all(dp[0] / 4 < b < dp[0] / 3.99 for b in curves["int8"][1])
    assert all(0 < b < dp[0] / 5 for label in ("PowerSGD r=4", "top-k 1%") for b in curves[label][1])
    assert curves["local SGD H=8"][1] == [0] * 7 + [dp[0]]
