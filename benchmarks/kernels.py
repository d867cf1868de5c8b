"""GPU kernels: correctness against cupy, then TFLOP/s against cuBLAS and the unfused cupy path.

    python benchmarks/kernels.py                 # needs a CUDA GPU, cupy and triton
    python benchmarks/kernels.py --quick         # fewer sizes

Matmul: Triton (kernels/matmul.py, autotuned with CUDA-event timing) vs cupy.matmul (cuBLAS) for
square fp16 / bf16 / fp32 problems, 2·n³ FLOPs. bf16 has no cupy dtype: the Triton side reads
uint16 storage as bfloat16 and the cuBLAS side is cublasGemmEx with CUDA_R_16BF.
Attention: causal flash attention forward (2·B·H·T²·D FLOPs, half of the full 4·B·H·T²·D) and
backward (2.5× the forward) vs minipar's reference op on cupy arrays (which materializes P).
Timings are medians of cupy_bench (L2 flushed between runs).
"""
import argparse
import sys

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    try:
        import cupy
    except ImportError:
        sys.exit("benchmarks/kernels.py needs a GPU with cupy: pip install 'minipar[gpu]'")
    from minipar.kernels.adapter import cupy_bench
    from minipar.kernels.flash_attention import attention_backward, attention_forward
    from minipar.kernels.matmul import matmul
    from minipar import backend, ops
    from minipar.autograd import Tensor

    backend.set_device("gpu")
    print(f"GPU: {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}")

    # ---- correctness first
    rng = cupy.random.default_rng(0)
    a, b = rng.standard_normal((300, 200), dtype=cupy.float32), rng.standard_normal((200, 500), dtype=cupy.float32)
    err = float(cupy.abs(matmul(a, b) - a @ b).max())
    print(f"check matmul fp32 (300×200 @ 200×500): max |Triton − cuBLAS| = {err:.2e}")
    assert err < 1e-3
    qkv = rng.standard_normal((2, 300, 3 * 4 * 64), dtype=cupy.float32)
    results = {}
    for mode in ("triton", "reference"):
        backend.set_kernels(mode)
        x = Tensor(qkv.copy(), requires_grad=True)
        y = ops.causal_self_attention(x, 4)
        (y * y).sum().backward()
        results[mode] = (y.data, x.grad)
    for name, i in (("out", 0), ("grad", 1)):
        err = float(cupy.abs(results["triton"][i] - results["reference"][i]).max())
        print(f"check flash attention {name} vs reference: {err:.2e}")
        assert err < 2e-2
    backend.set_kernels("auto")

    # ---- matmul
    sizes = [1024, 4096] if args.quick else [1024, 2048, 4096, 8192]
    print(f"\n{'matmul':<8}{'n':>6}{'Triton TFLOP/s':>16}{'cuBLAS TFLOP/s':>16}{'ratio':>7}")
    for dtype in ("float16", "bfloat16", "float32"):
        for n in sizes:
            flops = 2 * n**3
            if dtype == "bfloat16":
                a = (rng.standard_normal((n, n), dtype=cupy.float32).view(cupy.uint32) >> 16).astype(cupy.uint16)
                b, c = a.copy(), cupy.empty((n, n), cupy.uint16)
                ours = cupy_bench(lambda: matmul(a, b, c, dtype="bfloat16"))[0]
                theirs = _cublas_bf16(a, b, c, n)
            else:
                a = rng.standard_normal((n, n), dtype=cupy.float32).astype(dtype)
                b, c = a.copy(), cupy.empty((n, n), dtype)
                ours = cupy_bench(lambda: matmul(a, b, c))[0]
                theirs = cupy_bench(lambda: cupy.matmul(a, b, out=c))[0]
            t_ours, t_theirs = flops / ours / 1e9, (flops / theirs / 1e9) if theirs else float("nan")
            print(f"{dtype:<8}{n:>6}{t_ours:>16.1f}{t_theirs:>16.1f}{t_ours / t_theirs:>7.2f}", flush=True)

    # ---- attention
    grid = [(4, 16, 4096, 128), (2, 16, 8192, 128)] if args.quick else [
        (8, 16, 1024, 64), (4, 16, 2048, 64), (8, 16, 1024, 128), (4, 16, 4096, 64), (4, 16, 4096, 128), (2, 16, 8192, 128)]
    print(f"\n{'attention fp16':<16}{'B·H·T·D':>22}{'fwd TFLOP/s':>13}{'bwd TFLOP/s':>13}{'unfused fwd':>13}{'unfused bwd':>13}")
    for B, H, T, D in grid:
        qkv = rng.standard_normal((B, T, 3, H, D), dtype=cupy.float32).astype(cupy.float16)
        q, k, v = qkv.transpose(2, 0, 3, 1, 4)
        out = cupy.empty((B, T, H, D), cupy.float16)
        o = out.transpose(0, 2, 1, 3)
        lse = attention_forward(q, k, v, o)
        do = cupy.ones_like(o)
        dqkv = cupy.empty_like(qkv)
        dq, dk, dv = dqkv.transpose(2, 0, 3, 1, 4)
        fwd_flops = 2 * B * H * T * T * D
        fwd = cupy_bench(lambda: attention_forward(q, k, v, o))[0]
        bwd = cupy_bench(lambda: attention_backward(q, k, v, o, lse, do, dq, dk, dv))[0]
        unfused = _unfused(qkv.reshape(B, T, 3 * H * D).astype(cupy.float32), H, fwd_flops)
        print(f"{'':<16}{f'{B}·{H}·{T}·{D}':>22}{fwd_flops / fwd / 1e9:>13.1f}{2.5 * fwd_flops / bwd / 1e9:>13.1f}"
              f"{unfused[0]:>13.1f}{unfused[1]:>13.1f}", flush=True)


