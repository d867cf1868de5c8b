"""Collective algorithms built from point-to-point messages only.

Every function here works in place on a contiguous 1-D host (numpy) buffer of n elements, on a
communicator of p ranks that offers ``sendrecv``/``send``/``recv`` (minipar.comm.Communicator).
The buffer is cut into p chunks the way ``numpy.array_split`` cuts it — the first n mod p chunks
one element longer — so any n works, including 0, 1 and n < p (some chunks are then empty).

Costs in the α-β model (α: per-message latency, β: seconds per byte, n: bytes):

    ring reduce-scatter       p−1 steps   each rank sends (p−1)/p·n      T = (p−1)α + (p−1)/p·nβ
    ring all-gather           p−1 steps   each rank sends (p−1)/p·n      T = (p−1)α + (p−1)/p·nβ
    ring all-reduce           2(p−1)      each rank sends 2(p−1)/p·n     T = 2(p−1)α + 2(p−1)/p·nβ
    recursive doubling        log₂p       each rank sends log₂p·n        T = log₂p·(α + nβ)
    binomial broadcast/reduce ⌈log₂p⌉     the root sends/receives ⌈log₂p⌉·n

Ring is bandwidth-optimal, recursive doubling latency-optimal; :data:`SMALL_MESSAGE_BYTES` picks
between them. Every algorithm reduces in a fixed order, and both partners of an exchange combine
the same two values (IEEE addition and max are commutative), so all ranks end with bitwise
identical results — data-parallel replicas never drift apart.
"""
from __future__ import annotations

from typing import Any

import numpy as np

# Below this many bytes all-reduce uses recursive doubling. With 2(p−1) vs log₂p messages the
# ring pays (2(p−1) − log₂p)·α more latency and saves (log₂p − 2(p−1)/p)·nβ bandwidth; on shared
# memory here α ≈ 2-5 µs and β ≈ 0.1-0.2 ns/B, which puts the crossover at tens of KiB for p ≤ 8
# (benchmarks/collectives.py measures it; MPICH's own default switch point is of the same order).
SMALL_MESSAGE_BYTES = 64 * 1024

REDUCE_OPS = {"sum": np.add, "avg": np.add, "max": np.maximum}


class WireCodec:
    """How a ring collective puts float32/64 chunks on the wire in 16 bits: encode before each send,
    decode after each receive, accumulate in the buffer's own precision. Rounding happens per hop,
    so the ring all-reduce sends half the bytes at the cost of ~2⁻¹¹ (fp16) or 2⁻⁸ (bf16) relative
    error per addition."""

    def __init__(self, name: str):
        if name not in ("float16", "bfloat16"):
            raise ValueError(f"unknown wire format {name!r}: expected 'float16' or 'bfloat16'")
        self.name = name
        self.wire_dtype = np.float16 if name == "float16" else np.uint16

    def encode(self, x: np.ndarray) -> np.ndarray:
        if self.name == "float16":
            return x.astype(np.float16)
        bits = x.astype(np.float32).view(np.uint32)  # round to nearest even on the upper 16 bits
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)

    def decode(self, wire: np.ndarray, dtype: np.dtype) -> np.ndarray:
        if self.name == "float16":
            return wire.astype(dtype)
        return (wire.astype(np.uint32) << 16).view(np.float32).astype(dtype, copy=False)

    def round_trip(self, x: np.ndarray) -> None:
        """x ← decode(encode(x)) in place: what the other ranks will receive for it."""
        x[...] = self.decode(self.encode(x), x.dtype)


def chunk_bounds(n: int, p: int) -> list[int]:
    """Offsets [b₀ = 0, b₁, …, b_p = n] of the p chunks, sizes ⌈n/p⌉ for the first n mod p chunks, ⌊n/p⌋ after."""
    base, extra = divmod(n, p)
    bounds = [0]
    for i in range(p):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    return bounds


