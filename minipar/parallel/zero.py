"""ZeRO (Rajbhandari et al., 2020): data parallelism that shards the model state instead of copying it.

The decomposition everything rests on: all-reduce = reduce-scatter + all-gather. Plain DP
all-reduces gradients and lets every rank run the same optimizer step on the same full state. ZeRO
reduce-scatters instead — rank r receives only its 1/p of the summed gradient — updates only its
1/p of the parameters and optimizer state, and all-gathers parameters when they are needed.

Per rank, Ψ parameters in float32 (4 bytes each for parameters, gradients, Adam m and v):

    stage   sharded                 model-state bytes¹      bytes sent per step
    DP      nothing                 16Ψ                     2(p−1)/p·4Ψ   all-reduce(grads)
    1       optimizer state         8Ψ + 8Ψ/p               2(p−1)/p·4Ψ   reduce-scatter(grads) + all-gather(params)
    2       + gradients             4Ψ + 12Ψ/p              2(p−1)/p·4Ψ   the same
    3       + parameters (FSDP)     16Ψ/p                   3(p−1)/p·4Ψ   all-gather(params) in forward and again in
                                                                          backward + reduce-scatter(grads)

¹ in float32 there is no separate master copy: the parameters are the master (4 + 4 + 8/p words). Under
  mixed precision (16-bit parameters and gradients, float32 master + m + v, optim.py) the same table
  reads 16Ψ, 4Ψ + 12Ψ/p, 2Ψ + 14Ψ/p, 16Ψ/p — the ZeRO paper's. Stage 1 keeps the full local gradients
  in one flat buffer per group and its reduced slice in that buffer's own slice, so it costs nothing extra.

Mechanics. Parameters are grouped into flat buffers (stages 1-2: size-based buckets in gradient
order, like DP; stage 3: one *unit* per transformer block plus a root unit for the rest). Rank r
owns chunk r of every group (``numpy.array_split`` bounds, so sizes need not divide by p).

* A gradient hook copies each final gradient into its group's flat buffer — from stage 2 on it then
  drops the parameter's own gradient, so no gradient is held twice — and when the group is complete
  the buffer is reduce-scattered asynchronously (overlapping the rest of backward) and freed.
* ``step()`` runs the same AdamW arithmetic as the single-process optimizer on the shard
  (:func:`minipar.optim.adamw_update`), then — stages 1-2 — all-gathers the updated parameters in
  place, into the flat buffer the parameters are views of.

Peak memory: beyond the table's model state a rank holds transient buffers: the flat gradients of the
group being filled and of at most MAX_IN_FLIGHT = 2 groups queued for the communication thread (the
backward waits for the oldest rather than queue more: with 2 cores the thread can lag far behind); stage 3
also the block in hand and the next one (prefetch). ``train --peak-memory`` reports the measured peak.
* Stage 3 keeps only the shard. A forward pre-hook all-gathers a unit's parameters, a forward hook
  frees them and wraps the unit's output in an identity whose backward gathers them again just
  before the unit's backward needs them; the unit's reduce-scatter frees them once more.
  Prefetch (FSDP's forward/backward prefetch): the moment a unit's parameters are in place, the
  all-gather of the next unit — block i+1 in forward, block i−1 in backward — starts on the
  communication thread, so it runs while this unit computes; at most one unit ahead, so at most
  two units are whole at once. ``gather_wait_s`` sums the time the step still waited for them.

Gradient accumulation: stage 1 honours ``no_sync()`` (full gradients accumulate locally); stages
2-3 reduce-scatter on every backward and accumulate into the shard, as DeepSpeed does. Under a pipeline
each microbatch's backward of each chunk is its own pass; a group whose parameters span two chunks (an
interleaved or V schedule) adds a gradient that arrives twice before the group launches into its buffer,
so every gradient is reduced exactly once, in an order every rank of the group shares (same schedule).

Hybrid sharding (``replicas``, FSDP's HYBRID_SHARD / HSDP): ``comm`` is one group of K ranks that
shards the state, and ``replicas`` joins the N/K groups' ranks holding the same shard. A gradient is
reduce-scattered within the group (sum over K), then its shard all-reduced across the groups
(sum over N/K) — together the sum over all N ranks — on the communication thread, one after
the other. Per rank: model state 16Ψ/K (stage 3), bytes sent (3(K−1)/K + 2(R−1)/R·1/K)·Ψ·itemsize with
R = N/K: the shard-size all-reduce is the price of keeping the all-gathers inside a group (a node).

Expert parallelism: expert parameters are sharded over ``expert_comm`` (the ranks holding the same
experts) instead of ``comm``, each summed over its own replicas (data_parallel.replica_groups); every
shard carries its own communicator, and a stage-3 unit with both kinds holds one shard of each.

Deep dive, with measurements: docs/data_parallel.md.
"""
from __future__ import annotations

