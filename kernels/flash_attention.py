"""Causal flash attention, forward and backward, in Triton (after Dao et al. 2022 and Triton's
tutorial 06, written for minipar's layout).

Forward. One program owns BLOCK_M query rows of one (batch, head) and streams the keys and
values past them in BLOCK_N blocks, never forming the T × T score matrix. Online softmax keeps,
per row, the running maximum m, the running normalizer l and the unnormalized output acc:

    s = q kᵀ · scale                       (BLOCK_M × BLOCK_N, masked to keys ≤ query and < T)
    m' = max(m, rowmax s);   p = exp(s − m');   α = exp(m − m')
    l  = α·l + rowsum p;     acc = α·acc + p v;  m = m'
    o  = acc / l,   and the log-sum-exp L = m + log l is saved for backward.

Causality also bounds the loop: query block i never looks past key (i+1)·BLOCK_M.
Exponentials are base 2 (``exp2``, with log₂e folded into the scale), as GPUs compute them.

Backward recomputes P = exp(s − L) block by block instead of storing it (O(T) memory, not O(T²)):

    Δ  = rowsum(dO ⊙ O)                     (one pass)
    dV = Σ Pᵀ dO,   dP = dO Vᵀ,   dS = P ⊙ (dP − Δ),   dK = scale · Σ dSᵀ Q,   dQ = scale · Σ dS K

one program per key block for dK, dV (looping over the query blocks at or after it) and one per
query block for dQ (looping over the key blocks at or before it), so no two programs write the
same output. Head dims up to 128 (any size: HEAD_DIM is the next power of two, masked).

Layout: q, k, v are (B, H, T, D) views with arbitrary strides — minipar passes views straight into
the fused (B, T, 3C) projection — and o, dq, dk, dv are written through strides too.
"""
from __future__ import annotations

import math
from typing import Any

import triton
import triton.language as tl

from minipar.kernels.adapter import element_strides, empty, interpreting, kernel_arg

LOG2E = 1.4426950408889634


@triton.jit
def _rows(ptr, b, h, sb, sh, st, sd, offs_t, offs_d, T, D):
    """Addresses and mask of the rows ``offs_t`` (× dims ``offs_d``) of one (batch, head) of a strided tensor."""
    return (ptr + b * sb + h * sh + offs_t[:, None] * st + offs_d[None, :] * sd,
            (offs_t < T)[:, None] & (offs_d < D)[None, :])


@triton.jit
def _load_rows(ptr, b, h, sb, sh, st, sd, offs_t, offs_d, T, D):
    where, mask = _rows(ptr, b, h, sb, sh, st, sd, offs_t, offs_d, T, D)
    return tl.load(where, mask=mask, other=0.0)


