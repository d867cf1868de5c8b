"""Pipeline parallelism: the transformer's blocks split into consecutive stages over pp ranks; a batch
is cut into m microbatches that flow through the stages like a pipeline.

    stage 0: wte, wpe, blocks[0:k]      stage s: blocks[...]      last stage: blocks[...], ln_f, head + loss

Placement. The schedule object (schedules.py) says which virtual stage each of a rank's v chunks is, and so
where a stage's output goes: Megatron's interleaving puts chunk c of rank r at stage c·p + r (a microbatch
visits every rank v times; without interleaving v = 1 and stage s is rank s); DualPipeV's V puts rank r's
two chunks at stages r and 2p − 1 − r, so the last rank hands its first chunk's output to its second
locally (a mailbox, no message) and rank 0 holds both the embedding and the head.

Forward, stage s receives microbatch i's activations (b, T, C) from stage s − 1 and sends its output
to s + 1; backward runs the other way with the gradients of those activations. Messages are
point-to-point (``isend`` so a stage never blocks on its own sends; blocking ``recv``), tagged by
(microbatch, stage), b·T·C·itemsize bytes per hop: 2·(p·v − 1)·m hops per step (fewer when hops are local).

The schedule gives every rank its ordered passes (F, B or W; microbatch; chunk):

    gpipe        all forwards, then all backwards                 bubble (p−1)/(m+p−1), holds m microbatches
    1f1b         p−r−1 warm-up forwards, then F/B alternate         bubble (p−1)/(m+p−1), holds ≤ p − r
    interleaved  v chunks per rank, microbatches in groups of p    bubble (p−1)/(v·m+p−1)
    zb-h1        B computes input gradients only (autograd's split backward); each W (the weights'
                 gradients, from the activations B kept) fills a wait    bubble (p−1)/(3m+p−1) (F = B = W)
    dualpipev    the V above, DeepSeek's eight phases, split and whole backwards    bubble (p−1)/(6m+p−1)

``Pipeline.stats`` measures the bubble on a logical clock — a chunk's forward costs 1/v, its backward
2/v (B and W 1/v each when split), and each message carries its sender's clock, so a pass starts at
max(its rank's clock, the clock of the data it waits for) — which is the schedule's own bubble, free of
this machine's noise; ``--trace`` shows the wall-clock one (W passes as their own category).

Data parallelism sees one backward per chunk and step under ``engine.no_sync()`` but the last — the last
B of that chunk, or its last W when split — so its hooks fire once, when a parameter's gradient over
all microbatches is final, and the reduction of a chunk overlaps the rest of the pipeline.

Tied embeddings (GPT-2; a Llama with --tie-embeddings — an untied lm_head simply lives on the head's rank).
The head of the last stage reuses the first stage's token embedding. The rank with the
head keeps a mirror (not a parameter; a copy of the module when that rank holds the embedding too): at the
start of each step the embedding's rank sends it the table, and when the head's gradients are final the
head's rank sends the table's gradient back, which the embedding's rank adds in before the final backward
of its stage 0 — so ``wte.grad`` there is the single-process gradient (embedding + head) when data
parallelism reduces it, and its hook fires once.

Deep dive, with measurements: docs/pipeline.md.
"""
from __future__ import annotations

import contextlib
import copy
from typing import Any

import numpy as np

from minipar import ops, trace
from minipar.autograd import Tensor, no_grad
from minipar.backend import to_device, to_host
from minipar.comm import Communicator
from minipar.models.gpt import GPT
from minipar.nn import ModuleList
from minipar.parallel.schedules import Schedule
from minipar.safetensors_io import decode_safetensors, encode_safetensors

_TIED_WEIGHTS_TAG, _TIED_GRAD_TAG, _EVAL_TAG = 60000, 60001, 61000


