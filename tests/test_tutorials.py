"""Every tutorial runs to completion (each asserts its own invariants)."""
import subprocess
import sys
from pathlib import Path

import pytest

from minipar.testing import run_command

TUTORIALS = Path(__file__).resolve().parent.parent / "tutorials"
# tutorial file -> number of MPI ranks it is written for (1: plain python)
RANKS = {"01_autograd_and_gpt.py": 1, "02_collectives.py": 4, "03_data_parallel.py": 4, "04_zero.py": 4, "05_tensor_parallel.py": 4, "06_pipeline.py": 4, "07_hybrid.py": 8, "08_kernels.py": 1, "09_compression_and_async.py": 4, "10_planner.py": 1, "11_sequence_and_context.py": 4, "12_experts.py": 4, "13_memory.py": 4, "14_every_axis.py": 1, "15_gpt2_to_llama.py": 4, "16_fp8_on_a_laptop.py": 2, "17_llama_to_deepseek.py": 2, "18_todays_experts.py": 2}


@pytest.mark.parametrize("name", sorted(RANKS))
def test_tutorial_runs(name):
    path = str(TUTORIALS / name)
    if RANKS[name] == 1:
        out = subprocess.run([sys.executable, path], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stdout + out.stderr
        text = out.stdout
    else:
        text = run_command(RANKS[name], [sys.executable, path], timeout=300)
    assert "all invariants hold" in text


def test_every_tutorial_is_listed():
    assert sorted(p.name for p in TUTORIALS.glob("[0-9]*.py")) == sorted(RANKS)
