"""Mixture of experts: the MLP of a block as E expert MLPs and a router — Switch/GShard, Mixtral and Qwen3-MoE,
DeepSeek-V3.

    router   softmax (Switch, GShard; ``--router softmax``): p = softmax(x W_r) over the E experts (W_r: C × E,
             no bias); the k experts of largest p (ties: the lower index); gates k = 1: g = p_e (the router
             learns through it), k > 1: p renormalized over the k chosen
             softmax-topk (Mixtral, Qwen3-MoE): the same choice; gates p renormalized over the chosen (Mixtral;
             Qwen3's norm_topk_prob) or, ``norm_topk=False``, p as it is — for k = 1 a gate of 1
             sigmoid (DeepSeek-V3 §2.1.2): s = σ(x W_r); the choice ranks s + b, b a per-expert bias that no
             gradient touches (auxiliary-loss-free balancing, below), within the ``topk_groups`` best of
             ``groups`` expert groups (a group's score: the sum of its two best s + b; each token's experts then
             span at most that many groups — nodes, when each group is one node's experts); gates the chosen s
             renormalized (``norm_topk``; + 1e-20) × ``routed_scaling``
    capacity every expert takes at most ⌈c·k·N/E⌉ of the N·k assignments of a routing group of N tokens
             (one rank's microbatch; under context parallelism its whole sequences, over the cp ranks);
             priority: all first choices before any second choice, and within one choice rank the
             earlier token first (GShard). An assignment past capacity is dropped: that expert adds
             nothing for that token (the residual connection carries it on). c = 0 is dropless (MegaBlocks):
             every assignment is kept, the buffer as wide as the fullest expert's load
    experts  GELU (GPT-2): y_e = gelu(X_e W1_e + b1_e) W2_e + b2_e; SwiGLU (the Llama family, DeepSeek):
             y_e = (silu(X_e W_gate,e) ⊙ X_e W_up,e) W_down,e — ``inner`` wide (fine-grained experts: many
             narrow ones); all experts at once as batched matmuls on an (E, capacity, C) buffer gathered from
             the tokens (empty slots read a zero row)
    shared   ``n_shared`` always-on experts, one MLP ``n_shared``·inner wide (DeepSeek-V3's shared_experts),
             added to every token's output
    combine  out_n = Σ_j g_{n,j} · y_{e_{n,j}}[slot of n] (+ shared(x_n))
    balance  softmax routers: aux = E · Σ_i f_i · P_i (Switch): f_i the share of the N·k assignments routed to
             expert i (before dropping; no gradient), P_i the mean router probability of expert i. Under context
             parallelism each cp rank weighs its own tokens' mean probabilities by the group's f_i: the
             average over the cp ranks, which the global-token normalization takes (each rank's share
             1/(dp·cp), gradients summed), is the group's aux.
             sigmoid: DeepSeek-V3's sequence-wise loss, per sequence Σ_i f_i P_i with f_i = E/(k·T) × the
             tokens that chose i and P_i the mean over its T tokens of s_i / Σ_j s_j, averaged over the
             sequences; and the bias: after each step every expert's b_i moves by γ·sign(mean load − load_i)
             (``bias_update`` γ; loads: the kept assignments of the step's microbatches summed over the
             data-parallel replicas — the same numbers, so the same bias, on every rank)

The GPT adds ``aux_loss_coef`` × the sum of its layers' aux to the language-model loss. Routing
decisions (which expert, which slot) are index computations without gradient; everything they
select — gates, expert inputs, expert outputs — is differentiable through gather/scatter ops.

Deep dive, with measurements: docs/experts.md.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from minipar import ops
from minipar.autograd import Tensor
from minipar.backend import resolve_dtype, to_device, to_host, xp
from minipar.nn import Linear, Module, Parameter
from minipar.placement import Placement

EXPERTS = Placement(experts=True)


def route(probs: np.ndarray, k: int, capacity: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(chosen (N, k) experts, slot (N, k) in the flattened (E·capacity) buffer or −1 if dropped, counts (E,) of
    assignments each expert received before dropping) for router probabilities ``probs`` (N, E)."""
    E = probs.shape[1]
    chosen = top_k_experts(probs, k)
    return chosen, priority_slots(chosen, E, capacity), np.bincount(chosen.ravel(), minlength=E)


def top_k_experts(probs: np.ndarray, k: int) -> np.ndarray:
    """The k experts of largest probability per token, (N, k), ties to the lower index."""
    return np.argsort(-probs, axis=1, kind="stable")[:, :k]


