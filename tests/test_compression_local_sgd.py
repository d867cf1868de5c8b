"""Gradient compressors against MPI's exact sum, with their byte counts and error-feedback
invariants; local SGD / DiLoCo against synchronous data parallelism; both through the CLI."""
import json
import sys

import numpy as np
import pytest
from mpi4py import MPI

from minipar.testing import run_command, run_ranks


def _bucket(shapes, dtype=np.float64):
    from minipar.nn import Parameter
    from minipar.parallel.data_parallel import Bucket

    return Bucket([Parameter(np.zeros(s, dtype)) for s in shapes])


def _exact_sum(comm, x):
    out = np.empty_like(x)
    comm.mpi.Allreduce(x, out)
    return out


def _compressors_against_mpi():
    from minipar.comm import Communicator
    from minipar.parallel.compression import Cast, Int8, PowerSGD, TopK

    comm = Communicator()
    p, rng = comm.size, np.random.default_rng(comm.rank)
    n = 999
    bucket = _bucket([(n,)], np.float32)
    g = rng.standard_normal(n).astype(np.float32)
    total = _exact_sum(comm, g)
    # each rank's message is rounded to the wire (u = 2^-11, 2^-8) before float32 adds: an error of a few u·max|g|
    for wire, tol in (("float16", 2e-3), ("bfloat16", 2e-2)):
        out = g.copy()
        comm.reset_stats()
        Cast(wire).reduce(comm, bucket, out)
        np.testing.assert_allclose(out, total, atol=tol * np.abs(g).max() * 2 * p)
        assert comm.bytes_sent("grads") * 2 == _fp32_ring_bytes(n, p, comm.rank)  # half the float32 ring
        same = np.empty((p, n), np.float32)
        comm.mpi.Allgather(out, same)
        assert (same == out).all()

    out = g.copy()
    comm.reset_stats()
    Int8().reduce(comm, bucket, out)
    worst_scale = comm.mpi.allreduce(float(np.abs(g).max() / 127), op=MPI.MAX)
    assert np.abs(out - total).max() <= p * worst_scale / 2 + 1e-6  # rounding error ≤ half a step per rank
    assert comm.bytes_sent("grads") == (p - 1) * (n + 4)            # int8 + one float32 scale

    topk, sent_total, g_total = TopK(0.05), np.zeros(n), np.zeros(n)
    for step in range(4):
        g = np.random.default_rng((comm.rank, step)).standard_normal(n).astype(np.float32)
        out = g.copy()
        comm.reset_stats()
        topk.reduce(comm, bucket, out)
        sent_total += out
        g_total += g
        k = int(0.05 * n)
        assert comm.bytes_sent("grads") == (p - 1) * 8 * k          # k int32 indices + k float32 values
    # error feedback loses nothing: Σ_t sum sent = sum over ranks of (Σ_t g − what is still held back)
    # float32 payloads and residuals summed over 4 steps and p ranks against the float64 sums
    np.testing.assert_allclose(sent_total, _exact_sum(comm, g_total - topk.residual[id(bucket)]), rtol=1e-6, atol=1e-6)

    # PowerSGD with rank 2 is exact on gradients that share a rank-2 column space
    shapes = [(20, 12), (7,)]
    bucket = _bucket(shapes)
    u = np.random.default_rng(99).standard_normal((20, 2))
    matrix = u @ rng.standard_normal((2, 12))
    vector = rng.standard_normal(7)
    flat = np.concatenate([matrix.ravel(), vector])
    total = _exact_sum(comm, flat)
    comm.reset_stats()
    compressor = PowerSGD(rank=2)
    compressor.reduce(comm, bucket, flat)
    np.testing.assert_allclose(flat, total, rtol=1e-9, atol=1e-12)
    # error feedback keeps what this rank's gradient has beyond its share (1/p) of the shared approximation
    np.testing.assert_allclose(compressor.residual[id(bucket.params[0])], matrix - total[:240].reshape(20, 12) / p,
                               atol=1e-12)
    expected = sum(_fp32_ring_bytes(size, p, comm.rank) * 2 for size in (7, 20 * 2, 12 * 2))  # float64: twice fp32
    assert comm.bytes_sent("grads") == expected

    # error feedback over steps, on full-rank gradients: each rank's residual e_t = g_t + e_{t−1} − P_t Q_tᵀ/p (its
    # share of the summed approximation), so its shares add up to Σ_t g_t − e_T on every rank (what is held back is
    # added back, never lost), and the residuals' sum is all the approximations left out
    bucket, compressor = _bucket([(20, 12)]), PowerSGD(rank=2)
    sent_total, g_total = np.zeros(240), np.zeros(240)
    for step in range(3):
        g = np.random.default_rng((comm.rank, step, 7)).standard_normal(240)
        flat = g.copy()
        compressor.reduce(comm, bucket, flat)
        sent_total += flat
        g_total += g
    residual = compressor.residual[id(bucket.params[0])].ravel()
    assert np.abs(residual).max() > 0.1  # rank 2 of a full-rank 20×12 matrix: much is held back
    np.testing.assert_allclose(sent_total / comm.size, g_total - residual, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(sent_total, _exact_sum(comm, g_total - residual), rtol=1e-12, atol=1e-12)


def _fp32_ring_bytes(n, p, rank):
    from minipar.comm.collectives import all_reduce_bytes_sent

    return all_reduce_bytes_sent(n, 4, p, rank, "ring")


def _empty_buckets_pass_through():
    """A bucket of no elements — every compressor sends its empty (or scale-only) payload and returns nothing."""
    from minipar.comm import Communicator
    from minipar.parallel.compression import Cast, Int8, PowerSGD, TopK

    comm = Communicator()
    for compressor in (Cast("bfloat16"), Int8(), TopK(0.5), PowerSGD(1)):
        flat = np.zeros(0, np.float32)
        compressor.reduce(comm, _bucket([(0,)], np.float32), flat)
        assert flat.size == 0


def test_compressors_on_empty_buckets():
    run_ranks(2, _empty_buckets_pass_through)


def test_compressor_parameters_are_checked():
    from minipar.parallel.compression import COMPRESSIONS, PowerSGD, TopK, make_compressor

    for bad in (lambda: TopK(0), lambda: TopK(1.5), lambda: PowerSGD(0), lambda: make_compressor("zstd")):
        with pytest.raises(ValueError):
            bad()
    assert TopK(1.0).ratio == 1.0 and PowerSGD(1).rank == 1  # the edges are allowed
    assert make_compressor("none") is None
    assert [make_compressor(name).name for name in COMPRESSIONS[1:]] == ["float16", "bfloat16", "int8", "topk(0.01)",
                                                                          "powersgd(r=4)"]


@pytest.mark.parametrize("p", [2, 3])
def test_compressors(p):
    run_ranks(p, _compressors_against_mpi, timeout=120)


def _local_sgd_h1_is_data_parallel_sgd():
    from minipar.comm import Communicator
    from minipar.models.gpt import GPT, GPTConfig
    from minipar.optim import SGD
    from minipar.parallel.data_parallel import DataParallel
    from minipar.parallel.local_sgd import LocalSGD

    world = Communicator()
    alone = world.split(color=world.rank)
    cfg = GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=8, dtype="float64")
    rng = np.random.default_rng(world.rank)
    batches = [rng.integers(0, 32, (2, 8)) for _ in range(6)]
    dp, local = GPT(cfg, seed=1), GPT(cfg, seed=1)
    dp_engine, dp_opt = DataParallel(dp, world), SGD(dp.parameters(), lr=0.1)
    local_engine, local_opt = DataParallel(local, alone), SGD(local.parameters(), lr=0.1)
    averager = LocalSGD(local, world, sync_every=1, outer_lr=1.0, outer_momentum=0.0)
    for x in batches:
        for engine, opt, share in ((dp_engine, dp_opt, 1 / world.size), (local_engine, local_opt, 1.0)):
            (engine(x, x)[1] * share).backward()  # its tokens over those whose gradients the engine sums
            engine.sync_gradients()
            opt.step()
            opt.zero_grad()
        assert averager.step()
    for a, b in zip(dp.parameters(), local.parameters()):
        np.testing.assert_allclose(b.data, a.data, rtol=1e-9, atol=1e-13)


