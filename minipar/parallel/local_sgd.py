"""Local SGD and DiLoCo: communicate every H steps instead of every step.

Each rank trains its own replica with its inner optimizer (AdamW for DiLoCo, Douillard et al.
2023) for H steps without talking to anyone. Then the replicas meet: every rank's progress
Δ = θ_start − θ_local (a "pseudo-gradient") is averaged with one ring all-reduce, and an outer
optimizer — SGD with Nesterov momentum — moves the shared parameters:

    v ← μ v + Δ̄,      θ ← θ − η_out (Δ̄ + μ v)          (η_out = 1, μ = 0: plain model averaging)

Bytes: 2(p−1)/p·Ψ·itemsize every H steps, i.e. 1/H of synchronous data parallelism. With H = 1,
inner SGD and η_out = 1, μ = 0 this *is* synchronous data parallelism with SGD (tested).

Bounded staleness (``staleness`` = τ ≥ 1): the all-reduce of round t is started asynchronously and
only waited for at the end of round t + τ, so communication overlaps τ rounds of computation. Each
rank then continues from θ_global minus its own deltas of the last τ rounds (not yet averaged):
replicas differ by at most τ rounds of local progress, and agree exactly after ``finish()``.

Mixed precision: the parameters a 16-bit model trains are its optimizer's float32 masters (``masters``), so
θ, Δ and the outer step are float32 over the masters, and the 16-bit parameters are the masters rounded —
averaging the 16-bit copies instead would be undone by the next inner step, which rewrites them from the
masters. Bytes then count 4 per parameter.

Deep dive, with measurements: docs/compression.md.
"""
from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np

from minipar.backend import to_device, to_host, xp
from minipar.comm import Communicator, Handle
from minipar.nn import Module
from minipar.parallel.data_parallel import broadcast_parameters


class LocalSGD:
    def __init__(self, model: Module, comm: Communicator, sync_every: int, outer_lr: float = 0.7,
                 outer_momentum: float = 0.9, nesterov: bool = True, staleness: int = 0,
                 masters: list[Any] | None = None):
        """``masters``: per parameter (model.parameters() order) the float32 master the inner optimizer updates,
        or None where the parameter is its own master (module docstring, mixed precision)."""
        if sync_every < 1 or staleness < 0:
            raise ValueError(f"local SGD needs sync_every >= 1 and staleness >= 0, got {sync_every}, {staleness}")
        self.comm, self.sync_every, self.staleness = comm, sync_every, staleness
        self.outer_lr, self.outer_momentum, self.nesterov = outer_lr, outer_momentum, nesterov
        self.params = model.parameters()
        broadcast_parameters([(self.params, comm)])
        self.masters = masters or [None] * len(self.params)
        for p, w in zip(self.params, self.masters):  # the broadcast reached the 16-bit copies: the masters follow
            if w is not None:
                w[...] = p.data.astype(w.dtype)
        self.weights = [p.data if w is None else w for p, w in zip(self.params, self.masters)]  # what θ is
        self.global_params = self._flatten()                       # θ: identical on every rank
        self.anchor = self.global_params.copy()                    # θ_local at the start of this round
        self.velocity = xp.zeros_like(self.global_params)
        self.in_flight: deque[tuple[Handle, Any]] = deque()        # (all-reduce of Δ̄, own Δ) per round
        self.inner_steps = 0
        self.rounds = 0

    def _flatten(self) -> Any:
        return xp.concatenate([w.reshape(-1) for w in self.weights])

    def _set_local(self, flat: Any) -> None:
        offset = 0
        for p, w in zip(self.params, self.weights):
            w[...] = flat[offset:offset + w.size].reshape(w.shape)
            if w is not p.data:
                p.data[...] = w.astype(p.dtype)  # the 16-bit copy: the master rounded, as the optimizer writes it
            offset += w.size

    def _outer_step(self, mean_delta: Any) -> None:
        self.velocity *= self.outer_momentum
        self.velocity += mean_delta
        direction = mean_delta + self.outer_momentum * self.velocity if self.nesterov else self.velocity
        self.global_params -= self.outer_lr * direction

    def step(self) -> bool:
        """Call after every inner optimizer step; every H-th call runs an outer round. Returns True then."""
        self.inner_steps += 1
        if self.inner_steps % self.sync_every:
            return False
        own = self.anchor - self._flatten()  # Δ of this rank for this round
        self.in_flight.append((self.comm.all_reduce(own.copy(), op="avg", async_op=True, algorithm="ring",
                                                    label="grads"), own))
        if len(self.in_flight) > self.staleness:  # the round from τ rounds ago must be complete by now
            handle, _ = self.in_flight.popleft()
            self._outer_step(handle.wait())
        pending = sum((delta for _, delta in self.in_flight), xp.zeros_like(self.global_params))
        local = self.global_params - pending  # global state plus this rank's not-yet-averaged progress
        self._set_local(local)
        self.anchor = local.copy()
        self.rounds += 1
        return True

    def finish(self) -> None:
        """Apply every outstanding round; afterwards all replicas hold the same parameters."""
        while self.in_flight:
            handle, _ = self.in_flight.popleft()
            self._outer_step(handle.wait())
        self._set_local(self.global_params)
        self.anchor = self.global_params.copy()

    def export_state(self, optimizer: Any, names: dict[int, str]) -> dict[str, Any]:
        """Everything this rank resumes from, for a checkpoint (host arrays): θ, the momentum, its own θ_local and
        anchor, the inner optimizer's moments (the replicas' differ), the counters, and every round in flight —
        waited for, so its average is kept with this rank's Δ (waiting changes no value)."""
        inner = optimizer.export_state(names)
        state = {"local_sgd/global": self.global_params, "local_sgd/velocity": self.velocity,
                 "local_sgd/anchor": self.anchor, "local_sgd/local": self._flatten(),
                 "local_sgd/counters": np.array([self.inner_steps, self.rounds], np.int64),
                 **{f"local_sgd/inner/{kind}/{name}": a for kind, by_name in inner.items() for name, a in by_name.items()}}
        for i, (handle, own) in enumerate(self.in_flight):
            state[f"local_sgd/in_flight/{i}/mean"], state[f"local_sgd/in_flight/{i}/own"] = handle.wait(), own
        return {k: to_host(v) for k, v in state.items()}

    def import_state(self, state: dict[str, Any], optimizer: Any, names: dict[int, str]) -> None:
        """The inverse of :meth:`export_state`, on the same number of replicas."""
        self.global_params[...] = to_device(state["local_sgd/global"])
        self.velocity[...] = to_device(state["local_sgd/velocity"])
        self.anchor = to_device(state["local_sgd/anchor"]).copy()
        self._set_local(to_device(state["local_sgd/local"]))
        self.inner_steps, self.rounds = (int(n) for n in state["local_sgd/counters"])
        inner = {kind: {n: state[f"local_sgd/inner/{kind}/{n}"] for n in names.values()} for kind in ("exp_avg", "exp_avg_sq")}
        optimizer.import_state(inner["exp_avg"], inner["exp_avg_sq"], names, optimizer.step_count)
        rounds = sum(1 for k in state if k.startswith("local_sgd/in_flight/") and k.endswith("/mean"))
        self.in_flight = deque((Handle.completed(to_device(state[f"local_sgd/in_flight/{i}/mean"])),
                                to_device(state[f"local_sgd/in_flight/{i}/own"])) for i in range(rounds))

    def formula_bytes_per_round(self) -> float:
        p = self.comm.size
        return 2 * (p - 1) / p * self.global_params.nbytes