def group_limited_top_k(choice: np.ndarray, k: int, groups: int, topk_groups: int) -> np.ndarray:
    """DeepSeek-V3's choice, (N, k): the k experts of largest ``choice`` (N, E) among the ``topk_groups`` groups of
    E/groups consecutive experts whose two best choices sum highest; ties to the lower index (groups and experts)."""
    N, E = choice.shape
    if groups == 1:
        return top_k_experts(choice, k)
    by_group = choice.reshape(N, groups, E // groups)
    best_two = -np.sort(-by_group, axis=2)[:, :, :2].sum(axis=2)
    kept = np.zeros((N, groups), bool)
    np.put_along_axis(kept, top_k_experts(best_two, topk_groups), True, axis=1)
    return top_k_experts(np.where(np.repeat(kept, E // groups, axis=1), choice, -np.inf), k)


def priority_slots(chosen: np.ndarray, n_expert: int, capacity: int) -> np.ndarray:
    """Slot (N, k) of every assignment in the flattened (E·capacity) buffer, −1 where it is dropped: all first
    choices before any second choice, within a choice rank the earlier token first (GShard)."""
    N, k = chosen.shape
    slot = np.full((N, k), -1, np.int64)
    filled = np.zeros(n_expert, np.int64)
    for j in range(k):
        experts = chosen[:, j]
        order = np.argsort(experts, kind="stable")
        starts = np.searchsorted(experts[order], np.arange(n_expert))
        rank = np.empty(N, np.int64)
        rank[order] = np.arange(N) - starts[experts[order]]
        position = filled[experts] + rank
        kept = position < capacity
        slot[kept, j] = experts[kept] * capacity + position[kept]
        filled += np.bincount(experts, minlength=n_expert)
    return slot


def pack_slots(chosen: np.ndarray, kept: np.ndarray, n_expert: int) -> tuple[np.ndarray, int]:
    """(slot (N, k) or −1, width): the ``kept`` assignments, in priority order, in a (E·width) buffer just wide
    enough for the fullest expert — a rank's share of a routing group that other ranks share too."""
    load = np.bincount(chosen[kept], minlength=n_expert)
    width = max(1, int(load.max()))
    slot = priority_slots(np.where(kept, chosen, n_expert), n_expert + 1, width)  # dropped: a sentinel expert
    return np.where(kept, slot, -1), width


ROUTERS = ("softmax", "softmax-topk", "sigmoid")  # the --router choices


def stack_experts(gate: list[np.ndarray], up: list[np.ndarray], down: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Hugging Face's per-expert SwiGLU matrices — gate and up (I, C), down (C, I), PyTorch's (out, in) — as the
    MoE layer's (E, C, 2I) gate | up and (E, I, C)."""
    return np.stack([np.concatenate([g.T, u.T], axis=1) for g, u in zip(gate, up)]), np.stack([d.T for d in down])


def unstack_experts(c_fc: np.ndarray, c_proj: np.ndarray) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """The inverse of :func:`stack_experts`: (gate, up, down) of each expert, (out, in)."""
    return [(g.T, u.T, d.T) for (g, u), d in zip((np.split(w, 2, axis=1) for w in c_fc), c_proj)]


class MoEMLP(Module):
    """E expert MLPs behind a router (module docstring); ``aux_loss`` and ``stats`` after each forward.
    ``score_bias`` (sigmoid routers) is model state no gradient touches (a buffer, nn.Module.buffers):
    checkpointed with the parameters, moved by :meth:`update_bias` after each step."""

    buffers = ("score_bias",)

    def __init__(self, n_embd: int, n_expert: int, top_k: int, capacity_factor: float, dtype: str = "float32",
                 inner: int = 0, swiglu: bool = False, n_shared: int = 0, router: str = "softmax",
                 norm_topk: bool = True, routed_scaling: float = 1.0, groups: int = 1, topk_groups: int = 1,
                 bias_update: float = 0.0):
        dt, C, E = resolve_dtype(dtype), n_embd, n_expert
        inner = inner or 4 * C
        self.router = Linear(C, E, bias=False, dtype=dtype)
        self.c_fc = ExpertLinear(E, C, (2 if swiglu else 1) * inner, dt, bias=not swiglu)  # SwiGLU: gate | up
        self.c_proj = ExpertLinear(E, inner, C, dt, bias=not swiglu)
        if n_shared:
            self.shared = SharedExperts(C, n_shared * inner, swiglu, dtype)
        self.n_expert, self.top_k, self.capacity_factor, self.swiglu = E, top_k, capacity_factor, swiglu
        self.router_kind, self.norm_topk, self.routed_scaling = router, norm_topk, routed_scaling
        self.groups, self.topk_groups, self.bias_update = groups, topk_groups, bias_update
        self.score_bias = xp.zeros(E, dtype=xp.float32) if router == "sigmoid" else None
        self.aux_loss: Tensor | None = None
        self.stats: dict[str, float] = {}  # of the last forward
        self.reset_tally()  # self.tally: summed over forwards since: assignments, kept, load (E,)

    @classmethod
    def for_config(cls, cfg: Any) -> MoEMLP:
        """The MoE layer of ``cfg``: SwiGLU experts for the Llama family, GELU for GPT-2."""
        return cls(cfg.n_embd, cfg.n_expert, cfg.expert_top_k, cfg.capacity_factor, cfg.dtype, cfg.expert_width,
                   cfg.mlp_parts == 2, cfg.n_shared_expert, cfg.router, cfg.norm_topk_prob, cfg.routed_scaling,
                   cfg.expert_groups, cfg.topk_groups, cfg.bias_update)

    def reset_tally(self) -> None:
        self.tally: dict[str, Any] = {"assignments": 0, "kept": 0, "load": np.zeros(self.n_expert, np.int64)}

    def capacity(self, n_tokens: int, assigned: np.ndarray | None = None) -> int:
        """Slots per expert for a group of ``n_tokens``: ⌈c·k·N/E⌉, or dropless (c = 0) the most ``assigned`` (the
        group's assignments per expert)."""
        if self.capacity_factor == 0:
            if assigned is None:
                raise ValueError("a dropless layer's capacity is its group's fullest expert: pass the assignments")
            return max(1, int(assigned.max()))
        return max(1, math.ceil(self.capacity_factor * self.top_k * n_tokens / self.n_expert))

    def route(self, logits: Tensor) -> tuple[Tensor, np.ndarray, Tensor]:
        """(scores (N, E): probabilities or sigmoids, chosen (N, k) experts, gates (N, k)) — module docstring."""
        N, k = logits.shape[0], self.top_k
        rows = to_device(np.repeat(np.arange(N)[:, None], k, axis=1))
        if self.router_kind == "sigmoid":
            scores = ops.sigmoid(logits)
            choice = to_host(scores.data).astype(np.float64) + to_host(self.score_bias)
            chosen = group_limited_top_k(choice, k, self.groups, self.topk_groups)
            gates = scores[rows, to_device(chosen)]
            if self.norm_topk:
                gates = gates / (gates.sum(axis=-1, keepdims=True) + 1e-20)
            return scores, chosen, gates * self.routed_scaling if self.routed_scaling != 1.0 else gates
        scores = ops.softmax(logits, axis=-1)
        chosen = top_k_experts(to_host(scores.data), k)
        gates = scores[rows, to_device(chosen)]
        if (k > 1 and self.router_kind == "softmax") or (self.router_kind == "softmax-topk" and self.norm_topk):
            gates = gates / gates.sum(axis=-1, keepdims=True)
        return scores, chosen, gates

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        E, k, N = self.n_expert, self.top_k, B * T
        flat = x.reshape(N, C)
        scores, chosen, gates = self.route(self.router(flat))
        slot, assigned, n_group, cap = self.admit(chosen.reshape(B, T, k))
        # dispatch: slot s of expert e reads token tokens[e, s] (N: a zero row for an empty slot); an expert's
        # kept assignments fill its slots 0 … load[e] − 1
        rows = np.repeat(np.arange(N)[:, None], k, axis=1)
        tokens = np.full(E * cap, N, np.int64)
        kept = slot >= 0
        tokens[slot[kept]] = rows[kept]
        load = np.bincount(slot[kept] // cap, minlength=E)
        padded = ops.concat([flat, Tensor(xp.zeros((1, C), dtype=flat.dtype))], axis=0)
        shared: list[Tensor] = []  # the shared experts: computed while expert parallelism's dispatch travels
        meanwhile = (lambda: shared.append(self.shared(flat))) if hasattr(self, "shared") else None
        expert_out = self.run_experts(padded, tokens.reshape(E, cap), load, meanwhile)  # (E, cap, C)
        # combine: token n's j-th choice reads its slot (E·cap: a zero row for a dropped assignment)
        outputs = ops.concat([expert_out.reshape(E * cap, C), Tensor(xp.zeros((1, C), dtype=flat.dtype))], axis=0)
        picked = outputs[to_device(np.where(kept, slot, E * cap))]  # (N, k, C)
        y = (picked * gates.reshape(N, k, 1)).sum(axis=1)
        if shared:
            y = y + shared[0]
        if self.router_kind == "sigmoid":  # DeepSeek-V3's sequence-wise balance, averaged over the B sequences
            chose = np.zeros((B, T, E))
            np.put_along_axis(chose, chosen.reshape(B, T, k), 1.0, axis=2)
            f = to_device(chose.sum(axis=1) * E / (k * T), dtype=scores.dtype)  # (B, E), no gradient
            share = (scores / scores.sum(axis=-1, keepdims=True)).reshape(B, T, E).mean(axis=1)
            self.aux_loss = (share * Tensor(f)).sum() * (1.0 / B)
        else:
            share = to_device(assigned / (k * n_group), dtype=scores.dtype)  # f_i over the routing group
            self.aux_loss = (scores.mean(axis=0) * Tensor(share)).sum() * float(E)
        self.stats = {"dropped_fraction": 1.0 - kept.sum() / (N * k), "expert_load_min": int(load.min()),
                      "expert_load_max": int(load.max())}
        if not ops.recomputing():  # a recomputed forward routes the same tokens again: counted once
            self.tally["assignments"] += N * k
            self.tally["kept"] += int(kept.sum())
            self.tally["load"] += load
        return y.reshape(B, T, C)

    def update_bias(self, load: np.ndarray) -> None:
        """Auxiliary-loss-free balancing (DeepSeek-V3): b_i += γ·sign(mean load − load_i), ``load`` the step's
        assignments per expert over every replica — an overloaded expert's bias falls, an idle one's rises."""
        self.score_bias += to_device(self.bias_update * np.sign(load.mean() - load), dtype=self.score_bias.dtype)

    def admit(self, chosen: np.ndarray) -> tuple[np.ndarray, np.ndarray, int, int]:
        """Which of the (B, T, k) chosen assignments the routing group keeps: (slot (B·T, k) in the (E·width)
        buffer or −1, assignments per expert (E,) and tokens N of the whole group, width). The group is this
        forward's tokens; context parallelism replaces this with a group spanning the cp ranks' pieces."""
        flat = chosen.reshape(-1, chosen.shape[-1])
        assigned = np.bincount(flat.ravel(), minlength=self.n_expert)
        capacity = self.capacity(len(flat), assigned)
        return priority_slots(flat, self.n_expert, capacity), assigned, len(flat), capacity

    overlap = False  # expert parallelism: its exchanges travel while the shared experts compute (expert_parallel.py)

    def run_experts(self, padded: Tensor, tokens: np.ndarray, load: np.ndarray, meanwhile: Any = None) -> Tensor:
        """Every expert on its slots: (E, capacity, C) outputs for the (E, capacity) token indices into ``padded``
        (its last row is zeros), after ``meanwhile()``. Expert parallelism replaces this with a dispatch to the
        experts' owners, running ``meanwhile`` while the rows travel."""
        if meanwhile is not None:
            meanwhile()
        return self.experts(padded[to_device(tokens)])

    def experts(self, x: Tensor) -> Tensor:
        """The expert MLPs this module holds, on (experts, rows, C)."""
        h = self.c_fc(x)
        return self.c_proj(ops.swiglu(h) if self.swiglu else ops.gelu(h))


class SharedExperts(Module):
    """The always-on experts: one MLP as wide as all of them (SwiGLU or GELU, as the routed experts)."""

    def __init__(self, n_embd: int, width: int, swiglu: bool, dtype: str):
        self.c_fc = Linear(n_embd, (2 if swiglu else 1) * width, bias=not swiglu, dtype=dtype)
        self.c_proj = Linear(width, n_embd, bias=not swiglu, dtype=dtype)
        self.swiglu = swiglu

    def forward(self, x: Tensor) -> Tensor:
        h = self.c_fc(x)
        return self.c_proj(ops.swiglu(h) if self.swiglu else ops.gelu(h))


class ExpertLinear(Module):
    """E independent linear maps at once: (E, n, d_in) @ W (E, d_in, d_out) (+ b (E, 1, d_out))."""

    def __init__(self, n_expert: int, n_in: int, n_out: int, dtype: Any, bias: bool = True):
        self.weight = Parameter(xp.zeros((n_expert, n_in, n_out), dtype=dtype))
        self.bias = Parameter(xp.zeros((n_expert, n_out), dtype=dtype)) if bias else None
        for p in (self.weight, self.bias):  # split over expert-parallel ranks along the first axis
            if p is not None:
                p.placement = EXPERTS

    def forward(self, x: Tensor) -> Tensor:
        y = x @ self.weight
        return y if self.bias is None else y + self.bias.reshape(self.bias.shape[0], 1, self.bias.shape[1])
