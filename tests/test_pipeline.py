"""Pipeline parallelism (GPipe, 1F1B, interleaved 1F1B, ZB-H1, DualPipeV) and the full dp·tp·pp mesh reproduce
single-process training; each schedule's bubble and activation footprint in the engine are the
simulator's and the formulas'; split backward (B, then W) gives the gradients of one backward."""
import sys

import numpy as np
import pytest

from closed_forms import pipeline_bubble
from minipar.parallel.schedules import build
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
    assert stats["bubble"] == pytest.approx(pipeline_bubble(kind, pp, m), abs=1e-12)
    assert stats["peak_microbatches_in_flight"] == (m if kind == "gpipe" else min(pp, m))


@pytest.fixture(scope="module")
def reference8(tmp_path_factory):
    """Eight layers: enough for 4 ranks × 2 chunks."""
    return train_cli([*MODEL, "--n-layer", "8"], 1, str(tmp_path_factory.mktemp("single8") / "single"))


NEW_SCHEDULES = [("interleaved", 2, 2, 4, []), ("interleaved", 2, 2, 8, []), ("interleaved", 4, 2, 4, []),
                 ("interleaved", 4, 2, 8, []), ("zb-h1", 2, 1, 4, []), ("zb-h1", 4, 1, 4, []), ("zb-h1", 2, 1, 2, []), ("zb-h1", 3, 1, 4, []),
                 ("interleaved", 2, 2, 4, ["--dp", "2"]), ("zb-h1", 2, 1, 4, ["--dp", "2", "--zero", "1"]),
                 ("interleaved", 2, 2, 2, ["--dp", "2", "--tp", "2"]), ("zb-h1", 2, 1, 2, ["--dp", "2", "--tp", "2"]),
                 ("dualpipev", 2, 1, 4, []), ("dualpipev", 3, 1, 8, []), ("dualpipev", 4, 1, 8, []),
                 ("dualpipev", 2, 1, 4, ["--dp", "2", "--zero", "1"]), ("dualpipev", 2, 1, 4, ["--dp", "2", "--tp", "2"]),
                 # ZeRO-2/3 under every schedule: reduce-scatter per backward pass, ZeRO-3 gathering each unit
                 ("1f1b", 2, 1, 2, ["--dp", "2", "--zero", "2"]), ("zb-h1", 2, 1, 4, ["--dp", "2", "--zero", "2"]),
                 ("interleaved", 2, 2, 4, ["--dp", "2", "--zero", "2"]), ("1f1b", 2, 1, 4, ["--dp", "2", "--zero", "3"]),
                 ("gpipe", 2, 1, 2, ["--dp", "2", "--zero", "3", "--no-prefetch", "--eval-interval", "10"]),
                 ("interleaved", 2, 2, 4, ["--dp", "2", "--zero", "3"]), ("zb-h1", 3, 1, 4, ["--dp", "2", "--zero", "3"]),
                 ("dualpipev", 2, 1, 4, ["--dp", "2", "--zero", "3", "--eval-interval", "10"]),
                 ("dualpipev", 2, 1, 4, ["--dp", "2", "--zero", "2", "--tp", "2"]),
                 ("dualpipev", 2, 1, 4, ["--recompute", "full"])]  # split backward through recomputed blocks


@pytest.mark.parametrize("kind,pp,v,m,extra", NEW_SCHEDULES)
def test_interleaved_zero_bubble_and_dualpipev_match_single_process(tmp_path, reference, reference8, kind, pp, v, m,
                                                                    extra):
    """The tied embedding spans the first and last rank (interleaved, ZB-H1) or is mirrored on rank 0, which holds
    both ends of DualPipeV's V; L = 8 where there are more than 4 stages (uneven: 6 stages of 8 layers)."""
    ranks = pp * (2 if "--dp" in extra else 1) * (2 if "--tp" in extra else 1)
    schedule = build(kind, pp, m, v)
    layers = ["--n-layer", "8"] if schedule.n_stages > 4 else []
    result = train_cli([*MODEL, *layers, "--pp", str(pp), "--schedule", kind, "--virtual-stages", str(v),
                        "--microbatches", str(m), *extra], ranks, str(tmp_path / "pp"))
    assert_same_training(result, reference8 if layers else reference)
    if "--eval-interval" in extra:  # validation through the pipeline (ZeRO-3 gathering the units) = one process's
        evaluated = train_cli([*MODEL, *layers, "--eval-interval", "10"], 1, str(tmp_path / "single_eval"))[0]
        val = lambda records: [r["val_loss"] for r in records if "val_loss" in r]  # noqa: E731
        assert len(val(evaluated)) == 2
        np.testing.assert_allclose(val(result[0]), val(evaluated), rtol=1e-9)
    stats, sim = [r for r in result[0] if "pipeline" in r][-1]["pipeline"], schedule.simulate()  # rank 0's
    assert stats["bubble"] == pytest.approx(sim.bubble, abs=1e-12)
    if kind != "zb-h1" or m >= pp:
        assert stats["bubble"] == pytest.approx(pipeline_bubble(kind, pp, m, v), abs=1e-12)
    assert stats["peak_microbatches_in_flight"] == sim.peak_in_flight[0]


