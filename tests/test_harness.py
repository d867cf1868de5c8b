"""The multi-rank harness: a passing run, a rank that raises (must fail fast), a hang (must time out)."""
import time

import pytest
from mpi4py import MPI

from minipar.testing import run_ranks


def _ranks_sum(x):
    comm = MPI.COMM_WORLD
    assert comm.allreduce(x) == x * comm.size


def _rank1_raises():
    comm = MPI.COMM_WORLD
    if comm.rank == 1:
        raise ValueError("rank 1 fails on purpose")
    comm.recv(source=1)  # the others would wait forever for rank 1


def _all_ranks_hang():
    MPI.COMM_WORLD.recv(source=0, tag=77)


@pytest.mark.parametrize("n", [1, 3])
def test_ranks_run_and_communicate(n):
    run_ranks(n, _ranks_sum, 5, timeout=30)


def test_failing_rank_fails_fast():
    start = time.monotonic()
    with pytest.raises(AssertionError, match="rank 1 fails on purpose") as err:
        run_ranks(3, _rank1_raises, timeout=60)
    assert time.monotonic() - start < 10, "a failing rank must end the run within seconds, not at the timeout"
    assert "[rank 1]" in str(err.value)


def test_hanging_ranks_are_killed_at_timeout():
    start = time.monotonic()
    with pytest.raises(AssertionError, match="timed out after 3 s"):
        run_ranks(2, _all_ranks_hang, timeout=3)
    assert time.monotonic() - start < 8
