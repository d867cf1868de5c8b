"""Mixture of experts: the MLP of a GPT block as E expert MLPs and a router (Shazeer et al. 2017, Switch, Mixtral).

    router   p = softmax(x W_r)  over the E experts, per token (W_r: C × E, no bias)
    choose   the k experts of largest p (ties: the lower index)
    gates    k = 1: g = p_e (Switch: the router probability itself, so the router learns);
             k > 1: g_j = p_{e_j} / Σ_{j'} p_{e_j'} (Mixtral: renormalized over the k chosen)
    capacity every expert takes at most ⌈c·k·N/E⌉ of the N·k assignments of a routing group of N tokens
             (one rank's microbatch; under context parallelism its whole sequences, over the cp ranks);
             priority: all first choices before any second choice, and within one choice rank the
             earlier token first (GShard). An assignment past capacity is dropped: that expert adds
             nothing for that token (the residual connection carries it on).
    experts  y_e = gelu(X_e W1_e + b1_e) W2_e + b2_e, all experts at once as batched matmuls on an
             (E, capacity, C) buffer gathered from the tokens (empty slots read a zero row)
    combine  out_n = Σ_j g_{n,j} · y_{e_{n,j}}[slot of n]
    balance  aux = E · Σ_i f_i · P_i (Switch): f_i the share of the N·k assignments routed to expert i
             (before dropping; no gradient), P_i the mean router probability of expert i. Under context
             parallelism each cp rank weighs its own tokens' mean probabilities by the group's f_i: the
             average over the cp ranks, which the global-token normalization takes (each rank's share
             1/(dp·cp), gradients summed), is the group's aux

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


class MoEMLP(Module):
    """E expert MLPs (C → 4C → C, tanh-GELU) behind a top-k router; ``aux_loss`` and ``stats`` after each forward."""

    def __init__(self, n_embd: int, n_expert: int, top_k: int, capacity_factor: float, dtype: str = "float32"):
        dt, C, E = resolve_dtype(dtype), n_embd, n_expert
        self.router = Linear(C, E, bias=False, dtype=dtype)
        self.c_fc = ExpertLinear(E, C, 4 * C, dt)
        self.c_proj = ExpertLinear(E, 4 * C, C, dt)
        self.n_expert, self.top_k, self.capacity_factor = E, top_k, capacity_factor
        self.aux_loss: Tensor | None = None
        self.stats: dict[str, float] = {}  # of the last forward
        self.reset_tally()  # self.tally: summed over forwards since: assignments, kept, load (E,)

    def reset_tally(self) -> None:
        self.tally: dict[str, Any] = {"assignments": 0, "kept": 0, "load": np.zeros(self.n_expert, np.int64)}

    def capacity(self, n_tokens: int) -> int:
        return max(1, math.ceil(self.capacity_factor * self.top_k * n_tokens / self.n_expert))

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        E, k, N = self.n_expert, self.top_k, B * T
        flat = x.reshape(N, C)
        probs = ops.softmax(self.router(flat), axis=-1)
        chosen = top_k_experts(to_host(probs.data), k)
        slot, assigned, n_group, cap = self.admit(chosen.reshape(B, T, k))
        rows = np.repeat(np.arange(N)[:, None], k, axis=1)
        gates = probs[to_device(rows), to_device(chosen)]  # (N, k)
        if k > 1:
            gates = gates / gates.sum(axis=-1, keepdims=True)
        # dispatch: slot s of expert e reads token tokens[e, s] (N: a zero row for an empty slot); an expert's
        # kept assignments fill its slots 0 … load[e] − 1
        tokens = np.full(E * cap, N, np.int64)
        kept = slot >= 0
        tokens[slot[kept]] = rows[kept]
        load = np.bincount(slot[kept] // cap, minlength=E)
        padded = ops.concat([flat, Tensor(xp.zeros((1, C), dtype=flat.dtype))], axis=0)
        expert_out = self.run_experts(padded, tokens.reshape(E, cap), load)  # (E, cap, C)
        # combine: token n's j-th choice reads its slot (E·cap: a zero row for a dropped assignment)
        outputs = ops.concat([expert_out.reshape(E * cap, C), Tensor(xp.zeros((1, C), dtype=flat.dtype))], axis=0)
        picked = outputs[to_device(np.where(kept, slot, E * cap))]  # (N, k, C)
        y = (picked * gates.reshape(N, k, 1)).sum(axis=1)
        share = to_device(assigned / (k * n_group), dtype=probs.dtype)  # f_i over the routing group
        self.aux_loss = (probs.mean(axis=0) * Tensor(share)).sum() * float(E)
        self.stats = {"dropped_fraction": 1.0 - kept.sum() / (N * k), "expert_load_min": int(load.min()),
                      "expert_load_max": int(load.max())}
        if not ops.recomputing():  # a recomputed forward routes the same tokens again: counted once
            self.tally["assignments"] += N * k
            self.tally["kept"] += int(kept.sum())
            self.tally["load"] += load
        return y.reshape(B, T, C)

    def admit(self, chosen: np.ndarray) -> tuple[np.ndarray, np.ndarray, int, int]:
        """Which of the (B, T, k) chosen assignments the routing group keeps: (slot (B·T, k) in the (E·width)
        buffer or −1, assignments per expert (E,) and tokens N of the whole group, width). The group is this
        forward's tokens; context parallelism replaces this with a group spanning the cp ranks' pieces."""
        flat = chosen.reshape(-1, chosen.shape[-1])
        capacity = self.capacity(len(flat))
        return (priority_slots(flat, self.n_expert, capacity), np.bincount(flat.ravel(), minlength=self.n_expert),
                len(flat), capacity)

    def run_experts(self, padded: Tensor, tokens: np.ndarray, load: np.ndarray) -> Tensor:
        """Every expert on its slots: (E, capacity, C) outputs for the (E, capacity) token indices into ``padded``
        (its last row is zeros). Expert parallelism replaces this with a dispatch to the experts' owners."""
        return self.experts(padded[to_device(tokens)])

    def experts(self, x: Tensor) -> Tensor:
        """The expert MLPs this module holds, on (experts, rows, C)."""
        return self.c_proj(ops.gelu(self.c_fc(x)))


class ExpertLinear(Module):
    """E independent linear maps at once: (E, n, d_in) @ W (E, d_in, d_out) + b (E, 1, d_out)."""

    def __init__(self, n_expert: int, n_in: int, n_out: int, dtype: Any):
        self.weight = Parameter(xp.zeros((n_expert, n_in, n_out), dtype=dtype))
        self.bias = Parameter(xp.zeros((n_expert, n_out), dtype=dtype))
        self.weight.placement = self.bias.placement = EXPERTS  # split over expert-parallel ranks along the first axis

    def forward(self, x: Tensor) -> Tensor:
        return x @ self.weight + self.bias.reshape(self.bias.shape[0], 1, self.bias.shape[1])
