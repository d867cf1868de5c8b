"""Pipeline parallelism (GPipe and 1F1B) and the full dp·tp·pp mesh reproduce single-process
training; the schedules' bubble and activation footprint match the formulas."""
import sys

import numpy as np
import pytest

from minipar.parallel.schedules import bubble_formula, schedule
from minipar.testing import assert_same_training, run_command, run_ranks, train_cli

MODEL = ["--n-layer", "4", "--n-head", "2", "--n-embd", "16", "--block-size", "16", "--batch-size", "8",
         "--steps", "20", "--eval-interval", "0", "--json", "--lr", "3e-3", "--warmup", "5", "--dtype", "float64"]


def train(tmp_path, name, ranks=1, extra=()):
    return train_cli([*MODEL, *extra], ranks, str(tmp_path / name))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return train(tmp_path_factory.mktemp("single"), "single")


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_pipeline_matches_single_process(tmp_path, reference, pp, kind):
    m = 4
    result = train(tmp_path, "pp", pp, ["--pp", str(pp), "--schedule", kind, "--microbatches", str(m)])
    assert_same_training(result, reference)
    stats = result[0][-1]["pipeline"]  # rank 0 = stage 0
    assert stats["bubble"] == pytest.approx(bubble_formula("1f1b", pp, m), rel=0.10)
    assert stats["peak_microbatches_in_flight"] == (m if kind == "gpipe" else min(pp, m))


def test_hybrid_dp2_tp2_pp2_matches_single_process(tmp_path, reference):
    result = train(tmp_path, "hybrid", 8, ["--dp", "2", "--tp", "2", "--pp", "2", "--microbatches", "2"])
    assert_same_training(result, reference)


def test_hybrid_with_zero1(tmp_path, reference):
    assert_same_training(train(tmp_path, "z1", 4, ["--dp", "2", "--pp", "2", "--zero", "1", "--microbatches", "2"]), reference)


def _peak_activations_per_stage(m):
    from minipar.comm import Communicator
    from minipar.models.gpt import GPT, GPTConfig
    from minipar.parallel.data_parallel import DataParallel
    from minipar.parallel.pipeline import Pipeline

    comm = Communicator()
    x = np.random.default_rng(0).integers(0, 32, (m, 8))
    peaks = {}
    for kind in ("gpipe", "1f1b"):
        model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=comm.size, n_head=2, n_embd=8), seed=0)
        pipeline = Pipeline(model, comm, kind)
        pipeline.run(DataParallel(model, comm.split(color=comm.rank)), x, x, m)
        peaks[kind] = [int(v) for v in comm.all_gather(np.array([pipeline.stats["peak_microbatches_in_flight"]]))]
        assert pipeline.stats["bubble"] == pytest.approx(bubble_formula(kind, comm.size, m), rel=1e-12)
    p = comm.size
    assert peaks["gpipe"] == [m] * p                                # GPipe keeps every microbatch
    assert peaks["1f1b"] == [min(p - s, m) for s in range(p)]       # 1F1B: at most p − s ≤ p


@pytest.mark.parametrize("p,m", [(4, 8), (3, 2)])
def test_activation_footprint_per_stage(p, m):
    run_ranks(p, _peak_activations_per_stage, m, timeout=120)


def test_schedules_are_complete_and_causal():
    for p in (1, 2, 3, 5):
        for m in (1, 2, 7):
            for kind in ("gpipe", "1f1b"):
                for s in range(p):
                    ops = [(k, i) for k, i, _ in schedule(kind, p, s, m)]
                    assert sorted(ops) == sorted([("F", i) for i in range(m)] + [("B", i) for i in range(m)])
                    assert all(ops.index(("F", i)) < ops.index(("B", i)) for i in range(m))
    assert [a[:2] for a in schedule("1f1b", 4, 0, 8)[:5]] == [("F", 0), ("F", 1), ("F", 2), ("F", 3), ("B", 0)]
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        schedule("zigzag", 2, 0, 2)


@pytest.mark.parametrize("ranks,args,message", [
    (2, ["--pp", "2", "--n-layer", "1"], "--pp 2 needs at least 2 transformer layers"),
    (4, ["--pp", "2", "--dp", "2", "--zero", "2"], "with --pp use --zero 0 or 1"),
])
def test_bad_pipeline_config(ranks, args, message):
    with pytest.raises(AssertionError) as err:
        run_command(ranks, [sys.executable, "-m", "minipar", "train", *args], timeout=60)
    assert str(err.value).count(message) == 1 and "exit 2" in str(err.value)  # refused by every rank, said once
