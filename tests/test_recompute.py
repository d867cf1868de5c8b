"""Activation recomputation: selective (attention probabilities) and full (whole blocks) give the same losses
and gradients as keeping everything (float64), alone and under tp (+sp), zero-3 and pp; the activations one
forward keeps match GPT's accounting (activation_elements) within 2%; bad combinations are refused."""
import sys
import tracemalloc

import numpy as np
import pytest

from minipar import ops
from minipar.autograd import Tensor
from minipar.models.gpt import GPT, GPTConfig, activation_elements
from minipar.testing import assert_same_training, gradcheck, run_command, train_cli

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=16, dtype="float64")


# GPT-2's attention-scaling options (scale_attn_weights, scale_attn_by_inverse_layer_idx): q·kᵀ/√D, q·kᵀ/(√D·(i+1)),
# unscaled, unscaled/(i+1) — a recomputation that rebuilt the probabilities with the default 1/√D trains wrongly
SCALINGS = [(True, False), (True, True), (False, False), (False, True)]


def _gradients(mode, dtype="float64", scaling=(True, False)):
    weights, by_layer = scaling
    model = GPT(GPTConfig(**{**CFG.__dict__, "dtype": dtype, "scale_attn_weights": weights,
                             "scale_attn_by_inverse_layer_idx": by_layer}), seed=3).set_recompute(mode)
    x = np.random.default_rng(0).integers(0, 64, (3, 16))
    _, loss = model(x, x)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("mode", ["selective", "full"])
def test_same_loss_and_gradients(mode, scaling):
    (loss, grads), (ref_loss, ref) = _gradients(mode, scaling=scaling), _gradients("none", scaling=scaling)
    assert loss == ref_loss
    for name, g in ref.items():
        np.testing.assert_allclose(grads[name], g, rtol=1e-12, atol=1e-15, err_msg=name)


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recomputation_under_bfloat16(mode):
    """Full recomputation repeats the original 16-bit forward — the same bfloat16 inputs, the same float32
    arithmetic — so loss and gradients are bit for bit those of keeping everything. Selective recomputation
    rebuilds the attention probabilities in float32 where keeping them stored them in bfloat16: the same loss,
    gradients within 4 units of bfloat16 roundoff (2^-8) of each tensor's largest (measured: 1.7)."""
    (loss, grads), (ref_loss, ref) = _gradients(mode, "bfloat16"), _gradients("none", "bfloat16")
    assert loss == ref_loss
    for name, g in ref.items():
        got, want = grads[name].astype(np.float64), g.astype(np.float64)
        if mode == "full":
            assert (got == want).all(), name
        else:
            assert np.abs(got - want).max() <= 4 * 2.0**-8 * np.abs(want).max(), name


