"""Triton kernels for the hot GPU paths (matmul, fused attention), with a numpy adapter so they run
under ``TRITON_INTERPRET=1`` on the CPU. Importing this package needs nothing beyond numpy; the
kernel modules import triton themselves.

Deep dive, with measurements: docs/gpu.md.
"""

import os as _os
import sys as _sys

if __name__ == "kernels":  # imported as a top-level package: Python started in the repository root, where this
    # folder would shadow an installed package of the same name (transformers imports the `kernels` package from
    # PyPI). minipar's kernels are minipar.kernels; as `kernels`, this folder steps aside for the installed one.
    import importlib.machinery as _machinery
    import importlib.util as _util

    _root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    _elsewhere = [p for p in _sys.path if _os.path.abspath(p or _os.curdir) != _root]
    _spec = _machinery.PathFinder.find_spec("kernels", _elsewhere)
    if _spec is not None:
        _installed = _util.module_from_spec(_spec)
        _sys.modules["kernels"] = _installed  # what `import kernels` returns once this body has run
        _spec.loader.exec_module(_installed)
    else:
        __file__ = None  # none installed: look like the empty namespace package it is here

