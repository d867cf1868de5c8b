"""Collective algorithms built from point-to-point messages only.

Every function here works in place on a contiguous 1-D host (numpy) buffer of n elements, on a
communicator of p ranks that offers ``sendrecv``/``send``/``recv`` (minipar.comm.Communicator).
The buffer is cut into p chunks the way ``numpy.array_split`` cuts it — the first n mod p chunks
one element longer — so any n works, including 0, 1 and n < p (some chunks are then empty).

Costs in the α-β-γ model (α: per-message latency, β: seconds per byte sent, γ: per byte reduced or
copied; n: bytes; p' the largest power of two ≤ p, fold = 1 when p is not one):

    all-reduce     ring               2(p−1)α + 2(p−1)/p·nβ + (p−1)/p·nγ
                   recursive doubling (log₂p' + 2fold)(α + nβ) + (log₂p' + fold)·nγ
                   Rabenseifner       (2log₂p' + 2fold)α + (2(p'−1)/p' + 2fold)·nβ + ((p'−1)/p' + fold)·nγ
                   hierarchical       ring RS + AG inside a node of q ranks, all-reduce of n/q across nodes
    reduce-scatter ring               (p−1)α + (p−1)/p·n(β + γ)
                   recursive halving  (log₂p' + 2fold)α + ((p'−1)/p' + fold)·n(β + γ)
    all-gather     ring               (p−1)α + (p−1)/p·nβ
                   recursive doubling (log₂p' + 2fold)α + ((p'−1)/p' + fold)·nβ
                   Bruck              ⌈log₂p⌉α + (p−1)/p·nβ + nγ (the final rotation)
    broadcast      binomial           ⌈log₂p⌉(α + nβ)
                   segmented          (⌈log₂p⌉ + k − 1)(α + (n/k)β) with k segments
    all-to-all     pairwise           (p−1)α + (p−1)/p·nβ (any counts)
                   Bruck              2⌈log₂p⌉α + ⌈log₂p⌉·(n/2)(β + 2γ) + 2nγ (equal blocks; per round
                                      a gather and a scatter of the blocks it moves besides the message)

Ring is bandwidth-optimal, the doubling/halving/Bruck family latency-optimal; ``minipar/comm/tuning.py``
measures α, β, γ and picks per call. Every algorithm reduces in a fixed order, and both partners of an
exchange combine the same two values (IEEE addition and max are commutative), or one rank reduces a
region and the others copy it, so all ranks end with bitwise identical results — data-parallel
replicas never drift apart. ``*_bytes_sent`` give each algorithm's exact bytes per rank.

Deep dive, with measurements: docs/collectives.md.
"""
from __future__ import annotations

from typing import Any

import numpy as np

REDUCE_OPS = {"sum": np.add, "avg": np.add, "max": np.maximum, "min": np.minimum}


class WireCodec:
    """How a ring collective puts float32/64 chunks on the wire in 16 bits: encode before each send,
    decode after each receive, accumulate in the buffer's own precision. Rounding happens per hop,
    so the ring all-reduce sends half the bytes at the cost of ~2⁻¹¹ (fp16) or 2⁻⁸ (bf16) relative
    error per addition. Ranges: bfloat16 has float32's; float16 ends at 65504, and any |x| ≥ 65520 arrives
    as ±inf — a non-finite result the training loop's check reports (an fp16 loss scale backs off), never a
    wrong finite number. A NaN stays a NaN with its sign (bfloat16: its quiet bit set; rounding the bits
    would carry a high payload into the exponent and sign and hand on ±0)."""

    def __init__(self, name: str):
        if name not in ("float16", "bfloat16"):
            raise ValueError(f"unknown wire format {name!r}: expected 'float16' or 'bfloat16'")
        self.name = name
        self.wire_dtype = np.float16 if name == "float16" else np.uint16

    def encode(self, x: np.ndarray) -> np.ndarray:
        if self.name == "float16":
            with np.errstate(over="ignore"):  # |x| ≥ 65520 becomes ±inf, as the class says
                return x.astype(np.float16)
        bits = x.astype(np.float32).view(np.uint32)  # round to nearest even on the upper 16 bits
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        nan = (bits & 0x7FFFFFFF) > 0x7F800000
        return np.where(nan, (bits >> 16) | 0x0040, rounded).astype(np.uint16)

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