def test_split_backward_through_recomputed_blocks():
    """B of fully recomputed blocks leaves every weight gradient to W (the recomputed graph's too); W then gives
    a plain backward's gradients, each weight's hook firing once, in W."""
    h = np.random.default_rng(1).standard_normal((2, 16, 16))
    grads = []
    for split in (False, True):
        model = GPT(CFG, seed=3).set_recompute("full")
        fired = []
        for name, p in model.named_parameters():
            p.register_hook(lambda p, name=name: fired.append(name))
        x = Tensor(h, requires_grad=True)
        out = model.transformer.h[1](model.transformer.h[0](x))
        deferred = out.backward(np.ones_like(h), defer={id(p) for p in model.parameters()} if split else None)
        if split:
            assert not fired and x.grad is not None  # B: the input's gradient, no weight's
            deferred.run()
        blocks = [n for n, _ in model.named_parameters() if n.startswith("transformer.h.")]
        assert sorted(fired) == sorted(blocks)
        grads.append((x.grad, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    np.testing.assert_array_equal(grads[0][0], grads[1][0])
    for name, g in grads[0][1].items():
        np.testing.assert_allclose(grads[1][1][name], g, rtol=1e-12, atol=1e-15, err_msg=name)


@pytest.mark.parametrize("factor", [0.5, 4.0])
def test_full_recomputation_keeps_the_balancing_loss(factor):
    """MoE blocks recomputed whole: the balancing loss of the first forward is a node on the block's output whose
    gradient the recomputed forward's own balancing loss receives — the same loss and gradients, bit for bit
    (the same arithmetic in the same order), with and without dropped tokens."""
    cfg = GPTConfig(**{**CFG.__dict__, "n_expert": 4, "capacity_factor": factor, "aux_loss_coef": 0.5})
    x = np.random.default_rng(0).integers(0, 64, (3, 16))
    runs = []
    for mode in ("none", "full"):
        model = GPT(cfg, seed=3).set_recompute(mode)
        _, loss = model(x, x)
        loss.backward()
        runs.append((loss.item(), {n: p.grad for n, p in model.named_parameters()}))
    assert runs[0][0] == runs[1][0]
    for name, grad in runs[0][1].items():
        np.testing.assert_array_equal(runs[1][1][name], grad, err_msg=name)


def test_recompute_function_by_finite_differences():
    w = np.random.default_rng(1).standard_normal((4, 4))
    fn = lambda t: ops.tanh(t @ Tensor(w)) * t  # noqa: E731
    gradcheck(lambda x: ops.recompute(fn, x).sum(), np.random.default_rng(2).standard_normal((3, 4)))


@pytest.mark.parametrize("shape", [(2, 4, 32, 64, 3), (3, 8, 64, 32, 2)])
@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_kept_activations_match_the_accounting(shape, mode):
    L, H, C, T, B = shape
    cfg = GPTConfig(vocab_size=256, block_size=T, n_layer=L, n_head=H, n_embd=C, dtype="float64")
    model = GPT(cfg).set_recompute(mode)
    x = np.random.default_rng(0).integers(0, 256, (B, T))
    model(x, x)[1].backward()  # first-use caches (masks) out of the way
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        _, loss = model(x, x)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    # the arrays, within 2%, + up to 16 KiB of the graph's own Python objects (Tensors, Contexts), which
    # matter where full recomputation leaves few arrays
    assert held == pytest.approx(activation_elements(cfg, B, mode) * 8, rel=0.02, abs=16 * 1024)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return train_cli(MODEL, 1, str(tmp_path_factory.mktemp("single") / "out"))


MODEL = ["--n-layer", "2", "--n-head", "2", "--n-embd", "16", "--block-size", "16", "--batch-size", "8", "--steps", "20",
         "--eval-interval", "0", "--json", "--lr", "3e-3", "--warmup", "5", "--dtype", "float64"]


@pytest.mark.parametrize("ranks,layout", [(1, ["--recompute", "full"]), (1, ["--recompute", "selective"]),
                                          (2, ["--recompute", "full", "--tp", "2", "--sp"]),
                                          (2, ["--recompute", "selective", "--tp", "2"]),
                                          (2, ["--recompute", "full", "--dp", "2", "--zero", "3"]),
                                          (2, ["--recompute", "full", "--pp", "2", "--microbatches", "2"]),
                                          (2, ["--recompute", "full", "--pp", "2", "--microbatches", "4",
                                               "--schedule", "zb-h1"])])
def test_training_matches(tmp_path, single, ranks, layout):
    assert_same_training(train_cli([*MODEL, *layout], ranks, str(tmp_path / "out")), single)


@pytest.fixture(scope="module")
def scaled_checkpoints(tmp_path_factory):
    """A tiny GPT-2 checkpoint per attention-scaling option, with its one-process training run."""
    runs = {}

    def run(scaling):
        if scaling not in runs:
            folder = tmp_path_factory.mktemp("scaled")
            cfg = GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=4, n_embd=16, dtype="float64",
                            scale_attn_weights=scaling[0], scale_attn_by_inverse_layer_idx=scaling[1])
            GPT(cfg, seed=5).save_hf(str(folder / "hf"))
            flags = ["--init-from", str(folder / "hf"), "--batch-size", "8", "--steps", "6", "--eval-interval", "0",
                     "--json", "--lr", "3e-3", "--warmup", "2", "--dtype", "float64"]
            runs[scaling] = flags, train_cli(flags, 1, str(folder / "single"))
        return runs[scaling]
    return run


@pytest.mark.slow  # the fast subset has the unit-level check (test_same_loss_and_gradients) of every scaling
@pytest.mark.parametrize("scaling", SCALINGS[1:])
@pytest.mark.parametrize("ranks,layout", [(1, ["--recompute", "selective"]),
                                          (2, ["--recompute", "selective", "--tp", "2"]),
                                          (2, ["--recompute", "full", "--tp", "2", "--sp"]),
                                          (2, ["--recompute", "full", "--cp", "2"])])
def test_training_matches_under_every_attention_scaling(tmp_path, scaled_checkpoints, scaling, ranks, layout):
    """A checkpoint with scale_attn_by_inverse_layer_idx or scale_attn_weights=False (--init-from) trains under
    recomputation, alone, with tp (+sp) and cp, as one process keeping everything does (float64, rtol 1e-9)."""
    flags, single = scaled_checkpoints(scaling)
    assert_same_training(train_cli([*flags, *layout], ranks, str(tmp_path / "out")), single)


@pytest.mark.parametrize("ranks,args,message", [
    (2, ["--recompute", "selective", "--cp", "2"], "--recompute selective recomputes the standard attention"),
])
def test_refused(ranks, args, message):
    with pytest.raises(AssertionError) as err:
        run_command(ranks, [sys.executable, "-m", "minipar", "train", *MODEL, *args], timeout=60)
    assert str(err.value).count(message) == 1 and "exit 2" in str(err.value)