@triton.jit
def _store_rows(ptr, value, b, h, sb, sh, st, sd, offs_t, offs_d, T, D):
    where, mask = _rows(ptr, b, h, sb, sh, st, sd, offs_t, offs_d, T, D)
    tl.store(where, value.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _row_statistics(LSE, DELTA, bh, offs_m, T):
    """The forward's log-sum-exp L and the Δ of the rows ``offs_m`` of one (batch, head)."""
    return (tl.load(LSE + bh * T + offs_m, mask=offs_m < T, other=0.0),
            tl.load(DELTA + bh * T + offs_m, mask=offs_m < T, other=0.0))


@triton.jit
def _probabilities(q, k, lse, offs_m, offs_n, T, qk_scale):
    """P = exp₂(q kᵀ·scale·log₂e − L) for one (query block, key block), 0 above the diagonal and past T."""
    p = tl.exp2(tl.dot(q, tl.trans(k)) * qk_scale - lse[:, None])
    visible = (offs_m[:, None] >= offs_n[None, :]) & (offs_m < T)[:, None] & (offs_n < T)[None, :]
    return tl.where(visible, p, 0.0)


@triton.jit
def attention_forward_kernel(Q, K, V, O, LSE, sqb, sqh, sqt, sqd, skb, skh, skt, skd, svb, svh, svt, svd,
                             sob, soh, sot, sod, H, T, D, qk_scale,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    start_m, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q = _load_rows(Q, b, h, sqb, sqh, sqt, sqd, offs_m, offs_d, T, D)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    for start_n in range(0, tl.minimum((start_m + 1) * BLOCK_M, T), BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _load_rows(K, b, h, skb, skh, skt, skd, offs_n, offs_d, T, D)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        s = tl.where((offs_m[:, None] >= offs_n[None, :]) & (offs_n < T)[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_rows(V, b, h, svb, svh, svt, svd, offs_n, offs_d, T, D)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    _store_rows(O, acc / l_i[:, None], b, h, sob, soh, sot, sod, offs_m, offs_d, T, D)
    tl.store(LSE + bh * T + offs_m, m_i + tl.log2(l_i), mask=offs_m < T)  # base-2 log-sum-exp of the scaled scores


@triton.jit
def attention_delta_kernel(O, DO, DELTA, sob, soh, sot, sod, H, T, D, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Δ = rowsum(dO ⊙ O) for one block of rows (dO laid out like O)."""
    start_m, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    o = _load_rows(O, b, h, sob, soh, sot, sod, offs_m, offs_d, T, D).to(tl.float32)
    do = _load_rows(DO, b, h, sob, soh, sot, sod, offs_m, offs_d, T, D).to(tl.float32)
    tl.store(DELTA + bh * T + offs_m, tl.sum(o * do, 1), mask=offs_m < T)


@triton.jit
def attention_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, sqb, sqh, sqt, sqd, skb, skh, skt, skd, svb, svh, svt, svd,
                          sob, soh, sot, sod, sgb, sgh, sgt, sgd, H, T, D, qk_scale, scale,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    """dK, dV for BLOCK_N keys: loop over the query blocks that can see them (causal: rows ≥ first key)."""
    start_n, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    offs_n = start_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    k = _load_rows(K, b, h, skb, skh, skt, skd, offs_n, offs_d, T, D)
    v = _load_rows(V, b, h, svb, svh, svt, svd, offs_n, offs_d, T, D)
    dk = tl.zeros((BLOCK_N, HEAD_DIM), tl.float32)
    dv = tl.zeros((BLOCK_N, HEAD_DIM), tl.float32)
    for start_m in range((start_n * BLOCK_N) // BLOCK_M * BLOCK_M, T, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = _load_rows(Q, b, h, sqb, sqh, sqt, sqd, offs_m, offs_d, T, D)
        do = _load_rows(DO, b, h, sob, soh, sot, sod, offs_m, offs_d, T, D)
        lse, delta = _row_statistics(LSE, DELTA, bh, offs_m, T)
        p = _probabilities(q, k, lse, offs_m, offs_n, T, qk_scale)   # (BLOCK_M, BLOCK_N)
        dv = tl.dot(tl.trans(p).to(do.dtype), do, dv)
        ds = p * (tl.dot(do, tl.trans(v)).to(tl.float32) - delta[:, None])
        dk = tl.dot(tl.trans(ds).to(q.dtype), q, dk)
    _store_rows(DK, dk * scale, b, h, sgb, sgh, sgt, sgd, offs_n, offs_d, T, D)
    _store_rows(DV, dv, b, h, sgb, sgh, sgt, sgd, offs_n, offs_d, T, D)


@triton.jit
def attention_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, sqb, sqh, sqt, sqd, skb, skh, skt, skd, svb, svh, svt, svd,
                        sob, soh, sot, sod, sgb, sgh, sgt, sgd, H, T, D, qk_scale, scale,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    """dQ for BLOCK_M queries: loop over the key blocks they can see (keys ≤ last query)."""
    start_m, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q = _load_rows(Q, b, h, sqb, sqh, sqt, sqd, offs_m, offs_d, T, D)
    do = _load_rows(DO, b, h, sob, soh, sot, sod, offs_m, offs_d, T, D)
    lse, delta = _row_statistics(LSE, DELTA, bh, offs_m, T)
    dq = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    for start_n in range(0, tl.minimum((start_m + 1) * BLOCK_M, T), BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _load_rows(K, b, h, skb, skh, skt, skd, offs_n, offs_d, T, D)
        v = _load_rows(V, b, h, svb, svh, svt, svd, offs_n, offs_d, T, D)
        p = _probabilities(q, k, lse, offs_m, offs_n, T, qk_scale)
        ds = p * (tl.dot(do, tl.trans(v)).to(tl.float32) - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq)
    _store_rows(DQ, dq * scale, b, h, sgb, sgh, sgt, sgd, offs_m, offs_d, T, D)


def _blocks(head_dim: int) -> dict:
    if interpreting():
        return {"BLOCK_M": 16, "BLOCK_N": 16}
    return {"BLOCK_M": 128, "BLOCK_N": 64 if head_dim <= 64 else 32, "num_warps": 4 if head_dim <= 64 else 8,
            "num_stages": 3}


SUPPORTED_DTYPES = ("float16", "bfloat16", "float32")


def _check(q: Any) -> tuple[int, int, int, int]:
    B, H, T, D = q.shape
    if D > 128:
        raise ValueError(f"flash attention supports head dims up to 128, got {D}")
    if str(q.dtype) not in SUPPORTED_DTYPES:
        raise TypeError(f"flash attention supports {SUPPORTED_DTYPES}, got {q.dtype} (use the reference path)")
    return B, H, T, D


def attention_forward(q: Any, k: Any, v: Any, out: Any, scale: float | None = None) -> Any:
    """Causal softmax(q kᵀ·scale) v into ``out`` (all (B, H, T, D) views; scale defaults to 1/√D);
    returns the (B, H, T) base-2 log-sum-exp."""
    B, H, T, D = _check(q)
    lse = empty(q, (B, H, T), dtype="float32")
    head_dim = max(16, triton.next_power_of_2(D))
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    blocks = _blocks(head_dim)
    grid = (triton.cdiv(T, blocks["BLOCK_M"]), B * H)
    attention_forward_kernel[grid](kernel_arg(q), kernel_arg(k), kernel_arg(v), kernel_arg(out), kernel_arg(lse),
                                   *element_strides(q), *element_strides(k), *element_strides(v), *element_strides(out),
                                   H, T, D, scale * LOG2E, HEAD_DIM=head_dim, **blocks)
    return lse


def attention_backward(q: Any, k: Any, v: Any, out: Any, lse: Any, grad_out: Any, dq: Any, dk: Any, dv: Any,
                       scale: float | None = None) -> None:
    """Write dq, dk, dv (views laid out alike) from the forward's q, k, v, out, lse and the gradient of out
    (``scale`` as given to :func:`attention_forward`).

    ``grad_out`` must be laid out like ``out`` (the Δ pass reads both with out's strides).
    """
    B, H, T, D = _check(q)
    if element_strides(grad_out) != element_strides(out):
        raise ValueError("grad_out must have the same strides as out")
    head_dim = max(16, triton.next_power_of_2(D))
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    blocks = _blocks(head_dim)
    delta = empty(q, (B, H, T), dtype="float32")
    attention_delta_kernel[(triton.cdiv(T, blocks["BLOCK_M"]), B * H)](
        kernel_arg(out), kernel_arg(grad_out), kernel_arg(delta), *element_strides(out), H, T, D,
        BLOCK_M=blocks["BLOCK_M"], HEAD_DIM=head_dim)
    if element_strides(dq) != element_strides(dk) or element_strides(dk) != element_strides(dv):
        raise ValueError("dq, dk and dv must be laid out alike")
    common = (*element_strides(q), *element_strides(k), *element_strides(v), *element_strides(grad_out),
              *element_strides(dq), H, T, D, scale * LOG2E, scale)
    tensors = [kernel_arg(a) for a in (q, k, v, grad_out, lse, delta)]
    attention_dkdv_kernel[(triton.cdiv(T, blocks["BLOCK_N"]), B * H)](*tensors, kernel_arg(dk), kernel_arg(dv), *common,
                                                                     HEAD_DIM=head_dim, **blocks)
    attention_dq_kernel[(triton.cdiv(T, blocks["BLOCK_M"]), B * H)](*tensors, kernel_arg(dq), *common,
                                                                   HEAD_DIM=head_dim, **blocks)