def all_reduce_bytes_sent(n: int, itemsize: int, p: int, rank: int, algorithm: str) -> int:
    """Exactly how many bytes ``rank`` sends in an all-reduce of n elements by ``algorithm`` (uneven chunks
    and the non-power-of-two fold included); the hierarchical one is the sum of its three phases."""
    if p == 1:
        return 0
    if algorithm == "ring":  # every chunk but its own in the reduce-scatter, all but its right neighbour's in the all-gather
        b = chunk_bounds(n, p)
        return (2 * n - (b[rank + 1] - b[rank]) - (b[(rank + 1) % p + 1] - b[(rank + 1) % p])) * itemsize
    pof2, extra = _fold(p)
    v = _virtual(rank, extra)
    if v < 0:  # an even rank of a folded pair sends its data once
        return n * itemsize
    folded = n if rank < 2 * extra else 0  # an odd one sends the result back
    if algorithm == "recursive_doubling":
        return ((pof2.bit_length() - 1) * n + folded) * itemsize
    if algorithm == "rabenseifner":
        regions = chunk_bounds(n, pof2)
        return (_halving_bytes(regions, v) + _doubling_bytes(regions, v) + folded) * itemsize
    raise ValueError(f"no byte formula for all-reduce algorithm {algorithm!r}")


def reduce_scatter_bytes_sent(bounds: list[int], itemsize: int, rank: int, algorithm: str) -> int:
    """Bytes ``rank`` sends in a reduce-scatter with chunk ``bounds`` (p + 1 offsets)."""
    p, n = len(bounds) - 1, bounds[-1]
    size = lambda i: bounds[i + 1] - bounds[i]  # noqa: E731
    if p == 1:
        return 0
    if algorithm == "ring":
        return (n - size(rank)) * itemsize
    pof2, extra = _fold(p)
    v = _virtual(rank, extra)
    if v < 0:
        return n * itemsize
    return (_halving_bytes(_fold_regions(bounds, pof2, extra), v) + (size(rank - 1) if rank < 2 * extra else 0)) * itemsize


def all_gather_bytes_sent(bounds: list[int], itemsize: int, rank: int, algorithm: str) -> int:
    """Bytes ``rank`` sends in an all-gather of chunks with ``bounds``."""
    p, n = len(bounds) - 1, bounds[-1]
    if p == 1:
        return 0
    if algorithm == "ring":  # every chunk but its right neighbour's
        right = (rank + 1) % p
        return (n - (bounds[right + 1] - bounds[right])) * itemsize
    if algorithm == "recursive_doubling":  # a folded even rank sends its chunk, its odd partner also the whole result
        pof2, extra = _fold(p)
        v = _virtual(rank, extra)
        if v < 0:
            return (bounds[rank + 1] - bounds[rank]) * itemsize
        return (_doubling_bytes(_fold_regions(bounds, pof2, extra), v) + (n if rank < 2 * extra else 0)) * itemsize
    sizes = [bounds[(rank + j) % p + 1] - bounds[(rank + j) % p] for j in range(p)]  # Bruck: prefixes of its order
    sent, distance = 0, 1
    while distance < p:
        sent += sum(sizes[:min(distance, p - distance)])
        distance <<= 1
    return sent * itemsize


def _halving_bytes(regions: list[int], v: int) -> int:
    """Elements virtual rank v sends in :func:`_halving`: everything but its own region."""
    return regions[-1] - (regions[v + 1] - regions[v])


def _doubling_bytes(regions: list[int], v: int) -> int:
    """Elements virtual rank v sends in :func:`_doubling_gather`: the 2ᵏ regions it holds in round k."""
    sent, lo, mask = 0, v, 1
    while mask < len(regions) - 1:
        sent += regions[lo + mask] - regions[lo]
        lo, mask = min(lo, lo ^ mask), mask << 1
    return sent


def _finish_avg(chunk: np.ndarray, op: str, p: int) -> None:
    if op == "avg":
        chunk /= p


