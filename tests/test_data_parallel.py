"""Data parallelism and ZeRO-1/2/3 reproduce single-process training, through the real CLI.

For dp ∈ {2, 4} and every ZeRO stage, 20 float64 steps under ``mpiexec -n dp python -m minipar
train --dp dp --zero z`` give the same losses and the same final parameters as the same command
on one process (rtol 1e-9); so does gradient accumulation. The step reports' counted bytes match
the ZeRO paper's formulas and the model-state memory drops as the table in zero.py says.
"""
import subprocess
import sys

import numpy as np
import pytest

from minipar.parallel import planner
from minipar.testing import assert_same_training, run_command, run_ranks, train_cli

MODEL = ["--n-layer", "2", "--n-head", "2", "--n-embd", "16", "--block-size", "16", "--batch-size", "8",
         "--steps", "20", "--eval-interval", "0", "--json", "--lr", "3e-3", "--warmup", "5", "--bucket-mb", "0.01"]


def train(tmp_path, name, ranks=1, extra=(), dtype="float64"):
    dp = ["--dp", str(ranks)] if ranks > 1 else []
    return train_cli([*MODEL, "--dtype", dtype, *dp, *extra], ranks, str(tmp_path / name))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("single")
    return {m: train(tmp, f"single-m{m}", extra=["--microbatches", str(m)]) for m in (1, 2)}


@pytest.mark.parametrize("dp", [2, 4])
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_matches_single_process(tmp_path, reference, dp, zero):
    result = train(tmp_path, "par", ranks=dp, extra=["--zero", str(zero)])
    assert_same_training(result, reference[1])
    assert_zero_paper_bytes(result, dp, passes=3 if zero == 3 else 2)


def assert_zero_paper_bytes(result, p, passes, replicas=1):
    """Rank 0's counted bytes per step against the ZeRO paper's closed form, with Ψ counted from the saved model:
    passes·(p−1)/p·Ψ·8 (2: all-reduce = reduce-scatter + all-gather; 3: stage 3's second all-gather), plus, under
    hybrid sharding over R replica groups, the all-reduce of each shard across them: 2(R−1)/R·Ψ/p·8. A ring step
    sends one numpy.array_split chunk, within one element of the average, and a rank sends (p−1) of them per pass
    and group (groups ≤ tensors): the deviation is at most passes·(p−1)·8 bytes per tensor (+ the same for R)."""
    records, params = result
    psi, tensors = sum(a.size for a in params.values()), len(params)
    closed = (passes * (p - 1) / p * psi + 2 * (replicas - 1) / replicas * psi / p) * 8
    slack = (passes * (p - 1) + 2 * (replicas - 1)) * 8 * tensors
    for r in records:
        assert abs(r["comm_bytes"] - closed) <= slack, (r["comm_bytes"], closed, slack)
        # the engine's own report says the same; its replica term takes rank 0's shard, ⌈n/p⌉ per group
        assert abs(r["comm_formula_bytes"] - closed) <= 2 * (replicas - 1) * 8 * tensors + 1e-12 * closed


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_gradient_accumulation_matches(tmp_path, reference, zero):
    result = train(tmp_path, "acc", ranks=2, extra=["--zero", str(zero), "--microbatches", "2"])
    assert_same_training(result, reference[2])


@pytest.mark.slow  # the fast subset keeps under 3 minutes; the module has faster tests
def test_model_state_memory_drops_with_zero_stage(tmp_path):
    p = 4
    states = {}
    for zero in (0, 1, 2, 3):
        records, params = train(tmp_path, f"mem{zero}", ranks=p, extra=["--zero", str(zero), "--steps", "2", "--warmup", "2"],
                                dtype="float32")
        states[zero] = records[-1]["model_state_bytes"]
    psi = sum(a.size for a in params.values())
    total = {z: sum(s.values()) for z, s in states.items()}
    # the ZeRO table in float32 (zero.py): 16Ψ, 8Ψ + 8Ψ/p, 4Ψ + 12Ψ/p, 16Ψ/p bytes. Each sharded group
    # is cut by numpy.array_split, so rank 0's slice is ⌈n/p⌉ ≥ n/p: at most one extra element per group, and
    # there are at most as many groups as tensors — the counted bytes exceed the table by less than that.
    table = {0: (16, 0), 1: (8, 8), 2: (4, 12), 3: (0, 16)}  # (replicated, sharded) bytes per parameter
    for zero, (replicated, sharded) in table.items():
        planned = (replicated + sharded / p) * psi
        assert planner.model_state_bytes(psi, p, zero, 4) == planned  # the planner's memory model is the table
        assert 0 <= total[zero] - planned <= sharded * len(params), (zero, total[zero], planned)
    assert 0 <= states[3]["params"] - 4 * psi / p <= 4 * len(params)


