"""Modules: named trees of parameters, in the PyTorch style.

A :class:`Module`'s parameters are the :class:`Parameter` attributes it holds, then those of its
sub-modules, in the order they were assigned; names are dotted paths (``transformer.h.0.ln_1.weight``).
A parameter reachable twice (a tied embedding) is listed once, under its first name.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator

import numpy as np

from minipar import ops, precision
from minipar.autograd import Tensor
from minipar.backend import resolve_dtype, to_device, to_host, xp
from minipar.placement import REPLICATED, Placement


class Parameter(Tensor):
    """A leaf Tensor that an optimizer updates, and where it lives across the mesh (placement.py; set by the
    parallel engines that split it — by default whole on every rank)."""

    placement: Placement = REPLICATED

    def __init__(self, data: Any):
        super().__init__(data, requires_grad=True)

    @property
    def norm_weight(self) -> Any:
        """The weight of this rank's squared gradient entries in a global gradient norm (Placement.norm_weight)."""
        weight = self.placement.norm_weight(self.ndim)
        return weight if np.ndim(weight) == 0 else xp.asarray(weight, dtype=xp.float64)


class Module:
    _forward_pre_hooks: tuple = ()
    _forward_hooks: tuple = ()
    # attributes that are model state but not parameters: no gradient, no optimizer (a router's balancing bias);
    # state_dict and load_state_dict carry them, checkpoints save them beside the parameters
    buffers: tuple[str, ...] = ()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.hooked(self.forward, *args, **kwargs)

    def hooked(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` between this module's forward hooks, as a call of the module would run it: a
        pipeline runs a model's parts (embedding, head) this way, so that ZeRO-3 gathers their parameters."""
        for hook in self._forward_pre_hooks:
            hook(self)
        out = fn(*args, **kwargs)
        for hook in self._forward_hooks:
            out = hook(self, out)
        return out

    def register_forward_pre_hook(self, hook: Callable[[Module], None]) -> None:
        """``hook(module)`` runs before every forward (ZeRO-3 gathers the module's parameters here)."""
        self._forward_pre_hooks = (*self._forward_pre_hooks, hook)

    def register_forward_hook(self, hook: Callable[[Module, Any], Any]) -> None:
        """``out = hook(module, out)`` runs after every forward and may replace the output."""
        self._forward_hooks = (*self._forward_hooks, hook)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def named_children(self) -> Iterator[tuple[str, Module]]:
        for name, value in vars(self).items():
            if isinstance(value, Module):
                yield name, value

    def named_parameters(self, prefix: str = "") -> Iterator[tuple[str, Parameter]]:
        seen: set[int] = set()
        for name, p in self._all_parameters(prefix):
            if id(p) not in seen:
                seen.add(id(p))
                yield name, p

    def _all_parameters(self, prefix: str) -> Iterator[tuple[str, Parameter]]:
        for name, value in vars(self).items():
            if isinstance(value, Parameter):
                yield prefix + name, value
            elif isinstance(value, Module):
                yield from value._all_parameters(f"{prefix}{name}.")

    def named_buffers(self, prefix: str = "") -> Iterator[tuple[str, Any]]:
        for name in self.buffers:
            if getattr(self, name, None) is not None:
                yield prefix + name, getattr(self, name)
        for name, child in self.named_children():
            yield from child.named_buffers(f"{prefix}{name}.")

    def parameters(self) -> list[Parameter]:
        return [p for _, p in self.named_parameters()]

    def modules(self) -> Iterator[Module]:
        yield self
        for _, child in self.named_children():
            yield from child.modules()

    def zero_grad(self) -> None:
        for p in self.parameters():
            p.grad = None

    def num_parameters(self) -> int:
        return sum(p.size for p in self.parameters())

    def state_dict(self) -> dict[str, np.ndarray]:
        """Host (numpy) copies of every parameter and buffer, by name."""
        return {**{name: to_host(p.data).copy() for name, p in self.named_parameters()}, **self.buffer_state()}

    def buffer_state(self) -> dict[str, np.ndarray]:
        return {name: to_host(b).copy() for name, b in self.named_buffers()}

    def load_state_dict(self, state: dict[str, Any], strict: bool = True) -> None:
        """Copy arrays into the parameters of the same name, checking names, shapes and casting dtypes."""
        params = {**dict(self.named_parameters()), **dict(self.named_buffers())}
        missing = sorted(set(params) - set(state))
        unexpected = sorted(set(state) - set(params))
        if strict and (missing or unexpected):
            raise KeyError(f"state_dict mismatch: missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                           f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}")
        for name, p in params.items():
            if name not in state:
                continue
            value = state[name]
            if tuple(value.shape) != tuple(p.shape):
                raise ValueError(f"{name}: checkpoint shape {tuple(value.shape)} != model shape {tuple(p.shape)}")
            if isinstance(p, Tensor):
                p.data = to_device(value, dtype=p.dtype)
            else:  # a buffer: the array attribute itself
                *path, leaf = name.split(".")
                owner = self
                for part in path:
                    owner = getattr(owner, part)
                setattr(owner, leaf, to_device(value, dtype=p.dtype))


class ModuleList(Module):
    """A list of modules named ``start``, ``start+1``, ... or by the given ``numbers`` (GPT-2's ``h.{i}``; a
    pipeline stage's share of the blocks keeps their global numbers, interleaved chunks included)."""

    def __init__(self, modules: list[Module], start: int = 0, numbers: list[int] | None = None):
        self._numbers = list(numbers) if numbers is not None else list(range(start, start + len(modules)))
        for number, m in zip(self._numbers, modules):
            setattr(self, str(number), m)

    def __len__(self) -> int:
        return len(self._numbers)

    def __iter__(self) -> Iterator[Module]:
        return (getattr(self, str(n)) for n in self._numbers)

    def __getitem__(self, i: int) -> Module:
        return getattr(self, str(self._numbers[i]))


class Linear(Module):
    """y = x W + b, W of shape (in, out) as in GPT-2's Conv1D (zero-initialized; the model initializes). With an
    ``fp8`` recipe (precision.py) its three GEMMs take quantized operands."""

    fp8: precision.Recipe | None = None
    fp8_weight: tuple[Any, Any] | None = None  # (q, s): the weight as ZeRO-3 gathered it in FP8, while it is whole
    fp8_reduce: Callable[..., Any] | None = None  # the amax over the ranks holding other tokens (context parallelism)
    # how forward uses each parameter (as LayerNorm's): as it is, or — a projection every tp rank holds whole and
    # runs on its sequence shard (parallel/tensor_parallel.py) — through an op that sums its gradients
    param_use: Callable[[Parameter], Tensor] = staticmethod(lambda p: p)

    def __init__(self, n_in: int, n_out: int, bias: bool = True, dtype: str = "float32"):
        dt = resolve_dtype(dtype)
        self.weight = Parameter(xp.zeros((n_in, n_out), dtype=dt))
        self.bias = Parameter(xp.zeros(n_out, dtype=dt)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        w, b = self.param_use(self.weight), None if self.bias is None else self.param_use(self.bias)
        if self.fp8 is not None:
            gathered = (lambda: self.fp8_weight) if self.fp8_weight is not None else None
            return precision.linear(x, w, self.fp8, b, gathered, self.fp8_reduce)
        return ops.linear(x, w, b)


class LayerNorm(Module):
    # how forward uses each parameter: as it is, or — sequence parallelism — through an op that sums the
    # gradients the ranks' sequence shards give it (parallel/tensor_parallel.py)
    param_use: Callable[[Parameter], Tensor] = staticmethod(lambda p: p)

    def __init__(self, n: int, eps: float = 1e-5, dtype: str = "float32"):
        dt = resolve_dtype(dtype)
        self.weight = Parameter(xp.ones(n, dtype=dt))
        self.bias = Parameter(xp.zeros(n, dtype=dt))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return ops.layer_norm(x, self.param_use(self.weight), self.param_use(self.bias), self.eps)


class RMSNorm(LayerNorm):
    """Llama's norm: x / √(mean(x²) + ε) ⊙ w — no mean subtracted, no bias."""

    def __init__(self, n: int, eps: float = 1e-6, dtype: str = "float32"):
        self.weight = Parameter(xp.ones(n, dtype=resolve_dtype(dtype)))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return ops.rms_norm(x, self.param_use(self.weight), self.eps)


class Embedding(Module):
    """Rows of a (vocab, dim) table. As the owner of the vocabulary layout it also scores hidden
    states against the table (a tied LM head) and computes the loss over the vocabulary; a
    vocab-parallel embedding overrides all three."""

    def __init__(self, n_embeddings: int, dim: int, dtype: str = "float32"):
        self.weight = Parameter(xp.zeros((n_embeddings, dim), dtype=resolve_dtype(dtype)))

    def forward(self, idx: Any) -> Tensor:
        return ops.embedding(idx, self.weight)

    def attend(self, h: Tensor) -> Tensor:
        """Logits h Wᵀ (B, T, vocab)."""
        return ops.linear(h, self.weight, transposed=True)

    def cross_entropy(self, logits: Tensor, targets: Any) -> Tensor:
        return ops.cross_entropy(logits, targets)


def count_layer_norm_bytes(model: Module) -> dict[str, int]:
    """A counter of the bytes of every layer-norm output this rank computes — the (B, T, C) residual-stream
    tensors, (B, T/tp, C) under sequence parallelism — filled by forward hooks; the loop resets it per step."""
    counter = {"layer_norm": 0}

    def count(module: Any, out: Any) -> Any:
        counter["layer_norm"] += out.data.nbytes
        return out

    for module in model.modules():
        if isinstance(module, LayerNorm):  # RMSNorm too
            module.register_forward_hook(count)
    return counter
