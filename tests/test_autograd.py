"""The engine itself: topological order, accumulation, hooks, no_grad, dtype preservation, aliasing."""
import numpy as np
import pytest

from minipar import Tensor, no_grad, ops
from minipar.autograd import Function


def test_shared_subexpression_accumulates():
    x = Tensor(np.array([2.0, 3.0]), requires_grad=True)
    y = x * x            # used twice below
    z = (y + y * x).sum()  # z = Σ x² + x³  ->  dz/dx = 2x + 3x²
    z.backward()
    np.testing.assert_allclose(x.grad, 2 * x.data + 3 * x.data**2)


def test_grad_accumulates_across_backward_calls_and_zero_grad():
    x = Tensor(np.ones(3), requires_grad=True)
    (x * 2.0).sum().backward()
    (x * 3.0).sum().backward()
    np.testing.assert_allclose(x.grad, 5.0)
    x.zero_grad()
    assert x.grad is None


def test_hook_fires_once_when_gradient_is_final():
    w = Tensor(np.ones((2, 2)), requires_grad=True)
    fired = []
    w.register_hook(lambda t: fired.append(t.grad.copy()))
    x = Tensor(np.arange(4.0).reshape(2, 2))
    out = (x @ w) @ w + x @ w  # w used three times: the hook must see the total
    out.sum().backward()
    assert len(fired) == 1
    np.testing.assert_allclose(fired[0], w.grad)


def test_hooks_fire_in_reverse_layer_order():
    ws = [Tensor(np.eye(3), requires_grad=True) for _ in range(4)]
    order = []
    for i, w in enumerate(ws):
        w.register_hook(lambda t, i=i: order.append(i))
    h = Tensor(np.ones((2, 3)))
    for w in ws:
        h = ops.tanh(h @ w)
    h.sum().backward()
    assert order == [3, 2, 1, 0]  # last layer's gradient is final first: that is what lets DDP overlap


def test_leaf_grads_do_not_alias():
    a = Tensor(np.ones(3), requires_grad=True)
    b = Tensor(np.ones(3), requires_grad=True)
    (a + b).sum().backward()   # Add hands the same gradient array to both inputs
    a.grad *= 10.0             # an optimizer scaling one gradient in place
    np.testing.assert_allclose(b.grad, 1.0)


def test_no_grad_records_nothing():
    x = Tensor(np.ones(2), requires_grad=True)
    with no_grad():
        y = x * 2.0
    assert not y.requires_grad and y.is_leaf


def test_float32_stays_float32():
    x = Tensor(np.ones((2, 3), np.float32), requires_grad=True)
    w = Tensor(np.ones((3, 4), np.float32), requires_grad=True)
    y = ops.gelu(ops.layer_norm(x @ w * 0.5 + 1.0, Tensor(np.ones(4, np.float32)), Tensor(np.zeros(4, np.float32))))
    loss = ops.cross_entropy(y, np.array([0, 1]))
    assert y.dtype == np.float32 and loss.dtype == np.float32
    loss.backward()
    assert x.grad.dtype == np.float32 and w.grad.dtype == np.float32


def test_16_bit_inputs_compute_in_float32_and_store_in_16_bits():
    """Autocast: an op with a float16 input computes on float32 copies (integer inputs, indices, stay as they are)
    and stores its output in float16; a scalar (a loss) stays float32; the gradients come back in float16."""
    rng = np.random.default_rng(0)
    table = rng.standard_normal((5, 3)).astype(np.float16)
    rows = np.array([4, 0, 4])
    x = Tensor(table, requires_grad=True)
    y = x[rows] * x[rows]
    assert y.dtype == np.float16
    np.testing.assert_array_equal(y.data, (table[rows].astype(np.float32) ** 2).astype(np.float16))
    loss = y.sum()
    assert loss.dtype == np.float32 and loss.data.ndim == 0
    loss.backward()
    assert x.grad.dtype == np.float16
    expected = np.zeros((5, 3), np.float32)
    np.add.at(expected, rows, 2 * table[rows].astype(np.float32))
    np.testing.assert_array_equal(x.grad, expected.astype(np.float16))


def test_reshape_takes_the_shape_as_arguments_or_one_sequence():
    x = Tensor(np.arange(6.0), requires_grad=True)
    for shape in ((2, 3), ((2, 3),), ([2, 3],), (-1,), ((6,),)):
        np.testing.assert_array_equal(x.reshape(*shape).data, np.arange(6.0).reshape(*shape))


def test_backward_needs_scalar_or_gradient():
    x = Tensor(np.ones(3), requires_grad=True)
    with pytest.raises(RuntimeError, match="scalar"):
        (x * 2.0).backward()
    (x * 2.0).backward(np.array([1.0, 0.0, 2.0]))
    np.testing.assert_allclose(x.grad, [2.0, 0.0, 4.0])


def test_custom_function_and_needs_input_grad():
    class Square(Function):
        @staticmethod
        def forward(ctx, a, b):
            ctx.save_for_backward(a)
            return a * a + b

        @staticmethod
        def backward(ctx, g):
            assert ctx.needs_input_grad == (True, False)
            return 2 * ctx.saved[0] * g, None

    x = Tensor(np.array([3.0]), requires_grad=True)
    Square.apply(x, Tensor(np.array([1.0]))).sum().backward()
    np.testing.assert_allclose(x.grad, [6.0])


def test_graph_is_freed_after_backward():
    x = Tensor(np.ones(2), requires_grad=True)
    y = (x * 2.0).sum()
    y.backward()
    assert y._ctx is None


def test_split_backward_defers_only_the_weights():
    """backward(defer=weights) computes the input's gradient (B); run() adds the weights' (W), each once, with
    their hooks firing there — also through ops that ignore needs_input_grad (Add returns both gradients): with
    the weight as the first input or the second, and beside a constant, which gets no gradient in either half."""
    rng = np.random.default_rng(0)
    values = [rng.standard_normal(s) for s in ((3, 4), (4, 5), (5,))]
    results = []
    for split in (False, True):
        x, w, b = (Tensor(v, requires_grad=True) for v in values)
        constant = Tensor(rng.standard_normal(5))
        fired = []
        for name, t in (("w", w), ("b", b)):
            t.register_hook(lambda t, name=name: fired.append(name))
        # w used twice; b through Add, first (with x's path second) and second; b + constant: all of it waits for W
        y = (ops.tanh(b + ops.linear(x, w)) * (x @ w + b)).sum() + (b + constant).sum()
        deferred = y.backward(defer={id(w), id(b)} if split else None)
        if split:
            assert x.grad is not None and w.grad is None and b.grad is None and not fired
            deferred.run()
        assert sorted(fired) == ["b", "w"] and constant.grad is None
        results.append((x.grad, w.grad, b.grad))
    for plain, split in zip(*results):
        np.testing.assert_allclose(split, plain, rtol=1e-12)
