"""A communicator: point-to-point messages over mpi4py, the collectives of ``collectives.py`` on top,
byte/time accounting per operation, asynchronous handles, and a debug-mode mismatch/hang detector.

    comm = Communicator()                       # MPI.COMM_WORLD
    comm.all_reduce(grad, op="avg")             # in place, blocking
    h = comm.all_reduce(bucket, async_op=True)  # returns at once; a communication thread runs it
    ...compute...
    h.wait()
    print(comm.stats["all_reduce"].bytes)       # bytes this rank sent inside all-reduces

Execution model. Collectives on one communicator run one at a time, in call order, on every rank:
a blocking call runs on the caller's thread when nothing is queued, otherwise it queues behind
the pending async work and waits. Async calls go to a per-communicator FIFO worker thread that
makes the blocking MPI calls (mpi4py releases the GIL inside them, numpy releases it inside
reductions), so communication progresses while the main thread computes. Needs
MPI_THREAD_MULTIPLE, which mpi4py requests by default.

Cores. Creating the world communicator with p > 1 ranks calls ``backend.share_cores`` so the
ranks on one machine split its cores for BLAS instead of oversubscribing them (an explicit
OPENBLAS_NUM_THREADS / OMP_NUM_THREADS wins).

Arrays. Messages travel as raw bytes, so any numpy dtype works; reductions are numpy ufuncs on
the host. cupy arrays are staged: copied to the host (which synchronizes the stream) before any
MPI call and copied back after.

Watchdog (:func:`start_watchdog`, ``train --comm-timeout``, as NCCL's). Every blocking wait on a peer — a
send, a receive, a send-receive, an async handle's wait — records whom it waits for, in which collective;
a daemon thread looks once a second, and a wait older than the timeout prints "rank r waited T s in
<collective> (<label>) on <communicator> for rank q, which did not answer" and aborts the job
(``MPI_Abort``): a stopped, deadlocked or diverged rank ends the run instead of hanging it.

Debug mode (``MINIPAR_DEBUG=1``). Before every collective the ranks send (sequence number, op,
dtype, shape, call site) to rank 0, which compares them and answers; a mismatch raises a
``CollectiveMismatch`` on every rank naming both sides, and a rank that does not arrive within
``MINIPAR_DEBUG_TIMEOUT`` seconds (default 60) is reported as missing instead of hanging the job.
"""
from __future__ import annotations

import itertools
import json
import os
import queue
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from minipar.backend import is_low_precision, on_gpu, share_cores, to_host
from minipar.comm import collectives as algo
from minipar.comm import tuning

COLLECTIVE_TAG_BASE = 1 << 16  # user point-to-point tags must stay below this
_DEBUG_TAG, _VERDICT_TAG = COLLECTIVE_TAG_BASE - 2, COLLECTIVE_TAG_BASE - 1
_SIGNATURE_BYTES = 4096
_COMM_DIR = os.path.dirname(os.path.abspath(__file__))


ALL_REDUCE = {"ring": algo.ring_all_reduce, "recursive_doubling": algo.recursive_doubling_all_reduce,
              "rabenseifner": algo.rabenseifner_all_reduce}
ALL_GATHER = {"ring": algo.ring_all_gather, "recursive_doubling": algo.recursive_doubling_all_gather,
              "bruck": algo.bruck_all_gather}
_SHARED_NODE = 0  # this process's node, from MPI_Comm_split_type(SHARED) when the world communicator is made


def node_id() -> int:
    """This rank's node: ``MINIPAR_RANKS_PER_NODE`` = k makes world ranks [ik, (i+1)k) node i (one machine
    acting as several, for tests and tutorials); otherwise the shared-memory node MPI reports."""
    per_node = os.environ.get("MINIPAR_RANKS_PER_NODE")
    if per_node:
        if not per_node.isdigit() or int(per_node) < 1:
            raise ValueError(f"MINIPAR_RANKS_PER_NODE must be a positive integer, got {per_node!r}")
        return MPI.COMM_WORLD.Get_rank() // int(per_node)
    return _SHARED_NODE


class CollectiveMismatch(RuntimeError):
    """Ranks called different collectives (or shapes/dtypes) at the same point, or one never arrived."""


@dataclass
class OpStats:
    calls: int = 0
    bytes: int = 0  # bytes this rank sent
    seconds: float = 0.0
    algorithm: str | None = None  # the algorithm of the latest call (collectives that have several)


class _Running:
    """The collective a communicator is executing: the thread running it (None: none), the bytes it has
    sent so far and its algorithm. Collectives on one communicator execute one at a time, so one record
    suffices; a point-to-point call from another thread meanwhile is not counted into it."""

    __slots__ = ("thread", "sent", "algorithm", "name")

    def __init__(self) -> None:
        self.thread: int | None = None
        self.sent = 0
        self.algorithm: str | None = None
        self.name = ""  # "all_reduce (grads)": what the watchdog reports


