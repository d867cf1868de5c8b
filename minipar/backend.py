"""One place that decides where arrays live: numpy on the CPU, cupy on the GPU.

Every other module writes ``xp.zeros(...)``, ``xp.exp(...)`` with ``from minipar.backend import xp``.
``xp`` is a thin proxy that forwards attribute lookups to the active array module, so switching
with :func:`set_device` takes effect everywhere, including in modules imported earlier.

    >>> from minipar.backend import xp, set_device
    >>> set_device("cpu"); xp.__name__
    'numpy'
"""
from __future__ import annotations

import types
from typing import Any

import numpy

_active: types.ModuleType = numpy

DTYPES = {"float32": numpy.float32, "float64": numpy.float64, "float16": numpy.float16}


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
        return DTYPES[name]
    return numpy.dtype(name).type