def _unfused(qkv, H, fwd_flops):
    """TFLOP/s of minipar's reference attention op on cupy (fp32: the unfused path materializes P)."""
    from minipar.kernels.adapter import cupy_bench
    from minipar import backend, ops
    from minipar.autograd import Tensor

    backend.set_kernels("reference")
    try:
        x = Tensor(qkv, requires_grad=True)
        fwd = cupy_bench(lambda: ops.causal_self_attention(x, H), warmup=3, rep=10)[0]
        y = ops.causal_self_attention(x, H)
        bwd = cupy_bench(lambda: y._ctx.fn.backward(y._ctx, qkv[..., : qkv.shape[-1] // 3]), warmup=3, rep=10)[0]
    except Exception as e:  # noqa: BLE001 (P for long sequences may not fit: report, don't abort the table)
        print(f"   (unfused path: {type(e).__name__})")
        return float("nan"), float("nan")
    finally:
        backend.set_kernels("auto")
    return fwd_flops / fwd / 1e9, 2.5 * fwd_flops / bwd / 1e9


def _cublas_bf16(a, b, c, n):
    """cuBLAS bf16 GEMM time (ms) via cublasGemmEx, or None where this cupy cannot call it."""
    import cupy
    from cupy_backends.cuda.libs import cublas

    from minipar.kernels.adapter import cupy_bench

    try:
        handle = cupy.cuda.device.get_cublas_handle()
        one, zero = np.array(1.0, np.float32), np.array(0.0, np.float32)
        bf16, f32 = 14, 68  # CUDA_R_16BF, CUBLAS_COMPUTE_32F

        def call():  # row-major C = A B  ==  column-major Cᵀ = Bᵀ Aᵀ
            cublas.gemmEx(handle, 0, 0, n, n, n, one.ctypes.data, b.data.ptr, bf16, n, a.data.ptr, bf16, n,
                          zero.ctypes.data, c.data.ptr, bf16, n, f32, -1)

        cublas.setPointerMode(handle, cublas.CUBLAS_POINTER_MODE_HOST)
        return cupy_bench(call)[0]
    except Exception as e:  # noqa: BLE001
        print(f"   (cuBLAS bf16 unavailable: {e})")
        return None


if __name__ == "__main__":
    main()
