"""Differentiable operations: each a :class:`~minipar.autograd.Function` with its math in the docstring.

Elementwise ops broadcast like numpy; their backward sums the gradient over broadcast axes
(:func:`unbroadcast`). The hot GPT ops are fused: one Function computes a whole layer norm,
GELU, attention or cross-entropy, and its backward is the closed-form derivative, written with
in-place updates to avoid temporaries. Ops that take parameters (linear, layer norm, matmul) read
them in backward with ``ctx.input(i)`` instead of saving them, so sharded data parallelism may
release and re-gather parameter storage in between. Every op is checked against finite
differences in float64 (tests/test_ops.py).
"""
from __future__ import annotations

import itertools
import math
from typing import Any, Sequence

from minipar.autograd import Context, Function, Tensor, no_grad
from minipar.backend import cache_blocks, use_triton, xp

# ------------------------------------------------------------------------------------------ helpers


def unbroadcast(grad: Any, shape: tuple[int, ...]) -> Any:
    """Sum ``grad`` down to ``shape``: the adjoint of numpy broadcasting."""
    if grad.shape == shape:
        return grad
    extra = grad.ndim - len(shape)
    axes = tuple(range(extra)) + tuple(extra + i for i, n in enumerate(shape) if n == 1 and grad.shape[extra + i] != 1)
    return grad.sum(axis=axes).reshape(shape)


def _row_sums(x: Any, scale: float = 1.0) -> Any:
    """scale · Σ over the last axis, shape ``x.shape[:-1]``, as the matrix-vector product x·(scale, …, scale):
    BLAS reads each row once at full speed, where numpy's reduction over short rows is 3-5× slower."""
    return x @ xp.full(x.shape[-1], scale, dtype=x.dtype)


def _row_dots(a: Any, b: Any) -> Any:
    """Σ_j a_ij b_ij per row of two matrices, reading both once and writing no product array (einsum)."""
    return xp.einsum("ij,ij->i", a, b)


def _column_sums(rows: Any) -> Any:
    """Σ over the rows of a matrix (a bias's or a norm's gradient), as the product (1, …, 1)·rows."""
    return xp.ones(len(rows), dtype=rows.dtype) @ rows


def _shape(x: Any) -> tuple[int, ...]:
    return getattr(x, "shape", ())


def _matmul2d(a: Any, b: Any) -> Any:
    """a @ b for matrices: the Triton kernel when the backend says so (kernels/matmul.py), else BLAS."""
    if use_triton(a.dtype):
        from minipar.kernels.matmul import matmul

        return matmul(a, b)
    return a @ b


# ------------------------------------------------------------------------------------- elementwise


class Add(Function):
    """z = a + b;  dz/da = dz/db = 1."""

    @staticmethod
    def forward(ctx: Context, a: Any, b: Any) -> Any:
        ctx.shapes = _shape(a), _shape(b)
        return a + b

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        sa, sb = ctx.shapes
        return unbroadcast(g, sa), unbroadcast(g, sb)


class Sub(Function):
    """z = a - b."""

    @staticmethod
    def forward(ctx: Context, a: Any, b: Any) -> Any:
        ctx.shapes = _shape(a), _shape(b)
        return a - b

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        sa, sb = ctx.shapes
        return unbroadcast(g, sa), unbroadcast(-g, sb) if ctx.needs_input_grad[1] else None


class Mul(Function):
    """z = a * b;  dz/da = b, dz/db = a."""

    @staticmethod
    def forward(ctx: Context, a: Any, b: Any) -> Any:
        ctx.save_for_backward(a, b)
        return a * b

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        a, b = ctx.saved
        ga = unbroadcast(g * b, _shape(a)) if ctx.needs_input_grad[0] else None
        gb = unbroadcast(g * a, _shape(b)) if ctx.needs_input_grad[1] else None
        return ga, gb


class Div(Function):
    """z = a / b;  dz/da = 1/b, dz/db = -a/b²."""

    @staticmethod
    def forward(ctx: Context, a: Any, b: Any) -> Any:
        ctx.save_for_backward(a, b)
        return a / b

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        a, b = ctx.saved
        ga = unbroadcast(g / b, _shape(a)) if ctx.needs_input_grad[0] else None
        gb = unbroadcast(-g * a / (b * b), _shape(b)) if ctx.needs_input_grad[1] else None
        return ga, gb


class Neg(Function):
    @staticmethod
    def forward(ctx: Context, a: Any) -> Any:
        return -a

    @staticmethod
    def backward(ctx: Context, g: Any) -> Any:
        return -g


class Pow(Function):
    """z = aᵖ for a constant p;  dz/da = p·aᵖ⁻¹."""

    @staticmethod
    def forward(ctx: Context, a: Any, p: float) -> Any:
        ctx.save_for_backward(a)
        ctx.p = p
        return a**p

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        (a,) = ctx.saved
        return g * ctx.p * a ** (ctx.p - 1), None


class Exp(Function):
    @staticmethod
    def forward(ctx: Context, a: Any) -> Any:
        out = xp.exp(a)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx: Context, g: Any) -> Any:
        return g * ctx.saved[0]


