"""Hand-written collectives against MPI's own, over p = 1..8, awkward sizes, dtypes, ops and layouts.

Integers must match MPI bitwise; floats within a bound proportional to Σ|xᵢ| and the dtype's
epsilon (the two implementations add in different orders). Counted bytes must equal the formulas.
"""

import os
import time

import ml_dtypes
import numpy as np
import pytest
from mpi4py import MPI

from minipar.comm import CollectiveMismatch, Communicator
from minipar.comm.collectives import (all_gather_bytes_sent, all_reduce_bytes_sent, chunk_bounds,
                                      reduce_scatter_bytes_sent)
from minipar.comm.tuning import ALGORITHMS
from minipar.testing import run_ranks

DTYPES = ["float16", "float32", "float64", "int32", "int64"]
OPS = ["sum", "avg", "max"]
_MPI_OPS = {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX}


def _sizes(p):
    big = (256 << 10) // 8 + 3 * p + 1  # 256 KiB of float64 and then some: where bandwidth-bound algorithms win
    return sorted({0, 1, max(p - 1, 1), p, 7, 13 * p + 5, 1000, big})


def _data(rank, n, dtype, seed=0):
    rng = np.random.default_rng((seed, rank, n))
    if np.issubdtype(np.dtype(dtype), np.integer):
        return rng.integers(-1000, 1000, n).astype(dtype)
    return rng.standard_normal(n).astype(dtype)


def _check_close(ours, reference, abs_sum, dtype, p, what):
    if np.issubdtype(np.dtype(dtype), np.integer):
        np.testing.assert_array_equal(ours, reference, err_msg=what)
        return
    eps = np.finfo(dtype).eps
    bound = 4 * p * eps * (abs_sum + 1e-30)
    err = np.abs(ours.astype(np.float64) - reference)
    assert (err <= bound).all(), f"{what}: max error {err.max()} exceeds bound {bound[err.argmax()]}"


def _reference_reduce(mpi, x, op):
    """MPI's Allreduce in float64 (float16 is not an MPI type) or the native integer type."""
    wide = x.astype(np.float64) if np.issubdtype(x.dtype, np.floating) else x.copy()
    out = np.empty_like(wide)
    mpi.Allreduce(wide, out, op=_MPI_OPS[op])
    if op == "avg":
        out = out / mpi.size
    abs_sum = np.empty(x.shape)
    mpi.Allreduce(np.abs(x.astype(np.float64)), abs_sum, op=MPI.SUM)
    return out, abs_sum


def _all_reduce_grid():
    comm = Communicator()
    p = comm.size
    for n in _sizes(p):
        for dtype in DTYPES:
            for op in OPS:
                if op == "avg" and dtype.startswith("int"):
                    continue
                x = _data(comm.rank, n, dtype)
                ref, abs_sum = _reference_reduce(comm.mpi, x, op)
                if op == "max":
                    abs_sum = np.zeros_like(abs_sum)  # max is exact
                for algorithm in (*ALGORITHMS["all_reduce"][:3], None):
                    ours = x.copy()
                    assert comm.all_reduce(ours, op=op, algorithm=algorithm) is ours
                    _check_close(ours, ref, abs_sum, dtype, p, f"all_reduce {algorithm} {op} {dtype} n={n}")
                    # every rank holds bitwise the same result (replicas never drift)
                    gathered = np.empty((p, n), dtype)
                    comm.mpi.Allgather(ours, gathered)
                    assert (gathered.view(np.uint8) == ours.view(np.uint8)).all(), "ranks disagree bitwise"


def _reduce_scatter_and_all_gather_grid():
    comm = Communicator()
    p, r = comm.size, comm.rank
    for n in _sizes(p):
        b = chunk_bounds(n, p)
        counts = [b[i + 1] - b[i] for i in range(p)]
        for dtype in DTYPES:
            for op in OPS:
                if op == "avg" and dtype.startswith("int"):
                    continue
                x = _data(r, n, dtype)
                before = x.copy()
                wide = x.astype(np.float64) if dtype.startswith("float") else x
                ref = np.empty(counts[r], wide.dtype)
                comm.mpi.Reduce_scatter(wide, ref, recvcounts=counts, op=_MPI_OPS[op])
                if op == "avg":
                    ref = ref / p
                abs_sum = np.empty(counts[r])
                comm.mpi.Reduce_scatter(np.abs(wide.astype(np.float64)), abs_sum, recvcounts=counts, op=MPI.SUM)
                for algorithm in (*ALGORITHMS["reduce_scatter"], None):
                    ours = comm.reduce_scatter(x, op=op, algorithm=algorithm)
                    np.testing.assert_array_equal(x, before)  # input untouched
                    assert ours.shape == (counts[r],) and ours.dtype == np.dtype(dtype)
                    _check_close(ours, ref, abs_sum if op != "max" else 0 * abs_sum, dtype, p,
                                 f"reduce_scatter {algorithm} {op} {dtype} n={n}")
                    into = np.full(counts[r], 7, dtype)
                    assert comm.reduce_scatter(x, op=op, algorithm=algorithm, out=into) is into
                    np.testing.assert_array_equal(into, ours)

            # all-gather, equal and unequal contributions (Allgatherv as reference): bitwise
            local = _data(r, counts[r], dtype, seed=1)
            ref = np.empty(n, dtype)
            comm.mpi.Allgatherv(local, [ref, counts])
            same = _data(r, 3, dtype, seed=2)
            ref_same = np.empty(3 * p, dtype)
            comm.mpi.Allgather(same, ref_same)
            for algorithm in (*ALGORITHMS["all_gather"], None):
                np.testing.assert_array_equal(comm.all_gather(local, sizes=counts, algorithm=algorithm), ref)
                np.testing.assert_array_equal(comm.all_gather(same, algorithm=algorithm), ref_same)
                into = np.empty(n, dtype)
                assert comm.all_gather(local, sizes=counts, algorithm=algorithm, out=into) is into
                np.testing.assert_array_equal(into, ref)


