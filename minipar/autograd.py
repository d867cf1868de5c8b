"""Reverse-mode automatic differentiation.

A :class:`Tensor` wraps an xp array. Every differentiable operation is a :class:`Function` with two
static methods, in the style of micrograd/minitorch:

    forward(ctx, *inputs)  -> output array     (inputs arrive as raw arrays, never Tensors)
    backward(ctx, grad)    -> one gradient per positional input (None where there is none)

``Function.apply`` records the call in a graph: the output remembers its ``ctx`` and input Tensors.
``loss.backward()`` sorts that graph topologically (depth-first, inputs in argument order, so the
order is the same on every rank and every run) and walks it from the loss back to the leaves,
applying the chain rule  dL/dx = sum over consumers y of backward_y(dL/dy).

Because a node is visited only after every node that consumes it, a leaf's gradient is *final*
the moment the walk reaches it. That is when its hooks fire (:meth:`Tensor.register_hook`):
data-parallel buckets and ZeRO reduce-scatters start communicating there, while the walk goes on
computing the gradients of earlier layers.

Split backward (zero-bubble pipelines, Qi et al. 2024). ``out.backward(g, defer=weights)`` walks
the graph computing only what flows towards the inputs (B): a node whose inputs include a weight
in ``defer`` is asked — through ``ctx.needs_input_grad`` — for its other inputs' gradients only, and
is kept, with the gradient it received, in the returned :class:`WeightGradients`. Its ``run()`` (W)
later asks each kept node for the weights' gradients alone, from the same saved activations (no
forward is re-run), and accumulates them; the weights' hooks fire there. Ops that ignore the mask
and return a weight gradient in B anyway have it kept for W, so the result never depends on it. A node
whose backward re-runs a forward (full recomputation) backpropagates it with :meth:`Tensor.nested_backward`,
which defers that graph's weights into the same W.

Mixed precision (autocast). When a Function's array inputs include float16/bfloat16 ones, ``apply``
runs its forward in float32 on upcast copies and stores the output — and everything it saves for
backward — in the 16-bit type; backward upcasts the incoming gradient and the saved arrays, and
hands its gradients back in 16 bits. Storage, messages and memory are 2 bytes per element, the
arithmetic float32 (as a GPU's tensor cores accumulate). Scalars (a loss) stay float32. Functions
that only move data (reshapes, communication) set ``autocast = False`` and keep the dtype.

Gradients handed between nodes are never modified in place (one array may feed several inputs);
the ``.grad`` stored on a leaf is always an array the leaf owns, so optimizers and hooks may
update it in place.

Imports: this module and ``ops.py`` import each other, on purpose. ``ops`` defines every Function
on top of :class:`Function` and :class:`Tensor`; the Tensor operators here (``a + b``, ``a @ b``,
``a.sum()``) are one-line calls into ``ops``, so that ``x @ w + b`` reads like numpy. The cycle is
closed by one import at the bottom of this file, after both classes exist; nothing else in minipar
has an import cycle (tests/test_layering.py checks it).

Deep dive, with measurements: docs/architecture.md.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

from minipar.backend import is_low_precision, to_host, xp

_grad_enabled = True


@contextlib.contextmanager
def no_grad() -> Iterator[None]:
    """Run operations without recording a graph (evaluation, optimizer updates, generation)."""
    global _grad_enabled
    previous, _grad_enabled = _grad_enabled, False
    try:
        yield
    finally:
        _grad_enabled = previous


class Context:
    """Scratch space a Function's forward leaves for its backward."""

    needs_input_grad: tuple[bool, ...]
    storage: Any = None  # autocast: the 16-bit dtype this node's arrays are kept in (None: no autocast)
    unread: tuple[int, ...] = ()  # inputs whose arrays backward never reads (it saved what it needs: release_unread)

    def save_for_backward(self, *arrays: Any) -> None:
        self._saved = tuple(_store(a, self.storage) for a in arrays) if self.storage is not None else arrays

    @property
    def saved(self) -> tuple:
        return tuple(_compute(a) for a in self._saved) if self.storage is not None else self._saved

    def input(self, i: int) -> Any:
        """The i-th forward input's array *as it is now*.

        Backward passes read parameters this way rather than saving them in forward: ZeRO-3 frees a
        parameter's storage after forward and gathers it again just before backward.
        """
        value = self.inputs[i]
        value = value.data if isinstance(value, Tensor) else value
        return _compute(value) if self.storage is not None else value