def ring_reduce_scatter(comm: Any, src: np.ndarray, op: str, tag: int, bounds: list[int] | None = None,
                        codec: WireCodec | None = None, out: np.ndarray | None = None) -> np.ndarray:
    """Rank r gets the reduction of every rank's chunk r of ``src``, in ``out`` (default: chunk r of ``src``
    itself, so an all-reduce can follow in place); returns ``out``. ``src`` is otherwise left as it was;
    a given ``out`` must not overlap it.

    Step s = 0 … p−2: send the partial sum of chunk (r−s−1) right — at s = 0 this rank's own chunk,
    straight from ``src`` — receive the partial of chunk (r−s−2) from the left and add this rank's
    chunk to it, in the buffer it arrived in (the one just sent was just read by the neighbour:
    writing it again would cost a cache-line ownership transfer each). A chunk travels once around
    the ring, gaining one rank's contribution per hop, and arrives complete at its owner after p−1
    hops — into a given ``out`` directly. Scratch: two chunks alternating (none at p = 2 with ``out``),
    never a copy of the input. With a ``codec`` chunks travel encoded (16 bits) and are added in
    ``src``'s precision. T = (p−1)α + (p−1)/p·nβ + (p−1)/p·nγ.
    """
    p, r = comm.size, comm.rank
    bounds = bounds or chunk_bounds(src.size, p)
    reduce = REDUCE_OPS[op]
    into_out = out is not None and codec is None  # the last chunk may arrive in out itself
    if out is None:
        out = src[bounds[r]:bounds[r + 1]]
    if p == 1:
        if not np.shares_memory(out, src):
            out[...] = src
        _finish_avg(out, op, p)
        return out
    width = max(b1 - b0 for b0, b1 in zip(bounds, bounds[1:]))
    if codec is None:
        spare = [np.empty(width, src.dtype) for _ in range(min(p - 1 - into_out, 2))]
    else:
        wire = np.empty(width, codec.wire_dtype)
    right, left = (r + 1) % p, (r - 1) % p
    first = (r - 1) % p  # this rank's own copy of chunk r − 1 goes first
    send = src[bounds[first]:bounds[first + 1]]
    for s in range(p - 1):
        recv_i = (r - s - 2) % p
        lo, hi = bounds[recv_i], bounds[recv_i + 1]
        last = s == p - 2  # the last chunk to arrive is this rank's
        if codec is None:
            received = out if last and into_out else spare[s % 2][:hi - lo]
            comm.sendrecv(send, right, received, left, tag)
        else:
            comm.sendrecv(codec.encode(send), right, wire[:hi - lo], left, tag)
            received = codec.decode(wire[:hi - lo], src.dtype)
        send = out if last else received  # the sum is made where the chunk arrived, and travels on from there
        reduce(src[lo:hi], received, out=send)
    _finish_avg(out, op, p)
    return out


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
    """All-reduce = reduce-scatter + all-gather, in place: 2(p−1) steps, each rank sends 2(p−1)/p·n bytes
    (of the wire format's size per element when a ``codec`` is given)."""
    bounds = chunk_bounds(buf.size, comm.size)
    ring_reduce_scatter(comm, buf, op, tag, bounds, codec)
    ring_all_gather(comm, buf, tag, bounds, codec)