class Log(Function):
    @staticmethod
    def forward(ctx: Context, a: Any) -> Any:
        ctx.save_for_backward(a)
        return xp.log(a)

    @staticmethod
    def backward(ctx: Context, g: Any) -> Any:
        return g / ctx.saved[0]


class Tanh(Function):
    """z = tanh(a);  dz/da = 1 - z²."""

    @staticmethod
    def forward(ctx: Context, a: Any) -> Any:
        out = xp.tanh(a)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx: Context, g: Any) -> Any:
        (z,) = ctx.saved
        return g * (1.0 - z * z)


# -------------------------------------------------------------------------------------- reductions


def _normalize_axes(axis: Any, ndim: int) -> tuple[int, ...]:
    if axis is None:
        return tuple(range(ndim))
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    return tuple(a % ndim for a in axes)


class Sum(Function):
    """z = Σ_axis a;  the gradient is broadcast back along the summed axes."""

    @staticmethod
    def forward(ctx: Context, a: Any, axis: Any = None, keepdims: bool = False) -> Any:
        ctx.shape, ctx.axes = a.shape, _normalize_axes(axis, a.ndim)
        return a.sum(axis=ctx.axes, keepdims=keepdims)

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        kept = [1 if i in ctx.axes else n for i, n in enumerate(ctx.shape)]
        return xp.broadcast_to(g.reshape(kept), ctx.shape), None, None


# ------------------------------------------------------------------------------------------- shape


class Reshape(Function):
    autocast = False  # moves data: no arithmetic to do in float32

    @staticmethod
    def forward(ctx: Context, a: Any, shape: tuple[int, ...]) -> Any:
        ctx.shape = a.shape
        return a.reshape(shape)

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        return g.reshape(ctx.shape), None


class Transpose(Function):
    """Permute axes (reverse them when ``axes`` is None); the backward applies the inverse permutation."""

    autocast = False  # moves data: no arithmetic to do in float32

    @staticmethod
    def forward(ctx: Context, a: Any, axes: Sequence[int] | None = None) -> Any:
        axes = tuple(reversed(range(a.ndim))) if axes is None else tuple(a_ % a.ndim for a_ in axes)
        ctx.inverse = tuple(sorted(range(len(axes)), key=axes.__getitem__))
        return a.transpose(axes)

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        return g.transpose(ctx.inverse), None


def _is_basic_index(index: Any) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return all(isinstance(i, (int, slice)) or i is None or i is Ellipsis for i in items)


class GetItem(Function):
    """z = a[index]; the backward scatters g into zeros (adding where an integer index repeats, in input order).

    An integer array picks whole rows, and a tuple of integer arrays (``probs[rows, chosen]``, the MoE gates) the
    rows of the leading axes, numbered row-major into one flat index. Rows of several elements go through
    :func:`_scatter_add_rows` (an embedding's gradient: 19× numpy 2.4's ``add.at`` at 1024 rows of 768); rows of one
    element through ``add.at`` on the flat 1-D arrays, numpy's fast path (the whole backward 2× faster than
    ``add.at`` with the tuple index, 4× than the grouped rows, which sort twice: 65536 tokens choosing 8 of 64
    experts, AMD EPYC, ``benchmarks/moe.py --gates``).
    Both add in input order: ``add.at``'s bits. Other advanced indexes use ``add.at`` as they are."""

    @staticmethod
    def forward(ctx: Context, a: Any, index: Any) -> Any:
        ctx.shape, ctx.dtype, ctx.index = a.shape, a.dtype, index
        return a[index]

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        grad = xp.zeros(ctx.shape, dtype=ctx.dtype)
        index = ctx.index
        if _is_basic_index(index):
            grad[index] = g
        elif _integer_arrays(index) and grad.size:  # whole rows of the leading axes, as an embedding's
            arrays = index if isinstance(index, tuple) else (index,)
            rows = 0
            for i, n in zip(arrays, ctx.shape):  # row-major over the indexed axes (broadcast; negatives wrap)
                rows = rows * n + i % n
            width = math.prod(ctx.shape[len(arrays):])
            if width == 1:
                xp.add.at(grad.reshape(-1), rows.reshape(-1), g.reshape(-1))
            else:
                _scatter_add_rows(grad.reshape(-1, width), rows.reshape(-1), g.reshape(-1, width))
        else:
            xp.add.at(grad, index, g)
        return grad, None


class Concat(Function):
    """z = [a₀, a₁, …] joined along ``axis``; the backward splits g at the same boundaries."""

    autocast = False  # moves data: no arithmetic to do in float32

    @staticmethod
    def forward(ctx: Context, *arrays: Any, axis: int = 0) -> Any:
        ctx.axis = axis
        ctx.bounds = [a.shape[axis] for a in arrays]
        return xp.concatenate(arrays, axis=axis)

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        cuts = list(itertools.accumulate(ctx.bounds))[:-1]
        return tuple(xp.split(g, cuts, axis=ctx.axis))