def _stale_rounds_end_in_consensus(staleness):
    from minipar.comm import Communicator
    from minipar.models.gpt import GPT, GPTConfig
    from minipar.optim import AdamW
    from minipar.parallel.local_sgd import LocalSGD

    comm = Communicator()
    model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=8, dtype="float64"), seed=comm.rank)
    opt = AdamW(model.parameters(), lr=1e-2)
    averager = LocalSGD(model, comm, sync_every=3, staleness=staleness)
    psi = sum(q.size for q in model.parameters())
    rng = np.random.default_rng(comm.rank)
    comm.reset_stats()
    for step in range(12):
        x = rng.integers(0, 32, (2, 8))
        model(x, x)[1].backward()
        opt.step()
        opt.zero_grad()
        assert averager.step() == ((step + 1) % 3 == 0)
    averager.finish()
    assert comm.bytes_sent("grads") == 4 * _fp32_ring_bytes(psi, comm.size, comm.rank) * 2  # 4 rounds of Ψ float64
    mine = np.concatenate([q.data.ravel() for q in model.parameters()])
    everyone = np.empty((comm.size, mine.size))
    comm.mpi.Allgather(mine, everyone)
    assert (everyone == mine).all(), "replicas must agree after finish()"


def _diloco_follows_its_formula(staleness):
    """DiLoCo's defaults (Douillard et al. 2023: outer SGD, lr 0.7, Nesterov momentum 0.9), H = 2, against the
    update written out here with MPI's own average: per round t, Δ_r = θ_anchor − θ_local on each rank,
    Δ̄ = mean_r Δ_r, v ← 0.9·v + Δ̄, θ ← θ − 0.7·(Δ̄ + 0.9·v); with staleness τ, round t's Δ̄ is applied at the
    end of round t + τ and each rank continues from θ minus its own Δ of the rounds still in flight."""
    from minipar.comm import Communicator
    from minipar.models.gpt import GPT, GPTConfig
    from minipar.optim import SGD
    from minipar.parallel.local_sgd import LocalSGD

    comm = Communicator()
    model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=8, dtype="float64"), seed=comm.rank)
    with pytest.raises(ValueError):
        LocalSGD(model, comm, sync_every=0)
    averager = LocalSGD(model, comm, sync_every=2, staleness=staleness)  # broadcasts rank 0's parameters
    opt = SGD(model.parameters(), lr=0.05)
    flat = lambda: np.concatenate([q.data.ravel() for q in model.parameters()])  # noqa: E731
    theta, anchor, velocity, in_flight = flat(), flat(), np.zeros_like(flat()), []
    rng = np.random.default_rng(comm.rank)
    for step in range(10):
        x = rng.integers(0, 32, (2, 8))
        model(x, x)[1].backward()
        opt.step()
        opt.zero_grad()
        local = flat()
        if averager.step():
            own = anchor - local
            mean = np.empty_like(own)
            comm.mpi.Allreduce(own, mean)
            in_flight.append((mean / comm.size, own))
            if len(in_flight) > staleness:
                applied, _ = in_flight.pop(0)
                velocity = 0.9 * velocity + applied
                theta = theta - 0.7 * (applied + 0.9 * velocity)
            anchor = theta - sum((d for _, d in in_flight), np.zeros_like(theta))
            np.testing.assert_allclose(flat(), anchor, rtol=1e-12, atol=1e-14, err_msg=f"step {step + 1}")
    assert averager.rounds == 5
    averager.finish()  # the rounds still in flight, applied in order: every rank ends at θ
    for applied, _ in in_flight:
        velocity = 0.9 * velocity + applied
        theta = theta - 0.7 * (applied + 0.9 * velocity)
    np.testing.assert_allclose(flat(), theta, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("staleness", [0, 1])
def test_diloco_follows_its_formula(staleness):
    run_ranks(3, _diloco_follows_its_formula, staleness, timeout=60)


@pytest.mark.parametrize("p", [1, 3])
def test_local_sgd(p):
    run_ranks(p, _local_sgd_h1_is_data_parallel_sgd, timeout=60)
    for staleness in (0, 1, 2):
        run_ranks(p, _stale_rounds_end_in_consensus, staleness, timeout=60)


@pytest.mark.parametrize("extra,ratio", [(["--compression", "fp16"], 2.0), (["--compression", "int8"], None),
                                         (["--compression", "topk", "--topk-ratio", "0.05"], None),
                                         (["--compression", "powersgd", "--powersgd-rank", "2"], None),
                                         (["--local-sgd", "4"], None), (["--local-sgd", "4", "--staleness", "1"], None)])
def test_cli_trains_with_fewer_bytes(extra, ratio):
    out = run_command(2, [sys.executable, "-m", "minipar", "train", "--dp", "2", "--n-layer", "1", "--n-embd", "32",
                          "--n-head", "2", "--block-size", "16", "--batch-size", "8", "--steps", "8", "--json",
                          "--eval-interval", "0", "--bucket-mb", "0.01", *extra], timeout=120)
    records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert len(records) == 8 and all(np.isfinite(r["loss"]) for r in records)
    sent = sum(r["comm_bytes"] for r in records)
    if extra[0] == "--local-sgd":
        full = records[3]["comm_formula_bytes"]  # one outer round, at steps 4 and 8
        # two rounds of the formula's bytes, up to the ring's uneven last chunks (≤ 1 element per step)
        assert sent == pytest.approx(2 * full, rel=0.01) and records[0]["comm_bytes"] == 0
    else:
        full = sum(r["comm_formula_bytes"] for r in records)
        assert sent < full / 1.9
        if ratio:
            assert full / sent == pytest.approx(ratio, rel=0.01)  # uneven chunks per bucket: ≤ 1 element per step


def test_cli_rejects_bad_combinations():
    for args, message in [(["--compression", "topk", "--zero", "1"], "use it with --zero 0"),
                          (["--local-sgd", "2", "--zero", "1"], "--local-sgd replaces"),
                          (["--compression", "topk", "--topk-ratio", "0"], "ratio must be in (0, 1]")]:
        with pytest.raises(AssertionError) as err:
            run_command(2, [sys.executable, "-m", "minipar", "train", "--dp", "2", *args], timeout=60)
        assert message in str(err.value)


def _losses(extra, ranks=2):
    out = run_command(ranks, [sys.executable, "-m", "minipar", "train", "--dp", str(ranks), "--n-layer", "2",
                              "--n-embd", "32", "--n-head", "2", "--block-size", "32", "--batch-size", "8",
                              "--steps", "30", "--json", "--eval-interval", "0", "--bucket-mb", "0.01", *extra],
                      timeout=180)
    return [json.loads(line)["loss"] for line in out.splitlines() if line.startswith("{")]


@pytest.mark.parametrize("precision,method", [  # fp16 where the loss scale matters (error feedback, masters), bf16
    ("fp16-mixed", ["--compression", "powersgd"]), ("fp16-mixed", ["--local-sgd", "4"]),  # where the wire casts
    ("fp16-mixed", ["--compression", "topk", "--topk-ratio", "0.05"]), ("bf16-mixed", ["--compression", "fp16"]),
    ("bf16-mixed", ["--compression", "int8"]), ("bf16-mixed", ["--local-sgd", "4"])])
def test_mixed_precision_with_compression_and_local_sgd(precision, method):
    """16-bit training under each compression and under local SGD lowers the loss as the fp32 run with the same
    method does: the last 5 steps' mean loss within 3% of fp32's (30 steps of 16-bit rounding, a noisy
    method on top), having fallen by at least 90% of what fp32's fell."""
    mixed, fp32 = _losses([*method, "--precision", precision]), _losses(method)
    assert len(mixed) == 30 and all(np.isfinite(mixed))
    late, late_fp32 = np.mean(mixed[-5:]), np.mean(fp32[-5:])
    assert late == pytest.approx(late_fp32, rel=0.03) and mixed[0] - late >= 0.9 * (fp32[0] - late_fp32) > 0


def _error_feedback_is_kept_unscaled():
    """Top-k and PowerSGD under fp16 loss scaling: gradients scaled by S give S times the unscaled result, also
    after the scale changes between steps (the residual is stored divided by S); a step that overflowed (inf) on
    the last rank only leaves every rank's residual untouched, so the next finite step is as if it had not
    happened (a rank whose own gradient was finite must not keep that step's error either)."""
    from minipar.comm import Communicator
    from minipar.parallel.compression import PowerSGD, TopK

    comm = Communicator()
    rng = np.random.default_rng(comm.rank)
    bucket = _bucket([(8, 6), (5,)], np.float32)
    steps = [rng.standard_normal(53).astype(np.float32) for _ in range(3)]
    for make in (lambda: TopK(0.2), lambda: PowerSGD(2)):
        plain, scaled = make(), make()
        for g, scale in zip(steps, (1024.0, 64.0, 4096.0)):  # powers of two: the scaling itself is exact
            expected, got = g.copy(), g * np.float32(scale)
            plain.reduce(comm, bucket, expected)
            scaled.loss_scale = scale
            overflow = got.copy()
            if comm.rank == comm.size - 1:
                overflow[3] = np.inf
            with np.errstate(invalid="ignore", over="ignore"):
                scaled.reduce(comm, bucket, overflow)  # skipped by the loop: must leave no trace
            scaled.reduce(comm, bucket, got)
            np.testing.assert_allclose(got / scale, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("p", [1, 2, 3])
def test_error_feedback_is_kept_unscaled(p):
    run_ranks(p, _error_feedback_is_kept_unscaled)