def recursive_doubling_all_reduce(comm: Any, buf: np.ndarray, op: str, tag: int) -> None:
    """log₂p rounds; in round k rank r swaps its whole partial result with rank r XOR 2ᵏ and combines.

    For p not a power of two, let p' be the largest power of two below p and e = p − p'. Among
    the first 2e ranks each even rank first hands its data to its odd neighbour and sits out; the
    remaining p' ranks run the rounds; the even ranks then receive the result (MPICH's scheme).
    Each participating rank sends log₂p'·n bytes (+n for the folded pairs).

    The rule that gives every rank the same bits (NaN payloads, signed zeros, max/min of ±0 too): both partners of
    a round compute op(lower ranks' partial, higher ranks' partial) — the same operands in the same order — into
    a buffer that is neither operand. Order alone is not enough: numpy's in-place loops return different NaNs for
    ``np.add(a, b, out=a)`` and ``np.add(a, b, out=b)``, and the partner whose own partial is the lower one would
    write into its first operand while the other wrote into its second. Nor does a round write into the buffer it
    just sent: on shared memory the partner has only now read those cache lines, and writing them back costs an
    ownership transfer per line (2–4× the add's time, measured at 64 KiB). So the result alternates between two
    scratch buffers, and the last round writes into ``buf`` (sent only in the first round); with one round (p' = 2)
    the result is copied into ``buf``. T = (log₂p' + 2fold)(α + nβ) + (log₂p' + fold)·nγ (+ nγ copy at p' = 2).
    """
    p, r = comm.size, comm.rank
    reduce = REDUCE_OPS[op]
    pof2, extra = _fold(p)
    v = _virtual(r, extra)
    if v < 0:
        comm.send(buf, r + 1, tag)
        comm.recv(buf, r + 1, tag)
        _finish_avg(buf, op, p)
        return
    incoming, scratch = np.empty_like(buf), [np.empty_like(buf)]
    if r < 2 * extra:
        comm.recv(incoming, r - 1, tag)
        reduce(incoming, buf, out=buf)  # one rank computes the pair's sum: no partner to agree with
    partial, mask = buf, 1
    while mask < pof2:
        partner = _real(v ^ mask, extra)
        comm.sendrecv(partial, partner, incoming, partner, tag)
        lower, higher = (incoming, partial) if partner < r else (partial, incoming)
        mask <<= 1
        if mask == pof2 and partial is not buf:
            result = buf
        else:
            if partial is scratch[0] and len(scratch) == 1:  # from the third round on (p' ≥ 8)
                scratch.append(np.empty_like(buf))
            result = scratch[1] if partial is scratch[0] else scratch[0]
        reduce(lower, higher, out=result)  # the same operands, order and (non-)aliasing on both partners
        partial = result
    if partial is not buf:  # one round (p' = 2): the result is in scratch
        buf[...] = partial
    if r < 2 * extra:
        comm.send(buf, r - 1, tag)
    _finish_avg(buf, op, p)


def _fold(p: int) -> tuple[int, int]:
    """(p', e): the largest power of two p' ≤ p and the e = p − p' ranks left over. The first 2e ranks
    pair up (2i, 2i+1); the even one hands its data to the odd one and sits out, so p' ranks remain."""
    pof2 = 1 << (p.bit_length() - 1)
    return pof2, p - pof2


def _virtual(r: int, extra: int) -> int:
    """Rank r's number among the p' participating ranks (−1 for an even rank of a folded pair)."""
    if r < 2 * extra:
        return r // 2 if r % 2 else -1
    return r - extra


def _real(v: int, extra: int) -> int:
    return 2 * v + 1 if v < extra else v + extra


def _fold_regions(bounds: list[int], pof2: int, extra: int) -> list[int]:
    """Offsets of the p' regions that the participating ranks own after a fold: a folded odd rank speaks
    for its even partner's chunk and its own, every other rank for its own chunk."""
    if extra == 0:
        return bounds
    return [bounds[_real(u, extra) - (1 if u < extra else 0)] for u in range(pof2)] + [bounds[-1]]


def _halving(comm: Any, buf: np.ndarray, op: str, tag: int, regions: list[int], v: int, extra: int,
             out: np.ndarray | None = None) -> None:
    """Recursive halving over the p' participating ranks: afterwards virtual rank v holds the reduction
    over all of them of region v (``buf[regions[v]:regions[v+1]]``). Round k (mask p'/2, p'/4, … 1):
    keep the half of the current range that contains v, send the other half to v XOR mask and add
    what it sends back. log₂p' rounds, (p'−1)/p' of the data sent.

    Without ``out`` the reduction happens in ``buf`` (scratch: half of it, once). With ``out`` (region
    v's size) ``buf`` is only read: each round receives the kept half into a new array and adds this
    rank's partial to it there, and the last round receives straight into ``out`` — no copy of the
    input, the halves allocated shrink n/2, n/4, …"""
    pof2 = len(regions) - 1
    reduce = REDUCE_OPS[op]
    lo, hi, mask = 0, pof2, pof2 >> 1
    partial, base = buf, 0  # the running partial of regions [lo, hi) is partial[regions[lo] − base : regions[hi] − base]
    scratch = None
    while mask:
        mid = lo + mask
        keep, give = ((lo, mid), (mid, hi)) if v < mid else ((mid, hi), (lo, mid))
        k0, k1 = regions[keep[0]], regions[keep[1]]
        mine = partial[k0 - base:k1 - base]
        if out is None:
            if scratch is None:
                scratch = np.empty(k1 - k0, buf.dtype)  # the first round receives the most
            received = scratch[:k1 - k0]
        else:
            received = out if mask == 1 else np.empty(k1 - k0, buf.dtype)
        partner = _real(v ^ mask, extra)
        comm.sendrecv(partial[regions[give[0]] - base:regions[give[1]] - base], partner, received, partner, tag)
        if out is None:
            reduce(mine, received, out=mine)
        else:
            reduce(mine, received, out=received)
            partial, base = received, k0
        (lo, hi), mask = keep, mask >> 1