# ------------------------------------------------------------------------------------------ matmul


class MatMul(Function):
    """z = a @ b (batched, numpy broadcasting);  da = g @ bᵀ,  db = aᵀ @ g, summed over broadcast batch axes.

    When b is a matrix and a a stack, ``a`` is flattened to (N, K) so db is one GEMM, not a
    batch of GEMMs followed by a sum.
    """

    @staticmethod
    def forward(ctx: Context, a: Any, b: Any) -> Any:
        return a @ b

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        a, b = ctx.input(0), ctx.input(1)
        # numpy treats a 1-D a as a row (1, K) and a 1-D b as a column (K, 1); do the same, then drop the axis again
        a2, b2 = (a[None, :] if a.ndim == 1 else a), (b[:, None] if b.ndim == 1 else b)
        g2 = xp.expand_dims(g, -2) if a.ndim == 1 else g
        g2 = xp.expand_dims(g2, -1) if b.ndim == 1 else g2
        ga = gb = None
        if ctx.needs_input_grad[0]:
            ga = unbroadcast(g2 @ xp.swapaxes(b2, -1, -2), a2.shape).reshape(a.shape)
        if ctx.needs_input_grad[1]:
            if b2.ndim == 2:
                gb = a2.reshape(-1, a2.shape[-1]).T @ g2.reshape(-1, g2.shape[-1])
            else:
                gb = unbroadcast(xp.swapaxes(a2, -1, -2) @ g2, b2.shape)
            gb = gb.reshape(b.shape)
        return ga, gb


class Linear(Function):
    """y = x W + b with W of shape (in, out) (GPT-2's Conv1D layout), or y = x Wᵀ + b when
    ``transposed`` (W of shape (out, in): the tied LM head reusing the (vocab, C) embedding).

    Backward, with x flattened to (N, in) and W in (in, out) form:  dx = g Wᵀ,  dW = xᵀ g,
    db = Σ_rows g. Costs 2·N·in·out FLOPs forward and twice that backward.
    """

    @staticmethod
    def forward(ctx: Context, x: Any, w: Any, b: Any = None, transposed: bool = False) -> Any:
        ctx.transposed, ctx.has_bias = transposed, b is not None
        out = _matmul2d(x.reshape(-1, x.shape[-1]), w.T if transposed else w)
        if b is not None:
            out += b
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        x, w = ctx.input(0), ctx.input(1)
        w_in_out = w.T if ctx.transposed else w
        g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
        gx = _matmul2d(g2, w_in_out.T).reshape(x.shape) if ctx.needs_input_grad[0] else None
        gw = None
        if ctx.needs_input_grad[1]:
            gw = _matmul2d(g2.T, x2) if ctx.transposed else _matmul2d(x2.T, g2)
        gb = _column_sums(g2) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb, None


# ------------------------------------------------------------------------------ fused network ops


class Softmax(Function):
    """y = exp(x - max x) / Σ exp(x - max x);  dx = y ⊙ (g - Σ g⊙y)."""

    @staticmethod
    def forward(ctx: Context, x: Any, axis: int = -1) -> Any:
        y = _softmax(x, axis)
        ctx.save_for_backward(y)
        ctx.axis = axis
        return y

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        (y,) = ctx.saved
        return _softmax_backward(y, g, ctx.axis), None


def _softmax(x: Any, axis: int, out: Any = None) -> Any:
    """softmax along ``axis`` into ``out`` (a new array by default; may be x itself). fmax ignores NaN and is
    faster than max; a NaN in a row still makes the whole row NaN, through exp and the sum."""
    y = xp.subtract(x, xp.fmax.reduce(x, axis=axis, keepdims=True), out=out)
    xp.exp(y, out=y)
    y /= _sums_along(y, axis)
    return y


def _softmax_backward(y: Any, g: Any, axis: int, out: Any = None) -> Any:
    """dx = y ⊙ (g − Σ g⊙y) along ``axis``, into ``out`` (a new array by default; may be g itself)."""
    dx = xp.subtract(g, _sums_along(g * y, axis), out=out)
    dx *= y
    return dx


def _sums_along(x: Any, axis: int) -> Any:
    """Σ over ``axis``, kept as an axis of size 1 (matrix-vector products when it is the last axis)."""
    if axis % x.ndim == x.ndim - 1:
        return _row_sums(x)[..., None]
    return x.sum(axis=axis, keepdims=True)


