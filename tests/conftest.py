"""Test-session settings. Triton kernels run in Triton's numpy interpreter: this must be set before
triton is first imported."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
