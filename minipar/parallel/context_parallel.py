"""Context parallelism: every sample's sequence split over cp ranks — ring attention (default) or Ulysses.

Rank c of a cp group is given some positions of every sequence of its data-parallel rows: its tokens,
targets and position embeddings. Everything but attention is per token and needs no communication.
Attention needs every key for every query; two ways to get them:

Ring attention (``kind="ring"``; Liu et al. 2023, as in torchtitan and picotron). The K/V blocks travel
around the cp ranks (isend right, irecv left), each overlapped with the attention of the block in hand;
partial results merge by the online-softmax (log-sum-exp) rule and the backward sends dK/dV around the
ring with their blocks (:class:`RingAttention`). With a causal mask the early positions attend to little:
a ``contiguous`` split leaves rank 0 almost idle and the last rank with most of the work; the ``zigzag``
split gives rank c chunks c and 2·cp−1−c of 2·cp, one early and one late, so the work is equal
(``model.context_work["pairs"]`` counts it; ``["wait_s"]`` the time spent waiting for blocks). Per rank and layer it sends (cp−1)·2 blocks of K|V forward and
cp·4 blocks of K|V|dK|dV backward.

DeepSpeed-Ulysses (``kind="ulysses"``; Jacobs et al. 2023; contiguous chunks). Two all-to-alls re-slice
the activations from sequence-sharded to head-sharded and back:

    qkv (B, T/cp, 3, H, D) ──all-to-all──> (B, T, 3, H/cp, D)     every rank: all positions, H/cp heads
    causal attention on H/cp heads, exactly as one process computes those heads
    y   (B, T, H/cp, D)    ──all-to-all──> (B, T/cp, H, D)         back to this rank's positions

with the conjugate all-to-alls in backward. Per layer and direction a rank sends (cp−1)/cp of its
3·B·(T/cp)·C' + B·(T/cp)·C' elements (C' = C/tp, the heads this tp rank holds), pairwise.

Why both equal single-process training. Every (query, key) score is computed once, on one rank, with
the same causal mask on global positions; all other layers are per token. Each rank's loss is the mean
over its T/cp positions, its backward starts from its share of the global tokens (data_parallel.py), and
parameters are replicated over cp like over dp, so summing gradients over the dp×cp ranks (``Mesh.grad_comm``)
gives the gradient of the mean over all tokens — autograd's
backward through the exchanges routes every rank's share of every other rank's loss to where it belongs.

A mixture-of-experts layer routes the whole sequences of its cp ranks as one group, as one process
routes them (:func:`admit_across`): each rank all-gathers the experts its tokens chose (B·(T/cp)·k
integers), places every rank's choices at their true positions and applies the capacity and priority
rule to the whole group; it keeps its own kept assignments and computes them itself. The balancing
loss weighs this rank's mean router probabilities by the group's assignment shares, so the average
over the cp ranks is the group's loss.

Constraints: T divisible by cp (contiguous) or 2·cp (zigzag); for Ulysses the heads a rank holds
(n_head / tp) divisible by cp.

Deep dive, with measurements: docs/context_parallel.md.
"""
from __future__ import annotations

import math
import time
from typing import Any

import numpy as np

from minipar import ops, precision
from minipar.autograd import Context, Function, Tensor
from minipar.backend import is_low_precision, to_device, xp
from minipar.comm import Communicator
from minipar.models.gpt import GPT
from minipar.models.moe import MoEMLP, pack_slots, priority_slots

KINDS = ("ring", "ulysses")          # the --cp-kind choices
SPLITS = ("zigzag", "contiguous")    # the --cp-split choices