class LayerNorm(Function):
    """y = x̂ ⊙ w + b,  x̂ = (x - μ) / σ,  μ, σ² = mean, variance over the last axis, σ = √(σ² + ε).

    Backward (N = last-axis size, ĝ = g ⊙ w):
        dx = (1/σ) (ĝ - mean(ĝ) - x̂ ⊙ mean(ĝ ⊙ x̂)),   dw = Σ_rows g ⊙ x̂,   db = Σ_rows g.

    The reductions only read: sums of products are einsums (Σ_j x̂² per row, Σ_i g ⊙ x̂ per column,
    mean(ĝ ⊙ x̂) per row) and plain sums matrix-vector products, so no product array is written for them.
    """

    @staticmethod
    def forward(ctx: Context, x: Any, w: Any, b: Any, eps: float = 1e-5) -> Any:
        n = x.shape[-1]
        rows = x.reshape(-1, n)
        xhat = rows - _row_sums(rows, 1.0 / n)[:, None]
        rstd = _row_dots(xhat, xhat)
        rstd *= 1.0 / n
        rstd += eps
        xp.sqrt(rstd, out=rstd)
        xp.reciprocal(rstd, out=rstd)
        xhat *= rstd[:, None]
        ctx.save_for_backward(xhat, rstd)
        y = xhat * w
        y += b
        return y.reshape(x.shape)

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        (xhat, rstd), w = ctx.saved, ctx.input(1)
        n = xhat.shape[-1]
        g2 = g.reshape(-1, n)
        gw = xp.einsum("ij,ij->j", g2, xhat) if ctx.needs_input_grad[1] else None
        gb = _column_sums(g2) if ctx.needs_input_grad[2] else None
        gx = None
        if ctx.needs_input_grad[0]:
            ghat = g2 * w
            mean_ghat_xhat = _row_dots(ghat, xhat)
            mean_ghat_xhat *= 1.0 / n
            gx = xhat * mean_ghat_xhat[:, None]
            gx += _row_sums(ghat, 1.0 / n)[:, None]
            xp.subtract(ghat, gx, out=gx)
            gx *= rstd[:, None]
            gx = gx.reshape(g.shape)
        return gx, gw, gb, None


_GELU_C = math.sqrt(2.0 / math.pi)
_GELU_A = 0.044715


class GELU(Function):
    """GELU, tanh approximation (GPT-2's ``gelu_new``):  y = ½ x (1 + t),  t = tanh(x (c + a·c x²)).

    dy/dx = ½ (1 + t) + ½ x (1 - t²) c (1 + 3a x²) = (1 + t) (½ + (1 - t) x (½c + (3/2)a·c x²)),
    with c = √(2/π), a = 0.044715. Forward saves t, so backward needs no tanh.
    """

    @staticmethod
    def forward(ctx: Context, x: Any) -> Any:
        t, y = xp.empty_like(x), xp.empty_like(x)
        for xb, tb, yb in cache_blocks(x, t, y):  # each block's eight passes stay in the cache
            xp.multiply(xb, xb, out=tb)
            tb *= _GELU_A * _GELU_C
            tb += _GELU_C
            tb *= xb
            xp.tanh(tb, out=tb)
            xp.add(tb, 1.0, out=yb)
            yb *= xb
            yb *= 0.5
        ctx.save_for_backward(x, t)
        return y

    @staticmethod
    def backward(ctx: Context, g: Any) -> Any:
        x, t = ctx.saved
        slope = xp.empty_like(x)
        for xb, tb, gb, sb in cache_blocks(x, t, g, slope):
            xp.multiply(xb, xb, out=sb)
            sb *= 1.5 * _GELU_A * _GELU_C
            sb += 0.5 * _GELU_C
            sb *= xb
            scratch = xp.subtract(1.0, tb)
            sb *= scratch
            sb += 0.5
            xp.add(tb, 1.0, out=scratch)
            sb *= scratch
            sb *= gb
        return slope


class RMSNorm(Function):
    """y = x̂ ⊙ w,  x̂ = x / ρ,  ρ = √(mean(x²) + ε) over the last axis (Zhang & Sennrich 2019; Llama).

    Backward (N = last-axis size, ĝ = g ⊙ w):  dx = (1/ρ) (ĝ − x̂ ⊙ mean(ĝ ⊙ x̂)),  dw = Σ_rows g ⊙ x̂.
    """

    @staticmethod
    def forward(ctx: Context, x: Any, w: Any, eps: float = 1e-6) -> Any:
        n = x.shape[-1]
        rows = x.reshape(-1, n)
        rrms = _row_dots(rows, rows)
        rrms *= 1.0 / n
        rrms += eps
        xp.sqrt(rrms, out=rrms)
        xp.reciprocal(rrms, out=rrms)
        xhat = rows * rrms[:, None]
        ctx.save_for_backward(xhat, rrms)
        return (xhat * w).reshape(x.shape)

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        (xhat, rrms), w = ctx.saved, ctx.input(1)
        n = xhat.shape[-1]
        g2 = g.reshape(-1, n)
        gw = xp.einsum("ij,ij->j", g2, xhat) if ctx.needs_input_grad[1] else None
        gx = None
        if ctx.needs_input_grad[0]:
            ghat = g2 * w
            mean_ghat_xhat = _row_dots(ghat, xhat)
            mean_ghat_xhat *= 1.0 / n
            gx = xhat * mean_ghat_xhat[:, None]
            xp.subtract(ghat, gx, out=gx)
            gx *= rrms[:, None]
            gx = gx.reshape(g.shape)
        return gx, gw, None