def _doubling_gather(comm: Any, buf: np.ndarray, tag: int, regions: list[int], v: int, extra: int) -> None:
    """The mirror of :func:`_halving` without reduction: virtual rank v holds region v; round k swaps
    the 2ᵏ regions it has with v XOR 2ᵏ's, straight into place. log₂p' rounds, (p'−1)/p' of the data."""
    pof2 = len(regions) - 1
    lo, mask = v, 1
    while mask < pof2:
        theirs = lo ^ mask
        partner = _real(v ^ mask, extra)
        comm.sendrecv(buf[regions[lo]:regions[lo + mask]], partner, buf[regions[theirs]:regions[theirs + mask]],
                      partner, tag)
        lo, mask = min(lo, theirs), mask << 1


def recursive_halving_reduce_scatter(comm: Any, src: np.ndarray, op: str, tag: int, bounds: list[int],
                                     out: np.ndarray) -> np.ndarray:
    """Rank r gets in ``out`` the reduction of every rank's chunk r of ``src`` (left unchanged); returns ``out``.
    Non-powers of two fold first: in each of the e pairs the even rank sends its whole input to the
    odd one (n), which then speaks for both chunks (reducing in that received copy) and returns the
    even rank's chunk at the end. T = (log₂p' + 2[e>0])α + ((p'−1)/p'·n + [even: n])β + ((p'−1)/p' + [odd: 1])·nγ:
    fewer messages than the ring (log₂p vs p−1), the same bytes when p is a power of two."""
    p, r = comm.size, comm.rank
    if p == 1:
        out[...] = src
        _finish_avg(out, op, p)
        return out
    pof2, extra = _fold(p)
    v = _virtual(r, extra)
    if v < 0:
        comm.send(src, r + 1, tag)
        comm.recv(out, r + 1, tag)
        return out
    regions = _fold_regions(bounds, pof2, extra)
    if r >= 2 * extra:
        _halving(comm, src, op, tag, regions, v, extra, out=out)
        _finish_avg(out, op, p)
        return out
    work = np.empty_like(src)  # the even partner's input arrives here and is reduced in place
    comm.recv(work, r - 1, tag)
    REDUCE_OPS[op](src, work, out=work)
    _halving(comm, work, op, tag, regions, v, extra)
    _finish_avg(work[bounds[r - 1]:bounds[r + 1]], op, p)
    comm.send(work[bounds[r - 1]:bounds[r]], r - 1, tag)
    out[...] = work[bounds[r]:bounds[r + 1]]
    return out


def rabenseifner_all_reduce(comm: Any, buf: np.ndarray, op: str, tag: int) -> None:
    """Rabenseifner's all-reduce: recursive-halving reduce-scatter, then recursive-doubling all-gather,
    over p' ranks after the fold (the even rank of each pair sends n to its partner first and gets the
    result back last). T = 2log₂p'·α + 2(p'−1)/p'·nβ + (p'−1)/p'·nγ (+ 2α + 2nβ + nγ with a fold):
    the ring's bandwidth with logarithmically many messages — the best of both for mid sizes."""
    p, r = comm.size, comm.rank
    pof2, extra = _fold(p)
    v = _virtual(r, extra)
    if v < 0:
        comm.send(buf, r + 1, tag)
        comm.recv(buf, r + 1, tag)
        return
    if r < 2 * extra:
        incoming = np.empty_like(buf)
        comm.recv(incoming, r - 1, tag)
        REDUCE_OPS[op](buf, incoming, out=buf)
    regions = chunk_bounds(buf.size, pof2)
    _halving(comm, buf, op, tag, regions, v, extra)
    _finish_avg(buf[regions[v]:regions[v + 1]], op, p)
    _doubling_gather(comm, buf, tag, regions, v, extra)
    if r < 2 * extra:
        comm.send(buf, r - 1, tag)


