"""Triton kernels for the hot GPU paths (matmul, fused attention), with a numpy adapter so they run
under ``TRITON_INTERPRET=1`` on the CPU. Importing this package needs nothing beyond numpy; the
kernel modules import triton themselves.

Deep dive, with measurements: docs/gpu.md.
"""