class _Waits:
    """What every thread of this process is blocked on now: thread -> (what, peer's world rank, since)."""

    def __init__(self) -> None:
        self.lock, self.now = threading.Lock(), {}
        self.timeout = 0.0  # 0: no watchdog

    def begin(self, what: str, peer: int) -> None:
        if self.timeout:
            with self.lock:
                self.now[threading.get_ident()] = (what, peer, time.monotonic())

    def end(self) -> None:
        if self.timeout:
            with self.lock:
                self.now.pop(threading.get_ident(), None)

    def oldest(self) -> tuple[str, int, float] | None:
        with self.lock:
            return min(self.now.values(), key=lambda w: w[2], default=None)


_WAITS = _Waits()


def start_watchdog(timeout: float) -> None:
    """Abort the job when any wait on a peer lasts longer than ``timeout`` seconds (module docstring); once per
    process, from any thread. 0 (or less) turns it off."""
    first = not _WAITS.timeout
    _WAITS.timeout = max(0.0, float(timeout))
    if not first or not _WAITS.timeout:
        return

    def watch() -> None:
        while True:
            time.sleep(min(1.0, _WAITS.timeout / 10))
            oldest = _WAITS.oldest()
            if oldest is not None and time.monotonic() - oldest[2] > _WAITS.timeout:
                what, peer, since = oldest
                me = MPI.COMM_WORLD.Get_rank()
                print(f"minipar: rank {me} waited {time.monotonic() - since:.0f} s in {what} for rank {peer}, which "
                      f"did not answer (--comm-timeout {_WAITS.timeout:g}); aborting the job", file=sys.stderr, flush=True)
                time.sleep(0.5)  # let mpiexec forward the line: MPI_Abort's kill can overtake the rank's output
                MPI.COMM_WORLD.Abort(3)
                os._exit(3)  # should MPI_Abort come back, this loop must not report again

    threading.Thread(target=watch, name="minipar-watchdog", daemon=True).start()