def stage_blocks(n_layer: int, n_stages: int, stage: int) -> range:
    """The blocks of ``stage``: a balanced contiguous split (``numpy.array_split``)."""
    if n_layer < n_stages:
        raise ValueError(f"{n_stages} pipeline stages (--pp × --virtual-stages) need at least {n_stages} transformer "
                         f"layers (n_layer={n_layer})")
    base, extra = divmod(n_layer, n_stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


class Pipeline:
    """This rank's chunks of ``model`` (pruned in place) and the schedule that runs a step's microbatches."""

    def __init__(self, model: GPT, comm: Communicator, schedule: Schedule):
        if schedule.p != comm.size:
            raise ValueError(f"{schedule} is for {schedule.p} pipeline ranks, the group has {comm.size}")
        self.model, self.comm, self.schedule = model, comm, schedule
        p, v, self.rank = schedule.p, schedule.v, comm.rank
        self.n_ranks, self.n_stages = p, schedule.n_stages
        self.embedding_rank, self.head_rank = schedule.rank_of(0), schedule.rank_of(self.n_stages - 1)
        cfg, t = model.config, model.transformer
        stages = [schedule.stage(self.rank, c) for c in range(v)]
        self.chunks = [[t.h[i] for i in stage_blocks(cfg.n_layer, self.n_stages, s)] for s in stages]
        numbers = [i for s in stages for i in stage_blocks(cfg.n_layer, self.n_stages, s)]
        t.h = ModuleList([t.h[i] for i in numbers], numbers=numbers)
        holds_embedding, holds_head = self.rank == self.embedding_rank, self.rank == self.head_rank
        # the head reads the token embedding (a tied head; DeepSeek's MTP modules embed the tokens ahead): the last
        # stage keeps a mirror of the table, and its gradient goes back to the first (``tied``)
        self.tied, self.head_embedding = p > 1 and cfg.head_uses_embedding, None
        if not holds_embedding and hasattr(t, "wpe"):  # learned positions (GPT-2)
            del t.wpe
        if not holds_head:
            del t.ln_f
            if not cfg.ties_embeddings:  # an untied head (Llama's lm_head) lives on the last stage only
                del model.lm_head
            if hasattr(model, "mtp"):  # so do DeepSeek's multi-token prediction modules
                del model.mtp
        if not (holds_embedding or (holds_head and cfg.head_uses_embedding)):
            del t.wte
        self.table_shape = tuple(t.wte.weight.shape) if hasattr(t, "wte") else None  # (ZeRO-3 frees it)
        if self.tied and holds_head:  # a mirror of the token embedding (a copy where the rank holds the table too)
            self.head_embedding = copy.copy(t.wte) if holds_embedding else t.wte
            self.head_embedding.weight = Tensor(t.wte.weight.data)
        self.weights = {id(q) for q in model.parameters()}  # what a split backward defers to W
        self.mailbox: dict[int, tuple[Any, float]] = {}  # messages from this rank to itself (DualPipeV's tip)
        self.stats: dict[str, float] = {}

    # ------------------------------------------------------------------------------- messages
    def _tag(self, microbatch: int, stage: int) -> int:
        """Four tags per (microbatch, receiving stage): activations, their clock, gradients, their clock."""
        return 4 * (microbatch * self.n_stages + stage)

    def _send(self, array: Any, dest: int, tag: int, clock: float, label: str) -> list:
        if dest == self.rank:
            self.mailbox[tag] = (array, clock)
            return []
        return [self.comm.isend(array, dest, tag, label=label),
                self.comm.isend(np.array([clock]), dest, tag + 1, label="pp_clock")]

    def _recv(self, shape: tuple, source: int, tag: int, name: str) -> tuple[Any, float]:
        if source == self.rank:
            return self.mailbox.pop(tag)
        with trace.span(f"recv {name}", "comm"):
            array = self.comm.recv(np.empty(shape, self._dtype), source, tag)
            clock = self.comm.recv(np.empty(1), source, tag + 1)
        return to_device(array), float(clock[0])

    @property
    def _dtype(self) -> Any:
        return np.dtype(self.model.config.dtype)

    def _exchange_tied_embedding(self) -> None:
        """The token-embedding table, as it is now, to the head's mirror."""
        if not self.tied:
            return
        if self.rank == self.embedding_rank != self.head_rank:
            self.comm.send(self._table(), self.head_rank, _TIED_WEIGHTS_TAG, label="pp_embedding")
        elif self.rank == self.head_rank:
            table = (self._table() if self.rank == self.embedding_rank else to_device(
                self.comm.recv(np.empty(self.table_shape, self._dtype), self.embedding_rank,
                               _TIED_WEIGHTS_TAG)))
            self.head_embedding.weight = Tensor(table, requires_grad=True)

    def _table(self) -> Any:
        """The token-embedding table as it is now (read between the model's hooks: ZeRO-3 gathers it)."""
        return self.model.hooked(lambda: self.model.transformer.wte.weight.data.copy())

    # ------------------------------------------------------------------------------- compute
    def _forward(self, chunk: int, inp: Any, targets: Any, seed: float = 0.0) -> tuple[Tensor, Tensor | None]:
        """This rank's ``chunk`` on ``inp`` (token ids on stage 0, else activations): (its output — the loss on the
        last stage —, the balancing loss of its MoE layers when that is not already in the loss, else None).
        A stage before the last hangs its balancing loss on its output (ops.add_loss), so that backward gives it
        ``seed``, the gradient the final loss starts from."""
        stage, model = self.schedule.stage(self.rank, chunk), self.model
        x = model.hooked(model.embed, to_device(inp)) if stage == 0 else inp  # hooked: the model's own parameters
        for block in self.chunks[chunk]:                                        # (ZeRO-3 gathers them around it)
            x = block(x)
        balance = model.balance_loss(self.chunks[chunk])
        if stage < self.n_stages - 1:
            return (x if balance is None or not seed else ops.add_loss(x, balance, seed)), balance
        loss = model.hooked(model.head, x, to_device(targets), embedding=self.head_embedding)[1]
        return (loss if balance is None else loss + balance), None

    def run(self, engine: Any, x: np.ndarray, y: np.ndarray, loss_scale: float = 1.0,
            tokens: int | None = None) -> list[Any]:
        """Forward and backward of the schedule's m microbatches of (x, y); returns this rank's terms of their losses
        as 0-d xp arrays: the losses on the rank with the last stage, the balancing losses of an MoE model's
        earlier stages on theirs (their sum over the pipeline ranks is each microbatch's loss).

        Each chunk's backward passes but its last run under ``engine.no_sync()`` (module docstring). The loss is
        normalized by the global token count: microbatch i's backward starts from loss_i·loss_scale·n_i/N, with
        n_i its targets and N = ``tokens``, all the targets whose gradients the data-parallel reduction sums
        (``Layout.loss_tokens``; None: this rank's own y, as without data parallelism) — so the gradient is that of
        (token-sum of losses)/N, and every activation gradient the one process's (data_parallel.py). float16 loss
        scaling multiplies it by loss_scale; the losses returned are unscaled."""
        m, schedule = self.schedule.m, self.schedule
        xs, ys = np.split(x, m), np.split(y, m)
        seeds = [loss_scale * yi.size / (tokens or y.size) for yi in ys]
        if self.n_ranks == 1:
            return self._run_single_stage(engine, xs, ys, seeds)
        last_stage = self.n_stages - 1
        shape = (len(xs[0]), len(self.model.positions(x.shape[1])), self.model.config.n_embd)
        self._exchange_tied_embedding()
        order, split, cost = schedule.actions(self.rank), schedule.split_backward, schedule.costs()
        final = {}  # chunk -> index of the pass that completes its gradients
        for k, a in enumerate(order):
            if a.kind == ("W" if split else "B"):
                final[a.chunk] = k
        inputs, outputs, weight_passes, losses, sends = {}, {}, {}, {}, []  # losses: microbatch -> this rank's terms
        clock, peak = 0.0, 0
        for k, (kind, i, chunk) in enumerate(order):
            stage, name = schedule.stage(self.rank, chunk), f"{i}" + (f".{chunk}" if schedule.v > 1 else "")
            if kind == "F":
                if stage == 0:
                    inp = xs[i]
                else:
                    data, sent_at = self._recv(shape, schedule.rank_of(stage - 1), self._tag(i, stage), f"act {name}")
                    clock, inp = max(clock, sent_at), Tensor(data, requires_grad=True)
                with trace.span(f"F{name}", "forward"):
                    out, balance = self._forward(chunk, inp, ys[i], seeds[i])
                clock += cost["F"]
                inputs[i, chunk], outputs[i, chunk] = inp, out
                peak = max(peak, len(outputs) + len(weight_passes))
                for term in (out,) if stage == last_stage else (balance,) if balance is not None else ():
                    losses[i] = term.data if i not in losses else losses[i] + term.data
                if stage < last_stage:
                    sends += self._send(out.data, schedule.rank_of(stage + 1), self._tag(i, stage + 1), clock,
                                        "pp_activations")
                continue
            completes = final[chunk] == k
            if completes and stage == 0 and self.tied:  # the head's share of the tied embedding
                wte = self.model.transformer.wte.weight
                head_grad = self._recv(self.table_shape, self.head_rank, _TIED_GRAD_TAG, "embedding grad")[0]
                wte.grad = head_grad if wte.grad is None else wte.grad + head_grad
            with engine.no_sync() if not completes else contextlib.nullcontext():
                if kind == "W":
                    with trace.span(f"W{name}", "weights"):
                        weight_passes.pop((i, chunk)).run()
                    clock += cost["W"]
                else:
                    grad = None
                    if stage < last_stage:
                        grad, sent_at = self._recv(shape, schedule.rank_of(stage + 1), self._tag(i, stage) + 2,
                                                   f"grad {name}")
                        clock = max(clock, sent_at)
                    with trace.span(f"B{name}", "backward"):
                        out = outputs.pop((i, chunk))
                        deferred = (out * seeds[i] if stage == last_stage else out).backward(
                            None if stage == last_stage else grad, defer=self.weights if split else None)
                    if split:
                        weight_passes[i, chunk] = deferred
                    clock += cost["B"]
                    inp = inputs.pop((i, chunk))
                    if stage > 0:
                        sends += self._send(inp.grad, schedule.rank_of(stage - 1), self._tag(i, stage - 1) + 2, clock,
                                            "pp_gradients")
            if completes and stage == last_stage and self.tied:  # the head's gradients are final: its table's too
                sends += self._send(self.head_embedding.weight.grad, self.embedding_rank, _TIED_GRAD_TAG, clock,
                                    "pp_embedding")
        with trace.span("wait sends", "comm"):
            for handle in sends:
                handle.wait()
        makespan = float(self.comm.all_reduce(np.array([clock]), op="max", label="pp_clock")[0])
        busy = m * schedule.v * sum(cost[kind] for kind in ("FBW" if split else "FB"))
        self.stats = {"peak_microbatches_in_flight": peak, "logical_step_time": makespan,
                      "bubble": 1.0 - busy / makespan, "bubble_formula": schedule.bubble()}
        return list(losses.values())

    def _run_single_stage(self, engine: Any, xs: list, ys: list, seeds: list[float]) -> list[Any]:
        """No pipeline: plain gradient accumulation through the engine (which may be ZeRO-3's hooks)."""
        m, losses = len(xs), []
        for i, (xi, yi) in enumerate(zip(xs, ys)):
            with engine.no_sync() if i < m - 1 else contextlib.nullcontext():
                with trace.span(f"F{i}", "forward"):
                    _, loss = engine(xi, yi)
                with trace.span(f"B{i}", "backward"):
                    (loss * seeds[i]).backward()
            losses.append(loss.data)  # a device scalar: read once per step, by the caller
        self.stats = {"peak_microbatches_in_flight": 1, "bubble": 0.0, "bubble_formula": 0.0}
        return losses

    def forward_only(self, engine: Any, x: np.ndarray, y: np.ndarray) -> float | None:
        """This rank's term of the loss of (x, y) without gradients (evaluation): the loss on the rank with the last
        stage, an MoE model's balancing losses on the others (summed over the pipeline: the loss), else None."""
        if self.n_ranks == 1:
            with no_grad():
                return engine(x, y)[1].item()
        self._exchange_tied_embedding()
        shape = (len(x), len(self.model.positions(x.shape[1])), self.model.config.n_embd)
        schedule, total, sends = self.schedule, None, []
        with no_grad():
            for stage, chunk in sorted((schedule.stage(self.rank, c), c) for c in range(schedule.v)):
                inp = x if stage == 0 else self._recv(shape, schedule.rank_of(stage - 1), _EVAL_TAG + 2 * stage,
                                                      "eval")[0]
                out, balance = self._forward(chunk, inp, y)
                term = out if stage == self.n_stages - 1 else balance
                total = total if term is None else term.item() + (total or 0.0)
                if stage < self.n_stages - 1:
                    sends += self._send(out.data, schedule.rank_of(stage + 1), _EVAL_TAG + 2 * (stage + 1), 0.0,
                                        "pp_activations")
        for handle in sends:
            handle.wait()
        return total


def stage_state(local: dict[str, np.ndarray], comm: Communicator) -> dict[str, np.ndarray]:
    """Every stage's parameters by name, on every rank of the pipeline group (stages hold disjoint names)."""
    blob = b"".join(encode_safetensors({k: to_host(v) for k, v in local.items()}))
    merged = {}
    for stage_blob in comm.all_gather_bytes(blob, label="checkpoint"):
        merged.update(decode_safetensors(stage_blob)[0])
    return merged