def recursive_doubling_all_gather(comm: Any, buf: np.ndarray, tag: int, bounds: list[int]) -> None:
    """Rank r holds chunk r of ``buf``; afterwards every rank holds all p chunks, in place.

    Round k swaps everything a rank has gathered so far (2ᵏ chunks) with rank r XOR 2ᵏ, straight into
    place: log₂p rounds and, for a power of two, the ring's bytes with no copy. Otherwise the fold of
    :func:`recursive_halving_reduce_scatter` in reverse: the even rank of each of the e pairs first
    sends its chunk to the odd one, which gathers for both and finally sends it the whole result.
    T = (log₂p' + 2[e>0])α + ((p'−1)/p'·n + [odd: n])β."""
    p, r = comm.size, comm.rank
    if p == 1:
        return
    pof2, extra = _fold(p)
    v = _virtual(r, extra)
    if v < 0:
        comm.send(buf[bounds[r]:bounds[r + 1]], r + 1, tag)
        comm.recv(buf, r + 1, tag)
        return
    if r < 2 * extra:
        comm.recv(buf[bounds[r - 1]:bounds[r]], r - 1, tag)
    _doubling_gather(comm, buf, tag, _fold_regions(bounds, pof2, extra), v, extra)
    if r < 2 * extra:
        comm.send(buf, r - 1, tag)


def bruck_all_gather(comm: Any, buf: np.ndarray, tag: int, bounds: list[int] | None = None) -> None:
    """Bruck's all-gather: ⌈log₂p⌉ rounds for any p. A scratch buffer holds the chunks of ranks r, r+1, …
    in that order; in round k (distance 2ᵏ) rank r sends its first min(2ᵏ, p−2ᵏ) chunks to r − 2ᵏ and
    appends as many from r + 2ᵏ; a final rotation puts them in rank order.
    T = ⌈log₂p⌉α + (p−1)/p·nβ (+ one local copy of n): the latency-optimal all-gather."""
    p, r = comm.size, comm.rank
    bounds = bounds or chunk_bounds(buf.size, p)
    order = [(r + j) % p for j in range(p)]
    offsets = [0]
    for rank in order:
        offsets.append(offsets[-1] + bounds[rank + 1] - bounds[rank])
    rotated = np.empty(buf.size, buf.dtype)
    rotated[:offsets[1]] = buf[bounds[r]:bounds[r + 1]]
    distance = 1
    while distance < p:
        count = min(distance, p - distance)
        comm.sendrecv(rotated[:offsets[count]], (r - distance) % p,
                      rotated[offsets[distance]:offsets[distance + count]], (r + distance) % p, tag)
        distance <<= 1
    head = offsets[p - r]  # chunks r … p−1, then 0 … r−1
    buf[bounds[r]:] = rotated[:head]
    buf[:bounds[r]] = rotated[head:]