def test_split_backward_equals_one_backward():
    """B (input gradients only) then W (weights), from one forward: the gradients of a plain backward;
    the weights' hooks fire once, in W; the input's gradient is there after B."""
    from minipar.autograd import Tensor
    from minipar.models.gpt import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=8, dtype="float64")
    h = np.random.default_rng(0).standard_normal((2, 8, 8))
    grads, fired = [], []
    for split in (False, True):
        model = GPT(cfg, seed=0)
        x = Tensor(h, requires_grad=True)
        out = model.transformer.h[1](model.transformer.h[0](x))
        for name, p in model.named_parameters():
            p.register_hook(lambda p, name=name, split=split: fired.append((split, name)))
        weights = {id(p) for p in model.parameters()} if split else None
        deferred = out.backward(np.ones_like(h), defer=weights)
        if split:
            assert x.grad is not None and not [f for f in fired if f[0]]  # B: the input's gradient, no weight's
            deferred.run()
        grads.append({"x": x.grad, **{n: p.grad for n, p in model.named_parameters() if p.grad is not None}})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 10
    for name in grads[0]:
        np.testing.assert_allclose(grads[1][name], grads[0][name], rtol=1e-12, atol=1e-15, err_msg=name)
    assert sorted(n for s, n in fired if s) == sorted(n for s, n in fired if not s)  # each hook once per backward


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
        pipeline = Pipeline(model, comm, build(kind, comm.size, m))
        pipeline.run(DataParallel(model, comm.split(color=comm.rank)), x, x)
        peaks[kind] = [int(v) for v in comm.all_gather(np.array([pipeline.stats["peak_microbatches_in_flight"]]))]
        assert pipeline.stats["bubble"] == pytest.approx(pipeline_bubble(kind, comm.size, m), rel=1e-12)
    p = comm.size
    assert peaks["gpipe"] == [m] * p                                # GPipe keeps every microbatch
    assert peaks["1f1b"] == [min(p - s, m) for s in range(p)]       # 1F1B: at most p − s ≤ p


@pytest.mark.parametrize("p,m", [(4, 8), (3, 2)])
def test_activation_footprint_per_stage(p, m):
    run_ranks(p, _peak_activations_per_stage, m, timeout=120)


@pytest.mark.parametrize("ranks,args,message", [
    (2, ["--pp", "2", "--n-layer", "1"], "2 pipeline stages (--pp × --virtual-stages) need at least 2 transformer layers"),
    (2, ["--pp", "2", "--schedule", "interleaved", "--virtual-stages", "2", "--microbatches", "3", "--batch-size", "6"],
     "--microbatches 3 must be a multiple of --pp 2"),
    (2, ["--pp", "2", "--virtual-stages", "2"], "--virtual-stages 2 needs --schedule interleaved"),
    (2, ["--pp", "2", "--schedule", "interleaved", "--virtual-stages", "3", "--n-layer", "4", "--microbatches", "2"],
     "6 pipeline stages (--pp × --virtual-stages) need at least 6 transformer layers"),
    (1, ["--schedule", "interleaved", "--virtual-stages", "2"], "it needs --pp >= 2"),
    (2, ["--pp", "2", "--schedule", "dualpipev", "--microbatches", "2"], "--microbatches 2 < 4"),
    (2, ["--pp", "2", "--schedule", "dualpipev", "--microbatches", "4", "--n-layer", "3"],
     "4 pipeline stages (--pp × --virtual-stages) need at least 4 transformer layers"),
])
def test_bad_pipeline_config(ranks, args, message):
    with pytest.raises(AssertionError) as err:
        run_command(ranks, [sys.executable, "-m", "minipar", "train", *args], timeout=60)
    assert str(err.value).count(message) == 1 and "exit 2" in str(err.value)  # refused by every rank, said once