class Sigmoid(Function):
    """y = σ(x) = 1 / (1 + e^{−x});  dx = g ⊙ y(1 − y)."""

    @staticmethod
    def forward(ctx: Context, x: Any) -> Any:
        y = xp.negative(x)
        xp.exp(y, out=y)
        y += 1.0
        xp.reciprocal(y, out=y)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx: Context, g: Any) -> Any:
        (y,) = ctx.saved
        return g * y * (1.0 - y)


class SwiGLU(Function):
    """y = silu(a) ⊙ b of the packed (…, 2I) input [a | b] (Shazeer 2020; Llama's MLP: a = x W_gate, b = x W_up),
    silu(a) = a·σ(a).  da = g ⊙ b ⊙ σ(a)(1 + a(1 − σ(a))),  db = g ⊙ silu(a)."""

    @staticmethod
    def forward(ctx: Context, h: Any) -> Any:
        a, b = xp.split(h, 2, axis=-1)
        sig = xp.negative(a)
        xp.exp(sig, out=sig)
        sig += 1.0
        xp.reciprocal(sig, out=sig)
        silu = a * sig
        ctx.save_for_backward(a, b, sig, silu)
        return silu * b

    @staticmethod
    def backward(ctx: Context, g: Any) -> Any:
        a, b, sig, silu = ctx.saved
        slope = 1.0 - sig  # σ(a)(1 + a(1 − σ(a)))
        slope *= a
        slope += 1.0
        slope *= sig
        slope *= b
        slope *= g
        return xp.concatenate([slope, g * silu], axis=-1)


def rope_tables(positions: Any, head_dim: int, theta: float, dtype: Any) -> tuple[Any, Any]:
    """(cos, sin), each (T, head_dim), of rotary position embeddings at ``positions`` (Su et al. 2021, in
    Hugging Face's half-split layout): frequency i of D/2 is θ^(−2i/D), and both halves of a head share them."""
    inv_freq = 1.0 / theta ** (xp.arange(0, head_dim, 2, dtype=xp.float64) / head_dim)
    angles = xp.asarray(positions, dtype=xp.float64)[:, None] * inv_freq[None, :]
    angles = xp.concatenate([angles, angles], axis=-1)
    return xp.cos(angles).astype(dtype), xp.sin(angles).astype(dtype)


class Rope(Function):
    """Rotary position embedding of x (B, T, heads, D): y = x ⊙ cos + rotate(x) ⊙ sin, rotate([x₁ | x₂]) =
    [−x₂ | x₁] (the two halves of each head are the rotated pairs). A rotation per pair, so its backward is the
    inverse rotation: dx = g ⊙ cos + rotateᵀ(g ⊙ sin), rotateᵀ([u₁ | u₂]) = [u₂ | −u₁]."""

    @staticmethod
    def forward(ctx: Context, x: Any, cos: Any, sin: Any) -> Any:
        ctx.tables = cos[:, None, :], sin[:, None, :]
        cos, sin = ctx.tables
        x1, x2 = xp.split(x, 2, axis=-1)
        return x * cos + xp.concatenate([-x2, x1], axis=-1) * sin

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        cos, sin = ctx.tables
        u1, u2 = xp.split(g * sin, 2, axis=-1)
        return g * cos + xp.concatenate([u2, -u1], axis=-1), None, None


class Embedding(Function):
    """y[i] = W[idx[i]];  dW[v] = Σ_{i: idx[i] = v} g[i]  (a scatter-add: :func:`_scatter_add_rows`)."""

    @staticmethod
    def forward(ctx: Context, idx: Any, w: Any) -> Any:
        ctx.save_for_backward(idx)
        ctx.shape, ctx.dtype = w.shape, w.dtype
        return w[idx]

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        (idx,) = ctx.saved
        gw = xp.zeros(ctx.shape, dtype=ctx.dtype)
        _scatter_add_rows(gw, idx.reshape(-1), g.reshape(-1, ctx.shape[1]))
        return None, gw


def _integer_arrays(index: Any) -> bool:
    """Whether ``index`` is an integer array or a tuple of them (advanced indexing of the leading axes only)."""
    arrays = index if isinstance(index, tuple) else (index,)
    return bool(arrays) and all(isinstance(i, xp.ndarray) and i.dtype.kind in "iu" for i in arrays)


def _scatter_add_rows(out: Any, index: Any, rows: Any) -> None:
    """out[index[i]] += rows[i] for every i, in order: the same bits as ``add.at(out, index, rows)``, 5× faster
    (1024 rows of 768 on an Intel Xeon, one thread: docs/speed.md).

    ``add.at`` makes one small add per row. Here the rows are grouped by occurrence instead: group k holds
    every index's k-th row (a stable sort by index, then a stable sort by occurrence), so the indices within
    a group are distinct and the group is one vectorized ``out[indices] += rows``. Groups run in order
    k = 0, 1, …, so each out[v] adds its rows in input order, exactly as ``add.at`` does. As many groups as
    the most frequent index has rows (one index everywhere: still 3–4× faster than ``add.at``).
    """
    if index.size == 0:
        return
    by_index = xp.argsort(index, kind="stable")
    sorted_index = index[by_index]
    first = xp.concatenate((xp.ones(1, bool), sorted_index[1:] != sorted_index[:-1]))  # where each index's rows begin
    occurrence = xp.arange(index.size) - xp.flatnonzero(first)[xp.cumsum(first) - 1]
    by_occurrence = xp.argsort(occurrence, kind="stable")
    targets, picked = sorted_index[by_occurrence], rows[by_index[by_occurrence]]
    bounds = [0, *xp.cumsum(xp.bincount(occurrence)).tolist()]
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        out[targets[lo:hi]] += picked[lo:hi]


