"""The mixture-of-experts MLP: routing with capacity and the stated priority rule, outputs against a
per-token reference, float64 gradients (router and gates included) against finite differences, and
the GPT's loss with the load-balancing term."""
import math

import numpy as np
import pytest

from minipar import ops
from minipar.autograd import Tensor
from minipar.models.gpt import GPT, GPTConfig
from minipar.models.moe import MoEMLP, route
from minipar.testing import gradcheck

from closed_forms import expert_capacity


def test_route_capacity_and_priority():
    probs = np.array([[0.6, 0.3, 0.1], [0.5, 0.4, 0.1], [0.7, 0.1, 0.2], [0.2, 0.5, 0.3]])
    chosen, slot, assigned = route(probs, k=2, capacity=2)
    assert chosen.tolist() == [[0, 1], [0, 1], [0, 2], [1, 2]]
    # first choices first: tokens 0 and 1 fill expert 0; token 2's first choice is dropped; token 3 -> expert 1
    assert slot[:, 0].tolist() == [0, 1, -1, 2]
    # second choices: expert 1 has one place left (token 0), token 1's is dropped; expert 2 takes tokens 2 and 3
    assert slot[:, 1].tolist() == [3, -1, 4, 5]
    assert assigned.tolist() == [3, 3, 2]  # before dropping


def _reference(x, router, w1, b1, w2, b2, k, capacity):
    """Token by token, in the priority order the docstring states."""
    N, E = x.shape[0], router.shape[1]
    logits = x @ router
    probs = np.exp(logits - logits.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    chosen = np.argsort(-probs, axis=1, kind="stable")[:, :k]
    gates = probs[np.arange(N)[:, None], chosen]
    gates = gates / gates.sum(1, keepdims=True) if k > 1 else gates
    used, out = [0] * E, np.zeros_like(x)
    for j in range(k):
        for n in range(N):
            e = chosen[n, j]
            if used[e] < capacity:
                used[e] += 1
                h = x[n] @ w1[e] + b1[e]
                h = 0.5 * h * (1 + np.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h ** 3)))
                out[n] += gates[n, j] * (h @ w2[e] + b2[e])
    share = np.bincount(chosen.ravel(), minlength=E) / (k * N)
    return out, E * (probs.mean(0) * share).sum()


def _moe(C, E, k, factor, seed):
    rng = np.random.default_rng(seed)
    moe = MoEMLP(C, E, k, factor, dtype="float64")
    params = [rng.standard_normal(p.shape) * 0.5 for p in (moe.router.weight, moe.c_fc.weight, moe.c_fc.bias,
                                                           moe.c_proj.weight, moe.c_proj.bias)]
    return moe, params, rng.standard_normal((2, 6, C))


def _use(moe, params):
    moe.router.weight, moe.c_fc.weight, moe.c_fc.bias, moe.c_proj.weight, moe.c_proj.bias = params


@pytest.mark.parametrize("k,factor", [(1, 4.0), (2, 4.0), (2, 0.5), (3, 1.0), (2, 0.75), (1, 1.1)])
def test_outputs_match_a_per_token_reference(k, factor):
    """12 tokens, 4 experts: capacities 12, 24, 3, 9, ⌈4.5⌉ = 5 and ⌈3.3⌉ = 4 (closed_forms.expert_capacity)."""
    moe, params, x = _moe(4, 4, k, factor, seed=k)
    _use(moe, [Tensor(p) for p in params])
    y = moe(Tensor(x))
    ref, aux = _reference(x.reshape(-1, 4), *params, k, expert_capacity(factor, k, 12, 4))
    np.testing.assert_allclose(y.data.reshape(-1, 4), ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(moe.aux_loss.item(), aux, rtol=1e-12)
    if factor >= 4.0:  # room for every assignment
        assert moe.stats["dropped_fraction"] == 0
    if factor < 1.0:   # fewer places than assignments
        assert moe.stats["dropped_fraction"] > 0


@pytest.mark.parametrize("k,factor", [(1, 4.0), (2, 4.0), (2, 0.5)])
def test_gradients_by_finite_differences(k, factor):
    """Router, gates, expert weights and inputs (float64); with factor 0.5 some assignments are dropped."""
    moe, params, x = _moe(3, 3, k, factor, seed=10 + k)

    def out(x, *ps):
        _use(moe, list(ps))
        y = moe(x)
        return ops.concat([y.reshape(-1), moe.aux_loss.reshape(1)])  # the output and the balancing loss

    gradcheck(out, x, *params, rtol=1e-5, atol=1e-8)


def test_gpt_adds_the_balancing_loss():
    cfg = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=8, dtype="float64", n_expert=4,
                    expert_top_k=2, capacity_factor=1.0, aux_loss_coef=0.5)
    model = GPT(cfg, seed=0)
    idx = np.random.default_rng(1).integers(0, 32, (2, 8))
    logits, loss = model(idx, idx)
    aux = sum(block.mlp.aux_loss.item() for block in model.transformer.h)
    plain = model.transformer.wte.cross_entropy(logits, idx).item()
    assert loss.item() == pytest.approx(plain + 0.5 * aux, rel=1e-12)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    assert sum(p.size for p in model.parameters()) == cfg.num_parameters()
    with pytest.raises(ValueError, match="no Hugging Face GPT-2 layout"):
        model.save_hf("/tmp/never-written")


@pytest.mark.parametrize("bad,match", [(dict(n_expert=4, expert_top_k=5), "between 1 and n_expert"),
                                       (dict(n_expert=4, capacity_factor=0), "capacity_factor")])
def test_config_refuses(bad, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(**bad)
