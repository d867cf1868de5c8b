"""One place that decides where arrays live: numpy on the CPU, cupy on the GPU.

Every other module writes ``xp.zeros(...)``, ``xp.exp(...)`` with ``from minipar.backend import xp``.
``xp`` is a thin proxy that forwards attribute lookups to the active array module, so switching
with :func:`set_device` takes effect everywhere, including in modules imported earlier.

    >>> from minipar.backend import xp, set_device
    >>> set_device("cpu"); xp.__name__
    'numpy'
"""
from __future__ import annotations

import functools
import importlib.util
import os
import types
from typing import Any, Iterator

import numpy

_active: types.ModuleType = numpy

DTYPES = ("float32", "float64", "float16", "bfloat16")
LOW_PRECISION = ("float16", "bfloat16")  # 2-byte storage, fp32 arithmetic


@functools.lru_cache(maxsize=None)
def is_low_precision(dtype: Any) -> bool:
    """float16 or bfloat16: stored in 2 bytes; minipar computes with them in float32 (autograd's autocast).
    Cached per dtype: autograd asks for every input of every op, and a dtype's name costs microseconds."""
    return numpy.dtype(dtype).name in LOW_PRECISION


class _ArrayModule:
    """Forwards ``xp.name`` to the active array module (numpy or cupy)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(_active, name)

    def __repr__(self) -> str:
        return f"<xp -> {_active.__name__}>"


xp: Any = _ArrayModule()


def _keep_freed_memory_in_the_heap() -> None:
    """Stop glibc from handing every large numpy temporary back to the OS.

    By default glibc serves allocations above ~128 KiB-32 MiB with a fresh ``mmap`` and returns
    them with ``munmap`` (and trims the heap top beyond 128 KiB). A training step allocates and
    frees the same few-MB activations hundreds of times, so each one is page-faulted in again:
    measured here, that is ~25% of a CPU step. Raising the mmap and trim thresholds keeps freed
    blocks in the heap for reuse — the host-side analogue of a GPU caching allocator. Linux/glibc
    only; elsewhere this does nothing.
    """
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 1 << 30)
    libc.mallopt(m_trim_threshold, 1 << 30)


_keep_freed_memory_in_the_heap()

CACHE_BLOCK = 32768  # elements (128 KiB of float32): a chain of elementwise ops over a few such blocks stays in L2


def cache_blocks(*arrays: Any) -> Iterator[tuple[Any, ...]]:
    """Matching views of same-shaped ``arrays``, block by block of :data:`CACHE_BLOCK` elements.

    numpy runs each elementwise op as a pass over whole arrays; a fused op of k such ops over an
    activation bigger than the cache reads and writes main memory k times. Run block by block, the k
    passes touch data the first pass left in the cache: the same arithmetic on each element, in the
    same order, so the same bits. On the GPU (one kernel per op either way), for non-contiguous
    arrays (a flat view would be a copy) and for arrays of one block or less this yields the arrays
    themselves, once.
    """
    n = arrays[0].size
    if _active is not numpy or n <= CACHE_BLOCK or not all(a.flags.c_contiguous for a in arrays):
        yield arrays
        return
    flat = [a.reshape(-1) for a in arrays]
    for start in range(0, n, CACHE_BLOCK):
        yield tuple(f[start:start + CACHE_BLOCK] for f in flat)


_THREAD_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
_OPENBLAS_SETTERS = ("openblas_set_num_threads", "scipy_openblas_set_num_threads64_",
                     "scipy_openblas_set_num_threads_64_", "openblas_set_num_threads64_")


def share_cores(local_ranks: int) -> int:
    """Give each of ``local_ranks`` processes on this machine its share of the cores for BLAS.

    OpenBLAS starts one busy-waiting thread per core in *every* process; k ranks on c cores then
    run k·c spinning threads and a step slows down tens of times (measured here: 195 ms instead
    of 7 ms for 2 ranks on 2 cores). Like ``torchrun`` setting OMP_NUM_THREADS, each rank gets
    max(1, c // k) threads — unless the user set one of the thread variables, which wins. Returns
    the count chosen (0: left to the user). Works after numpy is loaded by calling OpenBLAS's
    own setter.
    """
    if any(v in os.environ for v in _THREAD_VARS):
        return 0
    threads = max(1, (os.cpu_count() or 1) // max(1, local_ranks))
    for var in _THREAD_VARS:
        os.environ[var] = str(threads)  # for child processes and libraries loaded later
    _set_loaded_openblas_threads(threads)
    return threads


def _set_loaded_openblas_threads(threads: int) -> None:
    import ctypes

    with open("/proc/self/maps") as maps:
        libraries = {line.split()[-1] for line in maps if "openblas" in line.lower() and "/" in line}
    for path in libraries:
        lib = ctypes.CDLL(path)
        for name in _OPENBLAS_SETTERS:
            setter = getattr(lib, name, None)
            if setter is not None:
                setter(ctypes.c_int(threads))
                break


KERNEL_MODES = ("auto", "triton", "reference")
KERNEL_DTYPES = ("float16", "bfloat16", "float32")  # what the Triton kernels implement
_kernel_mode = "auto"


def set_kernels(mode: str) -> None:
    """Route matmul and attention through the Triton kernels (``"triton"``), through numpy/cupy
    (``"reference"``), or through Triton exactly when on the GPU (``"auto"``, the default).

    On the CPU "triton" means Triton's interpreter (needs TRITON_INTERPRET=1): slow, for testing.
    Float64 always takes the reference path. The environment variable MINIPAR_KERNELS sets the start value.
    """
    global _kernel_mode
    if mode not in KERNEL_MODES:
        raise ValueError(f"unknown kernel mode {mode!r}: expected one of {KERNEL_MODES}")
    if mode == "triton" and not _triton_installed():
        raise RuntimeError("--kernels triton needs triton: pip install 'minipar[gpu]' (or triton)")
    _kernel_mode = mode


def use_triton(dtype: Any) -> bool:
    """Whether an op on arrays of ``dtype`` should run the Triton kernel."""
    if str(numpy.dtype(dtype)) not in KERNEL_DTYPES or _kernel_mode == "reference":
        return False
    return _kernel_mode == "triton" or (_active is not numpy and _triton_installed())


@functools.lru_cache(maxsize=1)
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def set_device(device: str) -> None:
    """Select ``"cpu"`` (numpy) or ``"gpu"`` (cupy) for all subsequent array creation."""
    global _active
    if device == "cpu":
        _active = numpy
    elif device == "gpu":
        try:
            import cupy
        except ImportError as e:  # a clear message instead of a bare ImportError deep inside a step
            raise RuntimeError("--device gpu needs cupy: pip install 'minipar[gpu]'") from e
        _active = cupy
    else:
        raise ValueError(f"unknown device {device!r}: expected 'cpu' or 'gpu'")


def device() -> str:
    """The active device name, ``"cpu"`` or ``"gpu"``."""
    return "cpu" if _active is numpy else "gpu"


def memory_available() -> float:
    """Bytes a new allocation could still get on the active device: the GPU's free memory, or on the host the
    least of MemAvailable (what the kernel could hand out without swapping; else the physical memory), this
    process's address-space limit (RLIMIT_AS, ``ulimit -v``) less what it maps already, and its cgroup's limit
    less the cgroup's usage (a container's memory)."""
    if _active is not numpy:
        return float(_active.cuda.Device().mem_info[0])
    limits = [physical_memory()]
    try:
        with open("/proc/meminfo") as f:
            limits = [float(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")] or limits
    except OSError:
        pass
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_AS)[0]
        if soft != resource.RLIM_INFINITY:
            with open("/proc/self/statm") as f:
                mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
            limits.append(float(soft - mapped))
    except (ImportError, OSError, ValueError):
        pass
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),  # cgroup v2, v1
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit_file) as f, open(usage_file) as g:
                text = f.read().strip()
                if text != "max" and int(text) < 1 << 60:  # v1 writes a huge number for "no limit"
                    limits.append(float(int(text) - int(g.read().strip())))
            break
        except (OSError, ValueError):
            continue
    return max(0.0, min(limits))


def physical_memory() -> float:
    """The host's physical memory in bytes (16 GB where the OS does not say)."""
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError):
        return 16e9


def on_gpu(a: Any) -> bool:
    """True when ``a`` is a cupy array (it has a CUDA ``device`` and is not a numpy array)."""
    return not isinstance(a, numpy.ndarray) and hasattr(a, "__cuda_array_interface__")


def to_host(a: Any) -> numpy.ndarray:
    """Copy an xp array to a numpy array (no copy when it already is one)."""
    return a.get() if on_gpu(a) else numpy.asarray(a)


def to_device(a: Any, dtype: Any = None) -> Any:
    """Move a host array onto the active device, optionally casting it."""
    return _active.asarray(a, dtype=dtype)


def resolve_dtype(name: str | Any) -> Any:
    """``"float32"`` -> ``numpy.float32``; numpy dtypes pass through."""
    if isinstance(name, str):
        if name not in DTYPES:
            raise ValueError(f"unknown dtype {name!r}: expected one of {sorted(DTYPES)}")
        if name == "bfloat16":  # numpy's bfloat16 comes from ml_dtypes (as JAX's does); imported on first use: 1 s
            import ml_dtypes
            return ml_dtypes.bfloat16
        return getattr(numpy, name)
    return numpy.dtype(name).type


set_kernels(os.environ.get("MINIPAR_KERNELS", "auto"))