class CrossEntropy(Function):
    """Mean negative log-likelihood of integer targets under softmax(logits) over the last axis.

    L = (1/N) Σᵢ (logsumexp(zᵢ) - zᵢ[tᵢ]);   dL/dzᵢ = (softmax(zᵢ) - onehot(tᵢ)) / N.
    Targets equal to ``ignore_index`` contribute nothing and are not counted in N.
    """

    @staticmethod
    def forward(ctx: Context, logits: Any, targets: Any, ignore_index: int = -100) -> Any:
        z = logits.reshape(-1, logits.shape[-1])
        t = targets.reshape(-1)
        keep = t != ignore_index
        rows, safe_t = xp.arange(len(t)), xp.where(keep, t, 0)
        zmax = xp.fmax.reduce(z, axis=-1)  # as in _softmax
        probs = z - zmax[:, None]
        xp.exp(probs, out=probs)
        total = _row_sums(probs)
        probs /= total[:, None]
        logsumexp = xp.log(total) + zmax
        count = xp.maximum(keep.sum(), 1)  # stays on the device: no host round-trip in the step
        loss = ((logsumexp - z[rows, safe_t]) * keep).sum() / count
        ctx.save_for_backward(probs, safe_t, keep, rows)
        ctx.shape, ctx.count = logits.shape, count
        return loss.astype(logits.dtype)

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        probs, safe_t, keep, rows = ctx.saved
        grad = probs  # consumed: the graph is freed after backward
        grad[rows, safe_t] -= 1.0
        grad *= (g / ctx.count) * keep[:, None].astype(grad.dtype)
        return grad.reshape(ctx.shape), None, None


class CausalSelfAttention(Function):
    """Multi-head causal attention on a fused (B, T, (H + 2K)·D) tensor [q | k | v]: H query heads, K key/value
    heads (K = H, or grouped-query attention: query head h reads K/V head h // (H/K)).

    Forward per head:  S = q kᵀ·s + M  (M = -∞ above the diagonal),  P = softmax(S),  y = P v,
                       with the score scale s = 1/√D unless given (GPT-2's scale_attn_* options).
    Backward:          dv = Pᵀ dy,  dP = dy vᵀ,  dS = P ⊙ (dP - Σ_row dP ⊙ P)·s,
                       dq = dS k,   dk = dSᵀ q,  a K/V head's gradient summed over the H/K queries it serves.
    Returns (B, T, H·D) with heads concatenated, as GPT-2 does. ``n_head`` (and ``kv_heads``, default n_head)
    are the heads present in ``qkv``: all of them, or the local share under tensor parallelism. When the backend
    routes it to Triton (``backend.use_triton``), kernels/flash_attention.py computes the same function block by
    block, saving only the log-sum-exp instead of P.
    """

    @staticmethod
    def forward(ctx: Context, qkv: Any, n_head: int, scale: float | None, recompute: bool = False,
                kv_heads: int | None = None) -> Any:
        B, T, width = qkv.shape
        H, K = n_head, kv_heads or n_head
        D = width // (H + 2 * K)
        heads = qkv.reshape(B, T, H + 2 * K, D).transpose(0, 2, 1, 3)  # (B, H + 2K, T, D) views
        q, k_kv, v_kv = heads[:, :H], heads[:, H:H + K], heads[:, H + K:]
        k, v = repeat_heads(k_kv, H), repeat_heads(v_kv, H)  # what is kept is the K heads (backward repeats them)
        ctx.scale = 1.0 / math.sqrt(D) if scale is None else scale
        ctx.flash, ctx.kv_heads = use_triton(qkv.dtype), K
        if ctx.flash:  # kernels/flash_attention.py: online softmax, never the (T, T) matrix
            from minipar.kernels.flash_attention import attention_forward

            out = xp.empty((B, T, H, D), dtype=qkv.dtype)
            lse = attention_forward(q, k, v, out.transpose(0, 2, 1, 3), ctx.scale)
            ctx.save_for_backward(q, k_kv, v_kv, out, lse)
            return out.reshape(B, T, H * D)
        p = _attention_probabilities(q, k, ctx.scale)
        y = p @ v
        ctx.save_for_backward(q, k_kv, v_kv, None if recompute else p)  # selective recomputation: P again in backward
        return y.transpose(0, 2, 1, 3).reshape(B, T, H * D)

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        q, k, v = ctx.saved[:3]
        B, H, T, D = q.shape
        K = ctx.kv_heads
        k, v = repeat_heads(k, H), repeat_heads(v, H)
        gy = xp.ascontiguousarray(g).reshape(B, T, H, D).transpose(0, 2, 1, 3)
        gqkv = xp.empty((B, T, H + 2 * K, D), dtype=g.dtype)
        gheads = gqkv.transpose(0, 2, 1, 3)  # (B, H + 2K, T, D) view
        gq = gheads[:, :H]
        gk, gv = (gheads[:, H:H + K], gheads[:, H + K:]) if K == H else (xp.empty_like(q), xp.empty_like(q))
        if ctx.flash:
            from minipar.kernels.flash_attention import attention_backward

            out, lse = ctx.saved[3:]
            attention_backward(q, k, v, out.transpose(0, 2, 1, 3), lse, gy, gq, gk, gv, ctx.scale)
        else:
            p = ctx.saved[3] if ctx.saved[3] is not None else _attention_probabilities(q, k, ctx.scale)
            xp.matmul(xp.swapaxes(p, -1, -2), gy, out=gv)
            dp = gy @ xp.swapaxes(v, -1, -2)
            ds = _softmax_backward(p, dp, axis=-1, out=dp)
            ds *= ctx.scale
            xp.matmul(ds, k, out=gq)
            xp.matmul(xp.swapaxes(ds, -1, -2), q, out=gk)
        if K != H:  # each K/V head's gradient: the sum over the query heads it serves
            gheads[:, H:H + K], gheads[:, H + K:] = fold_heads(gk, K), fold_heads(gv, K)
        return gqkv.reshape(B, T, (H + 2 * K) * D), None, None, None, None