import time
from collections import deque
from typing import Any, Callable

import numpy as np

from minipar.autograd import Context, Function, Tensor
from minipar.backend import is_low_precision, to_device, to_host, xp
from minipar.comm import Communicator, Handle
from minipar.comm.collectives import chunk_bounds
from minipar import precision
from minipar.nn import Linear, Module, ModuleList
from minipar.optim import Optimizer, adamw_update, master_gradient, scale_to_norm, sum_of_squares
from minipar.parallel.data_parallel import (Bucket, ReplicatedModel, broadcast_parameters, gradient_ready_order,
                                            live_bytes, make_buckets, replica_groups, rounded_to)

MAX_IN_FLIGHT = 2  # groups whose flat gradients may wait for the communication thread at once


class Shard:
    """One flat group of parameters and this rank's slice [lo, hi) of it: parameters, gradient, Adam state."""

    def __init__(self, bucket: Bucket, weight_decay: float):
        self.bucket, self.comm = bucket, bucket.comm
        comm = bucket.comm
        bounds = chunk_bounds(bucket.size, comm.size)
        self.sizes = [bounds[i + 1] - bounds[i] for i in range(comm.size)]
        self.lo, self.hi = bounds[comm.rank], bounds[comm.rank + 1]
        self.state_dtype = xp.float32 if is_low_precision(bucket.dtype) else bucket.dtype  # mixed: fp32 master, m, v
        # per-element AdamW decay (matrices only, as minipar.optim does) and grad-norm weights (tensor_parallel.py)
        self.weight_decay = self._per_element([weight_decay if len(s) >= 2 else 0.0 for s in bucket.shapes])
        self.norm_weight = self._per_element([p.norm_weight for p in bucket.params])
        self.params: Any = None   # this rank's parameter slice (a view into the full flat buffer for stages 1-2)
        self.flat: Any = None     # stages 1-2: the full flat parameters that p.data are views of
        self.grad: Any = None     # this rank's reduced gradient slice
        self.m = xp.zeros(self.hi - self.lo, dtype=self.state_dtype)
        self.v = xp.zeros(self.hi - self.lo, dtype=self.state_dtype)
        self.master: Any = None  # mixed precision: the float32 master of this rank's slice
        self.pending: list[Handle] = []  # reduce-scatters launched since the last sync_gradients
        self.prefetch: Handle | None = None  # stage 3: an all-gather of the parameters started ahead of use
        self.filled: set[int] = set()    # parameters whose gradients are in the buffer since the last launch
        self.buffer: Any = None          # their gradients, flat, until the group is complete
        self.gathered = True
        self.fp8_layers: list[Any] | None = None  # stage 3: the Linears whose weights this shard gathers in FP8

    def _per_element(self, values: list[float]) -> Any:
        """One value per parameter, spread over this rank's slice of the flat buffer (a scalar when all agree)."""
        if all(np.ndim(v) == 0 for v in values) and len(set(values)) == 1:
            return float(values[0])
        full = self.bucket.flatten([xp.full(shape, v, dtype=self.state_dtype) for v, shape in zip(values, self.bucket.shapes)])
        return full[self.lo:self.hi].copy()


