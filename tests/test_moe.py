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
                                       (dict(n_expert=4, capacity_factor=-1), "capacity_factor")])
def test_config_refuses(bad, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(**bad)


# ------------------------------------------------------------------------------------ today's MoE

def _modern_reference(x, router, gate_up, down, shared, bias, kind, k, norm, scaling, groups, topk_groups):
    """Token by token, written from the papers' definitions (models/moe.py's docstring), dropless: SwiGLU experts
    (gate | up), the shared experts' MLP on every token, and the router — Mixtral/Qwen3's softmax over the chosen
    (or not), DeepSeek-V3's sigmoid with its bias only in the choice, group-limited, the gates renormalized and
    scaled — plus the sigmoid router's sequence-wise balance loss. Returns (outputs, aux)."""
    silu = lambda a: a / (1 + np.exp(-a))  # noqa: E731
    swiglu = lambda h: silu(h[..., :h.shape[-1] // 2]) * h[..., h.shape[-1] // 2:]  # noqa: E731
    N, E = x.shape[0], router.shape[1]
    logits = x @ router
    if kind == "sigmoid":
        scores = 1 / (1 + np.exp(-logits))
        choice = scores + bias
        per = E // groups
        chosen = []
        for n in range(N):
            group_score = [sorted(choice[n, g * per:(g + 1) * per])[-2:] for g in range(groups)]
            best = sorted(range(groups), key=lambda g: (-sum(group_score[g]), g))[:topk_groups]
            allowed = [e for e in range(E) if e // per in best]
            chosen.append(sorted(allowed, key=lambda e: (-choice[n, e], e))[:k])
        chosen = np.array(chosen)
    else:
        scores = np.exp(logits - logits.max(1, keepdims=True))
        scores /= scores.sum(1, keepdims=True)
        chosen = np.array([sorted(range(E), key=lambda e: (-scores[n, e], e))[:k] for n in range(N)])
    gates = scores[np.arange(N)[:, None], chosen]
    if norm:
        gates = gates / (gates.sum(1, keepdims=True) + (1e-20 if kind == "sigmoid" else 0.0))
    gates = gates * scaling
    out = np.stack([swiglu(x[n] @ shared[0]) @ shared[1] for n in range(N)]) if shared else np.zeros_like(x)
    for n in range(N):
        for j in range(k):
            e = chosen[n, j]
            out[n] += gates[n, j] * (swiglu(x[n] @ gate_up[e]) @ down[e])
    aux = None
    if kind == "sigmoid":  # per sequence (2 sequences of N/2 tokens): E/(k·T)·counts · the mean normalized scores
        T = N // 2
        total = 0.0
        for b in range(2):
            rows = slice(b * T, (b + 1) * T)
            f = np.bincount(chosen[rows].ravel(), minlength=E) * E / (k * T)
            p = (scores[rows] / scores[rows].sum(1, keepdims=True)).mean(0)
            total += (f * p).sum()
        aux = total / 2
    return out, aux


MODERN = {  # (router, k, norm_topk_prob, routed_scaling, groups, topk_groups, shared experts)
    "mixtral": ("softmax-topk", 2, True, 1.0, 1, 1, 0),
    "qwen3 unnormalized": ("softmax-topk", 2, False, 1.0, 1, 1, 0),
    "deepseek-v3": ("sigmoid", 2, True, 2.5, 4, 2, 1),
    "sigmoid k=3, no groups": ("sigmoid", 3, True, 1.0, 1, 1, 2),
}


def _modern_moe(name, seed=0):
    kind, k, norm, scaling, groups, topk_groups, shared = MODERN[name]
    C, E, inner = 4, 8, 3
    moe = MoEMLP(C, E, k, 0.0, "float64", inner=inner, swiglu=True, n_shared=shared, router=kind, norm_topk=norm,
                 routed_scaling=scaling, groups=groups, topk_groups=topk_groups)
    rng = np.random.default_rng(seed)
    for p in moe.parameters():
        p.data = rng.standard_normal(p.shape) * 0.7
    if kind == "sigmoid":
        moe.score_bias = rng.standard_normal(E).astype(np.float32) * 0.3
    return moe, rng.standard_normal((2, 6, C))


@pytest.mark.parametrize("name", list(MODERN))
def test_todays_routers_and_experts_match_a_per_token_reference(name):
    """Dropless (capacity_factor 0) SwiGLU experts behind each router against the per-token reference: outputs to
    1e-12, and the sigmoid router's sequence-wise loss."""
    moe, x = _modern_moe(name)
    kind, k, norm, scaling, groups, topk_groups, shared = MODERN[name]
    y = moe(Tensor(x))
    reference_shared = (moe.shared.c_fc.weight.data, moe.shared.c_proj.weight.data) if shared else None
    ref, aux = _modern_reference(x.reshape(-1, 4), moe.router.weight.data, moe.c_fc.weight.data,
                                 moe.c_proj.weight.data, reference_shared, moe.score_bias, kind, k, norm, scaling,
                                 groups, topk_groups)
    np.testing.assert_allclose(y.data.reshape(-1, 4), ref, rtol=1e-12, atol=1e-12)
    assert moe.stats["dropped_fraction"] == 0  # dropless
    if aux is not None:
        assert moe.aux_loss.item() == pytest.approx(aux, rel=1e-12)


@pytest.mark.parametrize("name", ["deepseek-v3", "mixtral"])
def test_todays_moe_gradients_by_finite_differences(name):
    """Router (through the gates and the balance loss; the bias takes none), experts, shared experts and inputs."""
    moe, x = _modern_moe(name, seed=5)
    params = [p.data.copy() for p in moe.parameters()]
    named = [name for name, _ in moe.named_parameters()]

    def out(x, *ps):
        for path, p in zip(named, ps):
            *owner, leaf = path.split(".")
            module = moe
            for part in owner:
                module = getattr(module, part)
            setattr(module, leaf, p)
        y = moe(x)
        return ops.concat([y.reshape(-1), moe.aux_loss.reshape(1)])

    gradcheck(out, x[:1, :4], *params, rtol=1e-5, atol=1e-8)


def test_group_limited_routing_keeps_each_token_within_its_groups():
    """8 experts in 4 groups of 2, each token within its 2 best groups (by the sum of their two best scores)."""
    from minipar.models.moe import group_limited_top_k

    choice = np.array([[0.9, 0.0, 0.8, 0.7, 0.1, 0.1, 0.6, 0.6],    # groups: 0.9, 1.5, 0.2, 1.2 -> 1 and 3
                       [0.5, 0.5, 0.5, 0.5, 0.1, 0.9, 0.0, 0.0]])   # ties: groups 0 and 1 (1.0, 1.0, 1.0, 0.0)
    chosen = group_limited_top_k(choice, 3, 4, 2)
    assert chosen.tolist() == [[2, 3, 6], [0, 1, 2]]


def test_the_bias_moves_by_gamma_toward_the_mean_load():
    moe = MoEMLP(4, 4, 1, 0.0, "float64", router="sigmoid", bias_update=0.01)
    moe.update_bias(np.array([10.0, 2.0, 4.0, 4.0]))  # mean 5
    np.testing.assert_array_equal(moe.score_bias, np.array([-0.01, 0.01, 0.01, 0.01], np.float32))


@pytest.mark.parametrize("bad,match", [
    (dict(n_expert=6, expert_groups=4, router="sigmoid"), "expert_groups 4 must divide n_expert 6"),
    (dict(n_expert=8, expert_groups=4, topk_groups=5, router="sigmoid"), "topk_groups 5 must be between 1 and"),
    (dict(n_expert=8, expert_top_k=5, expert_groups=4, topk_groups=2, router="sigmoid"), "expert_top_k 5 >"),
    (dict(n_expert=4, bias_update=0.001), "router 'softmax' has no bias"),
    (dict(n_expert=4, router="top2"), "unknown router 'top2'"),
    (dict(n_expert=4, first_dense_layers=2, n_layer=2), "leaves no MoE layer"),
])
def test_todays_moe_config_is_refused_in_one_line(bad, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(**bad)


@pytest.mark.parametrize("arch", ["gpt2", "llama", "deepseek"])
def test_parameter_counts_of_todays_moe_are_the_models(arch):
    """Fine-grained experts, shared ones and a first dense layer: the config's count is the model's arrays'."""
    from minipar.models import build_model, config_from_dict

    extra = {"llama": dict(n_inner=24), "deepseek": dict(n_inner=24, kv_lora_rank=8)}.get(arch, {})
    cfg = config_from_dict(dict(arch=arch, vocab_size=32, block_size=8, n_layer=3, n_head=2, n_embd=8, n_expert=8,
                                moe_inner=6, n_shared_expert=1, first_dense_layers=1, **extra))
    model = build_model(cfg)
    assert sum(p.size for p in model.parameters()) == cfg.num_parameters()
    assert type(model.transformer.h[0].mlp).__name__ != "MoEMLP" and model.transformer.h[1].mlp.n_expert == 8
