"""Context parallelism: every sample's sequence split over cp ranks — here DeepSpeed-Ulysses (Jacobs et al. 2023).

Rank c of a cp group is given positions [c·T/cp, (c+1)·T/cp) of every sequence of its data-parallel
rows: its tokens, targets and position embeddings. Everything but attention is per token and needs no
communication. Attention needs all T keys for every query, so around it two all-to-alls re-slice the
activations from sequence-sharded to head-sharded and back:

    qkv (B, T/cp, 3, H, D) ──all-to-all──> (B, T, 3, H/cp, D)     every rank: all positions, H/cp heads
    causal attention on H/cp heads, exactly as one process computes those heads
    y   (B, T, H/cp, D)    ──all-to-all──> (B, T/cp, H, D)         back to this rank's positions

Backward is the conjugate pair (each all-to-all's gradient is the opposite all-to-all). Per layer and
direction a rank sends (cp−1)/cp of its 3·B·(T/cp)·C' + B·(T/cp)·C' elements (C' = C/tp, the heads this
tp rank holds) with the pairwise algorithm — a volume independent of cp per rank at fixed B·T/cp.

Why it equals single-process training. Attention per head is computed whole, on one rank; all other
layers are per token. Each rank's loss is the mean over its T/cp positions, and parameters are
replicated over cp like over dp, so averaging gradients over the dp×cp ranks (``Mesh.grad_comm``)
gives the gradient of the mean over all tokens — autograd's backward through the all-to-alls routes
every rank's share of every other rank's loss to where it belongs.

Constraints: T divisible by cp; the heads a rank holds (n_head / tp) divisible by cp.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from minipar import ops
from minipar.autograd import Context, Function, Tensor
from minipar.backend import xp
from minipar.comm import Communicator
from minipar.models.gpt import GPT

KINDS = ("ulysses",)


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


class UlyssesAttention:
    """Causal self-attention of a (B, T/cp, 3·H·D) q|k|v shard: all-to-all to heads, attend, all-to-all back."""

    def __init__(self, comm: Communicator):
        self.comm = comm

    def __call__(self, qkv: Tensor, n_head: int, scale: float | None) -> Tensor:
        heads = SequenceToHeads.apply(qkv, self.comm, n_head, 3)
        y = ops.causal_self_attention(heads, n_head // self.comm.size, scale)
        return HeadsToSequence.apply(y, self.comm, n_head)


def check_context_parallel(cfg: Any, cp: int, tp: int, kind: str) -> None:
    """Raise before any communication if a GPT config cannot be split over ``cp`` context-parallel ranks."""
    if kind not in KINDS:
        raise ValueError(f"--cp-kind {kind!r}: only {list(KINDS)} is implemented so far (ring attention is not yet)")
    if cfg.block_size % cp:
        raise ValueError(f"--cp {cp} splits each sequence: the sequence length (--block-size {cfg.block_size}) "
                         "must be divisible by it")
    if (cfg.n_head // tp) % cp:
        raise ValueError(f"--cp {cp} (Ulysses) splits the attention heads of each tp rank: n_head / tp = "
                         f"{cfg.n_head // tp} must be divisible by it")


def context_slice(a: np.ndarray, comm: Communicator) -> np.ndarray:
    """This rank's contiguous chunk of the positions of a (B, T) batch."""
    t = a.shape[1] // comm.size
    return a[:, comm.rank * t:(comm.rank + 1) * t]


def context_parallel(model: GPT, comm: Communicator, kind: str = "ulysses") -> GPT:
    """Make ``model`` attend across the ``comm`` ranks that split each sequence (in place)."""
    tp = model.tp_comm.size if hasattr(model, "tp_comm") else 1
    check_context_parallel(model.config, comm.size, tp, kind)
    for block in model.transformer.h:
        block.attn.core = UlyssesAttention(comm)
    model.context_shard = (comm.rank, comm.size)
    return model