def scatter_heads(comm: Communicator, x: Any, label: str) -> Any:
    """(B, t, K, H, D) on T/cp positions -> (B, cp·t, K, H/cp, D): every position, this rank's head group."""
    B, t, K, H, D = x.shape
    n, g = comm.size, H // comm.size
    blocks = xp.ascontiguousarray(x.reshape(B, t, K, n, g, D).transpose(3, 0, 1, 2, 4, 5))  # block j: heads of rank j
    got = comm.all_to_all(blocks.reshape(-1), label=label, algorithm="pairwise").reshape(n, B, t, K, g, D)  # block i: positions of rank i
    return xp.ascontiguousarray(got.transpose(1, 0, 2, 3, 4, 5)).reshape(B, n * t, K, g, D)


def gather_heads(comm: Communicator, y: Any, label: str) -> Any:
    """The inverse: (B, T, K, H/cp, D) -> (B, T/cp, K, H, D), this rank's positions with every head."""
    B, T, K, g, D = y.shape
    n, t = comm.size, T // comm.size
    blocks = xp.ascontiguousarray(y.reshape(B, n, t, K, g, D).transpose(1, 0, 2, 3, 4, 5))  # block j: positions of rank j
    got = comm.all_to_all(blocks.reshape(-1), label=label, algorithm="pairwise").reshape(n, B, t, K, g, D)  # block i: heads of rank i
    return xp.ascontiguousarray(got.transpose(1, 2, 3, 0, 4, 5)).reshape(B, t, K, n * g, D)


