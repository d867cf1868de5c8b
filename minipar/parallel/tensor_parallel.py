"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019): split each layer's matrices over tp ranks.

Two conjugate operators carry all the communication (``f`` and ``g`` in the paper):

    f  = CopyToTensorParallel       forward: identity        backward: all-reduce(dx)
    g  = ReduceFromTensorParallel   forward: all-reduce(y)   backward: identity

A column-parallel linear splits W (in, out) by columns: rank r computes y_r = x W[:, r] — its
own slice of the output, no communication — after an ``f`` (every rank's dx is partial, so dx is
summed in backward). A row-parallel linear splits W by rows and consumes such a slice:
y = Σ_r y_r W[r, :] is a ``g``. Composed column→row, a layer costs one all-reduce forward and one
backward, of the B·T·C activations:

    attention:  f → c_attn (column: this rank's heads' q, k, v) → attention on H/tp heads
                  → c_proj (row) → g
    MLP:        f → c_fc (column, 4C/tp wide) → gelu → c_proj (row) → g

so a transformer layer makes exactly 2 all-reduces forward and 2 backward of B·T·C elements.

Vocabulary parallelism. The (V, C) embedding is split by rows; rank r owns tokens
[r·V'/tp, (r+1)·V'/tp) of the vocabulary padded to V' = tp·⌈V/tp⌉. The lookup zeroes rows it does
not own and a ``g`` sums them (one all-reduce of B·T·C). The tied head after an ``f`` produces only
this rank's slice of the logits, and the cross-entropy never assembles the full (B, T, V)
logits: it all-reduces the row maxima, the sums of exponentials and the target logits (three
all-reduces of B·T numbers); its backward, softmax − onehot on the local slice, needs none. Padded
vocabulary columns are masked to −∞, so the loss is the unpadded one.

Parameters that every tp rank holds whole (layer norms, wpe, row-parallel biases, mixture-of-experts
MLPs, which run whole on the replicated tokens — under sequence parallelism on the gathered sequence:
an all-gather of B·T·C in, this rank's shard out, an all-gather of its gradient back) receive
identical gradients on every rank; their placement (no tp split: minipar/placement.py) makes a global
gradient norm count them once — as :func:`split_of` says, for every parameter, how it is split.

Sequence parallelism (Megatron-SP, Korthikanti et al. 2022; ``sequence_parallel=True``). Between
the tensor-parallel regions — layer norms, residual adds, dropout's place, the head's input — every
rank holds only T/tp of each sequence, (B, T/tp, C), instead of a full replica. The conjugate pair
changes shape, not cost:

    ḡ  = GatherSequence            forward: all-gather along T    backward: reduce-scatter of dx
    ḡ* = ReduceScatterSequence     forward: reduce-scatter along T backward: all-gather of dy

ḡ replaces f before each column-parallel layer and ḡ* replaces g after each row-parallel one. A ring
all-gather plus a ring reduce-scatter of B·T·C elements send exactly what one ring all-reduce sends,
2(tp−1)/tp·B·T·C, so a layer still costs 2 all-reduces' worth forward and 2 backward, while the layer
norm and residual activations shrink by tp. The parameters used on a shard (layer norms, wpe,
row-parallel biases) see only this rank's tokens: their gradients pass an ``f`` (all-reduce, label
``sp_params``), which makes them whole and equal on every rank, as in TP. The loss is unchanged:
the head gathers the full sequence for its vocabulary slice. T must be divisible by tp.

Deep dive, with measurements: docs/tensor_parallel.md.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from minipar import ops, precision
from minipar.autograd import Context, Function, Tensor
from minipar.backend import to_device, xp
from minipar.comm import Communicator
from minipar.models.gpt import GPT
from minipar.nn import Module, Parameter
from minipar.placement import Split


class CopyToTensorParallel(Function):
    """f: identity forward, all-reduce of the gradient backward."""

    autocast = False  # moves data: keeps its dtype (16-bit messages under mixed precision)

    @staticmethod
    def forward(ctx: Context, x: Any, comm: Communicator, label: str = "tp_backward") -> Any:
        ctx.comm, ctx.label = comm, label
        return x

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        return ctx.comm.all_reduce(g.copy(), label=ctx.label), None, None


class ReduceFromTensorParallel(Function):
    """g: all-reduce forward, identity backward."""

    autocast = False  # moves data: keeps its dtype (16-bit messages under mixed precision)

    @staticmethod
    def forward(ctx: Context, x: Any, comm: Communicator, label: str = "tp_forward") -> Any:
        return comm.all_reduce(x.copy(), label=label)

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        return g, None, None


