"""Triton kernels on numpy arrays through the interpreter (TRITON_INTERPRET=1, see conftest.py),
against numpy: matmul, flash attention forward and backward, and the GPT step through them."""
import numpy as np
import pytest

from minipar.kernels.adapter import InterpretedArray, interpreting
from minipar.kernels.flash_attention import attention_backward, attention_forward
from minipar.kernels.matmul import matmul
from minipar import backend, ops
from minipar.autograd import Tensor
from minipar.models.gpt import GPT, GPTConfig

rng = np.random.default_rng(0)


def test_runs_in_the_interpreter():
    assert interpreting()
    a = InterpretedArray(np.zeros((3, 4), np.float32)[:, ::2])
    assert a.untyped_storage() is a and a.cpu() is a and a.size() == (3, 2) and a.stride() == (4, 2)


@pytest.mark.parametrize("shape", [(1, 1, 1), (37, 29, 45), (64, 64, 64), (5, 70, 3), (80, 16, 80)])
# float32: K ≤ 80 products accumulated in float32 (u = 6e-8, ~K·u relative); float16 inputs round to u = 4.9e-4
# and the output again to float16, a few u
@pytest.mark.parametrize("dtype,tol", [(np.float32, 1e-5), (np.float16, 2e-2)])
def test_matmul(shape, dtype, tol):
    M, K, N = shape
    a, b = rng.standard_normal((M, K)).astype(dtype), rng.standard_normal((K, N)).astype(dtype)
    c = matmul(a, b)
    assert c.dtype == dtype and c.shape == (M, N)
    reference = a.astype(np.float64) @ b.astype(np.float64)
    np.testing.assert_allclose(c.astype(np.float64), reference, rtol=tol, atol=tol * np.sqrt(K))


@pytest.mark.parametrize("group_m", [1, 2, 3])
def test_matmul_grouped_order_and_transposed_views(group_m):
    a, w = rng.standard_normal((80, 24)).astype(np.float32), rng.standard_normal((72, 24)).astype(np.float32)
    config = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": group_m}  # 5 × 5 tiles, uneven groups
    np.testing.assert_allclose(matmul(a, w.T, config=config), a @ w.T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(matmul(a.T, a, config=config), a.T @ a, rtol=1e-5, atol=1e-4)


def test_matmul_rejects_bad_input():
    with pytest.raises(ValueError, match="matmul needs"):
        matmul(np.ones((2, 3), np.float32), np.ones((2, 3), np.float32))
    with pytest.raises(TypeError, match="float64"):
        matmul(np.ones((2, 2)), np.ones((2, 2)))


def reference_attention(q, k, v, do):
    """Causal attention and its gradients, longhand in float64."""
    T, D = q.shape[2], q.shape[3]
    s = q @ k.swapaxes(-1, -2) / np.sqrt(D)
    s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    dp = do @ v.swapaxes(-1, -2)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True)) / np.sqrt(D)
    return p @ v, ds @ k, ds.swapaxes(-1, -2) @ q, p.swapaxes(-1, -2) @ do


@pytest.mark.parametrize("B,H,T,D", [(1, 2, 37, 32), (2, 1, 16, 8), (1, 1, 50, 48), (1, 1, 33, 64), (1, 1, 20, 128),
                                     (1, 1, 1, 32)])
def test_flash_attention_forward_and_backward(B, H, T, D):
    qkv = rng.standard_normal((B, T, 3, H, D)).astype(np.float32)
    q, k, v = qkv.transpose(2, 0, 3, 1, 4)  # strided views, as minipar passes them
    out = np.empty((B, T, H, D), np.float32)
    lse = attention_forward(q, k, v, out.transpose(0, 2, 1, 3))
    grad = rng.standard_normal((B, T, H, D)).astype(np.float32)
    dqkv = np.empty_like(qkv)
    attention_backward(q, k, v, out.transpose(0, 2, 1, 3), lse, grad.transpose(0, 2, 1, 3), *dqkv.transpose(2, 0, 3, 1, 4))
    expected = reference_attention(*(a.astype(np.float64) for a in (q, k, v, grad.transpose(0, 2, 1, 3))))
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out.transpose(0, 2, 1, 3), *dqkv.transpose(2, 0, 3, 1, 4)), expected):
        # float32 against float64: sums of up to T·D = 6,400 float32 products and the online softmax's rescaling
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=name)