class SequenceToHeads(Function):
    """(B, T/cp, K·H·D) -> (B, T, K·(H/cp)·D); backward: the inverse all-to-all of the gradient."""

    autocast = False  # moves data: keeps its dtype (16-bit messages under mixed precision)

    @staticmethod
    def forward(ctx: Context, x: Any, comm: Communicator, n_head: int, k: int) -> Any:
        B, t, width = x.shape
        ctx.comm, ctx.shape = comm, (B, t, k, n_head, width // (k * n_head))
        out = scatter_heads(comm, x.reshape(ctx.shape), "cp_forward")
        return out.reshape(B, comm.size * t, -1)

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        B, t, k, H, D = ctx.shape
        grad = gather_heads(ctx.comm, g.reshape(B, ctx.comm.size * t, k, H // ctx.comm.size, D), "cp_backward")
        return grad.reshape(B, t, k * H * D), None, None, None


class HeadsToSequence(Function):
    """(B, T, (H/cp)·D) -> (B, T/cp, H·D); backward: the inverse all-to-all of the gradient."""

    autocast = False  # moves data: keeps its dtype (16-bit messages under mixed precision)

    @staticmethod
    def forward(ctx: Context, y: Any, comm: Communicator, n_head: int) -> Any:
        B, T, width = y.shape
        ctx.comm, ctx.shape = comm, (B, T, 1, n_head // comm.size, width * comm.size // n_head)
        out = gather_heads(comm, y.reshape(ctx.shape), "cp_forward")
        return out.reshape(B, T // comm.size, -1)

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        B, T, _, gh, D = ctx.shape
        grad = scatter_heads(ctx.comm, g.reshape(B, T // ctx.comm.size, 1, gh * ctx.comm.size, D), "cp_backward")
        return grad.reshape(B, T, gh * D), None, None


def kv_heads_of(rank: int, size: int, kv_heads: int) -> Any:
    """The K/V heads Ulysses rank ``rank`` of ``size`` needs for its query heads: its K/size of them, or — fewer
    K/V heads than ranks — the one its queries share (query head h reads K/V head h // (H/K))."""
    if kv_heads >= size:
        per = kv_heads // size
        return np.arange(rank * per, (rank + 1) * per)
    return np.array([rank * kv_heads // size])


class KVToHeads(Function):
    """Grouped-query K|V, (B, T/cp, 2·K·D) -> (B, T, 2·k'·D): every position, the k' K/V heads this rank's query
    heads read (:func:`kv_heads_of`; k' = K/cp, or 1 shared by cp/K ranks). One pairwise all-to-all of the K heads,
    never the H they are repeated to. Backward sends each rank's gradient of those heads back; a head shared by
    several ranks sums their parts."""

    autocast = False  # moves data: keeps its dtype (16-bit messages under mixed precision)

    @staticmethod
    def forward(ctx: Context, x: Any, comm: Communicator, kv_heads: int) -> Any:
        B, t, width = x.shape
        n, K = comm.size, kv_heads
        ctx.comm, ctx.shape = comm, (B, t, 2, K, width // (2 * K))
        ctx.needed = [kv_heads_of(j, n, K) for j in range(n)]
        x5 = x.reshape(ctx.shape)
        blocks = xp.ascontiguousarray(xp.stack([x5[:, :, :, to_device(heads)] for heads in ctx.needed]))
        got = comm.all_to_all(blocks.reshape(-1), label="cp_forward", algorithm="pairwise").reshape(blocks.shape)
        return xp.ascontiguousarray(got.transpose(1, 0, 2, 3, 4, 5)).reshape(B, n * t, -1)  # block i: rank i's positions

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        B, t, _, K, D = ctx.shape
        n = ctx.comm.size
        blocks = xp.ascontiguousarray(g.reshape(B, n, t, 2, -1, D).transpose(1, 0, 2, 3, 4, 5))
        back = ctx.comm.all_to_all(blocks.reshape(-1), label="cp_backward", algorithm="pairwise").reshape(blocks.shape)
        grad = xp.zeros(ctx.shape, dtype=g.dtype)
        for j, heads in enumerate(ctx.needed):  # from rank j: this rank's positions of the heads j reads
            grad[:, :, :, to_device(heads)] += back[j]
        return grad.reshape(B, t, 2 * K * D), None, None


class UlyssesAttention:
    """Causal self-attention of a (B, T/cp, (H + 2K)·D) q|k|v shard: all-to-all to heads, attend, all-to-all
    back. With K = H one all-to-all moves q|k|v; with grouped-query heads q moves as H heads and k|v as the K
    heads they are (:class:`KVToHeads`), repeated only inside the attention."""

    def __init__(self, comm: Communicator):
        self.comm = comm

    def __call__(self, qkv: Tensor, n_head: int, scale: float | None, kv_heads: int | None = None) -> Tensor:
        n, K = self.comm.size, kv_heads or n_head
        if K == n_head:
            heads = SequenceToHeads.apply(qkv, self.comm, n_head, 3)
            y = ops.causal_self_attention(heads, n_head // n, scale)
        else:
            D = qkv.shape[-1] // (n_head + 2 * K)
            q = SequenceToHeads.apply(qkv[:, :, :n_head * D], self.comm, n_head, 1)
            kv = KVToHeads.apply(qkv[:, :, n_head * D:], self.comm, K)
            y = ops.causal_self_attention(ops.concat([q, kv], axis=2), n_head // n, scale,
                                          kv_heads=len(kv_heads_of(0, n, K)))
        return HeadsToSequence.apply(y, self.comm, n_head)


_RING_TAG = 900  # point-to-point tag of the ring's K/V (and dK/dV) blocks, below the collectives' tags


def chunk_positions(rank: int, size: int, t: int, split: str) -> Any:
    """The global positions of the t tokens of each sequence that ``rank`` of ``size`` holds.
    contiguous: chunk ``rank`` of ``size``; zigzag: chunks ``rank`` and 2·size−1−rank of 2·size, so every rank
    holds an early and a late chunk and the causal attention work is the same on every rank."""
    if split == "contiguous":
        return np.arange(rank * t, (rank + 1) * t)
    c = t // 2
    return np.concatenate([np.arange(rank * c, (rank + 1) * c), np.arange((2 * size - 1 - rank) * c, (2 * size - rank) * c)])


class RingAttention(Function):
    """Causal attention of this rank's queries against every rank's keys and values, which travel around the ring.

    Forward, step s = 0 … N−1: the K/V block of rank r−s is in hand; the block of rank r−s−1 is already on its
    way (isend right / irecv left, overlapped with this block's attention). Per block: scores masked by the
    global positions (key after query: −∞; a block entirely after every query is skipped), and the
    online-softmax merge  m' = max(m, m_b),  l' = l·e^{m−m'} + Σ e^{S−m'},  o' = o·e^{m−m'} + e^{S−m'} V.
    out = o / l, and the log-sum-exp L = m + log l is saved. Backward: with Δ = Σ dO ⊙ O per query, each
    block gives dV += Pᵀ dO, dS = P ⊙ (dO Vᵀ − Δ), dQ += s·dS K, dK += s·dSᵀ Q (P = e^{S−L}); the K, V, dK,
    dV of a block travel together and after N hops come home complete. Bytes per rank and layer: (N−1)·2·n
    forward, N·4·n backward, n = B·(H/tp)·t·D elements. Under mixed precision the blocks travel in 16 bits
    (dK, dV rounded once per hop) and every block's arithmetic runs in float32.
    """
    autocast = False  # upcasts each block itself, so that K|V and dK|dV travel in the 16-bit storage dtype

    @staticmethod
    def forward(ctx: Context, qkv: Any, comm: Communicator, n_head: int, scale: float | None, split: str,
                work: dict[str, float], kv_heads: int | None = None) -> Any:
        B, t, width = qkv.shape
        H, K = n_head, kv_heads or n_head
        D = width // (H + 2 * K)
        storage = qkv.dtype
        compute = xp.float32 if is_low_precision(storage) else storage
        heads = qkv.reshape(B, t, H + 2 * K, D).transpose(0, 2, 1, 3)
        q, k, v = heads[:, :H], heads[:, H:H + K], heads[:, H + K:]  # (B, heads, t, D) views
        qf = q.astype(compute, copy=False)
        scale = 1.0 / math.sqrt(D) if scale is None else scale
        r, N = comm.rank, comm.size
        positions_of = lambda rank: to_device(chunk_positions(rank, N, t, split))  # noqa: E731
        mine = positions_of(r)
        m = xp.full((B, H, t), -xp.inf, dtype=compute)
        l, o = xp.zeros((B, H, t), compute), xp.zeros((B, H, t, D), compute)
        kv = xp.ascontiguousarray(xp.stack([k, v]))  # what travels: the K heads, in the storage dtype
        for s in range(N):
            if s < N - 1:  # the next block is on its way while this one is computed
                arriving = xp.empty_like(kv)
                receive = comm.irecv(arriving, (r - 1) % N, _RING_TAG)
                send = comm.isend(kv, (r + 1) % N, _RING_TAG, label="cp_forward")
            masked = positions_of((r - s) % N)[None, :] > mine[:, None]
            if not masked.all():
                work["pairs"] += int((~masked).sum()) * B * H
                kf, vf = (ops.repeat_heads(a, H) for a in kv.astype(compute, copy=False))
                scores = xp.where(masked, -xp.inf, (qf @ xp.swapaxes(kf, -1, -2)) * scale)
                m_new = xp.maximum(m, scores.max(axis=-1))
                safe = xp.where(xp.isfinite(m_new), m_new, 0.0)
                p = xp.exp(scores - safe[..., None])
                decay = xp.exp(m - safe)
                l = l * decay + p.sum(axis=-1)
                o = o * decay[..., None] + p @ vf
                m = m_new
            if s < N - 1:
                waited = time.perf_counter()
                send.wait()
                kv = receive.wait()
                work["wait_s"] += time.perf_counter() - waited  # the exchange the block's attention did not hide
        out = (o / l[..., None]).astype(storage, copy=False)
        ctx.save_for_backward(q, k, v, out, m + xp.log(l))
        ctx.comm, ctx.scale, ctx.positions_of, ctx.compute = comm, scale, positions_of, compute
        return out.transpose(0, 2, 1, 3).reshape(B, t, H * D)

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        q, k, v, out, lse = ctx.saved
        comm, scale, positions_of, compute = ctx.comm, ctx.scale, ctx.positions_of, ctx.compute
        B, H, t, D = q.shape
        K = k.shape[1]
        r, N = comm.rank, comm.size
        mine = positions_of(r)
        do = xp.ascontiguousarray(g.reshape(B, t, H, D).transpose(0, 2, 1, 3)).astype(compute, copy=False)
        q = q.astype(compute, copy=False)
        delta = (do * out.astype(compute, copy=False)).sum(axis=-1)
        dq = xp.zeros_like(q)
        travel = xp.ascontiguousarray(xp.stack([k, v, xp.zeros_like(k), xp.zeros_like(v)]))  # K, V, dK, dV
        for s in range(N):
            masked = positions_of((r - s) % N)[None, :] > mine[:, None]
            if not masked.all():
                kj, vj, dkj, dvj = travel.astype(compute, copy=False)
                kj, vj = ops.repeat_heads(kj, H), ops.repeat_heads(vj, H)
                scores = xp.where(masked, -xp.inf, (q @ xp.swapaxes(kj, -1, -2)) * scale)
                p = xp.exp(scores - lse[..., None])
                dvj += ops.fold_heads(xp.swapaxes(p, -1, -2) @ do, K)
                ds = p * (do @ xp.swapaxes(vj, -1, -2) - delta[..., None])
                dq += (ds @ kj) * scale
                dkj += ops.fold_heads(xp.swapaxes(ds, -1, -2) @ q, K) * scale
                travel[2], travel[3] = dkj, dvj  # (no-ops in full precision: views)
            arriving = xp.empty_like(travel)  # every block moves on, N hops in all: home again at the end
            receive = comm.irecv(arriving, (r - 1) % N, _RING_TAG + 1)
            comm.isend(travel, (r + 1) % N, _RING_TAG + 1, label="cp_backward").wait()
            travel = receive.wait()
        dqkv = xp.concatenate([dq.astype(travel.dtype, copy=False), travel[2], travel[3]], axis=1)  # (B, H + 2K, t, D)
        return (xp.ascontiguousarray(dqkv.transpose(0, 2, 1, 3)).reshape(B, t, (H + 2 * K) * D), None, None, None, None,
                None, None)


class RingAttentionCore:
    """The attention of one block under ring context parallelism; ``work["pairs"]`` counts the (query, key)
    pairs this rank scored (per head and sample), to show the causal load balance of the split, and
    ``work["wait_s"]`` the forward's exposed communication."""

    def __init__(self, comm: Communicator, split: str, work: dict[str, float]):
        self.comm, self.split, self.work = comm, split, work

    def __call__(self, qkv: Tensor, n_head: int, scale: float | None, kv_heads: int | None = None) -> Tensor:
        return RingAttention.apply(qkv, self.comm, n_head, scale, self.split, self.work, kv_heads)


def check_context_parallel(cfg: Any, cp: int, tp: int, kind: str, split: str) -> None:
    """Raise before any communication if a GPT config cannot be split over ``cp`` context-parallel ranks."""
    if kind == "ulysses" and split != "contiguous":
        raise ValueError("--cp-kind ulysses gathers whole sequences per head: use --cp-split contiguous")
    parts = 2 * cp if split == "zigzag" else cp
    if cfg.block_size % parts:
        raise ValueError(f"--cp {cp} with --cp-split {split} cuts each sequence into {parts} chunks: the sequence "
                         f"length (--block-size {cfg.block_size}) must be divisible by {parts}")
    if kind == "ulysses" and (cfg.n_head // tp) % cp:
        raise ValueError(f"--cp {cp} (Ulysses) splits the attention heads of each tp rank: n_head / tp = "
                         f"{cfg.n_head // tp} must be divisible by it")
    kv = max(1, cfg.kv_heads // tp)  # the K/V heads of a tp rank (one, shared, when tp > K)
    if kind == "ulysses" and kv % cp and cp % kv:
        raise ValueError(f"--cp {cp} (Ulysses) with {kv} key/value heads per tp rank: one must divide the other — "
                         "each rank receives its share of them, or the one its query heads share")


def context_slice(a: np.ndarray, comm: Communicator, split: str) -> np.ndarray:
    """This rank's tokens of a (B, T) batch: its positions in every sequence."""
    return a[:, chunk_positions(comm.rank, comm.size, a.shape[1] // comm.size, split)]


def admit_across(mlp: MoEMLP, comm: Communicator, split: str, chosen: np.ndarray) -> tuple[np.ndarray, np.ndarray,
                                                                                          int, int]:
    """MoEMLP.admit for a routing group of whole sequences split over the ``comm`` ranks: this rank's (B, t, k)
    choices, all-gathered (B·t·k integers from every rank), placed at their global positions; the capacity and
    priority rule over all of them decides which of this rank's assignments are kept."""
    B, t, k = chosen.shape
    n, E, T = comm.size, mlp.n_expert, t * comm.size
    pieces = comm.all_gather(np.ascontiguousarray(chosen, np.int64).reshape(-1), label="cp_moe_route").reshape(n, B, t, k)
    group = np.empty((B, T, k), np.int64)
    for rank in range(n):
        group[:, chunk_positions(rank, n, t, split)] = pieces[rank]
    assigned = np.bincount(group.ravel(), minlength=E)
    group_slot = priority_slots(group.reshape(B * T, k), E, mlp.capacity(B * T, assigned)).reshape(B, T, k)
    kept = group_slot[:, chunk_positions(comm.rank, n, t, split)].reshape(B * t, k) >= 0
    slot, width = pack_slots(chosen.reshape(B * t, k), kept, E)
    return slot, assigned, B * T, width


def context_parallel(model: GPT, comm: Communicator, kind: str = "ring", split: str = "zigzag") -> GPT:
    """Make ``model`` attend across the ``comm`` ranks that split each sequence (in place); returns it.
    ``model.context_work`` counts the attention work of this rank and its waits (ring attention)."""
    tp = max(p.placement.tp_size for p in model.parameters())  # the heads a rank has left after tensor parallelism
    check_context_parallel(model.config, comm.size, tp, kind, split)
    model.given_positions = lambda T: to_device(chunk_positions(comm.rank, comm.size, T, split))
    model.context_work = {"pairs": 0, "wait_s": 0.0}
    for _, block in model.named_blocks():
        block.attn.core = UlyssesAttention(comm) if kind == "ulysses" else RingAttentionCore(comm, split, model.context_work)
        if isinstance(block.mlp, MoEMLP):
            block.mlp.admit = lambda chosen, mlp=block.mlp: admit_across(mlp, comm, split, chosen)
        for linear in block.projections():
            if linear.fp8 is not None:
                linear.fp8_reduce = token_amax(comm, linear.fp8)
    return model


def token_amax(comm: Communicator, recipe: Any) -> Any:
    """FP8 scales under context parallelism: a rank holds pieces of every sequence, so the activations and output
    gradients are cut along their tokens (axis 0) over the cp ranks — a tensorwise one, or rowwise's columns along
    the tokens of the weight-gradient GEMM, takes its amax over them (precision.amax_over); a token's own row
    stays local, and the weight is whole on every cp rank."""
    return precision.amax_over(comm, recipe, {"input": 0, "grad": 0})


def context_report(model: GPT, cp_comm: Communicator) -> dict[str, float]:
    """Ring attention's balance across the cp ranks this step: (query, key) pairs scored, max and min over the
    ranks, and the forward's exposed communication (ms, the slowest rank)."""
    work = model.context_work
    gathered = cp_comm.all_gather(np.array([work["pairs"], work["wait_s"]], np.float64), label="cp_report").reshape(-1, 2)
    return {"attention_pairs_max": float(gathered[:, 0].max()), "attention_pairs_min": float(gathered[:, 0].min()),
            "ring_wait_ms": float(gathered[:, 1].max() * 1e3)}