@pytest.mark.parametrize("dp,zero,k", [(4, 3, 2), (4, 1, 2), (4, 2, 2), (6, 3, 3), (6, 3, 2), (4, 3, 1)])
def test_hybrid_sharding_matches_single_process(tmp_path, reference, dp, zero, k):
    """--shard-group K: shard within groups of K, replicate across dp/K groups; the same training, the counted
    bytes of the formula, and model state 16Ψ/K (stage 3) instead of 16Ψ/dp."""
    batch = ["--batch-size", "12"] if dp == 6 else []
    result = train(tmp_path, "hsdp", ranks=dp, extra=["--zero", str(zero), "--shard-group", str(k), *batch])
    assert_same_training(result, train(tmp_path, "single", extra=batch) if dp == 6 else reference[1])
    assert_zero_paper_bytes(result, k, passes=3 if zero == 3 else 2, replicas=dp // k)
    assert all(r["comm_bytes_by_op"]["grads"] > 0 for r in result[0])
    if zero == 3:  # parameters, gradients, m, v: 4 float64 words per parameter, sharded over k (slices ⌈n/k⌉)
        psi, tensors = sum(a.size for a in result[1].values()), len(result[1])
        assert 0 <= sum(result[0][-1]["model_state_bytes"].values()) - 32 * psi / k <= 32 * tensors


@pytest.mark.parametrize("args,message", [
    (["--zero", "1", "--shard-group", "3"], "--shard-group 3 must divide the 4 data-parallel replicas"),
    (["--shard-group", "2"], "--shard-group chooses how ZeRO shards: use it with --zero 1, 2 or 3"),
])
def test_bad_shard_group(args, message):
    with pytest.raises(AssertionError) as err:
        run_command(4, [sys.executable, "-m", "minipar", "train", *MODEL, *args], timeout=60)
    assert str(err.value).count(message) == 1 and "exit 2" in str(err.value)


# ------------------------------------------------------------------------- library-level checks


def _zero3_prefetch():
    """Forward and backward: while a block computes, the next block's all-gather is already issued (except at
    the ends), at most two blocks are whole at once; the result equals ZeRO-3 without prefetch."""
    from minipar.comm import Communicator
    from minipar.models.gpt import GPT, GPTConfig
    from minipar.parallel.zero import ZeRO

    comm = Communicator()
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=16, dtype="float64")
    x = np.random.default_rng(comm.rank).integers(0, 64, (2, 16))
    states = {}
    for prefetch in (False, True):
        model = GPT(cfg, seed=0)
        engine = ZeRO(model, comm, 3, prefetch=prefetch)
        blocks = list(model.transformer.h)
        seen = []

        def probe(module, out, i):
            whole = [j for j, b in enumerate(blocks) if b.ln_1.weight.data.size > 0]
            ahead = [j for j, b in enumerate(blocks) if engine.shards[len(blocks) - 1 - j].prefetch is not None]
            seen.append((i, whole, ahead))
            return out
        for i, block in enumerate(blocks):
            block.attn.register_forward_hook(lambda m, out, i=i: probe(m, out, i))
        gathered, original = [], engine._gather

        def traced(shard, direction):  # which unit was gathered, in which pass, and whose all-gather is in flight
            original(shard, direction)
            unit = lambda s: len(blocks) - 1 - engine.shards.index(s)  # noqa: E731  (the root: -1)
            gathered.append((direction, unit(shard), [unit(t) for t in engine.shards if t.prefetch is not None]))
        engine._gather = traced
        for _ in range(2):
            _, loss = engine(x, x)
            loss.backward()
            engine.sync_gradients()
            engine.step()
            engine.zero_grad()
        states[prefetch] = engine.gathered_state_dict()
        for i, whole, ahead in seen:
            assert whole == [i]  # forward: the block in hand only (the next one is in flight, not yet whole)
            assert ahead == ([i + 1] if prefetch and i + 1 < len(blocks) else []), (prefetch, i, ahead)
        backward = [(unit, ahead) for direction, unit, ahead in gathered if direction < 0 and unit >= 0]
        assert [unit for unit, _ in backward] == [3, 2, 1, 0] * 2
        assert all(ahead == ([unit - 1] if prefetch and unit > 0 else []) for unit, ahead in backward), backward
    for name, value in states[False].items():
        np.testing.assert_allclose(states[True][name], value, rtol=1e-12, err_msg=name)