class Handle:
    """The future of an async operation: ``wait()`` blocks until it is done and returns its result."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None

    def _finish(self, result: Any = None, error: BaseException | None = None) -> None:
        self._result, self._error = result, error
        self._done.set()

    @classmethod
    def completed(cls, result: Any) -> Handle:
        """A handle whose operation is already done, e.g. one restored from a checkpoint."""
        handle = cls()
        handle._finish(result)
        return handle

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self) -> Any:
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._result


class _Worker:
    """One FIFO communication thread: runs submitted callables in order."""

    def __init__(self, name: str):
        self.queue: queue.Queue = queue.Queue()
        self.pending = 0
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def submit(self, fn: Callable[[], Any]) -> Handle:
        handle = Handle()
        with self.lock:
            self.pending += 1
        self.queue.put((fn, handle))
        return handle

    def _loop(self) -> None:
        while True:
            fn, handle = self.queue.get()
            try:
                handle._finish(fn())
            except BaseException as e:  # noqa: BLE001 (re-raised by handle.wait in the caller)
                handle._finish(error=e)
            finally:
                with self.lock:
                    self.pending -= 1


class Communicator:
    """``rank``/``size`` over an mpi4py communicator, with p2p, collectives and per-op accounting."""

    def __init__(self, mpi_comm: MPI.Comm | None = None, name: str = "world"):
        self.mpi = mpi_comm if mpi_comm is not None else MPI.COMM_WORLD
        self.rank, self.size, self.name = self.mpi.Get_rank(), self.mpi.Get_size(), name
        self.stats: dict[str, OpStats] = {}
        self.debug = os.environ.get("MINIPAR_DEBUG", "0") not in ("", "0")
        self.debug_timeout = float(os.environ.get("MINIPAR_DEBUG_TIMEOUT", "60"))
        self._sequence = 0
        self._nodes: list[int] | None = None      # node of every rank (first algorithm choice)
        self._cost: tuning.CostModel | None = None
        self._levels: Any = None                  # (node, cross) communicators, False: not hierarchical
        self._choices: dict[tuple[str, int], str] = {}
        self._worker: _Worker | None = None
        self._running = _Running()  # the collective executing now (one at a time per communicator)
        self._stats_lock = threading.Lock()
        self._world_ranks = MPI.Group.Translate_ranks(self.mpi.Get_group(), list(range(self.size)),
                                                      MPI.COMM_WORLD.Get_group())
        if mpi_comm is None and self.size > 1:
            global _SHARED_NODE
            node = self.mpi.Split_type(MPI.COMM_TYPE_SHARED)
            share_cores(node.Get_size())
            _SHARED_NODE = node.allreduce(self.rank, op=MPI.MIN)  # a node is named by its first world rank
            node.Free()

    def __repr__(self) -> str:
        return f"Communicator({self.name}, rank {self.rank} of {self.size})"

    def split(self, color: int, key: int | None = None, name: str | None = None) -> Communicator:
        """Ranks with equal ``color`` (≥ 0) form a new communicator, ordered by ``key`` (default: current rank)."""
        if color < 0:  # the MPI standard allows colors >= 0 (or MPI_UNDEFINED); MPICH does not check
            raise ValueError(f"split: color {color} is negative; colors are integers >= 0")
        sub = self.mpi.Split(color, self.rank if key is None else key)
        return Communicator(sub, name or f"{self.name}/{color}")

    # ------------------------------------------------------------------------------ accounting
    def _record(self, op: str, nbytes: int = 0, seconds: float = 0.0, call: bool = False,
                algorithm: str | None = None) -> None:
        with self._stats_lock:
            s = self.stats.get(op)
            if s is None:
                s = self.stats[op] = OpStats()
            s.bytes += nbytes
            s.seconds += seconds
            s.calls += call
            if algorithm is not None:
                s.algorithm = algorithm

    def reset_stats(self) -> None:
        with self._stats_lock:
            self.stats.clear()  # cleared in place: sub-communicator views share the dict

    def bytes_sent(self, op: str | None = None) -> int:
        """Bytes this rank sent in operation ``op`` (every operation when None)."""
        with self._stats_lock:
            return sum(s.bytes for k, s in self.stats.items() if op is None or k == op)

    # ------------------------------------------------------------------- point-to-point (host)
    def _sent(self, nbytes: int, label: str | None = None) -> None:
        """Count ``nbytes`` sent: inside a collective (and without a label of its own) into the collective's
        running total, recorded once when it ends; otherwise at once, under ``label`` or "p2p"."""
        running = self._running
        if label is None and running.thread == threading.get_ident():
            running.sent += nbytes
        else:
            self._record(label or "p2p", nbytes)

    def _waiting(self, peer: int) -> None:
        """Tell the watchdog this thread now blocks on ``peer`` (a rank of this communicator). Callers test
        ``_WAITS.timeout`` first, so that with the watchdog off a blocking call costs no Python call more."""
        running = self._running
        what = (f"{running.name} on communicator {self.name}" if running.thread == threading.get_ident()
                else f"a point-to-point message on communicator {self.name}")
        _WAITS.begin(what, self._world_ranks[peer])

    def sendrecv(self, send: np.ndarray, dest: int, recv: np.ndarray, source: int, tag: int) -> None:
        """Send ``send`` to ``dest`` while receiving ``recv`` from ``source`` (contiguous host arrays)."""
        if _WAITS.timeout:
            self._waiting(source)
        self.mpi.Sendrecv([send, MPI.BYTE], dest, tag, [recv, MPI.BYTE], source, tag)
        if _WAITS.timeout:
            _WAITS.end()
        self._sent(send.nbytes)

    def send(self, x: Any, dest: int, tag: int = 0, label: str | None = None) -> None:
        """Blocking send of an xp array (cupy arrays are staged through the host); bytes filed under ``label``."""
        host = np.ascontiguousarray(to_host(x))
        if _WAITS.timeout:
            self._waiting(dest)
        self.mpi.Send([host, MPI.BYTE], dest, tag)
        if _WAITS.timeout:
            _WAITS.end()
        self._sent(host.nbytes, label)

    def recv(self, x: Any, source: int, tag: int = 0) -> Any:
        """Blocking receive into the preallocated xp array ``x``; returns ``x``."""
        direct = not on_gpu(x) and x.flags.c_contiguous
        host = x if direct else np.empty(x.shape, x.dtype)
        if _WAITS.timeout:
            self._waiting(source)
        self.mpi.Recv([host, MPI.BYTE], source, tag)
        if _WAITS.timeout:
            _WAITS.end()
        if not direct:
            x[...] = _like(x, host)
        return x

    def isend(self, x: Any, dest: int, tag: int = 0, label: str | None = None) -> Handle:
        """Non-blocking send; the handle's ``wait()`` returns when the buffer may be reused."""
        host = np.ascontiguousarray(to_host(x))
        request = self.mpi.Isend([host, MPI.BYTE], dest, tag)
        self._sent(host.nbytes, label)
        return _RequestHandle(request, keep_alive=host, waits=(self, dest))

    def irecv(self, x: Any, source: int, tag: int = 0) -> Handle:
        """Non-blocking receive into ``x``; ``wait()`` returns ``x`` once the data has arrived."""
        direct = not on_gpu(x) and x.flags.c_contiguous
        host = x if direct else np.empty(x.shape, x.dtype)
        request = self.mpi.Irecv([host, MPI.BYTE], source, tag)
        finish = None if direct else (lambda: x.__setitem__(Ellipsis, _like(x, host)))
        return _RequestHandle(request, keep_alive=host, on_complete=finish, result=x, waits=(self, source))

    # ------------------------------------------------------------------------------ collectives
    def all_reduce(self, x: Any, op: str = "sum", async_op: bool = False, algorithm: str | None = None,
                   label: str | None = None, wire: str | None = None) -> Any:
        """Reduce ``x`` over all ranks, in place; every rank ends with the result (returns ``x``).

        ``algorithm``: "ring" (2(p−1)/p·n bytes sent per rank), "recursive_doubling" (log₂p·n),
        "rabenseifner" (2(p'−1)/p'·n in 2log₂p' messages), "hierarchical" (ring inside each node,
        all-reduce of n/q across nodes), or None: the fastest by this machine's cost model
        (``minipar/comm/tuning.py``). ``label`` (every collective takes one) files the call's bytes
        and time under that name in ``stats`` instead of the operation's, e.g. "grads" vs "loss".
        ``wire`` ("float16" / "bfloat16") sends a float buffer in 16 bits over the ring
        (accumulating in its own precision): half the bytes.
        """
        self._check_op(op, x)
        if wire is not None:
            if not np.issubdtype(x.dtype, np.floating) or op not in ("sum", "avg"):
                raise ValueError("a 16-bit wire format needs a float array and op 'sum' or 'avg'")
            codec = algo.WireCodec(wire)
            return self._collective("all_reduce", x, async_op, lambda buf, tag: algo.ring_all_reduce(self, buf, op, tag, codec),
                                    label, op=op, wire=wire)
        self._check_algorithm("all_reduce", algorithm)

        def run(buf: np.ndarray, tag: int) -> None:
            chosen = self._algorithm("all_reduce", buf.nbytes, algorithm)
            if chosen == "hierarchical":
                node, cross = self._hierarchy()
                algo.hierarchical_all_reduce(node, cross, buf, op, tag, self.size, self._cross_all_reduce)
            else:
                ALL_REDUCE[chosen](self, buf, op, tag)

        return self._collective("all_reduce", x, async_op, run, label, op=op, algorithm=algorithm)

    def reduce_scatter(self, x: Any, op: str = "sum", async_op: bool = False, label: str | None = None,
                       algorithm: str | None = None, out: Any = None) -> Any:
        """Reduce ``x`` (flattened, n elements) over all ranks; rank r returns chunk r (a 1-D array, or ``out``).

        Chunks follow ``numpy.array_split(n, p)``. ``x`` itself is left unchanged; ``out`` must not overlap it.
        "ring": p−1 steps, (p−1)/p·n bytes sent per rank, two chunks of scratch; "recursive_halving":
        log₂p steps, the same bytes for a power of two, scratch halving n/2, n/4, …; None: by the cost model.
        Neither copies ``x``; the last chunk to arrive lands in ``out`` directly.
        """
        self._check_op(op, x)
        self._check_algorithm("reduce_scatter", algorithm)
        b = algo.chunk_bounds(x.size, self.size)
        mine = b[self.rank + 1] - b[self.rank]
        if out is not None:
            if out.shape != (mine,) or out.dtype != x.dtype:
                raise ValueError(f"reduce_scatter: out must be a ({mine},) {x.dtype} array")
            if not on_gpu(out) and not on_gpu(x) and np.may_share_memory(out, x):  # numpy cannot look at cupy memory
                raise ValueError("reduce_scatter: out must not overlap x")

        def run(buf: np.ndarray, tag: int) -> np.ndarray:
            target = out if out is not None and not on_gpu(out) else np.empty(mine, buf.dtype)
            if self._algorithm("reduce_scatter", buf.nbytes, algorithm) == "ring":
                return algo.ring_reduce_scatter(self, buf, op, tag, b, out=target)
            return algo.recursive_halving_reduce_scatter(self, buf, op, tag, b, target)

        result = self._collective("reduce_scatter", x, async_op, run, label, op=op, in_place=False, algorithm=algorithm,
                                  out=out)
        return result if out is None or not on_gpu(out) or async_op else _copy_into(out, result)

    def all_gather(self, x: Any, sizes: list[int] | None = None, async_op: bool = False,
                   label: str | None = None, algorithm: str | None = None, out: Any = None) -> Any:
        """Concatenate every rank's ``x`` (flattened) in rank order; returns a new 1-D array on every rank
        (or fills ``out``, which saves allocating the result).

        In place: when ``x`` already is this rank's slice of ``out`` (``out[offset:offset + x.size]``), nothing
        is copied. ``sizes[r]`` is rank r's element count (default: all equal to ``x.size``). Each algorithm
        sends (p−1)/p·n bytes per rank of the n-element result (p a power of two), receiving straight into
        place: "ring" in p−1 steps, "recursive_doubling" in log₂p (more bytes for folded ranks when p is
        not a power of two), "bruck" in ⌈log₂p⌉ plus one local rotation; None: by the cost model.
        """
        sizes = [x.size] * self.size if sizes is None else list(sizes)
        if len(sizes) != self.size or sizes[self.rank] != x.size:
            raise ValueError(f"all_gather: sizes {sizes} must list {self.size} counts with sizes[{self.rank}] = {x.size}")
        self._check_algorithm("all_gather", algorithm)
        bounds = list(itertools.accumulate(sizes, initial=0))
        if out is not None and (out.shape != (bounds[-1],) or out.dtype != x.dtype):
            raise ValueError(f"all_gather: out must be a ({bounds[-1]},) {x.dtype} array")

        def run(local: np.ndarray, tag: int) -> np.ndarray:
            result = out if out is not None and not on_gpu(out) else np.empty(bounds[-1], dtype=local.dtype)
            mine = result[bounds[self.rank]:bounds[self.rank + 1]]
            if mine.size and MPI.buffer(mine).address != MPI.buffer(local).address:  # in place: already there
                mine[...] = local
            ALL_GATHER[self._algorithm("all_gather", result.nbytes, algorithm)](self, result, tag, bounds)
            return result

        result = self._collective("all_gather", x, async_op, run, label, in_place=False, same_shape=False, sizes=sizes,
                                  algorithm=algorithm, out=out)
        return result if out is None or not on_gpu(out) or async_op else _copy_into(out, result)

    def all_to_all(self, x: Any, async_op: bool = False, label: str | None = None, algorithm: str | None = None) -> Any:
        """Rank r's ``x`` (flattened, n = p·c elements) is p blocks of c; block j goes to rank j. Returns a new
        1-D array whose block i came from rank i (MPI_Alltoall). "pairwise": p−1 rounds, (p−1)/p·n bytes sent;
        "bruck": ⌈log₂p⌉ rounds, ⌈log₂p⌉·n/2 bytes; None: by the cost model."""
        if x.size % self.size:
            raise ValueError(f"all_to_all: {x.size} elements do not split into {self.size} equal blocks; "
                             "use all_to_all_v for uneven counts")
        self._check_algorithm("all_to_all", algorithm)
        bounds = [k * (x.size // self.size) for k in range(self.size + 1)]

        def run(buf: np.ndarray, tag: int) -> np.ndarray:
            out = np.empty_like(buf)
            if self._algorithm("all_to_all", buf.nbytes, algorithm) == "pairwise":
                algo.pairwise_all_to_all(self, buf, out, bounds, bounds, tag)
            else:
                algo.bruck_all_to_all(self, buf, out, tag)
            return out

        return self._collective("all_to_all", x, async_op, run, label, in_place=False, same_shape=False,
                                algorithm=algorithm)

    def all_to_all_v(self, x: Any, send_counts: list[int], recv_counts: list[int] | None = None,
                     async_op: bool = False, label: str | None = None) -> Any:
        """Rank r sends ``send_counts[j]`` elements of ``x`` (flattened, in rank order) to rank j and returns
        what every rank sent it, concatenated in source order (MPI_Alltoallv). Without ``recv_counts`` the
        ranks first exchange their counts (an all-to-all of p integers), as expert dispatch does. Pairwise
        exchange: p−1 rounds, each rank sends every element but those it keeps."""
        send_counts = [int(c) for c in send_counts]
        if len(send_counts) != self.size or min(send_counts, default=0) < 0 or sum(send_counts) != x.size:
            raise ValueError(f"all_to_all_v: send_counts {send_counts} must be {self.size} non-negative counts "
                             f"summing to x.size = {x.size}")
        if recv_counts is None:
            recv_counts = self.all_to_all(np.array(send_counts, np.int64), label=label).tolist()
        recv_counts = [int(c) for c in recv_counts]
        if len(recv_counts) != self.size or min(recv_counts, default=0) < 0:
            raise ValueError(f"all_to_all_v: recv_counts {recv_counts} must be {self.size} non-negative counts")
        send_bounds = [0, *np.cumsum(send_counts).tolist()]
        recv_bounds = [0, *np.cumsum(recv_counts).tolist()]

        def run(buf: np.ndarray, tag: int) -> np.ndarray:
            out = np.empty(recv_bounds[-1], buf.dtype)
            self._running.algorithm = "pairwise"
            algo.pairwise_all_to_all(self, buf, out, send_bounds, recv_bounds, tag)
            return out

        return self._collective("all_to_all_v", x, async_op, run, label, in_place=False, same_shape=False,
                                sizes=None)

    def all_gather_bytes(self, data: bytes, label: str | None = None) -> list[bytes]:
        """Every rank's ``data`` (any length), in rank order, on every rank: an all-gather of the
        lengths, then an all-gather(v) of the bytes."""
        sizes = [int(n) for n in self.all_gather(np.array([len(data)]), label=label)]
        everything = self.all_gather(np.frombuffer(data, np.uint8), sizes=sizes, label=label).tobytes()
        offsets = np.cumsum([0] + sizes).tolist()
        return [everything[a:b] for a, b in zip(offsets[:-1], offsets[1:])]

    def broadcast(self, x: Any, root: int = 0, async_op: bool = False, label: str | None = None,
                  algorithm: str | None = None) -> Any:
        """Root's ``x`` into every rank's ``x``; returns ``x``. "binomial": ⌈log₂p⌉ rounds of n bytes;
        "segmented": the same tree pipelined in segments (size chosen by the cost model); None: by the model."""
        self._check_root(root)
        self._check_algorithm("broadcast", algorithm)

        def run(buf: np.ndarray, tag: int) -> None:
            if self._algorithm("broadcast", buf.nbytes, algorithm) == "binomial":
                algo.binomial_broadcast(self, buf, root, tag)
            else:
                algo.segmented_broadcast(self, buf, root, tag, self.cost_model().segment_bytes(buf.nbytes, self.size,
                                                                                               self._node_count()))

        return self._collective("broadcast", x, async_op, run, label, root=root)

    def reduce(self, x: Any, op: str = "sum", root: int = 0, async_op: bool = False, label: str | None = None) -> Any:
        """Reduce onto ``root``'s ``x`` in place (binomial tree); other ranks' ``x`` is unchanged."""
        self._check_op(op, x)
        self._check_root(root)

        def run(buf: np.ndarray, tag: int) -> None:
            work = buf if self.rank == root else buf.copy()
            algo.binomial_reduce(self, work, op, root, tag)

        return self._collective("reduce", x, async_op, run, label, op=op, root=root)

    def barrier(self) -> None:
        """Returns on every rank only once all ranks have entered (dissemination, ⌈log₂p⌉ rounds)."""
        self._collective("barrier", np.empty(0, np.uint8), False, lambda buf, tag: algo.dissemination_barrier(self, tag), None)

    # ---------------------------------------------------------------------- algorithm selection
    def _check_algorithm(self, collective: str, algorithm: str | None) -> None:
        if algorithm is not None and algorithm not in tuning.ALGORITHMS[collective]:
            raise ValueError(f"unknown {collective} algorithm {algorithm!r}: expected one of "
                             f"{list(tuning.ALGORITHMS[collective])} or None (automatic)")

    def _algorithm(self, collective: str, nbytes: int, requested: str | None) -> str:
        """The algorithm this call runs (every rank reaches the same answer), recorded in the op's stats."""
        if requested is not None:
            chosen = requested
        elif self.size == 1:
            chosen = tuning.ALGORITHMS[collective][0]
        else:
            key = (collective, nbytes)
            chosen = self._choices.get(key)
            if chosen is None:  # on nodes of unequal size only a flat algorithm can run (4 + 2 ranks, say)
                flat = self._node_count() > 1 and collective == "all_reduce" and self._hierarchy() is None
                chosen = self._choices[key] = self.cost_model().best(collective, nbytes, self.size, self._node_count(),
                                                                      exclude=("hierarchical",) if flat else ())
        if chosen == "hierarchical" and self._hierarchy() is None:
            raise ValueError(f"hierarchical all-reduce needs several nodes with the same number of ranks each; "
                             f"this {self.size}-rank communicator's ranks sit on nodes {self._node_ids()}")
        self._running.algorithm = chosen  # recorded with the call's time
        return chosen

    def _node_ids(self) -> list[int]:
        """The node of every rank of this communicator (an all-gather on first use)."""
        if self._nodes is None:
            self._nodes = self.mpi.allgather(node_id())
        return self._nodes

    def _node_count(self) -> int:
        return len(set(self._node_ids()))

    def cost_model(self) -> tuning.CostModel:
        """The α-β-γ model this communicator chooses algorithms by: the same numbers on every rank."""
        if self._cost is None:
            self._cost = tuning.agree(self.mpi, self._node_ids())
        return self._cost

    def _hierarchy(self) -> tuple[Communicator, Communicator] | None:
        """(ranks on my node, ranks with my local index on every node), or None when the ranks do not sit on
        several nodes of equal size. Both account their bytes in this communicator's stats."""
        if self._levels is None:
            nodes = self._node_ids()
            order = list(dict.fromkeys(nodes))
            counts = [nodes.count(n) for n in order]
            if len(order) < 2 or len(set(counts)) > 1:
                self._levels = False
            else:
                node_index = order.index(nodes[self.rank])
                local = sum(1 for n in nodes[:self.rank] if n == nodes[self.rank])
                self._levels = (self._view(self.mpi.Split(node_index, self.rank), f"{self.name}/node"),
                                self._view(self.mpi.Split(local, self.rank), f"{self.name}/cross"))
        return self._levels or None

    def _view(self, mpi_comm: MPI.Comm, name: str) -> Communicator:
        sub = Communicator(mpi_comm, name)
        sub.stats, sub._stats_lock, sub._running, sub._cost = self.stats, self._stats_lock, self._running, self._cost
        return sub

    def cross_algorithm(self, nbytes: int) -> str:
        """The hierarchical all-reduce's step across nodes for a chunk of ``nbytes``: ring or recursive doubling."""
        nodes, model = self._node_count(), self.cost_model()
        return min(("ring", "recursive_doubling"), key=lambda a: model.time("all_reduce", a, nbytes, nodes, nodes))

    def _cross_all_reduce(self, cross: Communicator, buf: np.ndarray, op: str, tag: int) -> None:
        ALL_REDUCE[self.cross_algorithm(buf.nbytes)](cross, buf, op, tag)

    # ------------------------------------------------------------------------------- machinery
    def _check_op(self, op: str, x: Any) -> None:
        if op not in algo.REDUCE_OPS:
            raise ValueError(f"unknown reduction {op!r}: expected one of {sorted(algo.REDUCE_OPS)}")
        if op == "avg" and x.dtype.kind not in "fc" and not is_low_precision(x.dtype):  # bfloat16's kind is "V"
            raise TypeError(f"op='avg' needs a floating-point array, got {x.dtype}")

    def _check_root(self, root: int) -> None:
        if not 0 <= root < self.size:
            raise ValueError(f"root {root} is not a rank of this {self.size}-rank communicator")

    def _collective(self, name: str, x: Any, async_op: bool, run: Callable[[np.ndarray, int], Any], label: str | None,
                    in_place: bool = True, same_shape: bool = True, **details: Any) -> Any:
        """Run ``run(contiguous 1-D host buffer, tag)`` as collective ``name``, in call order, accounted under ``label or name``.

        The sequence number (and so the tag) is taken when the collective *executes*, not when it is
        called. Execution is serialized in issue order on every rank — inline when nothing is queued,
        else behind the queued work, and a submitted function's collectives inline on the worker as
        it runs — so a collective issued on the main thread while a submitted function is still
        waiting to issue its own gets the later number on every rank, however the threads are timed.
        """
        out = details.pop("out", None)  # before any message: the buffers the result goes to are writable
        if in_place:
            _check_writable(name, x, "its buffer")
        if out is not None:
            _check_writable(name, out, "out")
        call = (name, label or name, x, run, in_place, same_shape, details, _call_site() if self.debug else None)
        if async_op:
            return self._worker_thread().submit(lambda: self._execute(*call))
        worker = self._worker
        if worker is None or worker.pending == 0 or threading.current_thread() is worker.thread:
            return self._execute(*call)  # nothing queued, or already on the worker (inside submit()): run in order, here
        return worker.submit(lambda: self._execute(*call)).wait()

    def _execute(self, name: str, key: str, x: Any, run: Callable[[np.ndarray, int], Any], in_place: bool,
                 same_shape: bool, details: dict, site: str | None) -> Any:
        """Run one collective now, on this thread: take its sequence number, stage ``x``, account its bytes and time."""
        sequence = self._sequence
        self._sequence = sequence + 1
        tag = COLLECTIVE_TAG_BASE + sequence % (1 << 14)
        running = self._running
        running.thread, running.sent, running.algorithm = threading.get_ident(), 0, None
        running.name = name if key == name else f"{name} ({key})"
        start = time.perf_counter()
        try:
            if site is not None:
                self._verify_signature({"seq": sequence, "op": name, "dtype": str(x.dtype),
                                        "shape": list(x.shape) if same_shape else None, "details": dict(details),
                                        "site": site})
            if type(x) is np.ndarray and x.flags.c_contiguous:  # the common case: a view, nothing staged
                result = run(x if x.ndim == 1 else x.reshape(-1), tag)
                return x if in_place else result
            buf = np.ascontiguousarray(to_host(x)).reshape(-1)
            result = run(buf, tag)
            if not in_place:
                return _like(x, result)
            x[...] = _like(x, buf.reshape(x.shape))
            return x
        finally:
            running.thread = None
            self._record(key, running.sent, time.perf_counter() - start, True, running.algorithm)

    def submit(self, fn: Callable[[], Any]) -> Handle:
        """Run ``fn()`` on the communication thread, after the work already queued; collectives it
        calls run inline there. For compound operations (compress → collectives → decompress) that
        should overlap with the caller, like one async collective does."""
        return self._worker_thread().submit(fn)

    def _worker_thread(self) -> _Worker:
        if self._worker is None:
            self._worker = _Worker(f"minipar-comm-{self.name}")
        return self._worker

    def _verify_signature(self, signature: dict) -> None:
        """Debug mode: rank 0 collects every rank's signature, compares, and answers ok / the mismatch."""
        mine = json.dumps(signature).encode()[:_SIGNATURE_BYTES].ljust(_SIGNATURE_BYTES)
        deadline = time.monotonic() + self.debug_timeout
        if self.rank == 0:
            slots = [np.empty(_SIGNATURE_BYTES, np.uint8) for _ in range(self.size)]
            slots[0][:] = np.frombuffer(mine, np.uint8)
            requests = {r: self.mpi.Irecv([slots[r], MPI.BYTE], r, _DEBUG_TAG) for r in range(1, self.size)}
            _wait_all(requests, deadline)
            missing = sorted(r for r, req in requests.items() if not req.Test())
            if missing:
                for req in (requests[r] for r in missing):
                    req.Cancel()
                verdict = (f"collective #{signature['seq']} {signature['op']} at {signature['site']}: rank(s) {missing} "
                           f"did not arrive within {self.debug_timeout:.0f} s (hung, or skipped this collective)")
            else:
                sigs = [json.loads(bytes(s).decode(errors="replace").rstrip()) for s in slots]
                verdict = ""
                for r, other in enumerate(sigs[1:], start=1):
                    if other != sigs[0]:
                        verdict = (f"collective mismatch at #{signature['seq']}: rank 0 called {_describe(sigs[0])}, "
                                   f"rank {r} called {_describe(other)}")
                        break
            message = np.frombuffer(verdict.encode()[:4000].ljust(4096), np.uint8).copy()
            for r in range(1, self.size):
                if r not in missing:
                    self.mpi.Send([message, MPI.BYTE], r, _VERDICT_TAG)
        else:
            self.mpi.Send([np.frombuffer(mine, np.uint8).copy(), MPI.BYTE], 0, _DEBUG_TAG)
            answer = np.empty(4096, np.uint8)
            request = {0: self.mpi.Irecv([answer, MPI.BYTE], 0, _VERDICT_TAG)}
            _wait_all(request, deadline + self.debug_timeout + 1.0)  # rank 0 may wait a full timeout for others first
            if not request[0].Test():
                request[0].Cancel()
                raise CollectiveMismatch(f"collective #{signature['seq']} {signature['op']} at {signature['site']}: "
                                         f"rank 0 did not answer within {2 * self.debug_timeout + 1:.0f} s")
            verdict = bytes(answer).decode(errors="replace").rstrip()
        if verdict:
            raise CollectiveMismatch(verdict)


class _RequestHandle(Handle):
    """A Handle over an MPI request (p2p isend/irecv)."""

    def __init__(self, request: MPI.Request, keep_alive: Any, on_complete: Callable[[], None] | None = None,
                 result: Any = None, waits: tuple[Communicator, int] | None = None):
        super().__init__()
        self._request, self._keep_alive, self._on_complete, self._value = request, keep_alive, on_complete, result
        self._waits = waits  # (communicator, peer): whom wait() blocks on, for the watchdog

    def is_completed(self) -> bool:
        if not self._done.is_set() and self._request.Test():
            self._complete()
        return self._done.is_set()

    def wait(self) -> Any:
        if not self._done.is_set():
            if _WAITS.timeout and self._waits is not None:
                self._waits[0]._waiting(self._waits[1])
            self._request.Wait()
            if _WAITS.timeout:
                _WAITS.end()
            self._complete()
        return self._result

    def _complete(self) -> None:
        if not self._done.is_set():
            if self._on_complete is not None:
                self._on_complete()
            self._keep_alive = None
            self._finish(self._value)


def _wait_all(requests: dict[int, MPI.Request], deadline: float) -> None:
    pending = dict(requests)
    while pending and time.monotonic() < deadline:
        for r in [r for r, req in pending.items() if req.Test()]:
            del pending[r]
        if pending:
            time.sleep(0.001)


def _describe(sig: dict) -> str:
    extra = "".join(f", {k}={v}" for k, v in sig["details"].items())
    shape = "" if sig["shape"] is None else f", shape={tuple(sig['shape'])}"
    return f"{sig['op']}(dtype={sig['dtype']}{shape}{extra}) at {sig['site']}"


def _call_site() -> str:
    """file:line of the innermost frame outside minipar/comm (where the user asked for the collective)."""
    for frame in reversed(traceback.extract_stack()[:-1]):
        if not os.path.abspath(frame.filename).startswith(_COMM_DIR):
            return f"{os.path.basename(frame.filename)}:{frame.lineno}"
    return "?"


def _check_writable(collective: str, buffer: Any, what: str) -> None:
    if not on_gpu(buffer) and not buffer.flags.writeable:
        raise ValueError(f"{collective}: {what} is read-only, and the collective writes its result there "
                         "(pass a writable copy)")


def _copy_into(out: Any, result: Any) -> Any:
    out[...] = result
    return out


def _like(x: Any, host: np.ndarray) -> Any:
    """``host`` moved to wherever ``x`` lives (cupy for a cupy ``x``)."""
    if on_gpu(x):
        import cupy

        return cupy.asarray(host)
    return host
