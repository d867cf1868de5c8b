"""Handing numpy and cupy arrays to Triton kernels, and timing them without torch.

Triton launches with anything that has ``data_ptr()`` and ``dtype``:

* on the GPU (Triton 3.9 launches torch-free on the default stream) a cupy array needs only a thin
  wrapper: ``data_ptr() = a.data.ptr``;
* under ``TRITON_INTERPRET=1`` (the CPU interpreter, how the kernels are tested here) the
  interpreter also copies "device" tensors to "host" tensors with torch-tensor methods
  (``untyped_storage().data_ptr()``, ``cpu()``, ``new_empty``, ``set_``, ``copy_``,
  ``storage_offset``, ``size``, ``stride``). For a numpy array host and device are the same
  memory, so each of those returns the wrapper itself and the kernel reads and writes the array.
"""
from __future__ import annotations

import os
from typing import Any, Callable

import numpy as np


def interpreting() -> bool:
    """True when Triton runs kernels in its numpy interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


class InterpretedArray:
    """A numpy array posing as a torch tensor for the Triton interpreter."""

    def __init__(self, array: np.ndarray):
        self.array = array
        self.dtype = str(array.dtype)  # Triton maps "float32" -> fp32, "float16" -> fp16, ...

    def data_ptr(self) -> int:
        return self.array.ctypes.data

    def untyped_storage(self) -> InterpretedArray:
        return self

    def cpu(self) -> InterpretedArray:
        return self

    def new_empty(self, *args: Any, **kwargs: Any) -> InterpretedArray:
        return self

    def set_(self, *args: Any) -> InterpretedArray:
        return self

    def copy_(self, other: Any) -> InterpretedArray:
        return self

    def storage_offset(self) -> int:
        return 0

    def size(self) -> tuple[int, ...]:
        return self.array.shape

    def stride(self) -> tuple[int, ...]:
        return tuple(s // self.array.itemsize for s in self.array.strides)


class DeviceArray:
    """A cupy array for a Triton launch on the GPU. cupy has no bfloat16: pass uint16 storage with
    ``dtype="bfloat16"``."""

    def __init__(self, array: Any, dtype: str | None = None):
        self.array = array
        self.dtype = dtype or str(array.dtype)

    def data_ptr(self) -> int:
        return self.array.data.ptr


def kernel_arg(array: Any, dtype: str | None = None) -> Any:
    """Wrap an xp array for a kernel launch (numpy -> interpreter, cupy -> GPU); ``dtype`` names the
    element type when the storage type differs (bfloat16 kept in uint16)."""
    if isinstance(array, np.ndarray):
        if not interpreting():
            raise RuntimeError("Triton kernels on numpy arrays need TRITON_INTERPRET=1 (the CPU interpreter)")
        return InterpretedArray(array)
    return DeviceArray(array, dtype)


def empty(like: Any, shape: tuple[int, ...], dtype: Any = None) -> Any:
    """An uninitialized array on the same side (numpy or cupy) as ``like``."""
    if isinstance(like, np.ndarray):
        return np.empty(shape, dtype=dtype or like.dtype)
    import cupy

    return cupy.empty(shape, dtype=dtype or like.dtype)


def element_strides(array: Any) -> tuple[int, ...]:
    """Strides in elements (Triton's pointer arithmetic), for numpy and cupy alike."""
    return tuple(s // array.itemsize for s in array.strides)


def cupy_bench(fn: Callable[[], Any], warmup: int = 25, rep: int = 100,
               quantiles: tuple[float, ...] | None = (0.5, 0.2, 0.8)) -> Any:
    """Milliseconds per call measured with CUDA events (what triton.testing.do_bench does, minus torch).

    Returns the requested quantiles (a list), or the mean when ``quantiles`` is None — the calling
    convention Triton's autotuner expects of ``do_bench``.
    """
    import cupy

    for _ in range(warmup):
        fn()
    starts = [cupy.cuda.Event() for _ in range(rep)]
    ends = [cupy.cuda.Event() for _ in range(rep)]
    cache = cupy.empty(64 * 2**20, dtype=cupy.int8)  # flushed between calls: time from DRAM, not L2
    for start, end in zip(starts, ends):
        cache.fill(0)
        start.record()
        fn()
        end.record()
    ends[-1].synchronize()
    times = np.array([cupy.cuda.get_elapsed_time(s, e) for s, e in zip(starts, ends)])
    return float(times.mean()) if quantiles is None else [float(np.quantile(times, q)) for q in quantiles]