def test_zero3_prefetches_one_unit_ahead():
    run_ranks(2, _zero3_prefetch)


def _exact_bytes_and_overlap():
    from minipar.comm import Communicator
    from minipar.models.gpt import GPT, GPTConfig
    from minipar.parallel.data_parallel import DataParallel
    from minipar.parallel.zero import ZeRO

    comm = Communicator()
    p, rng = comm.size, np.random.default_rng(0)
    x = rng.integers(0, 64, (2, 8))
    for zero in (0, 1, 2, 3):
        model = GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=8, dtype="float64"),
                    seed=comm.rank)  # different on every rank: wrapping must broadcast rank 0's
        psi = model.num_parameters()
        engine = ZeRO(model, comm, zero, bucket_mb=0.002) if zero else DataParallel(model, comm, bucket_mb=0.002)
        reference = GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=8, dtype="float64"), seed=0)
        if zero < 3:
            for a, b in zip(model.parameters(), reference.parameters()):
                np.testing.assert_array_equal(a.data, b.data)
        comm.reset_stats()
        _, loss = engine(x, x)
        loss.backward()
        if zero == 0:  # every bucket's all-reduce started inside backward: communication overlapped it
            assert len(engine.buckets) > 1 and all(b.handle is not None for b in engine.buckets)
        else:
            assert all(s.pending for s in engine.shards)
        engine.sync_gradients()
        if zero:
            engine.clip_grad_norm(1.0)
            engine.step()
        sent = comm.bytes_sent("grads") + comm.bytes_sent("params")
        total = int(comm.all_reduce(np.array([sent]))[0])
        factor = 3 if zero == 3 else 2
        assert total == factor * (p - 1) * psi * 8, (zero, total, factor * (p - 1) * psi * 8)


@pytest.mark.parametrize("p", [3])
def test_exact_bytes_broadcast_and_overlap(p):
    from minipar.testing import run_ranks

    run_ranks(p, _exact_bytes_and_overlap, timeout=120)


@pytest.mark.parametrize("args,message", [
    (["--dp", "3"], "world size 2 != dp·tp·pp = 3·1·1"),
    (["--dp", "2", "--batch-size", "6", "--microbatches", "2"], "not divisible by --dp·--microbatches"),
])
def test_bad_parallel_config_fails_on_every_rank_before_communicating(args, message):
    with pytest.raises(AssertionError) as err:
        run_command(2, [sys.executable, "-m", "minipar", "train", *args], timeout=60)
    # every rank refuses it before communicating; rank 0 reports it once for all
    assert str(err.value).count(message) == 1 and "Traceback" not in str(err.value) and "exit 2" in str(err.value)


def test_zero_needs_data_parallel_ranks():
    proc = subprocess.run([sys.executable, "-m", "minipar", "train", "--zero", "2"], capture_output=True, text=True)
    assert proc.returncode != 0 and "--zero shards over the data- and context-parallel ranks: it needs --dp or --cp >= 2" in proc.stderr


def _unused_parameters_reduce_as_zeros():
    """A parameter that got no gradient in this forward (unused) reduces as zeros, beside one that did: the used
    one's gradient is MPI's sum of every rank's, the unused one's is 0 on every rank."""
    from mpi4py import MPI

    from minipar.autograd import Tensor
    from minipar.comm import Communicator
    from minipar.nn import Module, Parameter
    from minipar.parallel.data_parallel import DataParallel

    class Two(Module):
        def __init__(self):
            self.used, self.unused = Parameter(np.ones(3)), Parameter(np.ones(2))

        def forward(self, x):
            return (self.used * Tensor(x)).sum()

    comm = Communicator()
    engine = DataParallel(Two(), comm, bucket_mb=1.0)  # one bucket holds both
    x = np.arange(3.0) * (comm.rank + 1)
    engine(x).backward()
    engine.sync_gradients()
    total = np.empty(3)
    comm.mpi.Allreduce(x, total, op=MPI.SUM)
    used, unused = engine.module.used.grad, engine.module.unused.grad
    np.testing.assert_allclose(used, total, rtol=1e-15)
    assert (unused == 0).all() and unused.shape == (2,)


@pytest.mark.parametrize("p", [2, 3])
def test_unused_parameters_reduce_as_zeros(p):
    run_ranks(p, _unused_parameters_reduce_as_zeros)