class Tensor:
    """An xp array plus what autograd needs: ``grad``, ``requires_grad`` and the producing node."""

    __array_priority__ = 1000  # numpy_array * Tensor -> Tensor.__rmul__, not an object array

    def __init__(self, data: Any, requires_grad: bool = False):
        self.data = data
        self.requires_grad = requires_grad
        self.grad: Any = None
        self._ctx: Context | None = None  # set by Function.apply on non-leaf tensors
        self._hooks: list[Callable[[Tensor], None]] = []
        self._readers = 0  # recorded consumers whose backward reads this array (release_unread)

    # ---- array-like facts ----
    shape = property(lambda self: self.data.shape)
    dtype = property(lambda self: self.data.dtype)
    ndim = property(lambda self: self.data.ndim)
    size = property(lambda self: self.data.size)

    def __len__(self) -> int:
        return len(self.data)

    def __repr__(self) -> str:
        grad = ", requires_grad=True" if self.requires_grad else ""
        return f"Tensor(shape={tuple(self.shape)}, dtype={self.dtype}{grad})"

    def numpy(self) -> Any:
        return to_host(self.data)

    def item(self) -> float:
        return float(to_host(self.data))

    def detach(self) -> Tensor:
        return Tensor(self.data)

    @property
    def is_leaf(self) -> bool:
        return self._ctx is None

    # ---- gradients ----
    def register_hook(self, hook: Callable[[Tensor], None]) -> None:
        """Call ``hook(tensor)`` whenever backward has finished accumulating this leaf's ``grad``."""
        self._hooks.append(hook)

    def zero_grad(self) -> None:
        self.grad = None

    def backward(self, grad: Any = None, defer: set[int] | None = None) -> WeightGradients | None:
        """Accumulate d(self)/d(leaf) into every leaf's ``.grad`` (the graph is freed as it goes).

        With ``defer`` (ids of weight tensors) only the other gradients are computed now; the weights'
        are returned as a :class:`WeightGradients` to ``run()`` later (split backward, module docstring).
        """
        if grad is None:
            if self.size != 1:
                raise RuntimeError(f"backward() without a gradient needs a scalar, got shape {self.shape}")
            grad = xp.ones_like(self.data)
        deferred = WeightGradients() if defer is not None else None
        if deferred is not None:
            _splitting.append((defer, deferred))
        try:
            self._walk(grad, defer, deferred)
        finally:
            if deferred is not None:
                _splitting.pop()
        return deferred

    def _walk(self, grad: Any, defer: set[int] | None, deferred: WeightGradients | None) -> None:
        grads: dict[int, Any] = {id(self): grad}
        for node in _reverse_topological_order(self):
            g = grads.pop(id(node), None)
            if g is None:
                continue
            ctx = node._ctx
            if ctx is None:
                node._accumulate(g)
                continue
            node._ctx = None  # free saved activations as soon as they are used (W keeps the ones it needs)
            weights = tuple(isinstance(i, Tensor) and id(i) in defer and n
                            for i, n in zip(ctx.inputs, ctx.needs_input_grad)) if deferred else ()
            if any(weights):
                ctx.needs_input_grad = tuple(n and not w for n, w in zip(ctx.needs_input_grad, weights))
                if not any(ctx.needs_input_grad):
                    deferred.nodes.append((ctx, g, weights))
                    continue  # only weights need this node's gradient: all of it waits for W
            input_grads = _backward(ctx, g)
            if any(weights):  # W asks for the weights' gradients this op did not compute here anyway
                later = tuple(w and (i >= len(input_grads) or input_grads[i] is None) for i, w in enumerate(weights))
                if any(later):
                    deferred.nodes.append((ctx, g, later))
            for inp, ig in zip(ctx.inputs, input_grads):
                if ig is None or not isinstance(inp, Tensor) or not inp.requires_grad:
                    continue
                if ig is g and inp._ctx is None:
                    ig = ig.copy()  # a pass-through gradient handed to a leaf: give it its own array
                if deferred and id(inp) in defer:
                    deferred.ready.append((inp, ig))  # an op that computed a weight's gradient in B regardless
                    continue
                key = id(inp)
                grads[key] = ig if key not in grads else grads[key] + ig

    def nested_backward(self, grad: Any) -> None:
        """Backward through a graph built inside another node's backward (recomputation): under a split backward
        the outer walk's weights are deferred here too, and their W joins the outer one."""
        if not _splitting:
            self.backward(grad)
            return
        defer, outer = _splitting[-1]
        inner = self.backward(grad, defer=defer)
        outer.nodes += inner.nodes
        outer.ready += inner.ready

    def _accumulate(self, g: Any) -> None:
        if self.grad is None:
            self.grad = g.copy() if g.base is not None else g  # a view would alias another gradient
        else:
            self.grad += g
        for hook in self._hooks:
            hook(self)

    # ---- operators (defined in minipar.ops) ----
    def __add__(self, other): return _ops.add(self, other)
    def __radd__(self, other): return _ops.add(other, self)
    def __sub__(self, other): return _ops.sub(self, other)
    def __rsub__(self, other): return _ops.sub(other, self)
    def __mul__(self, other): return _ops.mul(self, other)
    def __rmul__(self, other): return _ops.mul(other, self)
    def __truediv__(self, other): return _ops.div(self, other)
    def __rtruediv__(self, other): return _ops.div(other, self)
    def __neg__(self): return _ops.neg(self)
    def __pow__(self, exponent: float): return _ops.pow(self, exponent)
    def __matmul__(self, other): return _ops.matmul(self, other)
    def __rmatmul__(self, other): return _ops.matmul(other, self)
    def __getitem__(self, index): return _ops.getitem(self, index)

    def sum(self, axis=None, keepdims: bool = False): return _ops.sum(self, axis, keepdims)
    def mean(self, axis=None, keepdims: bool = False): return _ops.mean(self, axis, keepdims)
    def reshape(self, *shape): return _ops.reshape(self, shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape)
    def transpose(self, *axes): return _ops.transpose(self, axes or None)
    T = property(lambda self: _ops.transpose(self, None))
    def exp(self): return _ops.exp(self)
    def log(self): return _ops.log(self)
    def tanh(self): return _ops.tanh(self)
    def softmax(self, axis: int = -1): return _ops.softmax(self, axis)


