"""Expert parallelism (GShard, DeepSpeed-MoE, Megatron-core): the E experts of every MoE layer are
split over the ep ranks of an expert-parallel group; tokens travel to their experts and back.

The ep group is carved out of the data-parallel replicas, dp × cp (mesh.py): each of its ranks trains on
its own tokens of the batch (its rows, or its pieces of their sequences), holds experts [r·E/ep, (r+1)·E/ep) and routes its own tokens exactly as
the single-process MoE layer does (models/moe.py: top-k, capacity per expert, priority rule).
Its kept assignments fill slots 0 … load[e] − 1 of each expert e. One MoE layer, on rank r:

    1. counts    all-to-all of E integers: rank r tells rank d how many rows it sends to each
                 of d's E/ep experts (pairwise, (ep−1)·E/ep·8 bytes sent)
    2. dispatch  all-to-all-v of the kept rows, ordered (owner, expert, slot):
                 R_out·C·itemsize bytes sent, R_out = kept rows for experts on other ranks
    3. compute   the local experts as one batched matmul on (E/ep, W, C), W the most rows any
                 local expert received; expert e takes source s's rows in source order
    4. combine   the outputs travel back by the reverse all-to-all-v: R_in·C·itemsize bytes,
                 R_in = rows this rank received from others; then they sit in the same
                 (E, capacity, C) slots the single-process layer fills
    backward     the conjugate pair, each exchange reversed: the outputs' gradients go to the owners
                 (R_out rows), the inputs' gradients back to the sources (R_in rows)
    recomputed   under --recompute full the backward first runs the layer's forward again: counts, dispatch and
                 combine once more (the same rows: the routing is the same), labelled "ep_recompute" — keeping
                 the dispatched rows instead would keep the activations recomputation exists to drop

so a layer sends (ep−1)·E/ep·8 + 2·(R_out + R_in)·C·itemsize bytes per microbatch and rank
(:func:`bytes_per_layer`). Every row is computed by the same expert weights on the same values
as in the single-process layer — the row-wise matmuls do not care which other rows share the
batch — so outputs, the balancing loss and all gradients are those of single-process training
(with the same token groups: one rank's microbatch; train.py's reference runs dp·m microbatches).

Gradients: an expert's weight gradient on its owner sums the ep ranks' token contributions; the
dense parameters are replicated over all dp·cp replicas and the experts only over the dp·cp/ep ranks with
the same ep rank (mesh.expert_grad_comm), so data_parallel.replica_groups sums each where it
lives. For the global gradient norm (summed over ep ranks like over tp ranks) a dense parameter's
squares count 1/ep on each ep rank (its placement: minipar/placement.py).

Under tensor parallelism each tp rank runs the MoE layers whole on the same (replicated) tokens and
exchanges them with the ranks of its own tp coordinate.

Deep dive, with measurements: docs/experts.md.
"""
from __future__ import annotations

import json
import time
from typing import Any

import numpy as np

from minipar import ops, trace
from minipar.autograd import Context, Function, Tensor
from minipar.backend import to_device, to_host, xp
from minipar.comm import Communicator, Handle
from minipar.models.moe import MoEMLP
from minipar.nn import Module, Parameter


def check_expert_parallel(cfg: Any, ep: int, dp: int) -> None:
    """Raise before any communication if ``ep`` cannot split this model's experts over the ``dp`` data-parallel
    replicas (dp·cp: context-parallel ranks are replicas too)."""
    if ep < 1:
        raise ValueError(f"--ep must be positive, got {ep}")
    if ep == 1:
        return
    if not cfg.n_expert:
        raise ValueError("--ep splits the experts of a mixture-of-experts model: pass --n-expert too")
    if cfg.n_expert % ep:
        raise ValueError(f"--ep {ep} must divide --n-expert {cfg.n_expert}: every rank holds n_expert/ep experts")
    if dp % ep:
        raise ValueError(f"--ep {ep} must divide dp·cp = {dp}: expert parallelism is carved out of the data-parallel "
                         "replicas")