class _GatherBeforeBackward(Function):
    """Identity in forward; in backward first calls ``gather()`` (stage 3 re-gathers a unit's parameters)."""

    autocast = False  # moves data: keeps its dtype (16-bit messages under mixed precision)

    @staticmethod
    def forward(ctx: Context, x: Any, gather: Any) -> Any:
        ctx.gather = gather
        return x

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        ctx.gather()
        return g, None


def default_units(model: Module) -> list[Module]:
    """Stage-3 units: every module held in a ModuleList (a GPT's blocks); the root unit takes the rest."""
    return [m for module in model.modules() if isinstance(module, ModuleList) for m in module]


class ZeRO(ReplicatedModel, Optimizer):
    """Sharded data parallelism and its sharded AdamW, ``stage`` ∈ {1, 2, 3}; wraps ``model`` like DataParallel.

    ``engine(x, y)`` runs the model; ``loss.backward()``; ``engine.sync_gradients()``;
    ``engine.clip_grad_norm(c)``; ``engine.step()``; ``engine.zero_grad()``. ``no_sync()``: stage 1
    accumulates full gradients locally; stages 2-3 reduce-scatter regardless (see the module doc).
    """

    def __init__(self, model: Module, comm: Communicator, stage: int, lr: float = 3e-4,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.1,
                 bucket_mb: float = 25.0, expert_comm: Communicator | None = None,
                 replicas: Communicator | None = None, prefetch: bool = True, reduce_dtype: Any = None,
                 expert_replicas: Communicator | None = None, fp8_all_gather: bool = False):
        if stage not in (1, 2, 3):
            raise ValueError(f"ZeRO stage must be 1, 2 or 3, got {stage}")
        ReplicatedModel.__init__(self, model)
        Optimizer.__init__(self, self.params, lr)
        self.stage = stage
        # hybrid sharding: the ranks holding the same shard in the other groups, per sharding communicator
        across = {id(comm): replicas, id(expert_comm): expert_replicas}
        self.replicas_of = {key: c for key, c in across.items() if c is not None and c.size > 1}
        groups = lambda params: replica_groups(params, comm, expert_comm)  # noqa: E731
        self.beta1, self.beta2, self.eps = betas[0], betas[1], eps
        self.prefetch, self.gather_wait_s = prefetch, 0.0
        self.in_flight: deque[Handle] = deque()  # reduce-scatters not yet known to be done, oldest first
        self.ahead: dict[tuple[int, int], list[Shard]] = {}  # (id(shard), +1 forward / −1 backward) -> next unit's
        for params, c in groups(self.params):  # every rank of every group from the same start
            broadcast_parameters([(params, c)] + ([(params, self.replicas_of[id(c)])]
                                                       if id(c) in self.replicas_of else []))
        wd = float(weight_decay)
        if stage < 3:  # groups of at most bucket_mb and a quarter of a shard: the transient gradient buffers (the
            bucket_bytes = min(bucket_mb * 2**20, sum(p.data.nbytes for p in self.params) / (4 * comm.size))  # 1 + 2
            # in flight) stay below one shard, never a whole model's gradients at once
            self.shards = [Shard(b, wd) for params, c in groups(gradient_ready_order(model))
                           for b in make_buckets(params, bucket_bytes, c, reduce_dtype)]
        else:
            units = default_units(model)
            inner = {id(p) for unit in units for p in unit.parameters()}
            root = [p for p in model.parameters() if id(p) not in inner]
            owners = [*reversed(units), *([model] if root else [])]  # gradient order: last block first, root last
            fp8 = {id(m.weight): m for m in model.modules()
                   if fp8_all_gather and isinstance(m, Linear) and m.fp8 is not None}
            self.shards, by_unit = [], {}
            for module in owners:
                by_unit[id(module)] = []
                for params, c in groups(module.parameters() if module is not model else root):
                    # a unit's FP8 weights form a shard of their own: they travel as e4m3 codes (_fp8_all_gather)
                    apart = [[p for p in params if id(p) in fp8], [p for p in params if id(p) not in fp8]]
                    for part in (part for part in apart if part):
                        shard = Shard(Bucket(part, c, reduce_dtype), wd)
                        shard.fp8_layers = [fp8[id(p)] for p in part] if id(part[0]) in fp8 else None
                        self.shards.append(shard)
                        by_unit[id(module)].append(shard)
                        module.register_forward_pre_hook(lambda m, shard=shard: self._gather(shard, +1))
                        module.register_forward_hook(lambda m, out, shard=shard: self._after_forward(shard, out))
            # use order: the root (embeddings) first, then the blocks; backward: the root (head), then the blocks reversed
            forward = [by_unit[id(u)] for u in ([model] if root else []) + units]
            backward = forward[:1] + forward[:0:-1] if root else forward[::-1]
            for order, direction in ((forward, +1), (backward, -1)):
                for here, following in zip(order, order[1:]):
                    for shard in here:
                        self.ahead[id(shard), direction] = following
        for shard in self.shards:
            flat = shard.bucket.flatten([p.data for p in shard.bucket.params])
            if stage < 3:
                shard.flat, shard.params = flat, flat[shard.lo:shard.hi]
                for i, p in enumerate(shard.bucket.params):
                    p.data = shard.bucket.slot(flat, i)
            else:
                shard.params = flat[shard.lo:shard.hi].copy()
                self._release(shard)
            if is_low_precision(shard.bucket.dtype):
                shard.master = shard.params.astype(xp.float32)
            for i, p in enumerate(shard.bucket.params):
                p.register_hook(lambda p, shard=shard, i=i: self._gradient_ready(shard, i))

    # ---------------------------------------------------------------------------- stage-3 units
    def _gather(self, shard: Shard, direction: int) -> None:
        """A unit's parameters whole (p.data views of the full flat buffer) — from its prefetch, or gathered
        now — then, with prefetch, start the all-gather of the next unit in ``direction`` (+1 forward, −1 back)."""
        if shard.gathered:
            return
        t0 = time.perf_counter()
        if shard.prefetch is not None:
            full, shard.prefetch = shard.prefetch.wait(), None
        else:
            full = self._all_gather(shard)
        self.gather_wait_s += time.perf_counter() - t0
        if shard.fp8_layers is None:
            for i, p in enumerate(shard.bucket.params):
                p.data = shard.bucket.slot(full, i)
        else:
            self._place_fp8(shard, *full)
        shard.gathered = True
        for following in self.ahead.get((id(shard), direction), []) if self.prefetch else []:
            if not following.gathered and following.prefetch is None:
                following.prefetch = self._all_gather(following, async_op=True)

    def _all_gather(self, shard: Shard, async_op: bool = False) -> Any:
        """A unit's shard from every rank: its 16-bit parameters, or (e4m3 codes, scales) of its FP8 weights."""
        if shard.fp8_layers is None:
            return shard.comm.all_gather(shard.params, sizes=shard.sizes, async_op=async_op, algorithm="ring",
                                         label="params")
        return shard.comm.submit(lambda: self._fp8_all_gather(shard)) if async_op else self._fp8_all_gather(shard)

    @staticmethod
    def _fp8_all_gather(shard: Shard) -> tuple[np.ndarray, np.ndarray]:
        """FP8 on the wire (torchao's enable_fsdp_float8_all_gather; tensorwise): each weight's amax over its
        pieces on the shard's ranks (one all-reduce of max, a float32 per weight), its scale from it — the whole
        weight's, as one process computes it — then every rank encodes its piece in e4m3 and the codes are
        all-gathered: 1 byte per element instead of 2, so the (p−1)/p·Ψ_fp8 elements of a gather cost Ψ_fp8 bytes
        less, for 4·(number of weights) bytes of amax."""
        recipe = shard.fp8_layers[0].fp8
        fmt = recipe.format("weight")
        local = to_host(shard.params).astype(np.float32)
        bounds = np.clip(shard.bucket.offsets, shard.lo, shard.hi) - shard.lo  # each weight's piece of this slice
        amax = np.array([np.abs(local[a:b]).max() if b > a else 0.0 for a, b in zip(bounds[:-1], bounds[1:])],
                        np.float32)
        amax = shard.comm.all_reduce(amax, op="max", algorithm="ring", label="fp8_amax")
        scales = precision.scales_of(amax, recipe, fmt)
        codes = precision.encode(local, np.repeat(scales, np.diff(bounds)), fmt).view(np.uint8)
        return shard.comm.all_gather(codes, sizes=shard.sizes, algorithm="ring", label="params"), scales

    @staticmethod
    def _place_fp8(shard: Shard, codes: np.ndarray, scales: np.ndarray) -> None:
        """Hand each FP8 weight's codes and scale to its Linear; the parameter holds the values they stand for."""
        q = codes.view(shard.fp8_layers[0].fp8.format("weight").dtype)
        for i, (p, layer) in enumerate(zip(shard.bucket.params, shard.fp8_layers)):
            layer.fp8_weight = (shard.bucket.slot(q, i), scales[i:i + 1].reshape(1, 1))
            p.data = to_device(precision.dequantize(*layer.fp8_weight, layer.fp8, "weight"), dtype=p.dtype)

    def _release(self, shard: Shard) -> None:
        for p in shard.bucket.params:
            p.data = xp.empty(0, dtype=shard.bucket.dtype)  # what a stage-3 parameter holds between uses
        for layer in shard.fp8_layers or ():
            layer.fp8_weight = None
        shard.gathered = False

    def _after_forward(self, shard: Shard, out: Any) -> Any:
        """Free the unit's parameters; make backward gather them again before it reaches the unit."""
        self._release(shard)
        gather = lambda: self._gather(shard, -1)  # noqa: E731
        wrap = lambda t: _GatherBeforeBackward.apply(t, gather) if isinstance(t, Tensor) and t.requires_grad else t  # noqa: E731
        return tuple(wrap(t) for t in out) if isinstance(out, tuple) else wrap(out)

    # ------------------------------------------------------------------------------- gradients
    def _gradient_ready(self, shard: Shard, i: int) -> None:
        """Parameter i's gradient is final: copy it into the group's flat buffer (stages 2-3 then drop it, so a
        rank never holds a group's gradients twice); the last one launches the reduce-scatter."""
        if self.stage == 1 and not self._sync:
            return
        if shard.buffer is None:
            shard.buffer = xp.zeros(shard.bucket.size, dtype=shard.bucket.grad_dtype)  # zeros: for unused parameters
        p, slot = shard.bucket.params[i], shard.bucket.slot(shard.buffer, i)
        if i in shard.filled:  # another backward's gradient before the group launched: a pipeline's chunks
            slot += p.grad     # run their backwards apart, so a group spanning two fills unevenly; sums stay exact
        else:
            slot[...] = p.grad
            shard.filled.add(i)
        # stage 1 keeps the full gradients — in the flat buffer, which will also hold its reduced slice; from
        # stage 2 on only the reduced slice is kept
        p.grad = slot if self.stage == 1 else None
        if len(shard.filled) == len(shard.bucket.params):
            self._launch(shard)

    def _launch(self, shard: Shard) -> None:
        flat = shard.buffer if shard.buffer is not None else xp.zeros(shard.bucket.size, dtype=shard.bucket.grad_dtype)
        if self.stage >= 2:
            shard.buffer = None  # the reduce-scatter holds it until it is done
        replicas = self.replicas_of.get(id(shard.comm))
        if replicas is None:
            handle = shard.comm.reduce_scatter(flat, async_op=True, algorithm="ring", label="grads")
        else:  # within the group, then across the groups: on the communication thread, in this order
            handle = shard.comm.submit(lambda: replicas.all_reduce(
                shard.comm.reduce_scatter(flat, algorithm="ring", label="grads"), algorithm="ring", label="grads"))
        shard.pending.append(handle)
        shard.filled = set()
        self.in_flight.append(handle)
        while len(self.in_flight) > MAX_IN_FLIGHT:  # bound the flat buffers queued for the communication thread
            self.in_flight.popleft().wait()
        if self.stage == 3:
            self._release(shard)

    def sync_gradients(self) -> None:
        """Wait for every reduce-scatter and add the result into this rank's gradient shard.

        A group whose gradients did not all arrive (a parameter unused in this forward) is reduced
        here, with zeros for the missing ones, in group order — the same on every rank.
        """
        for shard in self.shards:
            if shard.filled or not shard.pending:  # partial gradients, or none since the last sync
                self._launch(shard)
        for shard in self.shards:
            for handle in shard.pending:
                chunk = rounded_to(handle.wait(), shard.bucket.dtype)
                shard.grad = chunk if shard.grad is None else shard.grad + chunk
            if self.stage == 1 and shard.buffer is not None:  # the reduced slice in place of the local one
                shard.buffer[shard.lo:shard.hi] = shard.grad
                shard.grad = shard.buffer[shard.lo:shard.hi]
            shard.pending = []
            if shard.prefetch is not None:  # gathered ahead but not used this step (a pipeline's last unit): the
                shard.prefetch.wait()       # step changes the parameters, so it must not serve the next one
                shard.prefetch = None
        self.in_flight.clear()

    # ------------------------------------------------------------------------------- optimizer
    def clip_grad_norm(self, max_norm: float, sum_squares: Callable[[Any], Any] = lambda s: s) -> Any:
        """Global norm from the shards: Σg² per rank, summed over each replica group's ZeRO ranks with one
        scalar all-reduce (then over other groups by ``sum_squares``, e.g. tensor-parallel ranks)."""
        holders = [_GradHolder(s.grad, s.norm_weight, s.comm) for s in self.shards if s.grad is not None]
        local = 0.0
        for comm in dict.fromkeys(s.comm for s in self.shards):
            squares = sum_of_squares(h for h in holders if h.comm is comm)
            local = local + comm.all_reduce(xp.asarray(squares, dtype=xp.float64).reshape(1), label="grad_norm")[0]
        norm = xp.sqrt(xp.asarray(sum_squares(local))) * self.grad_scale
        scale_to_norm(holders, norm, max_norm)
        return norm

    def step(self) -> None:
        """AdamW on this rank's shard; stages 1-2 then all-gather the updated parameters."""
        self.step_count += 1
        for shard in self.shards:
            if shard.grad is None:
                continue
            mixed = shard.master is not None
            adamw_update(shard.master if mixed else shard.params,
                         master_gradient(shard.grad, self.grad_scale) if mixed else shard.grad, shard.m, shard.v,
                         step=self.step_count, lr=self.lr, beta1=self.beta1, beta2=self.beta2, eps=self.eps,
                         weight_decay=shard.weight_decay)
            if mixed:
                shard.params[...] = shard.master.astype(shard.params.dtype)  # rounded to 16 bits, then gathered
        if self.stage < 3:
            handles = [s.comm.all_gather(s.params, sizes=s.sizes, async_op=True, algorithm="ring", label="params",
                                         out=s.flat) for s in self.shards]  # in place: s.params is s.flat's slice
            for handle in handles:
                handle.wait()

    def zero_grad(self) -> None:
        super().zero_grad()
        for shard in self.shards:
            shard.grad = shard.buffer = None

    def state_arrays(self) -> list[Any]:
        return [a for s in self.shards for a in (s.m, s.v, s.master) if a is not None]

    # ------------------------------------------------------------------------------- reporting
    def formula_bytes(self) -> float:
        """Bytes one rank should send per step: (p−1)/p·Ψ per reduce-scatter and all-gather (ZeRO paper, §7:
        2 or 3 of them; gradients in their reduce dtype), per replica group;
        with hybrid sharding also 2(R−1)/R times its shard for the all-reduce across the R groups."""
        total = 0.0
        for s in self.shards:
            params, grads = np.dtype(s.bucket.dtype).itemsize, s.bucket.grad_dtype.itemsize  # gathers, reductions
            gathers = 2 if self.stage == 3 else 1
            total += (s.comm.size - 1) / s.comm.size * s.bucket.size * (gathers * params + grads)
            replicas = self.replicas_of.get(id(s.comm))
            if replicas:
                total += 2 * (replicas.size - 1) / replicas.size * (s.hi - s.lo) * grads
        return total

    def model_state_bytes(self, optimizer: Any = None) -> dict[str, int]:
        """Counted bytes of the live parameter, gradient and optimizer-state arrays on this rank."""
        return {"params": live_bytes([p.data for p in self.params] + [s.params for s in self.shards]),
                "grads": live_bytes([p.grad for p in self.params] + [s.grad for s in self.shards]),
                "optimizer": live_bytes(self.state_arrays())}

    def _gathered(self, pick: Callable[[Shard], Any]) -> dict[str, Any]:
        """A per-parameter full array from every rank's slice ``pick(shard)`` (one all-gather per group)."""
        names = {id(p): n for n, p in self.module.named_parameters()}
        out = {}
        for shard in self.shards:
            full = shard.comm.all_gather(pick(shard), sizes=shard.sizes, label="checkpoint")
            for i, p in enumerate(shard.bucket.params):
                out[names[id(p)]] = to_host(shard.bucket.slot(full, i)).copy()
        return out

    def gathered_state_dict(self) -> dict[str, Any]:
        """The full parameters by name on every rank."""
        return self._gathered(lambda s: s.params)

    def export_state(self, names: dict[int, str] | None = None) -> dict[str, dict[str, Any]]:
        """Adam's moments by parameter name, gathered whole from the shards (all ranks must call)."""
        return {"exp_avg": self._gathered(lambda s: s.m), "exp_avg_sq": self._gathered(lambda s: s.v)}

    def master_state(self, names: dict[int, str] | None = None) -> dict[str, Any]:
        """The float32 master weights by name, gathered whole (empty for a full-precision model; all ranks call)."""
        return self._gathered(lambda s: s.master) if any(s.master is not None for s in self.shards) else {}

    def import_state(self, exp_avg: dict[str, Any], exp_avg_sq: dict[str, Any], names: dict[int, str] | None = None,
                     step: int = 0, master: dict[str, Any] | None = None) -> None:
        """Take this rank's slice of full per-name moments — and float32 master weights, for a 16-bit model — e.g.
        from a checkpoint saved in another layout."""
        names = {id(p): n for n, p in self.module.named_parameters()}
        for shard in self.shards:
            pairs = [(exp_avg, shard.m), (exp_avg_sq, shard.v)] + ([(master, shard.master)] if master and
                                                                   shard.master is not None else [])
            for full, target in pairs:
                flat = xp.concatenate([to_device(full[names[id(p)]], dtype=target.dtype).reshape(-1)
                                       for p in shard.bucket.params])
                target[...] = flat[shard.lo:shard.hi]
        self.step_count = step


class _GradHolder:
    """Lets clip_grad_norm treat a gradient shard like a parameter's ``.grad``."""

    def __init__(self, grad: Any, norm_weight: Any, comm: Communicator):
        self.grad, self.norm_weight, self.comm = grad, norm_weight, comm