_splitting: list[tuple[set[int], WeightGradients]] = []  # the split backwards in progress, innermost last


class WeightGradients:
    """The weight-gradient half (W) of a split backward: the nodes B left for it, each with the gradient it
    received, and weight gradients some op computed early. ``run()`` computes, sums and accumulates them
    into the weights' ``.grad`` — each weight once, so its hooks fire once — and may be called once."""

    def __init__(self) -> None:
        self.nodes: list[tuple[Context, Any, tuple[bool, ...]]] = []
        self.ready: list[tuple[Tensor, Any]] = []

    def run(self) -> None:
        totals: dict[int, tuple[Tensor, Any]] = {}
        contributions = list(self.ready)
        for ctx, g, weights in self.nodes:
            ctx.needs_input_grad = weights
            grads = _backward(ctx, g)
            contributions += [(inp, ig.copy() if ig is g else ig)
                              for inp, ig, w in zip(ctx.inputs, grads, weights) if w and ig is not None]
        for weight, ig in contributions:
            previous = totals.get(id(weight))
            totals[id(weight)] = (weight, ig if previous is None else previous[1] + ig)
        for weight, total in totals.values():
            weight._accumulate(total)
        self.nodes, self.ready = [], []


class Function:
    """Base class of differentiable operations; subclasses define ``forward`` and ``backward``."""

    @staticmethod
    def forward(ctx: Context, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    @staticmethod
    def backward(ctx: Context, grad: Any) -> Any:
        raise NotImplementedError

    autocast = True  # 16-bit inputs: compute in float32, store in 16 bits (module docstring)

    @classmethod
    def apply(cls, *args: Any, **kwargs: Any) -> Tensor:
        ctx = Context()
        ctx.needs_input_grad = tuple(isinstance(a, Tensor) and a.requires_grad and _grad_enabled for a in args)
        raw = [a.data if isinstance(a, Tensor) else a for a in args]
        if cls.autocast:
            ctx.storage = next((r.dtype for r in raw if hasattr(r, "dtype") and is_low_precision(r.dtype)), None)
        if ctx.storage is not None:
            out = Tensor(_store(cls.forward(ctx, *[_compute(r) for r in raw], **kwargs), ctx.storage))
        else:
            out = Tensor(cls.forward(ctx, *raw, **kwargs))
        if any(ctx.needs_input_grad):
            ctx.fn, ctx.inputs = cls, args
            out.requires_grad, out._ctx = True, ctx
            for i, a in enumerate(args):
                if isinstance(a, Tensor) and i not in ctx.unread:
                    a._readers += 1
        return out


def release_unread(out: Tensor, start: Tensor) -> None:
    """Give back the arrays of the tensors between ``start`` and ``out`` that no backward will read.

    The graph keeps every op's output alive until backward (its consumers' contexts hold it). A Function whose
    backward needs less than its input — an FP8 Linear keeps its input's FP8 codes instead (precision.py) — lists
    that input in ``ctx.unread``; once every consumer of a tensor has, the tensor's array is dead weight. Which
    consumers a tensor has is known only when nothing else can consume it: a block's internal tensors, once the
    block has returned ``out`` from ``start`` (models/gpt.py's Block). The walk visits them and drops each one's
    ``data``; ``out``, ``start`` and leaves (parameters) keep theirs."""
    seen, stack = {id(start), id(out)}, [out]
    while stack:
        node = stack.pop()
        for inp in node._ctx.inputs if node._ctx is not None else ():
            if isinstance(inp, Tensor) and inp._ctx is not None and id(inp) not in seen:
                seen.add(id(inp))
                stack.append(inp)
                if inp._readers == 0:
                    inp.data = None


def _compute(a: Any) -> Any:
    """A 16-bit float array as float32 (anything else as it is)."""
    return a.astype(xp.float32) if hasattr(a, "dtype") and is_low_precision(a.dtype) else a


def _store(a: Any, storage: Any) -> Any:
    """A float32 array in the 16-bit ``storage`` dtype; scalars (a loss) and non-float32 values as they are."""
    return a.astype(storage) if hasattr(a, "dtype") and a.dtype == xp.float32 and a.ndim > 0 else a


def _backward(ctx: Context, g: Any) -> tuple:
    """ctx.fn.backward as a tuple; under autocast in float32, its gradients handed back in 16 bits."""
    grads = ctx.fn.backward(ctx, _compute(g) if ctx.storage is not None else g)
    grads = grads if isinstance(grads, tuple) else (grads,)
    return tuple(_store(x, ctx.storage) for x in grads) if ctx.storage is not None else grads


def _reverse_topological_order(root: Tensor) -> list[Tensor]:
    """Tensors reachable from ``root`` (that need a gradient), every consumer before its inputs."""
    post_order: list[Tensor] = []
    expanded: set[int] = set()
    stack: list[tuple[Tensor, bool]] = [(root, False)]
    while stack:
        node, inputs_done = stack.pop()
        if inputs_done:
            post_order.append(node)
            continue
        if id(node) in expanded:
            continue
        expanded.add(id(node))
        stack.append((node, True))
        if node._ctx is not None:
            for inp in reversed(node._ctx.inputs):
                if isinstance(inp, Tensor) and inp.requires_grad and id(inp) not in expanded:
                    stack.append((inp, False))
    post_order.reverse()
    return post_order


from minipar import ops as _ops  # noqa: E402  (operators above call into it; it imports this module)