def all_reduce_bytes_sent(n: int, itemsize: int, p: int, rank: int, algorithm: str | None = None) -> int:
    """Exactly how many bytes ``rank`` sends in an all-reduce of n elements (the formulas above, uneven chunks included)."""
    if algorithm is None:
        algorithm = "recursive_doubling" if n * itemsize <= SMALL_MESSAGE_BYTES else "ring"
    if p == 1:
        return 0
    if algorithm == "ring":  # every chunk but its own in the reduce-scatter, all but its right neighbour's in the all-gather
        b = chunk_bounds(n, p)
        return (2 * n - (b[rank + 1] - b[rank]) - (b[(rank + 1) % p + 1] - b[(rank + 1) % p])) * itemsize
    pof2 = 1 << (p.bit_length() - 1)
    extra = p - pof2
    rounds = pof2.bit_length() - 1
    if rank < 2 * extra:  # a folded pair: the even rank sends once, the odd one sends its rounds and the result back
        return n * itemsize if rank % 2 == 0 else (rounds + 1) * n * itemsize
    return rounds * n * itemsize


def _finish_avg(chunk: np.ndarray, op: str, p: int) -> None:
    if op == "avg":
        chunk /= p


def ring_reduce_scatter(comm: Any, buf: np.ndarray, op: str, tag: int, bounds: list[int] | None = None,
                        codec: WireCodec | None = None) -> None:
    """Afterwards chunk r of ``buf`` on rank r holds the reduction of every rank's chunk r.

    Step s = 0 … p−2: send chunk (r−s−1) to the right neighbour, receive chunk (r−s−2) from the
    left one and fold it into ours. A chunk travels once around the ring, gaining one rank's
    contribution per hop, and arrives complete at its owner after p−1 hops. With a ``codec``
    chunks travel encoded (16 bits) and are added in ``buf``'s precision.
    """
    p, r = comm.size, comm.rank
    bounds = bounds or chunk_bounds(buf.size, p)
    reduce = REDUCE_OPS[op]
    chunk = lambda i: buf[bounds[i]:bounds[i + 1]]  # noqa: E731
    scratch = np.empty(max(bounds[i + 1] - bounds[i] for i in range(p)), dtype=codec.wire_dtype if codec else buf.dtype)
    right, left = (r + 1) % p, (r - 1) % p
    for s in range(p - 1):
        send_i, recv_i = (r - s - 1) % p, (r - s - 2) % p
        incoming = scratch[:bounds[recv_i + 1] - bounds[recv_i]]
        comm.sendrecv(codec.encode(chunk(send_i)) if codec else chunk(send_i), right, incoming, left, tag)
        reduce(chunk(recv_i), codec.decode(incoming, buf.dtype) if codec else incoming, out=chunk(recv_i))
    _finish_avg(chunk(r), op, p)


def ring_all_gather(comm: Any, buf: np.ndarray, tag: int, bounds: list[int] | None = None,
                    codec: WireCodec | None = None) -> None:
    """Rank r holds chunk r of ``buf``; afterwards every rank holds all p chunks.

    Step s = 0 … p−2: send chunk (r−s) right, receive chunk (r−s−1) from the left, straight into
    place (with a ``codec``: encoded, then decoded into place; rank r's own chunk is rounded the
    same way first, so every rank ends with the same bits).
    """
    p, r = comm.size, comm.rank
    bounds = bounds or chunk_bounds(buf.size, p)
    right, left = (r + 1) % p, (r - 1) % p
    if codec:
        codec.round_trip(buf[bounds[r]:bounds[r + 1]])
        scratch = np.empty(max(bounds[i + 1] - bounds[i] for i in range(p)), dtype=codec.wire_dtype)
    for s in range(p - 1):
        send_i, recv_i = (r - s) % p, (r - s - 1) % p
        send, recv = buf[bounds[send_i]:bounds[send_i + 1]], buf[bounds[recv_i]:bounds[recv_i + 1]]
        if codec:
            incoming = scratch[:recv.size]
            comm.sendrecv(codec.encode(send), right, incoming, left, tag)
            recv[...] = codec.decode(incoming, buf.dtype)
        else:
            comm.sendrecv(send, right, recv, left, tag)