def _broadcast_reduce_barrier_grid():
    comm = Communicator()
    p, r = comm.size, comm.rank
    for n in (0, 1, 5, 1000):
        for dtype in DTYPES:
            for root in sorted({0, p - 1, p // 2}):
                x = _data(r, n, dtype)
                ref = x.copy()
                comm.mpi.Bcast(ref, root=root)
                for algorithm in (*ALGORITHMS["broadcast"], None):
                    np.testing.assert_array_equal(comm.broadcast(x.copy(), root=root, algorithm=algorithm), ref)
    big = _data(r, 70001, "float64")  # 560 KB: several segments
    ref = big.copy()
    comm.mpi.Bcast(ref, root=p - 1)
    np.testing.assert_array_equal(comm.broadcast(big, root=p - 1, algorithm="segmented"), ref)
    for n in (0, 1, 5, 1000):
        for dtype in DTYPES:
            for root in sorted({0, p - 1, p // 2}):

                x = _data(r, n, dtype, seed=3)
                before = x.copy()
                wide_ref, abs_sum = _reference_reduce(comm.mpi, x, "sum")
                comm.reduce(x, op="sum", root=root)
                if r == root:
                    _check_close(x, wide_ref, abs_sum, dtype, p, f"reduce root={root} {dtype} n={n}")
                else:
                    np.testing.assert_array_equal(x, before)
    comm.barrier()


def _non_contiguous_and_multidimensional():
    comm = Communicator()
    p = comm.size
    base = np.arange(60, dtype=np.float64).reshape(6, 10) + comm.rank
    view = base[:, ::3]  # strided
    expected = sum(np.arange(60, dtype=np.float64).reshape(6, 10)[:, ::3] + k for k in range(p))
    comm.all_reduce(view)
    np.testing.assert_allclose(base[:, ::3], expected)
    np.testing.assert_array_equal(base[:, 1], np.arange(60).reshape(6, 10)[:, 1] + comm.rank)  # untouched
    # reduce-scatter flattens: chunks of the row-major order
    grid = np.ones((p, 4), np.float32) * (comm.rank + 1)
    np.testing.assert_allclose(comm.reduce_scatter(grid), np.full(4, p * (p + 1) / 2))
    np.testing.assert_array_equal(comm.all_gather(grid[:1]).reshape(p, 4), np.repeat(np.arange(1, p + 1.0), 4).reshape(p, 4))


def _byte_accounting():
    comm = Communicator()
    p, r = comm.size, comm.rank
    totals = {}
    for n in (12 * p, 12 * p + 5):  # divisible by p, and not
        itemsize = 8
        c = [b1 - b0 for b0, b1 in zip(chunk_bounds(n, p)[:-1], chunk_bounds(n, p)[1:])]
        cases = {
            "ring": (lambda x: comm.all_reduce(x, algorithm="ring"), "all_reduce", (2 * n - c[r] - c[(r + 1) % p]), 2 * (p - 1) * n),
            "rs": (lambda x: comm.reduce_scatter(x, algorithm="ring"), "reduce_scatter", n - c[r], (p - 1) * n),
            "ag": (lambda x: comm.all_gather(x[:c[0]], sizes=[c[0]] * p, algorithm="ring"), "all_gather",
                   (p - 1) * c[0], p * (p - 1) * c[0]),
        }
        for key, (call, op, mine, total) in cases.items():
            comm.reset_stats()
            call(np.ones(n))
            sent = comm.stats[op].bytes
            assert sent == mine * itemsize, f"{key} n={n}: rank {r} sent {sent} bytes, formula {mine * itemsize}"
            if n % p == 0 and key == "ring":
                assert sent == 2 * (p - 1) * n * itemsize // p  # 2(p−1)/p·n
            if n % p == 0 and key == "rs":
                assert sent == (p - 1) * n * itemsize // p      # (p−1)/p·n
            totals[(key, n)] = (comm.mpi.allreduce(sent), total * itemsize)
        if p & (p - 1) == 0:  # recursive doubling: log₂p·n per rank
            comm.reset_stats()
            comm.all_reduce(np.ones(n), algorithm="recursive_doubling")
            assert comm.stats["all_reduce"].bytes == (p.bit_length() - 1) * n * itemsize
    for key, (got, want) in totals.items():
        assert got == want, f"{key}: all ranks sent {got} bytes, formula {want}"
    for n in (0, 1, 5, 12 * p + 5, (64 << 10) // 8 + 7):
        for algorithm in (*ALGORITHMS["all_reduce"][:3], None):
            comm.reset_stats()
            comm.all_reduce(np.ones(n), algorithm=algorithm)
            used = comm.stats["all_reduce"].algorithm
            assert used == algorithm or algorithm is None
            assert comm.stats["all_reduce"].bytes == all_reduce_bytes_sent(n, 8, p, r, used), (n, used)
        b = chunk_bounds(n, p)
        for algorithm in ALGORITHMS["reduce_scatter"]:
            comm.reset_stats()
            comm.reduce_scatter(np.ones(n), algorithm=algorithm)
            assert comm.stats["reduce_scatter"].bytes == reduce_scatter_bytes_sent(b, 8, r, algorithm), (n, algorithm)
        for algorithm in ALGORITHMS["all_gather"]:
            comm.reset_stats()
            comm.all_gather(np.ones(b[r + 1] - b[r]), sizes=np.diff(b).tolist(), algorithm=algorithm)
            assert comm.stats["all_gather"].bytes == all_gather_bytes_sent(b, 8, r, algorithm), (n, algorithm)
        if p & (p - 1) == 0 and n % p == 0:  # powers of two, even chunks: halving/doubling send what the ring sends
            assert reduce_scatter_bytes_sent(b, 8, r, "recursive_halving") == (p - 1) * n * 8 // p
            assert all_reduce_bytes_sent(n, 8, p, r, "rabenseifner") == 2 * (p - 1) * n * 8 // p
            assert all_gather_bytes_sent(b, 8, r, "bruck") == (p - 1) * n * 8 // p
    for async_op in (False, True):  # the time recorded is the call's own: positive, within the wall time around it
        comm.reset_stats()
        start = time.perf_counter()
        handle = comm.all_reduce(np.ones(4), async_op=async_op)
        if async_op:
            handle.wait()
        wall = time.perf_counter() - start
        assert comm.stats["all_reduce"].calls == 1 and 0 < comm.stats["all_reduce"].seconds <= wall
    for sizes in ([2] * p, [3] * (p + 1)):  # this rank's count must be x.size, one count per rank: refused locally
        with pytest.raises(ValueError, match="all_gather: sizes"):
            comm.all_gather(np.ones(3), sizes=sizes)


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 6, 7, 8])
def test_collectives_match_mpi(p):
    """Every collective (all-reduce, reduce-scatter, all-gather — also in place —, broadcast, reduce, barrier,
    all-to-all(-v)) against MPI's own, in one launch per p: starting p ranks costs seconds."""
    run_ranks(p, _every_collective_check, timeout=300)


def _every_collective_check():
    for check in (_all_reduce_grid, _reduce_scatter_and_all_gather_grid, _broadcast_reduce_barrier_grid,
                  _non_contiguous_and_multidimensional, _byte_accounting, _in_place_all_gather, _all_to_all_grid):
        check()


# ------------------------------------------------------------------------------ async and split


def _async_progresses_without_wait():
    comm = Communicator()
    x = np.full(1 << 20, float(comm.rank))  # 8 MiB: the ring
    handle = comm.all_reduce(x, async_op=True)
    compute = np.random.default_rng(0).standard_normal((128, 128))
    iterations = 0
    while not handle.is_completed():  # the main thread never calls into MPI here
        compute = np.tanh(compute @ compute * 0.01)
        iterations += 1
        assert iterations < 10**6, "async all-reduce made no progress while the caller computed"
    assert handle.wait() is x
    np.testing.assert_array_equal(x, sum(range(comm.size)))
    # queued async work, then a blocking call: all run in order
    bufs = [np.full(1000 + k, float(k + comm.rank)) for k in range(5)]
    handles = [comm.all_reduce(b, op="max", async_op=True) for b in bufs]
    y = comm.all_reduce(np.ones(3))
    np.testing.assert_array_equal(y, comm.size)
    for k, (h, b) in enumerate(zip(handles, bufs)):
        h.wait()
        np.testing.assert_array_equal(b, k + comm.size - 1)
    gathered = comm.all_gather(np.array([comm.rank]), async_op=True).wait()
    np.testing.assert_array_equal(gathered, np.arange(comm.size))


def _split_and_p2p():
    comm = Communicator()
    r, p = comm.rank, comm.size
    sub = comm.split(color=r % 2)
    ref = comm.mpi.Split(r % 2, r).allreduce(r)
    np.testing.assert_array_equal(sub.all_reduce(np.array([r])), [ref])
    # point-to-point, including a strided source and destination
    if p >= 2 and r < 2:
        peer = 1 - r
        out = np.arange(20.0).reshape(4, 5)[:, ::2] * (r + 1)
        into = np.zeros((4, 5))
        send = comm.isend(out, peer, tag=3)
        recv = comm.irecv(into[:, ::2], peer, tag=3)
        recv.wait()
        send.wait()
        np.testing.assert_array_equal(into[:, ::2], np.arange(20.0).reshape(4, 5)[:, ::2] * (peer + 1))
        comm.send(np.array([r]), peer, tag=4)
        got = comm.recv(np.empty(1, np.int64), peer, tag=4)
        assert got[0] == peer and comm.stats["p2p"].bytes == out.nbytes + 8


def _bad_arguments():
    comm = Communicator()
    with pytest.raises(ValueError, match="unknown reduction"):
        comm.all_reduce(np.ones(2), op="prod")
    with pytest.raises(TypeError, match="floating-point"):
        comm.all_reduce(np.ones(2, np.int32), op="avg")
    with pytest.raises(ValueError, match="root 9"):
        comm.broadcast(np.ones(2), root=9)
    with pytest.raises(ValueError, match="sizes"):
        comm.all_gather(np.ones(2), sizes=[1] * comm.size)
    x = np.ones(2 * comm.size)
    with pytest.raises(ValueError, match="must not overlap"):
        comm.reduce_scatter(x, out=x[:2])
    with pytest.raises(ValueError, match="color -1 is negative"):
        comm.split(color=-1)


def _p2p_beside_an_async_collective():
    """Bytes sent point-to-point on the main thread while the communication thread runs a collective are
    filed under "p2p", not into the collective: each keeps its exact count."""
    comm = Communicator(MPI.COMM_WORLD.Dup())
    r, p = comm.rank, comm.size
    comm.reset_stats()
    x = np.ones(1 << 18)  # 2 MiB: the ring, many steps
    handle = comm.all_reduce(x, algorithm="ring", async_op=True)
    message = np.full(1000, float(r))
    for _ in range(20):
        sending = comm.isend(message.copy(), (r + 1) % p, tag=5)
        comm.recv(message, (r - 1) % p, tag=5)
        sending.wait()
    handle.wait()
    assert (x == p).all() and message[0] == (r - 20) % p
    assert comm.stats["p2p"].bytes == 20 * message.nbytes
    assert comm.stats["all_reduce"].bytes == all_reduce_bytes_sent(x.size, 8, p, r, "ring")


@pytest.mark.parametrize("p", [3, 4])
def test_async_split_p2p(p):
    run_ranks(p, _async_split_p2p_and_bad_arguments, timeout=180)


def _async_split_p2p_and_bad_arguments():
    for check in (_async_progresses_without_wait, _split_and_p2p, _bad_arguments, _p2p_beside_an_async_collective):
        check()


# ----------------------------------------------------------------------------------- debug mode


def _mismatched_collectives():
    comm = Communicator()
    assert comm.debug
    comm.all_reduce(np.ones(4))  # agreed: passes
    try:
        if comm.rank == 1:
            comm.all_gather(np.ones(4, np.float32))
        else:
            comm.all_reduce(np.ones(4))
    except CollectiveMismatch as e:
        message = str(e)
    else:
        raise AssertionError("the mismatch went undetected")
    assert "collective mismatch at #1" in message
    assert "rank 0 called all_reduce(dtype=float64, shape=(4,)" in message
    assert "rank 1 called all_gather(dtype=float32" in message and "test_collectives.py:" in message


def _mismatched_shapes():
    comm = Communicator()
    try:
        comm.all_reduce(np.ones(4 + (comm.rank == comm.size - 1)))
    except CollectiveMismatch as e:
        assert f"rank {comm.size - 1} called all_reduce(dtype=float64, shape=(5,)" in str(e)
    else:
        raise AssertionError("the shape mismatch went undetected")


def _mismatched_algorithms():
    comm = Communicator()
    try:
        comm.all_reduce(np.ones(8), algorithm="ring" if comm.rank else "recursive_doubling")
    except CollectiveMismatch as e:
        assert "algorithm=ring" in str(e) and "algorithm=recursive_doubling" in str(e), str(e)
    else:
        raise AssertionError("ranks running different algorithms went undetected")


def _read_only_buffers_fail_before_any_message():
    """A read-only buffer is refused on the rank that holds it before anything is sent: with every rank's read-only
    (p = 3, 5 under recursive doubling hung), every rank raises; the next collective still works."""
    comm = Communicator()
    frozen = np.ones(6)
    frozen.flags.writeable = False
    for algorithm in ("ring", "recursive_doubling", "rabenseifner"):
        with pytest.raises(ValueError, match="all_reduce: its buffer is read-only"):
            comm.all_reduce(frozen, algorithm=algorithm)
    with pytest.raises(ValueError, match="reduce_scatter: out is read-only"):
        comm.reduce_scatter(np.ones(2 * comm.size), out=frozen[:2])
    with pytest.raises(ValueError, match="broadcast: its buffer is read-only"):
        comm.broadcast(frozen)
    x = np.ones(6)
    comm.all_reduce(x)
    assert (x == comm.size).all() and comm.all_gather(frozen).size == 6 * comm.size  # reading one is fine


@pytest.mark.parametrize("p", [2, 3, 5])
def test_read_only_buffers_fail_before_any_message(p):
    run_ranks(p, _read_only_buffers_fail_before_any_message)


def _one_rank_skips():
    comm = Communicator()
    if comm.rank != 1:
        try:
            comm.all_reduce(np.ones(2))
        except CollectiveMismatch as e:
            assert "rank(s) [1] did not arrive within 2 s" in str(e)
        else:
            raise AssertionError("the missing rank went undetected")
    MPI.COMM_WORLD.Barrier()


@pytest.mark.slow  # 5 s of 2- and 3-rank runs: the full suite runs it (the fast subset stays under 3 minutes)
@pytest.mark.parametrize("p", [2, 3])
def test_debug_mode_names_both_sides(p):
    env = {"MINIPAR_DEBUG": "1", "MINIPAR_DEBUG_TIMEOUT": "2"}
    run_ranks(p, _mismatched_collectives, env=env, timeout=60)
    run_ranks(p, _mismatched_shapes, env=env, timeout=60)
    run_ranks(p, _mismatched_algorithms, env=env, timeout=60)
    run_ranks(p, _one_rank_skips, env=env, timeout=60)


def test_chunk_bounds():
    assert chunk_bounds(0, 3) == [0, 0, 0, 0]
    assert chunk_bounds(2, 4) == [0, 1, 2, 2, 2]
    assert chunk_bounds(10, 3) == [0, 4, 7, 10]
    assert [len(a) for a in np.array_split(np.arange(10), 3)] == [4, 3, 3]


def _issue_order_with_submitted_work(seed, with_repro):
    """A program every rank runs identically — submitted functions that issue collectives, async and
    blocking collectives on the main thread, in a random order — but with rank-dependent sleeps, so the
    threads interleave differently on every rank. Each result must equal MPI's."""
    import time

    comm = Communicator(MPI.COMM_WORLD.Dup())
    rank, p = comm.rank, comm.size
    if with_repro:  # the reported hang: rank 1 is late inside its submitted function, rank 0 on the main thread
        x, y = np.full(3, rank + 1.0), np.full(5, 10.0 * (rank + 1))
        h1 = comm.submit(lambda: (time.sleep(0.2 if rank == 1 else 0), comm.all_reduce(x))[1])
        time.sleep(0.1 if rank == 0 else 0)
        h2 = comm.all_reduce(y, async_op=True)
        h1.wait(), h2.wait()
        assert (x == p * (p + 1) / 2).all() and (y == 10 * p * (p + 1) / 2).all()
    program = np.random.default_rng(seed)          # the same on every rank
    jitter = np.random.default_rng((seed, rank))   # different on every rank
    expected, handles, arrays = [], [], []

    def nap():
        time.sleep(float(jitter.uniform(0, 0.02)))

    for i in range(12):
        kind = program.choice(["submit", "async", "blocking"])
        n = int(program.integers(1, 40))
        data = [np.arange(n, dtype=np.float64) * (i + 1) + r for r in range(p)]
        total = np.sum(data, axis=0)
        if kind == "submit":
            pieces = int(program.integers(1, 4))
            bufs = [data[rank].copy() for _ in range(pieces)]

            def compound(bufs=bufs):
                for b in bufs:
                    nap()
                    comm.all_reduce(b)
                return bufs
            handles.append(comm.submit(compound))
            arrays.append(None)
            expected.append([total] * pieces)
        else:
            nap()
            buf = data[rank].copy()
            if kind == "async":
                handles.append(comm.all_reduce(buf, async_op=True))
            else:
                comm.all_reduce(buf)
                handles.append(None)
            arrays.append(buf)
            expected.append([total])
    for handle, array, want in zip(handles, arrays, expected):
        got = handle.wait() if handle is not None else None
        results = got if isinstance(got, list) else [array]
        for r, w in zip(results, want):
            np.testing.assert_allclose(r, w, rtol=1e-12)


@pytest.mark.parametrize("p", [2, 3, 5])
def test_submitted_and_main_thread_collectives_keep_issue_order(p):
    run_ranks(p, _issue_orders, [0, 1, 2], timeout=60)


def _issue_orders(seeds):
    for seed in seeds:
        _issue_order_with_submitted_work(seed, seed == 0)


def _hierarchical(per_node):
    """MINIPAR_RANKS_PER_NODE makes one machine several nodes: the hierarchical all-reduce against MPI, its
    bytes against its three phases' formulas, and the cost model's choice of it when nodes are far apart."""
    from minipar.comm.tuning import CostModel

    comm = Communicator(MPI.COMM_WORLD.Dup())
    p, r = comm.size, comm.rank
    q, m = per_node, p // per_node
    assert comm._node_ids() == [k // per_node for k in range(p)]
    for n in (0, 1, q - 1, 7, 13 * p + 5, 40003):
        for dtype in ("float32", "float64", "int64"):
            for op in OPS:
                if op == "avg" and dtype.startswith("int"):
                    continue
                x = _data(r, n, dtype)
                ref, abs_sum = _reference_reduce(comm.mpi, x, op)
                ours = x.copy()
                comm.all_reduce(ours, op=op, algorithm="hierarchical")
                _check_close(ours, ref, abs_sum if op != "max" else 0 * abs_sum, dtype, p, f"hierarchical {op} {dtype} {n}")
                gathered = np.empty((p, n), dtype)
                comm.mpi.Allgather(ours, gathered)
                assert (gathered.view(np.uint8) == ours.view(np.uint8)).all(), "ranks disagree bitwise"
        comm.reset_stats()
        comm.all_reduce(np.ones(n), algorithm="hierarchical")
        local, node_bounds = r % q, chunk_bounds(n, q)
        chunk = node_bounds[local + 1] - node_bounds[local]
        expected = (reduce_scatter_bytes_sent(node_bounds, 8, local, "ring")
                    + all_reduce_bytes_sent(chunk, 8, m, r // q, comm.cross_algorithm(chunk * 8))
                    + all_gather_bytes_sent(node_bounds, 8, local, "ring"))
        assert comm.stats["all_reduce"].bytes == expected
    if q == 1:  # one rank per node: the hierarchical algorithm is just its step across nodes
        return
    # between real nodes the links are slower: then the model picks the hierarchical algorithm by itself
    comm._cost = CostModel(alpha=5e-6, beta=1e-10, gamma=2e-10, alpha_inter=50e-6, beta_inter=1e-9)
    comm._choices.clear()
    x = np.full(1 << 18, r + 1.0)
    comm.all_reduce(x)
    assert comm.stats["all_reduce"].algorithm == "hierarchical" and (x == p * (p + 1) / 2).all()


def _hierarchical_refused_on_uneven_nodes():
    """Asked for by name, the hierarchical all-reduce is refused on nodes of unequal size; chosen by cost — with
    links between nodes slow enough that it would win on even nodes — a flat algorithm runs instead, at every
    size, and equals MPI's sum."""
    from minipar.comm.tuning import CostModel

    comm = Communicator(MPI.COMM_WORLD.Dup())
    with pytest.raises(ValueError, match="several nodes with the same number of ranks"):
        comm.all_reduce(np.ones(3), algorithm="hierarchical")
    comm._cost = CostModel(alpha=5e-6, beta=1e-10, gamma=2e-10, alpha_inter=50e-6, beta_inter=1e-9)
    if comm._node_count() > 1 and comm.size % comm._node_count() == 0:  # the model alone would pick it here
        assert comm._cost.best("all_reduce", 8 << 18, comm.size, comm._node_count()) == "hierarchical"
    for n in (0, 1, comm.size - 1, 1 << 10, 1 << 18):
        x = np.full(n, comm.rank + 1.0)
        comm.all_reduce(x)
        assert comm.stats["all_reduce"].algorithm != "hierarchical" and (x == comm.size * (comm.size + 1) / 2).all()


# bits, exponent field all ones (inf), quiet-NaN bit, per format
FORMATS = {"float16": (16, 0x7C00, 1 << 9), "float32": (32, 0x7F800000, 1 << 22),
           "float64": (64, 0x7FF0000000000000, 1 << 51), "bfloat16": (16, 0x7F80, 1 << 6)}


def _operands(name, r):
    """Rank r's operands where IEEE arithmetic does not commute bitwise: NaNs of both signs with payloads that
    differ by rank (a NaN + a NaN is one of them, which one depends on the operand order), ±0 (max and min of
    equal zeros return one operand), ±inf (+inf + −inf is a NaN whose sign is the hardware's), and ordinary values
    of every magnitude."""
    bits, inf, quiet = FORMATS[name]
    sign = 1 << (bits - 1)
    odd = sign if r % 2 else 0
    nans = [inf | quiet | (1 + r), sign | inf | quiet | (3 * r), odd | inf | quiet | r, (sign ^ odd) | inf | quiet]
    pattern = np.array(nans + [odd, sign ^ odd, sign] + [odd | inf, inf], np.dtype(f"uint{bits}"))
    special = pattern.view(ml_dtypes.bfloat16 if name == "bfloat16" else np.dtype(name))
    ordinary = (np.random.default_rng(r).standard_normal(5) * 4.0 ** r).astype(special.dtype)
    return np.concatenate([special, ordinary])


def _every_rank_gets_the_same_bits():
    """Every all-reduce algorithm — ring, recursive doubling, Rabenseifner, hierarchical (MINIPAR_RANKS_PER_NODE),
    the 16-bit wires — hands every rank the same bytes for sum, max and min of :func:`_operands` in float16, float32,
    float64 and bfloat16: a chunk is reduced on one rank and copied to the rest (ring, Rabenseifner, hierarchical,
    the wires), or both partners of a round combine the same operands in the same order into a buffer that is
    neither (recursive doubling: numpy's in-place loops return different NaNs for out=a and out=b)."""
    comm = Communicator(MPI.COMM_WORLD.Dup())
    algorithms = ["ring", "recursive_doubling", "rabenseifner"] + (["hierarchical"] if os.environ.get(
        "MINIPAR_RANKS_PER_NODE") else [])
    checked = 0
    with np.errstate(invalid="ignore", over="ignore"):
        for name in FORMATS:
            x = _operands(name, comm.rank)
            runs = [(a, op, None) for a in algorithms for op in ("sum", "max", "min")]
            runs += [("ring", "sum", wire) for wire in ("float16", "bfloat16")]
            for algorithm, op, wire in runs:
                if wire and x.dtype.itemsize < 4:  # a 16-bit wire is for wider buffers
                    continue
                got = comm.all_reduce(x.copy(), op=op, algorithm=None if wire else algorithm, wire=wire)
                every = MPI.COMM_WORLD.allgather(got.tobytes())
                assert len(set(every)) == 1, (x.dtype, algorithm, op, wire, [np.frombuffer(b, x.dtype) for b in every])
                checked += 1
    assert checked == 4 * 3 * len(algorithms) + 2 * 2


def test_16_bit_wires_keep_nans_and_state_float16s_range():
    """bfloat16: a NaN whose payload sits in the high bits stays a NaN of its sign (rounding the bits turned it into
    ±0), and every float32 that is no NaN rounds to nearest even as before; float16: the largest finite value
    arrives as itself, |x| ≥ 65520 as ±inf (the documented range), never as a wrong finite number."""
    from minipar.comm.collectives import WireCodec

    bf16 = WireCodec("bfloat16")
    nans = np.array([0x7FFFFFFF, 0xFFFFFFFF, 0x7FC00000, 0x7F800001, 0xFF80FFFF], np.uint32).view(np.float32)
    back = bf16.decode(bf16.encode(nans), np.dtype(np.float32))
    assert np.isnan(back).all() and (np.signbit(back) == np.signbit(nans)).all()
    ordinary = np.random.default_rng(0).standard_normal(10_000).astype(np.float32) * 1e3
    ordinary = np.concatenate([ordinary, [np.inf, -np.inf, 0.0, -0.0, 3.3895314e38]]).astype(np.float32)
    bits = ordinary.view(np.uint32)
    expected = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)  # round half to even, by hand
    assert (bf16.encode(ordinary) == expected).all()
    fp16 = WireCodec("float16")
    x = np.array([65504.0, 65519.0, 65520.0, -70000.0, np.nan])
    got = fp16.decode(fp16.encode(x), np.dtype(np.float64))
    assert got[:2].tolist() == [65504.0, 65504.0] and got[2:4].tolist() == [np.inf, -np.inf] and np.isnan(got[4])


@pytest.mark.parametrize("p", [2, 3, 4, 5, 6, 7, 8])
def test_every_rank_gets_the_same_bits(p):
    run_ranks(p, _every_rank_gets_the_same_bits, timeout=120,
              env={"MINIPAR_RANKS_PER_NODE": "2"} if p % 2 == 0 and p > 2 else None)


@pytest.mark.parametrize("p,per_node", [(4, 2), (6, 2), (6, 3), (8, 2), (8, 4)])
def test_hierarchical_all_reduce(p, per_node):
    run_ranks(p, _hierarchical, per_node, timeout=120, env={"MINIPAR_RANKS_PER_NODE": str(per_node)})


@pytest.mark.parametrize("p,per_node", [(5, 2), (3, 1), (4, 4), (6, 4), (4, 3), (6, 5), (8, 6)])
def test_hierarchical_needs_even_nodes(p, per_node):
    if p % per_node == 0 and p // per_node > 1:  # (3, 1): three one-rank nodes are even; the cross step is all
        run_ranks(p, _hierarchical, per_node, timeout=120, env={"MINIPAR_RANKS_PER_NODE": str(per_node)})
    else:
        run_ranks(p, _hierarchical_refused_on_uneven_nodes, timeout=60, env={"MINIPAR_RANKS_PER_NODE": str(per_node)})


def _two_hosts_on_one_machine():
    """Started as ``mpiexec -launcher fork -hosts localhost,127.0.0.1 -ppn 2 -n 4``: MPICH itself puts ranks
    0, 1 and 2, 3 on two nodes (its shared-memory split says so) and carries the messages between them
    over its network module, as between machines — no MINIPAR_RANKS_PER_NODE. minipar takes the nodes
    from that split, the hierarchical all-reduce matches MPI, the cost model measures the two links
    apart (and caches them under two nodes), and — given a link between the hosts 10× slower than shared
    memory — picks the hierarchical all-reduce for a large buffer by itself. (Which link measures faster on a
    busy 2-core machine is timing, not a property of the code: the test does not assert it.)"""
    import dataclasses
    import glob
    import os

    comm = Communicator()
    p, r = comm.size, comm.rank
    assert "MINIPAR_RANKS_PER_NODE" not in os.environ and comm._node_ids() == [0, 0, 2, 2]
    for n in (0, 5, 40003):
        x = _data(r, n, "float64")
        ref, abs_sum = _reference_reduce(comm.mpi, x, "sum")
        ours = x.copy()
        comm.all_reduce(ours, algorithm="hierarchical")
        _check_close(ours, ref, abs_sum, "float64", p, f"hierarchical across hosts n={n}")
    model = comm.cost_model()
    comm.mpi.Barrier()  # the first rank on each node writes the cache as it returns
    assert glob.glob(os.path.expanduser("~/.cache/minipar/collectives-*-4ranks-2nodes.json"))
    assert all(0 < value < 1 for value in dataclasses.astuple(model)), model  # seconds per message / byte
    comm._cost = dataclasses.replace(model, alpha_inter=10 * model.alpha, beta_inter=10 * model.beta)  # every rank
    x = np.full(1 << 20, r + 1.0)  # 8 MiB
    comm.all_reduce(x)
    assert (x == p * (p + 1) / 2).all()
    assert comm.stats["all_reduce"].algorithm == "hierarchical", comm._cost


def test_two_hosts_on_one_machine(tmp_path):
    """The multi-host recipe of the README (``mpiexec -hosts h1,h2 -ppn 2``), with hydra's fork launcher
    instead of ssh so that both "hosts" are this machine; HOME points at an empty directory so that the
    cost model is measured afresh."""
    run_ranks(4, _two_hosts_on_one_machine, timeout=120, env={"HOME": str(tmp_path)},
              launcher=["-launcher", "fork", "-hosts", "localhost,127.0.0.1", "-ppn", "2"])


def test_cost_model_choices():
    from minipar.comm.tuning import CostModel

    model = CostModel(alpha=5e-6, beta=1e-10, gamma=2e-10, alpha_inter=5e-6, beta_inter=1e-10)
    assert model.best("all_reduce", 1024, 8) == "recursive_doubling"   # latency-bound
    assert model.best("all_reduce", 64 << 20, 8) in ("ring", "rabenseifner")
    assert model.best("all_gather", 1024, 7) == "bruck" and model.best("all_gather", 64 << 20, 2) == "ring"
    assert model.best("reduce_scatter", 1024, 8) == "recursive_halving"
    # no copies: for a power of two, halving and doubling send the ring's bytes in log₂p messages
    assert model.best("reduce_scatter", 64 << 20, 4) == "recursive_halving"
    assert model.best("all_gather", 64 << 20, 8) == "recursive_doubling"
    assert model.best("all_gather", 64 << 20, 6) == "ring"  # the fold's extra n bytes cost more than its messages save
    assert model.best("broadcast", 64 << 20, 8) == "segmented" and model.best("broadcast", 64, 8) == "binomial"
    assert model.time("all_reduce", "hierarchical", 1 << 20, 8, nodes=1) == float("inf")
    far = CostModel(alpha=5e-6, beta=1e-10, gamma=2e-10, alpha_inter=30e-6, beta_inter=1e-9)
    assert far.best("all_reduce", 64 << 20, 16, nodes=2) == "hierarchical"
    # a pipelined broadcast pays α per segment: a link with more latency (inter-node here) takes longer segments
    latent = CostModel(alpha=1e-6, beta=1e-10, gamma=2e-10, alpha_inter=1e-4, beta_inter=1e-10)
    assert latent.segment_bytes(16 << 20, 4, nodes=1) < latent.segment_bytes(16 << 20, 4, nodes=2)


def _measured_model():
    model = Communicator().cost_model()
    assert model.alpha > 0 and model.gamma > 0  # measured: a message and an add take time
    assert (model.alpha_inter, model.beta_inter) == (model.alpha, model.beta)  # one node: its link is the only one


def test_the_cost_model_is_measured_on_a_fresh_machine(tmp_path):
    run_ranks(2, _measured_model, env={"HOME": str(tmp_path)}, timeout=120)  # no cached model under this HOME


@pytest.mark.parametrize("p", [2, 4, 8])
def test_the_cost_models_byte_terms_are_what_each_algorithm_sends(p):
    """With α = γ = 0 and β = 1 s/byte the model's time is the bytes the busiest rank sends: each algorithm's byte
    formula (checked above against the bytes real runs count), for p a power of two and n divisible by p."""
    from minipar.comm.collectives import all_to_all_bytes_sent
    from minipar.comm.tuning import CostModel

    bytes_only = CostModel(alpha=0.0, beta=1.0, gamma=0.0, alpha_inter=0.0, beta_inter=1.0)
    n, bounds = 96 * p, chunk_bounds(96 * p, p)  # n bytes of 1-byte elements
    formulas = {"all_reduce": lambda a, r: all_reduce_bytes_sent(n, 1, p, r, a),
                "reduce_scatter": lambda a, r: reduce_scatter_bytes_sent(bounds, 1, r, a),
                "all_gather": lambda a, r: all_gather_bytes_sent(bounds, 1, r, a),
                "all_to_all": lambda a, r: all_to_all_bytes_sent([n // p] * p, 1, r, a)}
    for collective, sent in formulas.items():
        for algorithm in ALGORITHMS[collective]:
            if algorithm != "hierarchical":  # several nodes: its phases are the ring's
                busiest = max(sent(algorithm, r) for r in range(p))
                assert bytes_only.time(collective, algorithm, n, p) == busiest, (collective, algorithm)


def _in_place_all_gather():
    comm = Communicator()
    p, r = comm.size, comm.rank
    counts = [3 * k + 1 for k in range(p)]
    offsets = np.cumsum([0, *counts])
    out = np.full(offsets[-1], -1.0)
    out[offsets[r]:offsets[r + 1]] = r
    for algorithm in ALGORITHMS["all_gather"]:
        result = comm.all_gather(out[offsets[r]:offsets[r + 1]], sizes=counts, algorithm=algorithm, out=out)
        assert result is out
        np.testing.assert_array_equal(out, np.repeat(np.arange(p, dtype=float), counts))


def _all_to_all_grid():
    """all_to_all and all_to_all_v against MPI's Alltoall/Alltoallv: equal blocks of 0, 1, 3 and 100 elements,
    uneven counts with zeros, n < p, int and float dtypes, both algorithms, async; bytes against the formulas."""
    from minipar.comm.collectives import all_to_all_bytes_sent

    comm = Communicator()
    p, r = comm.size, comm.rank
    for dtype in ("float32", "float64", "int32", "int64"):
        for c in (0, 1, 3, 100):
            x = _data(r, p * c, dtype, seed=c)
            ref = np.empty_like(x)
            comm.mpi.Alltoall(x, ref)
            for algorithm in (*ALGORITHMS["all_to_all"], None):
                comm.reset_stats()
                np.testing.assert_array_equal(comm.all_to_all(x, algorithm=algorithm), ref)
                used = comm.stats["all_to_all"].algorithm
                assert comm.stats["all_to_all"].bytes == all_to_all_bytes_sent([c] * p, x.itemsize, r, used)
            handle = comm.all_to_all(x.reshape(p, c), async_op=True)
            np.testing.assert_array_equal(handle.wait(), ref)
        rng = np.random.default_rng((7, r))
        for pattern in ("random", "zeros", "tiny"):
            if pattern == "random":
                send = rng.integers(0, 6, p)
            elif pattern == "zeros":
                send = np.where(np.arange(p) % 2 == r % 2, 0, rng.integers(1, 4, p))
            else:  # n < p: at most one element to one rank
                send = np.zeros(p, np.int64)
                send[(r + 1) % p] = 1 if r % 2 == 0 else 0
            x = _data(r, int(send.sum()), dtype, seed=11)
            recv = np.empty(p, np.int64)
            comm.mpi.Alltoall(send.astype(np.int64), recv)
            ref = np.empty(int(recv.sum()), dtype)
            comm.mpi.Alltoallv([x, send.tolist()], [ref, recv.tolist()])
            comm.reset_stats()
            np.testing.assert_array_equal(comm.all_to_all_v(x, send.tolist()), ref)
            assert comm.stats["all_to_all_v"].bytes == all_to_all_bytes_sent(send.tolist(), x.itemsize, r, "pairwise")
            np.testing.assert_array_equal(comm.all_to_all_v(x, send.tolist(), recv.tolist(), async_op=True).wait(), ref)
    if p > 1:
        with pytest.raises(ValueError, match="equal blocks"):
            comm.all_to_all(np.ones(p + 1))
    with pytest.raises(ValueError, match="summing to x.size"):
        comm.all_to_all_v(np.ones(3), [1] * p if p != 3 else [2] * p)


def test_byte_formulas_refuse_an_unknown_algorithm():
    from minipar.comm.collectives import all_reduce_bytes_sent

    for name in ("bogus", "hierarchical", "ring "):  # hierarchical's bytes are the sum of its phases, not a formula here
        with pytest.raises(ValueError, match="no byte formula"):
            all_reduce_bytes_sent(8, 8, 4, 0, name)