class RowsInFlight:
    """One exchange of rows between the ep ranks, split in two autograd nodes so that work runs while it travels:
    :class:`StartRows` hands the rows to the communication thread (an all-to-all-v), :class:`FinishRows` waits for
    what arrives. Backward the other way round: FinishRows' backward starts the gradient rows back, StartRows'
    backward waits for them — whatever the backward walk reaches in between runs while they travel. The time spent
    waiting (the exchange compute did not hide) adds to the layer's tally, ``exposed_s``. ``blocking``: each half
    waits as soon as it starts (the whole exchange exposed), to measure what the overlap hides."""

    def __init__(self, mlp: MoEMLP, send: list[int], recv: list[int], comm: Communicator, label: str,
                 blocking: bool = False):
        self.mlp, self.send, self.recv, self.comm, self.label = mlp, send, recv, comm, label
        self.blocking = blocking
        self.forward: Any = None
        self.backward: Any = None
        self.width = 0

    def wait(self, handle: Any, name: str) -> Any:
        t0 = time.perf_counter()
        with trace.span(name, "comm"):
            out = handle.wait()
        if not ops.recomputing():
            self.mlp.tally["exposed_s"] = self.mlp.tally.get("exposed_s", 0.0) + time.perf_counter() - t0
        return out.reshape(-1, self.width)


class StartRows(Function):
    autocast = False  # moves data: keeps its dtype (16-bit messages under mixed precision)

    @staticmethod
    def forward(ctx: Context, x: Any, flight: RowsInFlight) -> Any:
        ctx.flight, flight.width = flight, x.shape[1]
        flight.forward = flight.comm.all_to_all_v(xp.ascontiguousarray(x), [n * x.shape[1] for n in flight.send],
                                                  [n * x.shape[1] for n in flight.recv], async_op=True,
                                                  label=flight.label)
        if flight.blocking:
            flight.forward = Handle.completed(flight.wait(flight.forward, f"wait {flight.label}"))
        return xp.zeros(0, dtype=x.dtype)  # a token: the rows arrive in FinishRows

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        return ctx.flight.wait(ctx.flight.backward, "wait ep gradient rows"), None


class FinishRows(Function):
    autocast = False

    @staticmethod
    def forward(ctx: Context, token: Any, flight: RowsInFlight) -> Any:
        ctx.flight = flight
        return flight.wait(flight.forward, f"wait {flight.label}")

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        flight, width = ctx.flight, g.shape[1]
        flight.backward = flight.comm.all_to_all_v(xp.ascontiguousarray(g), [n * width for n in flight.recv],
                                                   [n * width for n in flight.send], async_op=True,
                                                   label="ep_backward")
        if flight.blocking:
            flight.backward = Handle.completed(flight.wait(flight.backward, "wait ep gradient rows"))
        return xp.zeros(0, dtype=g.dtype), None


def exchange_rows(mlp: MoEMLP, x: Tensor, send: list[int], recv: list[int], comm: Communicator, label: str,
                  meanwhile: Any = None) -> Tensor:
    """Rows of ``x`` to the ep ranks (``send[j]`` to rank j, ``recv[i]`` from rank i); ``meanwhile()`` runs while
    they travel (overlapped: the layer's ``overlap``), or after they arrived (blocking)."""
    flight = RowsInFlight(mlp, send, recv, comm, label, blocking=not mlp.overlap)
    token = StartRows.apply(x, flight)
    if meanwhile is not None:
        meanwhile()
    return FinishRows.apply(token, flight)