def ring_all_reduce(comm: Any, buf: np.ndarray, op: str, tag: int, codec: WireCodec | None = None) -> None:
    """All-reduce = reduce-scatter + all-gather: 2(p−1) steps, each rank sends 2(p−1)/p·n bytes
    (of the wire format's size per element when a ``codec`` is given)."""
    ring_reduce_scatter(comm, buf, op, tag, codec=codec)
    ring_all_gather(comm, buf, tag, codec=codec)


def recursive_doubling_all_reduce(comm: Any, buf: np.ndarray, op: str, tag: int) -> None:
    """log₂p rounds; in round k rank r swaps its whole partial result with rank r XOR 2ᵏ and combines.

    For p not a power of two, let p' be the largest power of two below p and e = p − p'. Among
    the first 2e ranks each even rank first hands its data to its odd neighbour and sits out; the
    remaining p' ranks run the rounds; the even ranks then receive the result (MPICH's scheme).
    Each participating rank sends log₂p'·n bytes (+n for the folded pairs).
    """
    p, r = comm.size, comm.rank
    reduce = REDUCE_OPS[op]
    pof2 = 1 << (p.bit_length() - 1)
    extra = p - pof2
    incoming = np.empty_like(buf)
    if r < 2 * extra:
        if r % 2 == 0:
            comm.send(buf, r + 1, tag)
            virtual = -1
        else:
            comm.recv(incoming, r - 1, tag)
            reduce(buf, incoming, out=buf)
            virtual = r // 2
    else:
        virtual = r - extra
    if virtual >= 0:
        mask = 1
        while mask < pof2:
            partner_virtual = virtual ^ mask
            partner = partner_virtual * 2 + 1 if partner_virtual < extra else partner_virtual + extra
            comm.sendrecv(buf, partner, incoming, partner, tag)
            reduce(buf, incoming, out=buf)
            mask <<= 1
    if r < 2 * extra:
        if r % 2:
            comm.send(buf, r - 1, tag)
        else:
            comm.recv(buf, r + 1, tag)
    _finish_avg(buf, op, p)


def binomial_broadcast(comm: Any, buf: np.ndarray, root: int, tag: int) -> None:
    """Root's ``buf`` to every rank along a binomial tree: ⌈log₂p⌉ rounds, every rank receives n bytes once.

    With ranks renumbered v = (r − root) mod p, rank v receives from v − 2ᵏ (2ᵏ = lowest set bit
    of v), then forwards to v + 2ʲ for every 2ʲ < 2ᵏ.
    """
    p, r = comm.size, comm.rank
    v = (r - root) % p
    mask = 1
    while mask < p:
        if v & mask:
            comm.recv(buf, (v - mask + root) % p, tag)
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:
        if v + mask < p:
            comm.send(buf, (v + mask + root) % p, tag)
        mask >>= 1


def binomial_reduce(comm: Any, buf: np.ndarray, op: str, root: int, tag: int) -> None:
    """The mirror of broadcast: partial results flow up the binomial tree; the root ends with the total.

    Rank v adds what v + 2ᵏ sends it for each 2ᵏ below its lowest set bit, then sends its partial to
    v − 2ᵏ. Non-root buffers are used as scratch.
    """
    p, r = comm.size, comm.rank
    reduce = REDUCE_OPS[op]
    v = (r - root) % p
    incoming = np.empty_like(buf)
    mask = 1
    while mask < p:
        if v & mask:
            comm.send(buf, (v - mask + root) % p, tag)
            break
        if v + mask < p:
            comm.recv(incoming, (v + mask + root) % p, tag)
            reduce(buf, incoming, out=buf)
        mask <<= 1
    if r == root:
        _finish_avg(buf, op, p)


def dissemination_barrier(comm: Any, tag: int) -> None:
    """⌈log₂p⌉ rounds of empty messages: in round k rank r signals r + 2ᵏ and waits for r − 2ᵏ."""
    p, r = comm.size, comm.rank
    empty, sink = np.empty(0, np.uint8), np.empty(0, np.uint8)
    distance = 1
    while distance < p:
        comm.sendrecv(empty, (r + distance) % p, sink, (r - distance) % p, tag)
        distance <<= 1
