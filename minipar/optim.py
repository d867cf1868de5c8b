"""Optimizers, learning-rate schedule, gradient clipping and loss scaling.

The update rules are functions on plain arrays (:func:`adamw_update`, :func:`sgd_update`) so that
the sharded optimizers of ZeRO apply exactly the same arithmetic to their slice of the parameters.

Mixed precision (Micikevicius et al. 2018). Parameters and gradients of a 16-bit model are 2 bytes
each; AdamW keeps a float32 master copy of every such parameter with its float32 moments, updates the
master from the gradient (upcast, times ``grad_scale`` = 1/loss scale) and writes it back rounded to
16 bits: 2Ψ + 2Ψ + (4 + 4 + 4)Ψ = 16Ψ bytes for Ψ parameters, the ZeRO paper's count. Norms are summed
in float32. float16 needs :class:`LossScaler` (its gradients would underflow); bfloat16 has float32's
range and does not.

Deep dive, with measurements: docs/memory.md.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Iterable

from minipar.backend import cache_blocks, is_low_precision, to_device, to_host, xp
from minipar.nn import Parameter


def adamw_update(p: Any, g: Any, m: Any, v: Any, *, step: int, lr: float, beta1: float, beta2: float,
                 eps: float, weight_decay: Any) -> None:
    """AdamW (Loshchilov & Hutter), in place on ``p``, ``m``, ``v``; ``step`` counts from 1.

        p ← p − lr·λ·p                                      (decoupled weight decay)
        m ← β₁ m + (1 − β₁) g,    v ← β₂ v + (1 − β₂) g²
        p ← p − lr · m̂ / (√v̂ + ε),  m̂ = m / (1 − β₁ᵗ),  v̂ = v / (1 − β₂ᵗ)

    One pass over memory: block by block (``backend.cache_blocks``), with two block-sized scratch
    arrays as the only temporaries.
    """
    per_element = not isinstance(weight_decay, float)  # an array: per-element decay (ZeRO shards)
    step_size, v_correction = lr / (1.0 - beta1**step), 1.0 - beta2**step
    for pb, gb, mb, vb, *decay in cache_blocks(p, g, m, v, *((weight_decay,) if per_element else ())):
        scratch, update = xp.empty_like(mb), xp.empty_like(mb)
        if per_element:
            xp.multiply(decay[0], lr, out=scratch)
            xp.subtract(1.0, scratch, out=scratch)
            pb *= scratch
        elif weight_decay != 0.0:
            pb *= 1.0 - lr * weight_decay
        mb *= beta1
        xp.multiply(gb, 1.0 - beta1, out=scratch)
        mb += scratch
        vb *= beta2
        xp.multiply(gb, gb, out=scratch)
        scratch *= 1.0 - beta2
        vb += scratch
        xp.divide(vb, v_correction, out=scratch)  # √v̂ + ε
        xp.sqrt(scratch, out=scratch)
        scratch += eps
        xp.multiply(mb, step_size, out=update)
        update /= scratch
        pb -= update


def sgd_update(p: Any, g: Any, buf: Any | None, *, lr: float, momentum: float, weight_decay: float) -> None:
    """p ← p − lr·(b),  b ← μ b + (g + λ p)  (heavy-ball momentum; plain SGD when μ = 0)."""
    if weight_decay:
        g = g + weight_decay * p
    if buf is not None:
        buf *= momentum
        buf += g
        g = buf
    p -= lr * g


class Optimizer:
    def __init__(self, params: Iterable[Parameter], lr: float):
        self.params = list(params)
        self.lr = lr
        self.step_count = 0
        self.grad_scale = 1.0  # 1 / the loss scale the gradients carry (mixed precision)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def clip_grad_norm(self, max_norm: float, sum_squares: Callable[[Any], Any] = lambda s: s) -> Any:
        """Clip the global gradient norm of the parameters this optimizer updates; returns the norm before.

        ``sum_squares`` adds the other ranks' Σg² when parameters are split across ranks (tensor parallelism).
        """
        return clip_grad_norm(self.params, max_norm, sum_squares, self.grad_scale)

    def state_arrays(self) -> list[Any]:
        return []


class AdamW(Optimizer):
    """AdamW; weight decay applies to matrices only (not to biases, layer norms' gains), as in GPT-2/3."""

    def __init__(self, params: Iterable[Parameter], lr: float = 3e-4, betas: tuple[float, float] = (0.9, 0.95),
                 eps: float = 1e-8, weight_decay: float = 0.1):
        super().__init__(params, lr)
        self.beta1, self.beta2 = betas
        self.eps, self.weight_decay = eps, float(weight_decay)
        # 16-bit parameters: a float32 master copy, float32 moments (module docstring)
        self.master = [p.data.astype(xp.float32) if is_low_precision(p.dtype) else None for p in self.params]
        self.m = [xp.zeros(p.shape, xp.float32 if w is not None else p.dtype) for p, w in zip(self.params, self.master)]
        self.v = [xp.zeros_like(m) for m in self.m]

    def state_arrays(self) -> list[Any]:
        return self.m + self.v + [w for w in self.master if w is not None]

    def master_state(self, names: dict[int, str]) -> dict[str, Any]:
        """The float32 master weights by name (host arrays); empty for a full-precision model."""
        return {names[id(p)]: to_host(w) for p, w in zip(self.params, self.master) if w is not None}

    def export_state(self, names: dict[int, str]) -> dict[str, dict[str, Any]]:
        """Adam's moments by parameter name (``names``: id(parameter) -> name), as host arrays."""
        return {"exp_avg": {names[id(p)]: to_host(m) for p, m in zip(self.params, self.m)},
                "exp_avg_sq": {names[id(p)]: to_host(v) for p, v in zip(self.params, self.v)}}

    def import_state(self, exp_avg: dict[str, Any], exp_avg_sq: dict[str, Any], names: dict[int, str], step: int,
                     master: dict[str, Any] | None = None) -> None:
        """Set the moments (by name, shapes checked), the step count and — for a 16-bit model, from ``master`` —
        the float32 master weights, e.g. from a checkpoint."""
        for p, m, v, w in zip(self.params, self.m, self.v, self.master):
            name = names[id(p)]
            if exp_avg[name].shape != m.shape:
                raise ValueError(f"{name}: optimizer state of shape {exp_avg[name].shape}, parameter is {m.shape}")
            m[...], v[...] = to_device(exp_avg[name]), to_device(exp_avg_sq[name])
            if w is not None and master is not None:
                w[...] = to_device(master[name])
        self.step_count = step

    def step(self) -> None:
        self.step_count += 1
        for p, m, v, w in zip(self.params, self.m, self.v, self.master):
            if p.grad is None:
                continue
            g = p.grad if w is None else master_gradient(p.grad, self.grad_scale)
            adamw_update(p.data if w is None else w, g, m, v, step=self.step_count, lr=self.lr, beta1=self.beta1,
                         beta2=self.beta2, eps=self.eps, weight_decay=self.weight_decay if p.ndim >= 2 else 0.0)
            if w is not None:
                p.data[...] = w.astype(p.dtype)  # the master rounded to 16 bits


class SGD(Optimizer):
    def __init__(self, params: Iterable[Parameter], lr: float = 0.1, momentum: float = 0.0, weight_decay: float = 0.0):
        super().__init__(params, lr)
        self.momentum, self.weight_decay = momentum, weight_decay
        self.buffers = [xp.zeros_like(p.data) if momentum else None for p in self.params]

    def state_arrays(self) -> list[Any]:
        return [b for b in self.buffers if b is not None]

    def step(self) -> None:
        self.step_count += 1
        for p, buf in zip(self.params, self.buffers):
            if p.grad is not None:
                sgd_update(p.data, p.grad, buf, lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay)


def cosine_lr(step: int, *, max_lr: float, warmup_steps: int, total_steps: int, min_lr: float = 0.0) -> float:
    """Linear warm-up over ``warmup_steps`` to ``max_lr``, then a cosine decay to ``min_lr`` at ``total_steps``.

    lr(s) = max_lr·(s+1)/warmup               for s < warmup
          = min_lr + ½(max_lr − min_lr)(1 + cos(π·(s − warmup)/(total − warmup)))   afterwards
    """
    if step < warmup_steps:
        return max_lr * (step + 1) / warmup_steps
    if step >= total_steps:
        return min_lr
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return min_lr + 0.5 * (max_lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def master_gradient(grad: Any, grad_scale: float) -> Any:
    """A 16-bit gradient as float32, without the loss scale it carries."""
    g = grad.astype(xp.float32)
    if grad_scale != 1.0:
        g *= grad_scale
    return g


class LossScaler:
    """Dynamic loss scaling for float16 (Micikevicius et al. 2018; PyTorch's GradScaler defaults): the loss
    is multiplied by ``scale`` before backward so small gradients do not underflow; a step whose gradients
    overflowed (a non-finite norm) is skipped and the scale multiplied by ``backoff``; after
    ``growth_interval`` good steps in a row it is multiplied by ``growth``."""

    def __init__(self, scale: float = 2.0**16, growth: float = 2.0, backoff: float = 0.5, growth_interval: int = 2000):
        self.scale, self.growth, self.backoff, self.growth_interval = scale, growth, backoff, growth_interval
        self.good_steps = 0

    def state(self) -> dict[str, float]:
        """What a checkpoint keeps, so that a resumed run scales and skips as the uninterrupted one does."""
        return {"loss_scale": self.scale, "good_steps": self.good_steps}

    def load_state(self, state: dict[str, float]) -> None:
        self.scale, self.good_steps = float(state["loss_scale"]), int(state["good_steps"])

    def update(self, finite: bool) -> None:
        if not finite:
            self.scale *= self.backoff
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps % self.growth_interval == 0:
            self.scale *= self.growth


def clip_grad_norm(params: Iterable[Parameter], max_norm: float,
                   sum_squares: Callable[[Any], Any] = lambda s: s, grad_scale: float = 1.0) -> Any:
    """Scale all gradients so their global L2 norm is at most ``max_norm``; returns the norm before
    clipping as a 0-d xp array (``float(norm)`` when you need it on the host).

    ``sum_squares`` turns this rank's Σg² into the global one: identity for one process, an
    all-reduce over the ranks that hold disjoint pieces of the gradients when they are sharded.
    A parameter's ``norm_weight`` (its placement's: a scalar or one weight per element; 1 for objects without
    one) weighs its squares, so that a replica held by several ranks counts once over all of them.
    The decision to clip is made on the device (a factor of 1 when the norm is within bounds),
    so a GPU step never waits for the host here.
    """
    held = [p for p in params if p.grad is not None]
    norm = xp.sqrt(xp.asarray(sum_squares(sum_of_squares(held)))) * grad_scale
    scale_to_norm(held, norm, max_norm)
    return norm


def sum_of_squares(held: Iterable[Any]) -> Any:
    """Σ norm_weight·g² over the gradients of ``held`` (objects with ``.grad``), as a 0-d xp array (16-bit
    gradients summed in float32)."""
    return sum((((g * g) * getattr(p, "norm_weight", 1.0)).sum()
                for p in held for g in [p.grad.astype(xp.float32) if is_low_precision(p.grad.dtype) else p.grad]),
               xp.zeros(()))


def scale_to_norm(held: Iterable[Any], norm: Any, max_norm: float) -> None:
    """Multiply every gradient by max_norm / norm when ``norm`` exceeds ``max_norm`` (0: never)."""
    if max_norm > 0:
        scale = xp.where(norm > max_norm, max_norm / (norm + 1e-6), 1.0)
        for p in held:
            p.grad *= scale.astype(p.grad.dtype)


def group_sum(*comms: Any) -> Callable[[Any], Any]:
    """s -> Σ over the ranks of each of ``comms`` in turn (skipping single ranks): a gradient norm's squares
    across the axes that split the parameters (tp, pp, ep)."""
    def total(s: Any) -> Any:
        for comm in comms:
            if comm.size > 1:
                s = comm.all_reduce(xp.asarray(s, dtype=xp.float64).reshape(1), label="grad_norm")[0]
        return s
    return total