def dispatch_to_owners(mlp: MoEMLP, comm: Communicator, padded: Tensor, tokens: np.ndarray, load: np.ndarray,
                       meanwhile: Any = None) -> Tensor:
    """MoEMLP.run_experts across the ep ranks: (E, capacity, C) outputs, computed by the experts' owners; the
    shared experts (``meanwhile``) run while the dispatch travels."""
    E, cap = tokens.shape
    ep, local = comm.size, E // comm.size
    C = padded.shape[1]
    again = ops.recomputing()  # a recomputed forward: the same exchanges once more, reported apart
    # 1. counts: counts[s, e] rows from source s for local expert e
    counts = comm.all_to_all(np.ascontiguousarray(load, np.int64), algorithm="pairwise",
                             label="ep_recompute" if again else "ep_counts")
    counts = counts.reshape(ep, local)
    send = load.reshape(ep, local).sum(axis=1).tolist()
    recv = counts.sum(axis=1).tolist()
    # 2. dispatch the kept rows in (owner, expert, slot) order
    order = np.concatenate([tokens[e, :load[e]] for e in range(E)])
    label = "ep_recompute" if again else "ep_forward"
    arrived = exchange_rows(mlp, padded[to_device(order)], send, recv, comm, label, meanwhile)  # source, expert, slot
    # 3. local experts on (local, W, C): expert e's rows from source s at [start[e, s], start[e, s] + counts[s, e])
    per_expert = counts.sum(axis=0)
    width = int(per_expert.max()) if local else 0
    start = np.cumsum(np.concatenate([np.zeros((local, 1), np.int64), counts.T[:, :-1]], axis=1), axis=1)
    source_offset = np.cumsum([0, *counts.sum(axis=1)])[:-1]                       # where source s's rows begin
    expert_offset = np.cumsum(np.concatenate([np.zeros((ep, 1), np.int64), counts[:, :-1]], axis=1), axis=1)
    gather = np.full(local * width, counts.sum(), np.int64)                          # default: a zero row
    back = np.empty(counts.sum(), np.int64)
    for s in range(ep):
        for e in range(local):
            n = counts[s, e]
            rows = source_offset[s] + expert_offset[s, e] + np.arange(n)
            places = e * width + start[e, s] + np.arange(n)
            gather[places], back[rows] = rows, places
    zero = Tensor(xp.zeros((1, C), dtype=padded.dtype))
    expert_in = ops.concat([arrived, zero], axis=0)[to_device(gather)].reshape(local, width, C)
    expert_out = mlp.experts(expert_in).reshape(local * width, C)
    # 4. combine: the outputs back to their sources, then into their (E, capacity) slots
    returned = exchange_rows(mlp, expert_out[to_device(back)], recv, send, comm, label)  # (Σ send, C): `order`'s order
    slots = np.full(E * cap, len(order), np.int64)
    slots[np.concatenate([e * cap + np.arange(load[e]) for e in range(E)])] = np.arange(len(order))
    me = comm.rank
    if not again:  # counted once per microbatch, like the routing
        mlp.tally["rows_out"] = mlp.tally.get("rows_out", 0) + sum(send) - send[me]
        mlp.tally["rows_in"] = mlp.tally.get("rows_in", 0) + sum(recv) - recv[me]
    return ops.concat([returned, zero], axis=0)[to_device(slots)].reshape(E, cap, C)


