"""minipar: a from-scratch, readable distributed-training engine.

Start reading at ``minipar/autograd.py`` (the engine), then ``ops.py``, ``models/gpt.py``
and ``train.py``; the parallel techniques live one per file in ``minipar/parallel/``.
"""
from minipar.autograd import Function, Tensor, no_grad
from minipar.backend import set_device, to_host, xp

__version__ = "0.1.0"
__all__ = ["Function", "Tensor", "no_grad", "set_device", "to_host", "xp", "__version__"]