def segmented_broadcast(comm: Any, buf: np.ndarray, root: int, tag: int, segment_bytes: int) -> None:
    """The binomial tree of :func:`binomial_broadcast`, pipelined: the buffer goes in segments of
    ``segment_bytes``; a rank forwards segment i (non-blocking) and receives segment i+1 meanwhile, so
    the tree's levels work at once. With k segments of s bytes: T = (⌈log₂p⌉ + k − 1)(α + sβ) instead
    of ⌈log₂p⌉(α + nβ) — for large n close to nβ, whatever the depth of the tree."""
    p, r = comm.size, comm.rank
    v = (r - root) % p
    low = v & -v if v else 1 << p.bit_length()
    parent = (v - low + root) % p if v else None
    children = [(v + m + root) % p for m in (1 << j for j in range(p.bit_length() - 1, -1, -1)) if m < low and v + m < p]
    step = max(1, segment_bytes // max(buf.itemsize, 1))
    pending = []
    for start in range(0, buf.size, step):
        segment = buf[start:start + step]
        if parent is not None:
            comm.recv(segment, parent, tag)
        pending += [comm.isend(segment, child, tag) for child in children]
    for handle in pending:
        handle.wait()


def hierarchical_all_reduce(node: Any, cross: Any, buf: np.ndarray, op: str, tag: int, p: int,
                            cross_all_reduce: Any) -> None:
    """Two levels, for q ranks on each of m nodes (p = q·m): a ring reduce-scatter inside the node
    (chunk i to local rank i), an all-reduce of that chunk across the nodes among the ranks with the same
    local rank (``cross_all_reduce``), a ring all-gather inside the node. Only n/q bytes per rank cross
    the slow links: T = 2(q−1)α_node + 2(q−1)/q·nβ_node + T_cross(n/q) + γ terms."""
    bounds = chunk_bounds(buf.size, node.size)
    mine = buf[bounds[node.rank]:bounds[node.rank + 1]]
    ring_reduce_scatter(node, buf, "sum" if op == "avg" else op, tag, bounds)
    cross_all_reduce(cross, mine, "sum" if op == "avg" else op, tag)
    if op == "avg":
        mine /= p
    ring_all_gather(node, buf, tag, bounds)


def pairwise_all_to_all(comm: Any, src: np.ndarray, out: np.ndarray, send_bounds: list[int],
                        recv_bounds: list[int], tag: int) -> None:
    """Rank r's block j of ``src`` (``send_bounds``) to rank j's block r of ``out`` (``recv_bounds``).

    Round k = 1 … p−1: send the block for r + k while receiving the one from r − k; this rank's own
    block is copied. Any p, any counts (zeros too): T = (p−1)α + (n − own)β; each rank sends every
    byte but its own block's, once — the bandwidth-optimal all-to-all."""
    p, r = comm.size, comm.rank
    out[recv_bounds[r]:recv_bounds[r + 1]] = src[send_bounds[r]:send_bounds[r + 1]]
    for k in range(1, p):
        dest, source = (r + k) % p, (r - k) % p
        comm.sendrecv(src[send_bounds[dest]:send_bounds[dest + 1]], dest,
                      out[recv_bounds[source]:recv_bounds[source + 1]], source, tag)


def bruck_all_to_all(comm: Any, src: np.ndarray, out: np.ndarray, tag: int) -> None:
    """Bruck's all-to-all for equal blocks of c = n/p elements: ⌈log₂p⌉ rounds instead of p−1.

    Rotate so that block i is the one for rank r + i; in round k (bit b = 2ᵏ) send every block whose
    index has bit b set to rank r + b and receive as many from r − b into the same places — a block
    travels i hops in total, to its destination; then block i holds what rank r − i sent, and a
    second rotation puts the blocks in source order. T = 2⌈log₂p⌉α + ⌈log₂p⌉·(n/2)(β + 2γ) + 2nγ (each
    round gathers and scatters its blocks besides the message): fewer messages, more bytes — the choice
    for small blocks on many ranks."""
    p, r = comm.size, comm.rank
    c = src.size // p
    blocks = src.reshape(p, c)
    rotated = np.concatenate([blocks[r:], blocks[:r]])  # block i: for rank r + i
    bit = 1
    while bit < p:
        chosen = [i for i in range(p) if i & bit]
        outgoing = np.ascontiguousarray(rotated[chosen])
        incoming = np.empty_like(outgoing)
        comm.sendrecv(outgoing.reshape(-1), (r + bit) % p, incoming.reshape(-1), (r - bit) % p, tag)
        rotated[chosen] = incoming
        bit <<= 1
    result = out.reshape(p, c)
    for j in range(p):  # block i came from rank r − i
        result[j] = rotated[(r - j) % p]


def all_to_all_bytes_sent(send_counts: list[int], itemsize: int, rank: int, algorithm: str) -> int:
    """Bytes ``rank`` sends in an all-to-all: pairwise sends every block but its own; Bruck (equal blocks
    of c) sends, in round k, the blocks whose index has bit k set."""
    p = len(send_counts)
    if algorithm == "pairwise":
        return (sum(send_counts) - send_counts[rank]) * itemsize
    c, sent, bit = send_counts[0], 0, 1
    while bit < p:
        sent += sum(1 for i in range(p) if i & bit) * c
        bit <<= 1
    return sent * itemsize


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
