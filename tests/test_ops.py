"""Every op's gradient against central finite differences, in float64."""
import numpy as np
import pytest

from minipar import Tensor, backend, ops
from minipar.autograd import Context
from minipar.testing import gradcheck

rng = np.random.default_rng(0)


def randn(*shape):
    return rng.standard_normal(shape)


@pytest.mark.parametrize("op", [ops.add, ops.sub, ops.mul, ops.div])
@pytest.mark.parametrize("shapes", [((3, 4), (3, 4)), ((2, 3, 4), (4,)), ((2, 1, 4), (3, 1)), ((3, 4), ())])
def test_binary_broadcasting(op, shapes):
    a, b = randn(*shapes[0]), randn(*shapes[1])
    if op is ops.div:
        b = np.abs(b) + 0.5
    gradcheck(op, a, b)


@pytest.mark.parametrize("fn", [ops.neg, ops.exp, ops.tanh, lambda x: ops.pow(x, 3.0), lambda x: x * 2.5 + 1.0,
                                lambda x: 1.0 - x, lambda x: 2.0 / x])
def test_unary(fn):
    gradcheck(fn, randn(3, 5) + 3.0)


def test_log():
    gradcheck(ops.log, np.abs(randn(4, 3)) + 0.1)


@pytest.mark.parametrize("axis,keepdims", [(None, False), (0, False), (1, True), ((0, 2), False), (-1, True)])
def test_sum_mean(axis, keepdims):
    x = randn(2, 3, 4)
    gradcheck(lambda t: ops.sum(t, axis, keepdims), x)
    gradcheck(lambda t: ops.mean(t, axis, keepdims), x)


def test_shape_ops():
    x = randn(2, 3, 4)
    gradcheck(lambda t: t.reshape(4, 6), x)
    gradcheck(lambda t: t.transpose(2, 0, 1), x)
    gradcheck(lambda t: t.T, x)
    gradcheck(lambda t: t[1, :, 1:3], x)
    gradcheck(lambda t: t[np.array([0, 2, 2]), 1], x.transpose(1, 0, 2))  # repeated integer index: scatter-add
    gradcheck(lambda t: t[np.array([[0, 2], [2, -2]])], x.transpose(1, 0, 2))  # whole rows, one of them twice
    gradcheck(lambda t: t[np.array([1, 1, -3])], randn(5))
    gradcheck(lambda a, b: ops.concat([a, b], axis=1), x, randn(2, 5, 4))


@pytest.mark.parametrize("shapes", [((3, 4), (4, 5)), ((2, 3, 4), (4, 5)), ((2, 3, 4), (2, 4, 5)),
                                    ((2, 1, 3, 4), (3, 4, 2)), ((4,), (4, 3)), ((3, 4), (4,))])
def test_matmul(shapes):
    gradcheck(ops.matmul, randn(*shapes[0]), randn(*shapes[1]))


def test_linear():
    gradcheck(ops.linear, randn(2, 3, 4), randn(4, 5), randn(5))
    gradcheck(ops.linear, randn(3, 4), randn(4, 5))
    gradcheck(lambda x, w: ops.linear(x, w, transposed=True), randn(2, 3, 4), randn(5, 4))  # x Wᵀ: the tied head


def test_softmax():
    gradcheck(lambda t: ops.softmax(t, -1), randn(3, 5))
    gradcheck(lambda t: ops.softmax(t, 0), randn(3, 5))


def test_layer_norm():
    gradcheck(lambda x, w, b: ops.layer_norm(x, w, b, 1e-5), randn(2, 3, 6), randn(6), randn(6))


def test_gelu():
    gradcheck(ops.gelu, randn(4, 7) * 2)