def repeat_heads(a: Any, H: int) -> Any:
    """(B, K, T, D) -> (B, H, T, D): K/V head g for query heads g·H/K … (g+1)·H/K − 1 (transformers' repeat_kv)."""
    return a if a.shape[1] == H else xp.repeat(a, H // a.shape[1], axis=1)


def fold_heads(g: Any, K: int) -> Any:
    """The inverse's gradient: (B, H, T, D) -> (B, K, T, D), each K/V head's queries' gradients summed."""
    B, H, T, D = g.shape
    return g if H == K else g.reshape(B, K, H // K, T, D).sum(axis=2)


def _attention_probabilities(q: Any, k: Any, scale: float) -> Any:
    """P = softmax(q kᵀ·scale + causal mask) per head: (B, H, T, T)."""
    s = q @ xp.swapaxes(k, -1, -2)
    s *= scale
    s += _causal_mask(q.shape[-2], s.dtype)
    return _softmax(s, axis=-1, out=s)


class Recompute(Function):
    """Full activation recomputation (gradient checkpointing, Chen et al. 2016): ``y = fn(x)`` keeping only x.

    Forward runs ``fn`` without recording a graph, so none of its intermediate activations stay alive.
    Backward runs ``fn`` again from the saved x with gradients on and backpropagates the incoming dy
    through it: the parameters inside ``fn`` receive their gradients there, x's is returned. Costs one
    more forward of ``fn`` per backward; the result is the same arithmetic, so the same numbers. Under a
    split backward (ZB-H1, DualPipeV) the recomputed graph's weight gradients wait for W with the others
    (``Tensor.nested_backward``), so the recomputed activations they need live until W.

    A side scalar ``fn`` computes besides y (a MoE layer's balancing loss, read by ``side()``) would have no
    graph in the first forward: :func:`recomputed_side` makes it a node on y whose backward records the
    gradient the side scalar receives; the recomputed forward's own side scalar then gets it (ops.add_loss).
    """

    autocast = False  # runs fn on the input as it is: the recomputed forward is the original one

    @staticmethod
    def forward(ctx: Context, x: Any, fn: Any, side: Any = None) -> Any:
        ctx.run, ctx.side, ctx.side_grad = fn, side, None
        with no_grad():
            out = fn(Tensor(x))
        ctx.save_for_backward(x)
        return out.data

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        inp = Tensor(ctx.saved[0], requires_grad=True)
        _recomputing.append(True)
        try:
            out = ctx.run(inp)
        finally:
            _recomputing.pop()
        if ctx.side_grad is not None:  # the side scalar's gradient, recorded by RecomputedSide (it ran first)
            out = add_loss(out, ctx.side(), ctx.side_grad)
        out.nested_backward(g)  # under a split backward its weights wait for W with the rest
        return inp.grad, None, None


_recomputing: list[bool] = []  # non-empty while a Recompute runs its forward again


def recomputing() -> bool:
    """Whether the forward running now is a recomputation (layers that count what they did count it once)."""
    return bool(_recomputing)


class RecomputedSide(Function):
    """The side scalar of a recomputed ``y`` (its value from the first forward) as a node on y: in backward it
    hands nothing to y and records its gradient for y's Recompute, whose backward comes later (it made y)."""

    autocast = False

    @staticmethod
    def forward(ctx: Context, y: Any, recompute: Context, value: Any) -> Any:
        ctx.recompute = recompute
        return value

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        previous = ctx.recompute.side_grad
        ctx.recompute.side_grad = g if previous is None else previous + g
        return None, None, None


class AddLoss(Function):
    """``x`` unchanged, with a side loss hung on it: backward passes x's gradient through and hands the side
    loss the gradient ``weight`` (the d total/d loss it would get as a term of the final loss). A pipeline
    stage whose MoE layers' balancing loss is not on the stage that computes the loss attaches it to its
    output this way (Megatron's MoEAuxLossAutoScaler), so its router receives that gradient in backward."""

    autocast = False  # moves nothing: keeps x's dtype

    @staticmethod
    def forward(ctx: Context, x: Any, loss: Any, weight: float) -> Any:
        ctx.loss_like, ctx.weight_value = loss, weight
        return x

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        return g, xp.full_like(ctx.loss_like, ctx.weight_value), None


_masks: dict[tuple, Any] = {}


def _causal_mask(T: int, dtype: Any) -> Any:
    """(T, T) additive mask: 0 on and below the diagonal, -inf above (cached per size and dtype)."""
    key = (T, xp.dtype(dtype).str, xp.__name__)
    if key not in _masks:
        _masks[key] = xp.triu(xp.full((T, T), -xp.inf, dtype=dtype), k=1)
    return _masks[key]


# ------------------------------------------------------------------------------ functional API


def add(a, b) -> Tensor: return Add.apply(a, b)
def sub(a, b) -> Tensor: return Sub.apply(a, b)
def mul(a, b) -> Tensor: return Mul.apply(a, b)
def div(a, b) -> Tensor: return Div.apply(a, b)
def neg(a) -> Tensor: return Neg.apply(a)
def pow(a, p: float) -> Tensor: return Pow.apply(a, p)  # noqa: A001 (mirrors the operator)
def exp(a) -> Tensor: return Exp.apply(a)
def log(a) -> Tensor: return Log.apply(a)
def tanh(a) -> Tensor: return Tanh.apply(a)
def sum(a, axis=None, keepdims: bool = False) -> Tensor: return Sum.apply(a, axis, keepdims)  # noqa: A001
def mean(a, axis=None, keepdims: bool = False) -> Tensor:
    """(1/N) Σ_axis a, N = the number of summed elements: a Sum scaled, so its gradient is g/N broadcast."""
    count = math.prod(a.shape[i] for i in _normalize_axes(axis, a.ndim))
    return Sum.apply(a, axis, keepdims) * (1.0 / count)
def reshape(a, shape) -> Tensor: return Reshape.apply(a, tuple(shape))
def transpose(a, axes=None) -> Tensor: return Transpose.apply(a, axes)
def getitem(a, index) -> Tensor: return GetItem.apply(a, index.data if isinstance(index, Tensor) else index)
def concat(tensors: Sequence, axis: int = 0) -> Tensor: return Concat.apply(*tensors, axis=axis)
def matmul(a, b) -> Tensor: return MatMul.apply(a, b)
def linear(x, w, b=None, transposed: bool = False) -> Tensor: return Linear.apply(x, w, b, transposed)
def softmax(x, axis: int = -1) -> Tensor: return Softmax.apply(x, axis)
def layer_norm(x, w, b, eps: float = 1e-5) -> Tensor: return LayerNorm.apply(x, w, b, eps)
def gelu(x) -> Tensor: return GELU.apply(x)
def rms_norm(x, w, eps: float = 1e-6) -> Tensor: return RMSNorm.apply(x, w, eps)
def swiglu(h) -> Tensor: return SwiGLU.apply(h)
def sigmoid(x) -> Tensor: return Sigmoid.apply(x)
def rope(x, cos, sin) -> Tensor: return Rope.apply(x, cos, sin)
def embedding(idx, w) -> Tensor: return Embedding.apply(idx, w)
def cross_entropy(logits, targets, ignore_index: int = -100) -> Tensor: return CrossEntropy.apply(logits, targets, ignore_index)
def causal_self_attention(qkv, n_head: int, scale: float | None = None, recompute: bool = False,
                          kv_heads: int | None = None) -> Tensor:
    """Causal multi-head attention of packed q|k|v (``kv_heads`` K/V heads, default n_head) with scores
    q·kᵀ·scale (default 1/√head_dim); ``recompute``: keep q, k, v only and compute the (T, T) probabilities again
    in backward (selective recomputation)."""
    return CausalSelfAttention.apply(qkv, n_head, scale, recompute, kv_heads)


def recompute(fn, x, side=None) -> Tensor: return Recompute.apply(x, fn, side)


def recomputed_side(y: Tensor, value: Tensor) -> Tensor:
    """``value`` (the side scalar ``fn`` computed in y's recomputed forward) with a gradient path (see Recompute)."""
    return RecomputedSide.apply(y, y._ctx, value.data) if y._ctx is not None else value
def add_loss(x, loss, weight: float) -> Tensor: return AddLoss.apply(x, loss, weight)