def bytes_per_layer(rows_out: int, rows_in: int, n_expert: int, ep: int, width: int, itemsize: int,
                    recomputed: bool = False) -> dict[str, int]:
    """What one MoE layer's exchanges send from one rank per microbatch, by label (the module docstring); with
    ``recomputed`` (full recomputation) the forward's counts and rows once more."""
    counts, rows = (ep - 1) * (n_expert // ep) * 8, (rows_out + rows_in) * width * itemsize
    return {"ep_counts": counts, "ep_forward": rows, "ep_backward": rows,
            **({"ep_recompute": counts + rows} if recomputed else {})}


def update_router_bias(model: Module, comm: Communicator) -> None:
    """Auxiliary-loss-free balancing after a step (MoEMLP.update_bias): every layer's expert loads of the step —
    its kept assignments over the microbatches — summed over the data-parallel replicas ``comm`` (dp·cp: the ranks
    that route other tokens; tp ranks route the same ones, pipeline stages their own layers) by one all-reduce of
    L·E numbers, so every rank moves every bias alike."""
    layers = [layer for layer in moe_layers(model) if layer.bias_update]
    if not layers:
        return
    loads = comm.all_reduce(np.concatenate([layer.tally["load"] for layer in layers]).astype(np.float64),
                            label="moe_bias")
    for layer, load in zip(layers, np.split(loads, len(layers))):
        layer.update_bias(load)


def moe_layers(model: Module) -> list[MoEMLP]:
    return [m for m in model.modules() if isinstance(m, MoEMLP)]


def expert_report(model: Module, comm: Communicator, stages: Communicator | None = None) -> dict[str, Any]:
    """This step's routing over the data-parallel replicas ``comm`` (one all-reduce of 2 + L·E numbers) and the
    pipeline ``stages`` (each holding its own layers: one all-reduce of 4 numbers, an all-gather of each stage's
    per-layer list): the share of assignments dropped for capacity, the fewest / most tokens any expert of any
    layer computed, each layer's max / mean expert load (1: perfectly balanced) and, with sigmoid routers, the
    range of their balancing biases."""
    layers = moe_layers(model)
    local = np.concatenate([[sum(m.tally["assignments"] for m in layers), sum(m.tally["kept"] for m in layers)],
                            *[m.tally["load"] for m in layers]]).astype(np.float64)
    total = comm.all_reduce(local, label="moe_report") if comm.size > 1 else local
    counts, low, high = total[:2], (total[2:].min() if layers else np.inf), (total[2:].max() if layers else 0.0)
    if stages is not None and stages.size > 1:
        counts = stages.all_reduce(counts, label="moe_report")
        negated_low, high = stages.all_reduce(np.array([-low, high]), op="max", label="moe_report")  # min = −max(−x)
        low = -negated_low
    loads = total[2:].reshape(len(layers), -1) if layers else np.zeros((0, 1))
    imbalance = [float(load.max() / max(load.mean(), 1e-12)) for load in loads]
    biases = [to_host(m.score_bias) for m in layers if m.score_bias is not None]
    bias_range = [float(min(b.min() for b in biases)), float(max(b.max() for b in biases))] if biases else []
    if stages is not None and stages.size > 1:
        gathered = [json.loads(part) for part in stages.all_gather_bytes(json.dumps([imbalance, bias_range]).encode(),
                                                                         label="moe_report")]
        imbalance = [value for stage, _ in gathered for value in stage]
        ranges = [r for _, r in gathered if r]
        bias_range = [min(r[0] for r in ranges), max(r[1] for r in ranges)] if ranges else []
    report = {"dropped_fraction": 1.0 - counts[1] / max(counts[0], 1.0), "expert_load_min": int(low),
              "expert_load_max": int(high), "load_max_over_mean": imbalance}
    if bias_range:
        report["bias_range"] = bias_range
    if any("rows_out" in m.tally for m in layers):  # this rank's rows to / from other ep ranks (bytes_per_layer)
        report.update(rows_out=sum(m.tally["rows_out"] for m in layers), rows_in=sum(m.tally["rows_in"] for m in layers),
                      exposed_all_to_all_ms=1e3 * sum(m.tally.get("exposed_s", 0.0) for m in layers))
    return report


def shard_expert_state(full: dict[str, np.ndarray], ep: int, rank: int, expert_names: set[str]) -> dict[str, np.ndarray]:
    """Rank ``rank``'s experts (a slice along the first axis) of every expert tensor in a full state."""
    return {n: np.ascontiguousarray(np.array_split(v, ep)[rank]) if n in expert_names else v for n, v in full.items()}


def expert_names(model: Module) -> set[str]:
    return {n for n, p in model.named_parameters() if p.placement.experts}


def expert_parallel(model: Module, comm: Communicator, overlap: bool = True) -> Module:
    """Keep only this rank's E/ep experts of every MoE layer, in place, and route tokens to their owners over
    ``comm`` (the ep group). Every rank must hold the same full model (same seed or checkpoint). ``overlap``: the
    exchanges run on the communication thread while the shared experts (forward) and whatever backward reaches
    first compute (:class:`RowsInFlight`); else they block."""
    ep, rank = comm.size, comm.rank
    names = expert_names(model)
    local = shard_expert_state(model.state_dict(), ep, rank, names)
    named = dict(model.named_parameters())
    for mlp in moe_layers(model):
        for linear in (mlp.c_fc, mlp.c_proj):
            for attr in ("weight", "bias") if linear.bias is not None else ("weight",):  # SwiGLU experts: no bias
                name = next(n for n, p in named.items() if p is getattr(linear, attr))
                param = Parameter(to_device(local[name], dtype=getattr(linear, attr).dtype))
                param.placement = getattr(linear, attr).placement
                setattr(linear, attr, param)
        mlp.run_experts = lambda padded, tokens, load, meanwhile=None, mlp=mlp: dispatch_to_owners(
            mlp, comm, padded, tokens, load, meanwhile)
        mlp.overlap = overlap
    for p in model.parameters():  # the experts split over ep, the rest whole on every ep rank (their placement)
        p.placement = p.placement.placed(ep_size=ep)
    return model