def gather_sequence(comm: Communicator, x: Any, label: str) -> Any:
    """(B, t, C) shards -> (B, tp·t, C), rank r's shard at [r·t, (r+1)·t): a ring all-gather of B·t·C each."""
    B, t, C = x.shape
    whole = comm.all_gather(xp.ascontiguousarray(x).reshape(-1), algorithm="ring", label=label)
    return xp.ascontiguousarray(whole.reshape(comm.size, B, t, C).transpose(1, 0, 2, 3)).reshape(B, comm.size * t, C)


def reduce_scatter_sequence(comm: Communicator, y: Any, label: str) -> Any:
    """(B, T, C) partial sums -> this rank's (B, T/tp, C) shard of their sum: a ring reduce-scatter."""
    B, T, C = y.shape
    blocks = xp.ascontiguousarray(y.reshape(B, comm.size, T // comm.size, C).transpose(1, 0, 2, 3)).reshape(-1)
    return comm.reduce_scatter(blocks, algorithm="ring", label=label).reshape(B, T // comm.size, C)


class GatherSequence(Function):
    """ḡ: all-gather along the sequence forward, reduce-scatter of the (partial) gradient backward. With
    ``replicated`` the ranks go on to compute the same thing on the whole sequence, so each already holds the
    whole gradient: backward keeps this rank's shard of it (Megatron's gather without a reduce-scatter)."""

    autocast = False  # moves data: keeps its dtype (16-bit messages under mixed precision)

    @staticmethod
    def forward(ctx: Context, x: Any, comm: Communicator, label: str = "sp", replicated: bool = False) -> Any:
        ctx.comm, ctx.label, ctx.replicated = comm, label, replicated
        return gather_sequence(comm, x, f"{label}_forward")

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        if ctx.replicated:
            return own_shard(ctx.comm, g), None, None, None
        return reduce_scatter_sequence(ctx.comm, g, f"{ctx.label}_backward"), None, None, None


class ScatterSequence(Function):
    """This rank's shard of a (B, T, C) tensor every tp rank holds whole; backward all-gathers the gradient."""

    autocast = False

    @staticmethod
    def forward(ctx: Context, y: Any, comm: Communicator, label: str = "sp") -> Any:
        ctx.comm, ctx.label = comm, label
        return own_shard(comm, y)

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        return gather_sequence(ctx.comm, g, f"{ctx.label}_backward"), None, None


def own_shard(comm: Communicator, y: Any) -> Any:
    """Positions [r·T/tp, (r+1)·T/tp) of a (B, T, C) tensor."""
    t = y.shape[1] // comm.size
    return xp.ascontiguousarray(y[:, comm.rank * t:(comm.rank + 1) * t])


class ReduceScatterSequence(Function):
    """ḡ*: reduce-scatter along the sequence forward, all-gather of the gradient backward."""

    autocast = False  # moves data: keeps its dtype (16-bit messages under mixed precision)

    @staticmethod
    def forward(ctx: Context, x: Any, comm: Communicator, label: str = "sp") -> Any:
        ctx.comm, ctx.label = comm, label
        return reduce_scatter_sequence(comm, x, f"{label}_forward")

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        return gather_sequence(ctx.comm, g, f"{ctx.label}_backward"), None, None


def _shard_used(p: Parameter, comm: Communicator | None) -> Tensor:
    """A whole parameter used on this rank's sequence shard only: under sequence parallelism an ``f`` sums
    its partial gradient over the tp ranks (without it, the identity)."""
    return p if comm is None else CopyToTensorParallel.apply(p, comm, "sp_params")


def _fp8_linear(module: Any, x: Tensor, w: Tensor, b: Tensor | None, split: dict[str, int]) -> Tensor:
    """x·w (+ b) in FP8 under ``module.fp8``: a scale whose group spans the tp slices (``split``: role -> the axis
    cut over tp) takes its amax over the group (precision.amax_over), then over cp (``module.fp8_reduce``)."""
    return precision.linear(x, w, module.fp8, b,
                            reduce_amax=precision.amax_over(module.comm, module.fp8, split, module.fp8_reduce))


class ColumnParallelLinear(Module):
    """y_r = f(x) W_r + b_r with W_r = W[:, cols of rank r] (in, out/tp); the output stays split.
    Sequence-parallel: ḡ(x) instead of f(x) — the full sequence from the shards.

    ``replicated=(start, group)``: the columns from ``start`` on are not this rank's alone but a copy held by every
    rank of ``group`` (a Llama's K/V head when tp > n_kv_head). Each rank's gradient of them covers its own query
    heads only, so an ``f`` over the group sums it (an all-reduce of in·(out − start) per step, label
    ``tp_kv_replicas``); the weight's placement says which columns are shared (a global norm counts each copy
    1/|group|)."""

    def __init__(self, weight: Any, bias: Any | None, comm: Communicator, sequence_parallel: bool = False,
                 replicated: tuple[int, Communicator] | None = None):
        self.weight, self.comm, self.sp, self.replicated = Parameter(weight), comm, sequence_parallel, replicated
        self.bias = Parameter(bias) if bias is not None else None  # Llama's linears have none
        if replicated is not None and bias is not None:
            raise ValueError("replicated columns are implemented for bias-free layers (Llama's)")

    fp8: Any = None  # a precision.Recipe: the GEMMs in FP8 (W and dy cut along their output axis)
    fp8_reduce: Any = None  # context parallelism's amax reduction (nn.Linear's)

    def forward(self, x: Tensor) -> Tensor:
        x = GatherSequence.apply(x, self.comm) if self.sp else CopyToTensorParallel.apply(x, self.comm)
        w = self.weight
        if self.replicated is not None:
            start, group = self.replicated
            w = ops.concat([w[:, :start], CopyToTensorParallel.apply(w[:, start:], group, "tp_kv_replicas")], axis=1)
        if self.fp8 is not None:
            return _fp8_linear(self, x, w, self.bias, {"weight": 1, "grad": 1})
        return ops.linear(x, w, self.bias)


class RowParallelLinear(Module):
    """y = g(x_r W_r) + b with W_r = W[rows of rank r, :] (in/tp, out); b is whole on every rank.
    Sequence-parallel: ḡ*(x_r W_r) + b — this rank's shard of the sum."""

    def __init__(self, weight: Any, bias: Any | None, comm: Communicator, sequence_parallel: bool = False):
        self.weight, self.comm, self.sp = Parameter(weight), comm, sequence_parallel
        self.bias = Parameter(bias) if bias is not None else None

    fp8: Any = None  # a precision.Recipe: the GEMMs in FP8 (x and W cut along the input axis)
    fp8_reduce: Any = None  # context parallelism's amax reduction (nn.Linear's)

    def forward(self, x: Tensor) -> Tensor:
        partial = (_fp8_linear(self, x, self.weight, None, {"input": 1, "weight": 0}) if self.fp8 is not None
                   else ops.linear(x, self.weight))
        if self.sp:
            y = ReduceScatterSequence.apply(partial, self.comm)
            return y if self.bias is None else y + _shard_used(self.bias, self.comm)
        y = ReduceFromTensorParallel.apply(partial, self.comm)
        return y if self.bias is None else y + self.bias


class SequenceParallelPositions(Module):
    """The position table, looked up at this rank's positions, its gradient summed over tp in backward."""

    def __init__(self, weight: Parameter, comm: Communicator):
        self.weight, self.comm = weight, comm

    def forward(self, positions: Any) -> Tensor:
        return ops.embedding(positions, _shard_used(self.weight, self.comm))


class VocabParallelEmbedding(Module):
    """This rank's rows [start, start + n) of the padded (V', C) table: lookup, tied head and loss."""

    def __init__(self, weight: Any, vocab_start: int, n_valid: int, comm: Communicator, sequence_parallel: bool = False):
        self.weight, self.comm, self.sp = Parameter(weight), comm, sequence_parallel
        self.vocab_start, self.n_valid = vocab_start, n_valid  # n_valid < rows on the rank holding padding

    def forward(self, idx: Any) -> Tensor:
        """The embedding rows, summed over the ranks' vocabulary slices: whole (B, T, C), or under sequence
        parallelism this rank's (B, T/tp, C) shard (a reduce-scatter instead of the all-reduce)."""
        local = idx - self.vocab_start
        mine = (local >= 0) & (local < self.n_valid)
        rows = ops.embedding(xp.where(mine, local, 0), self.weight) * mine[..., None].astype(self.weight.dtype)
        if self.sp:
            return ReduceScatterSequence.apply(rows, self.comm, "tp_embedding")
        return ReduceFromTensorParallel.apply(rows, self.comm, "tp_embedding")

    def attend(self, h: Tensor) -> Tensor:
        """This rank's slice of the logits, (B, T, V'/tp) — from the gathered sequence under sequence parallelism."""
        h = GatherSequence.apply(h, self.comm, "tp_head") if self.sp else CopyToTensorParallel.apply(h, self.comm, "tp_head")
        return ops.linear(h, self.weight, transposed=True)

    def cross_entropy(self, logits: Tensor, targets: Any) -> Tensor:
        return VocabParallelCrossEntropy.apply(logits, targets, self.vocab_start, self.n_valid, self.comm)


class VocabParallelCrossEntropy(Function):
    """Mean cross-entropy over a vocabulary split across ranks, from each rank's slice of the logits.

    With z the local logits, M = max over the whole vocabulary, S = Σ_vocab exp(z − M) and z_t the
    target's logit (held by one rank): Lᵢ = log Sᵢ + Mᵢ − zᵢ[tᵢ]. Three all-reduces (max, sum, sum)
    of one number per token. dL/dz = (exp(z − M)/S − onehot_local(t)) / N, no communication.
    """

    @staticmethod
    def forward(ctx: Context, logits: Any, targets: Any, vocab_start: int, n_valid: int, comm: Communicator) -> Any:
        z = logits.reshape(-1, logits.shape[-1]).copy()
        z[:, n_valid:] = -xp.inf  # padded vocabulary entries
        t = targets.reshape(-1) - vocab_start
        mine = (t >= 0) & (t < n_valid)
        rows, t = xp.arange(len(t)), xp.where(mine, t, 0)
        zmax = comm.all_reduce(z.max(axis=-1), op="max", label="tp_cross_entropy")
        probs = z - zmax[:, None]
        xp.exp(probs, out=probs)
        total = comm.all_reduce(probs.sum(axis=-1), label="tp_cross_entropy")
        target_logit = comm.all_reduce(xp.where(mine, z[rows, t], 0.0), label="tp_cross_entropy")
        probs /= total[:, None]
        ctx.save_for_backward(probs, rows[mine], t[mine])
        ctx.shape, ctx.count = logits.shape, len(rows)
        return xp.asarray((xp.log(total) + zmax - target_logit).mean(), dtype=logits.dtype)

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        probs, rows, cols = ctx.saved
        probs[rows, cols] -= 1.0
        probs *= g / ctx.count
        return probs.reshape(ctx.shape), None, None, None, None


# ------------------------------------------------------------------------------ sharding a GPT


def check_tensor_parallel(cfg: Any, tp: int, sequence_parallel: bool = False) -> None:
    """Raise before any communication if a GPT or Llama config cannot be split over ``tp`` ranks."""
    if cfg.n_head % tp:
        raise ValueError(f"--tp {tp} must divide n_head ({cfg.n_head}): heads are split across ranks")
    if cfg.kv_heads % tp and tp % cfg.kv_heads:
        raise ValueError(f"--tp {tp} and --n-kv-head {cfg.kv_heads}: one must divide the other — each rank keeps "
                         "its share of the key/value heads, or one of them, replicated over tp/n_kv_head ranks")
    if cfg.mlp_width % tp:
        raise ValueError(f"--tp {tp} must divide the MLP width ({cfg.mlp_width})")
    if sequence_parallel and tp < 2:
        raise ValueError("--sp splits the sequence over the tensor-parallel ranks: it needs --tp >= 2")
    if sequence_parallel and cfg.block_size % tp:
        raise ValueError(f"--sp splits each sequence over --tp {tp} ranks: the sequence length "
                         f"(--block-size {cfg.block_size}) must be divisible by it")


VOCAB_TABLES = ("transformer.wte.weight", "lm_head.weight")  # (V, C), split by vocabulary rows


def _vocab_rows(cfg: Any, tp: int, rank: int) -> tuple[int, int, int]:
    """(start, rows per rank, valid rows on this rank) of the padded vocabulary."""
    per_rank = math.ceil(cfg.vocab_size / tp)
    start = rank * per_rank
    return start, per_rank, max(0, min(per_rank, cfg.vocab_size - start))


def split_of(name: str, cfg: Any) -> Split | None:
    """How tensor parallelism splits parameter ``name`` of a GPT-2 or Llama (None: whole on every tp rank) — the
    one table of it, which the engine, checkpoints and exports read (placement.py). c_attn: its query heads
    and its K/V heads (a shared one when tp > K); attn.c_proj: the rows of those query heads; c_fc: its columns
    of each part (GPT-2: one, 4C wide; Llama: gate | up); mlp.c_proj: those rows; vocabulary tables: rows."""
    H, K, D, W = cfg.n_head, cfg.kv_heads, cfg.head_dim, cfg.mlp_width
    if cfg.n_expert and ".mlp." in name:           # mixture-of-experts MLPs: whole on every tp rank
        return None
    if name in VOCAB_TABLES:
        return Split(0, ((cfg.vocab_size, 1),), pad=True)
    if name.endswith(("attn.c_attn.weight", "attn.c_attn.bias")):
        return Split(-1, ((H, D), (K, D), (K, D)))
    if name.endswith("attn.c_proj.weight"):
        return Split(0, ((H, getattr(cfg, "v_head_dim", D)),))
    if name.endswith(("attn.q_proj.weight", "attn.q_b_proj.weight")):  # multi-head latent attention's up-projections
        return Split(-1, ((H, cfg.qk_head_dim),))
    if name.endswith("attn.kv_b_proj.weight"):
        return Split(-1, ((H, cfg.qk_nope_head_dim + cfg.v_head_dim),))
    if name.endswith(("mlp.c_fc.weight", "mlp.c_fc.bias")):
        return Split(-1, ((W, 1),) * cfg.mlp_parts)
    if name.endswith("mlp.c_proj.weight"):
        return Split(0, ((W, 1),))
    return None                                     # norms, wpe, row-parallel biases


def shard_state_dict(full: dict[str, np.ndarray], cfg: Any, tp: int, rank: int) -> dict[str, np.ndarray]:
    """Rank ``rank``'s tensor-parallel slice of a full (single-process or Hugging Face) state (:func:`split_of`)."""
    return {name: split.local(value, tp, rank) if (split := split_of(name, cfg)) else np.array(value, order="C")
            for name, value in full.items()}  # copies: a view would keep the whole state alive


def merge_state_dicts(shards: list[dict[str, np.ndarray]], cfg: Any) -> dict[str, np.ndarray]:
    """The inverse of :func:`shard_state_dict`: the full state from every rank's slice, in rank order."""
    return {name: split.merge([s[name] for s in shards]) if (split := split_of(name, cfg)) else value
            for name, value in shards[0].items()}


def tensor_parallel(model: GPT, comm: Communicator, sequence_parallel: bool = False) -> GPT:
    """Replace ``model``'s layers, in place, by their tensor-parallel slices over ``comm`` (its tp group);
    with ``sequence_parallel`` the activations between them live on T/tp shards (Megatron-SP).

    Every rank must hold the same full model (same seed or checkpoint); each keeps only its slice.
    """
    cfg, tp, rank, sp = model.config, comm.size, comm.rank, sequence_parallel
    check_tensor_parallel(cfg, tp, sp)
    local = shard_state_dict(model.state_dict(), cfg, tp, rank)
    dev = lambda name: to_device(local[name], dtype=model.transformer.wte.weight.dtype) if name in local else None  # noqa: E731
    start, _, valid = _vocab_rows(cfg, tp, rank)
    model.transformer.wte = VocabParallelEmbedding(dev("transformer.wte.weight"), start, valid, comm, sp)
    if "lm_head.weight" in local:  # an untied head: its own vocabulary-parallel table
        model.lm_head = VocabParallelEmbedding(dev("lm_head.weight"), start, valid, comm, sp)
    replicated = None
    if cfg.kv_heads < tp:  # K/V head r·K//tp on rank r: the ranks sharing one sum its gradient
        group = comm.split(rank * cfg.kv_heads // tp, name=f"{comm.name}/kv")
        replicated = (cfg.n_head // tp * cfg.head_dim, group)
    for p, block in model.named_blocks():
        if hasattr(block.attn, "kv_b_proj"):  # DeepSeek's multi-head latent attention
            _split_latent_attention(block.attn, dev, p, comm, sp)
        else:
            block.attn.c_attn = ColumnParallelLinear(dev(p + "attn.c_attn.weight"), dev(p + "attn.c_attn.bias"), comm,
                                                     sp, replicated)
        block.attn.c_proj = RowParallelLinear(dev(p + "attn.c_proj.weight"), dev(p + "attn.c_proj.bias"), comm, sp)
        block.attn.keep_heads(tp)
        for norm in (getattr(block.attn, "q_norm", None), getattr(block.attn, "k_norm", None)):  # Qwen3's QK-norm:
            if norm is not None:  # whole gains on this rank's heads, their gradients summed over tp
                norm.param_use = lambda w: CopyToTensorParallel.apply(w, comm, "tp_qk_norm")
        if not cfg.n_expert:  # a mixture-of-experts MLP runs whole on every tp rank (expert_parallel.py)
            block.mlp.c_fc = ColumnParallelLinear(dev(p + "mlp.c_fc.weight"), dev(p + "mlp.c_fc.bias"), comm, sp)
            block.mlp.c_proj = RowParallelLinear(dev(p + "mlp.c_proj.weight"), dev(p + "mlp.c_proj.bias"), comm, sp)
        if sp:  # the norms see this rank's shard: their parameters' gradients are summed over tp
            block.ln_1.param_use = block.ln_2.param_use = lambda p: _shard_used(p, comm)
            if cfg.n_expert:  # the MoE MLP runs whole on the gathered sequence; the residual keeps this shard
                block.ln_2.register_forward_hook(lambda _, h: GatherSequence.apply(h, comm, "sp_moe", True))
                block.mlp.register_forward_hook(lambda _, y: ScatterSequence.apply(y, comm, "sp_moe"))
    if sp:
        model.transformer.ln_f.param_use = lambda p: _shard_used(p, comm)
        if hasattr(model.transformer, "wpe"):  # learned positions (GPT-2; Llama rotates q and k instead)
            model.transformer.wpe = SequenceParallelPositions(model.transformer.wpe.weight, comm)
        model.sequence_shard = (rank, tp)
    for name, p in model.named_parameters():  # each parameter says where it lives
        p.placement = p.placement.placed(tp=split_of(name, cfg), tp_size=tp)
    return model


def _split_latent_attention(attn: Any, dev: Any, p: str, comm: Communicator, sp: bool) -> None:
    """Multi-head latent attention over tp ranks (models/deepseek.py). The up-projections — q_proj or q_b_proj,
    kv_b_proj — are column-parallel by heads, c_proj row-parallel, as any attention's. The down-projections to
    the latents (q_a_proj, kv_a_proj: c_Q, c_KV and the shared rope key k_R) and their norms are whole on every
    rank and run on every token the rank holds, as Megatron's MLA does.

    Gradients: each rank's heads give partial gradients of the latents; the column-parallel layers' ``f``
    all-reduces those of c_Q and c_KV, and k_R takes its own ``f`` (label ``tp_rope_key``): B·T·(r_q + r_kv + R)
    values backward in three all-reduces — less than the B·T·C of an ``f`` on x when the latents are narrower
    than the model, as DeepSeek-V3's are (2,112 against 7,168). The down-projections then see whole gradients,
    equal on every rank. Under sequence parallelism the down-projections run on this rank's T/tp tokens, and the
    ``ḡ`` of the up-projections (and k_R's own) gathers the latents, not x; the down-projections' and norms'
    gradients cover this shard's tokens, so an ``f`` sums them over tp (label ``sp_params``), as for layer norms."""
    for name in ("q_proj", "q_b_proj", "kv_b_proj"):
        if hasattr(attn, name):
            setattr(attn, name, ColumnParallelLinear(dev(f"{p}attn.{name}.weight"), None, comm, sp))
    if sp:
        attn.rope_key_use = lambda k: GatherSequence.apply(k, comm, "sp_rope_key")
        for name in ("q_a_proj", "q_a_norm", "kv_a_proj", "kv_a_norm"):
            if hasattr(attn, name):
                getattr(attn, name).param_use = lambda w: _shard_used(w, comm)
    else:
        attn.rope_key_use = lambda k: CopyToTensorParallel.apply(k, comm, "tp_rope_key")


def gather_tensor_parallel_state(local: dict[str, np.ndarray], cfg: Any, comm: Communicator) -> dict[str, np.ndarray]:
    """The full parameters from every tp rank's slice ``local``, on every rank of the group (one all-gather each)."""
    shards: list[dict[str, np.ndarray]] = [{} for _ in range(comm.size)]
    for name, value in local.items():  # every rank's slice of a name has the same shape
        pieces = np.split(comm.all_gather(np.ascontiguousarray(value).reshape(-1), label="checkpoint"), comm.size)
        for shard, piece in zip(shards, pieces):
            shard[name] = piece.reshape(value.shape)
    return merge_state_dicts(shards, cfg)
