"""Tiled matrix multiplication C = A B in Triton (after Triton's tutorial 03, written for minipar).

Each program computes one BLOCK_M × BLOCK_N tile of C, walking K in BLOCK_K steps and
accumulating in float32 whatever the input type (fp16, bf16 or fp32):

    acc = 0;  for k in 0, BLOCK_K, 2·BLOCK_K, …:  acc += A[m-tile, k:k+BLOCK_K] @ B[k:k+BLOCK_K, n-tile]

Grouped ordering. Programs are numbered so that GROUP_M consecutive programs cover a column of
GROUP_M row-tiles before moving right: those programs share the same B tiles and neighbouring A
tiles while both are still in L2, which for large matrices is worth ~10% over row-major order.
Edges: loads and stores are masked, so M, N, K need not be multiples of the blocks. Strides are
arguments, so transposed views (Wᵀ in a linear layer's backward) need no copies.
"""
from __future__ import annotations

import functools
from typing import Any

import triton
import triton.language as tl

from minipar.kernels.adapter import cupy_bench, element_strides, empty, interpreting, kernel_arg


@triton.jit
def matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                  PRECISION: tl.constexpr):
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group_size = GROUP_M * tiles_n                 # programs per group of GROUP_M tile-rows
    first_m = (pid // group_size) * GROUP_M
    rows_in_group = min(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group_size) % rows_in_group
    pid_n = (pid % group_size) // rows_in_group

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & (offs_n[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


# H100/H200-sized tiles; the autotuner times each with CUDA events (cupy_bench) per (M, N, K).
GPU_CONFIGS = [
    triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_stages=s, num_warps=w)
    for bm, bn, bk, s, w in [(128, 256, 64, 3, 8), (256, 128, 64, 3, 8), (128, 128, 64, 4, 4), (128, 128, 32, 4, 4),
                             (128, 64, 32, 4, 4), (64, 128, 32, 4, 4), (64, 64, 32, 5, 2), (128, 256, 32, 3, 8)]
]
SUPPORTED_DTYPES = ("float16", "bfloat16", "float32")  # float64 stays on numpy/cupy (cuBLAS DGEMM)
CPU_CONFIG = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2}  # small: the interpreter runs in numpy


@functools.lru_cache(maxsize=1)
def _tuned_kernel() -> Any:
    return triton.autotune(configs=GPU_CONFIGS, key=["M", "N", "K", "PRECISION"], do_bench=cupy_bench)(matmul_kernel)


def matmul(a: Any, b: Any, out: Any = None, config: dict | None = None, dtype: str | None = None) -> Any:
    """A (M, K) @ B (K, N) -> C (M, N) of A's dtype, on numpy (interpreter) or cupy (GPU) arrays.

    fp32 inputs are multiplied in IEEE fp32 (not TF32) so results match the reference path.
    ``config`` fixes the tile sizes (else: autotuned on the GPU, CPU_CONFIG in the interpreter).
    ``dtype="bfloat16"`` reads uint16 arrays as bfloat16 (cupy has no bfloat16 type).
    """
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"matmul needs (M, K) @ (K, N), got {a.shape} @ {b.shape}")
    name = dtype or str(a.dtype)
    if a.dtype != b.dtype or name not in SUPPORTED_DTYPES:
        raise TypeError(f"matmul needs two arrays of one of {SUPPORTED_DTYPES}, got {a.dtype} and {b.dtype}")
    M, K = a.shape
    N = b.shape[1]
    if out is None:
        out = empty(a, (M, N))
    precision = "ieee" if a.dtype.itemsize >= 4 else "tf32"  # tf32 is ignored for 16-bit inputs
    args = (kernel_arg(a, dtype), kernel_arg(b, dtype), kernel_arg(out, dtype), M, N, K, *element_strides(a), *element_strides(b),
            *element_strides(out))
    grid = lambda meta: (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)  # noqa: E731
    if config is None and not interpreting():
        _tuned_kernel()[grid](*args, PRECISION=precision)
    else:
        matmul_kernel[grid](*args, PRECISION=precision, **(config or CPU_CONFIG))
    return out