def test_gelu_matches_tanh_formula():
    x = np.linspace(-5, 5, 101)
    expected = 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))
    np.testing.assert_allclose(ops.gelu(Tensor(x)).data, expected, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gelu_block_by_block_gives_the_whole_arrays_bits(monkeypatch, dtype):
    """GELU runs its passes block by block (backend.cache_blocks): the same bits as one pass over everything,
    for a size that is no multiple of the block, and for a non-contiguous input (which takes the whole-array path)."""
    x = (randn(37, 61) * 3).astype(dtype)  # 2257 elements: 8 blocks of 256 and a tail of 209
    g = randn(37, 61).astype(dtype)

    def run(block, inp):
        monkeypatch.setattr(backend, "CACHE_BLOCK", block)
        t = Tensor(inp.copy() if inp.flags.c_contiguous else inp, requires_grad=True)
        y = ops.gelu(t)
        y.backward(g if inp.flags.c_contiguous else g.T.copy().T)
        return y.data, t.grad

    whole, blocked = run(10**9, x), run(256, x)
    assert all(np.array_equal(a, b) for a, b in zip(whole, blocked))
    strided = run(256, np.asfortranarray(x))
    assert all(np.array_equal(a, b) for a, b in zip(whole, strided))


def test_embedding():
    idx = np.array([[0, 3, 3], [1, 0, 4]])
    gradcheck(lambda w: ops.embedding(idx, w), randn(5, 4))


@pytest.mark.parametrize("tokens", ["random", "one", "none"])
def test_embedding_gradient_is_add_at_bit_for_bit(tokens):
    """dW[v] = Σ_{i: idx[i] = v} g[i], summed in input order: the same bits as numpy's add.at (an independent
    oracle), signed zeros included, with repeated and unused tokens, one token everywhere, and no tokens."""
    rng = np.random.default_rng(0)
    vocab, width = 37, 5
    idx = {"random": rng.integers(0, vocab, (4, 64)), "one": np.full(300, 7), "none": np.zeros((0,), int)}[tokens]
    g = rng.standard_normal((*idx.shape, width))
    g[g < -1.5] = -0.0
    ctx = Context()
    ops.Embedding.forward(ctx, idx, np.zeros((vocab, width)))
    _, gw = ops.Embedding.backward(ctx, g)
    expected = np.zeros((vocab, width))
    np.add.at(expected, idx.reshape(-1), g.reshape(-1, width))
    assert gw.dtype == np.float64 and np.array_equal(gw, expected) and np.array_equal(np.signbit(gw), np.signbit(expected))
    rows = Tensor(np.zeros((vocab, width)), requires_grad=True)  # indexing whole rows scatters the same way
    rows[idx - vocab * (idx % 2)].backward(g)  # odd tokens as negative indices
    assert np.array_equal(rows.grad, expected) and np.array_equal(np.signbit(rows.grad), np.signbit(expected))


@pytest.mark.parametrize("trailing", [(), (3,)])
def test_tuple_index_gradient_is_add_at_bit_for_bit(trailing):
    """a[rows, cols] with integer arrays (the MoE gates probs[rows, chosen], broadcast (N, 1) against (N, k)):
    the backward adds g where a pair repeats, in input order — add.at's bits (the independent oracle), signed zeros,
    negative indices, and trailing axes picked whole."""
    rng = np.random.default_rng(1)
    shape = (6, 5, *trailing)
    rows = rng.integers(-6, 6, (40, 1))
    cols = rng.integers(0, 5, (40, 3))
    g = rng.standard_normal((40, 3, *trailing))
    g[g < -1.5] = -0.0
    a = Tensor(np.zeros(shape), requires_grad=True)
    a[rows, cols].backward(g)
    expected = np.zeros(shape)
    np.add.at(expected, (rows, cols), g)
    assert np.array_equal(a.grad, expected) and np.array_equal(np.signbit(a.grad), np.signbit(expected))


@pytest.mark.parametrize("ignore", [False, True])
def test_cross_entropy(ignore):
    targets = np.array([[1, 0, 3], [2, 2, 4]])
    if ignore:
        targets[0, 1] = -100
    gradcheck(lambda z: ops.cross_entropy(z, targets), randn(2, 3, 5))


def test_cross_entropy_value():
    z = randn(6, 7)
    t = rng.integers(0, 7, 6)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    loss = ops.cross_entropy(Tensor(z), t)
    np.testing.assert_allclose(loss.item(), -logp[np.arange(6), t].mean(), rtol=1e-13)


@pytest.mark.parametrize("B,T,H,D", [(1, 1, 1, 2), (2, 5, 2, 3), (1, 7, 3, 2)])
def test_causal_attention(B, T, H, D):
    gradcheck(lambda qkv: ops.causal_self_attention(qkv, H), randn(B, T, 3 * H * D))


def test_causal_attention_matches_reference():
    B, T, H, D = 2, 6, 2, 4
    qkv = randn(B, T, 3 * H * D)
    q, k, v = (qkv[..., i * H * D:(i + 1) * H * D].reshape(B, T, H, D).transpose(0, 2, 1, 3) for i in range(3))
    s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(D)
    s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    expected = (p @ v).transpose(0, 2, 1, 3).reshape(B, T, H * D)
    out = ops.causal_self_attention(Tensor(qkv), H)
    np.testing.assert_allclose(out.data, expected, rtol=1e-12)