def test_flash_attention_half_precision_forward():
    q, k, v = (rng.standard_normal((1, 2, 40, 32)).astype(np.float16) for _ in range(3))
    out = np.empty_like(q)
    attention_forward(q, k, v, out)
    expected = reference_attention(*(a.astype(np.float64) for a in (q, k, v, q)))[0]
    np.testing.assert_allclose(out.astype(np.float64), expected, atol=1e-2)  # float16 output: u = 4.9e-4 × |out| ≤ 4


def test_flash_attention_rejects_float64():
    q = np.ones((1, 1, 4, 8))
    with pytest.raises(TypeError, match="reference path"):
        attention_forward(q, q, q, np.empty_like(q))


@pytest.fixture
def triton_kernels():
    backend.set_kernels("triton")
    yield
    backend.set_kernels("auto")


@pytest.mark.slow  # the fast subset keeps under 3 minutes; the module has faster tests
def test_gpt_step_through_the_kernels_matches_the_reference(triton_kernels):
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, dtype="float32")
    idx, targets = rng.integers(0, 64, (2, 16)), rng.integers(0, 64, (2, 16))
    results = {}
    for mode in ("triton", "reference"):
        backend.set_kernels(mode)
        model = GPT(cfg, seed=0)
        logits, loss = model(idx, targets)
        loss.backward()
        results[mode] = (logits.data, loss.item(), {n: p.grad for n, p in model.named_parameters()})
    (l1, loss1, g1), (l2, loss2, g2) = results["triton"], results["reference"]
    # two float32 computations in different summation orders (tiles vs BLAS): differences of a few u = 6e-8 per
    # op, amplified through 2 blocks forward and backward; gradients near zero get the absolute bound
    np.testing.assert_allclose(l1, l2, rtol=1e-4, atol=1e-5)
    assert loss1 == pytest.approx(loss2, rel=1e-5)
    for name in g2:
        np.testing.assert_allclose(g1[name], g2[name], rtol=1e-3, atol=1e-5, err_msg=name)


def test_attention_op_dispatch(triton_kernels):
    """The autograd op takes the kernel for float32 and the reference for float64, in one mode."""
    x32 = Tensor(rng.standard_normal((1, 5, 24)).astype(np.float32), requires_grad=True)
    x64 = Tensor(x32.data.astype(np.float64), requires_grad=True)
    y32, y64 = ops.causal_self_attention(x32, 2), ops.causal_self_attention(x64, 2)
    assert y32._ctx.flash and not y64._ctx.flash
    np.testing.assert_allclose(y32.data, y64.data, rtol=1e-5, atol=1e-6)  # float32 kernel vs float64 reference
    assert not backend.use_triton("float64")
    backend.set_kernels("reference")
    assert not backend.use_triton("float32")
    backend.set_kernels("auto")
    assert not backend.use_triton("float32")  # auto: Triton only on the GPU
    with pytest.raises(ValueError, match="unknown kernel mode"):
        backend.set_kernels("fast")


def test_every_gpu_tile_config_is_one_triton_compiles():
    """The GPU autotuner's configs (not run here: no GPU) obey Triton's rules: power-of-two tiles (tl.arange and
    tl.dot need them, K-tiles of at least 16) and warps, and at least one pipeline stage."""
    from minipar.kernels.matmul import GPU_CONFIGS

    power_of_two = lambda x: x > 0 and x & (x - 1) == 0  # noqa: E731
    for config in GPU_CONFIGS:
        tiles = [config.kwargs[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K")]
        assert all(map(power_of_two, tiles)) and config.kwargs["BLOCK_K"] >= 16, config
        assert power_of_two(config.num_warps) and config.num_stages >= 1, config
