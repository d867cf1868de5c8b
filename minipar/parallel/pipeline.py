"""Pipeline parallelism: the transformer's blocks split into consecutive stages over pp ranks; a batch
is cut into m microbatches that flow through the stages like a pipeline.

    stage 0: wte, wpe, blocks[0:k]      stage s: blocks[...]      last stage: blocks[...], ln_f, head + loss

Virtual stages. With v chunks per rank (interleaved 1F1B) the blocks split into p·v stages and rank
r holds stages r, r + p, r + 2p, … (its chunks 0 … v−1): stage s's output goes to rank (s + 1) mod p,
so a microbatch visits every rank v times. Without interleaving v = 1 and stage s is rank s.

Forward, stage s receives microbatch i's activations (b, T, C) from stage s − 1 and sends its output
to s + 1; backward runs the other way with the gradients of those activations. Messages are
point-to-point (``isend`` so a stage never blocks on its own sends; blocking ``recv``), tagged by
(microbatch, stage), b·T·C·itemsize bytes per hop: 2·(p·v − 1)·m hops per step.

Schedules (schedules.py: one generator each, verified by its simulator) give every rank its ordered
passes (F, B or W; microbatch; chunk):

    gpipe        all forwards, then all backwards                 bubble (p−1)/(m+p−1), holds m microbatches
    1f1b         p−r−1 warm-up forwards, then F/B alternate         bubble (p−1)/(m+p−1), holds ≤ p − r
    interleaved  v chunks per rank, microbatches in groups of p    bubble (p−1)/(v·m+p−1)
    zb-h1        B computes input gradients only (autograd's split backward); each W (the weights'
                 gradients, from the activations B kept) fills a wait    bubble (p−1)/(3m+p−1) (F = B = W)

``Pipeline.stats`` measures the bubble on a logical clock — a chunk's forward costs 1/v, its backward
2/v (B and W 1/v each when split), and each message carries its sender's clock, so a pass starts at
max(its rank's clock, the clock of the data it waits for) — which is the schedule's own bubble, free of
this machine's noise; ``--trace`` shows the wall-clock one (W passes as their own category).

Data parallelism sees one backward per chunk and step under ``engine.no_sync()`` but the last — the last
B of that chunk, or its last W when split — so its hooks fire once, when a parameter's gradient over
all microbatches is final, and the reduction of a chunk overlaps the rest of the pipeline.

Tied embeddings. The head of the last stage reuses the first stage's token embedding. The last
rank keeps a mirror (not a parameter): at the start of each step rank 0 sends it the table, and
after its last pass the last rank sends the table's gradient back, which rank 0 adds in before the
final backward of its chunk 0 — so rank 0's ``wte.grad`` is the single-process gradient (embedding +
head) when data parallelism reduces it.

Deep dive, with measurements: docs/pipeline.md.
"""
from __future__ import annotations

import contextlib
from typing import Any

import numpy as np

from minipar import trace
from minipar.autograd import Tensor, no_grad
from minipar.backend import to_device, to_host
from minipar.comm import Communicator
from minipar.models.gpt import GPT
from minipar.nn import ModuleList
from minipar.parallel.schedules import SCHEDULES, bubble_formula, check_schedule, costs, schedule
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

    def __init__(self, model: GPT, comm: Communicator, kind: str = "1f1b", virtual_stages: int = 1):
        p, v = comm.size, virtual_stages
        check_schedule(kind, p, p, v)
        self.model, self.comm, self.kind, self.v = model, comm, kind, v
        self.rank, self.n_ranks, self.n_stages = comm.rank, p, p * v
        self.is_first, self.is_last = self.rank == 0, self.rank == p - 1  # hold stage 0 / the last stage
        cfg, t = model.config, model.transformer
        self.chunks = [[t.h[i] for i in stage_blocks(cfg.n_layer, p * v, c * p + self.rank)] for c in range(v)]
        numbers = [i for c in range(v) for i in stage_blocks(cfg.n_layer, p * v, c * p + self.rank)]
        t.h = ModuleList([t.h[i] for i in numbers], numbers=numbers)
        if not self.is_first:
            del t.wpe
        if not self.is_last:
            del t.ln_f
        if not (self.is_first or self.is_last):
            del t.wte
        self.tied = p > 1
        if self.tied and self.is_last:
            t.wte.weight = Tensor(t.wte.weight.data)  # a mirror of rank 0's table, refreshed every step
        self.weights = {id(q) for q in model.parameters()}  # what a split backward defers to W
        self.stats: dict[str, float] = {}

    # ------------------------------------------------------------------------------- messages
    def _tag(self, microbatch: int, stage: int) -> int:
        """Four tags per (microbatch, receiving stage): activations, their clock, gradients, their clock."""
        return 4 * (microbatch * self.n_stages + stage)

    def _send(self, array: Any, dest: int, tag: int, clock: float, label: str) -> list:
        return [self.comm.isend(array, dest, tag, label=label),
                self.comm.isend(np.array([clock]), dest, tag + 1, label="pp_clock")]

    def _recv(self, shape: tuple, source: int, tag: int, name: str) -> tuple[Any, float]:
        with trace.span(f"recv {name}", "comm"):
            array = self.comm.recv(np.empty(shape, self._dtype), source, tag)
            clock = self.comm.recv(np.empty(1), source, tag + 1)
        return to_device(array), float(clock[0])

    @property
    def _dtype(self) -> Any:
        return np.dtype(self.model.config.dtype)

    def _exchange_tied_embedding(self) -> None:
        """Rank 0's current token-embedding table to the last rank's mirror."""
        if not self.tied:
            return
        if self.is_first:
            self.comm.send(self.model.transformer.wte.weight.data, self.n_ranks - 1, _TIED_WEIGHTS_TAG, label="pp_embedding")
        elif self.is_last:
            wte = self.model.transformer.wte
            table = self.comm.recv(np.empty(wte.weight.shape, self._dtype), 0, _TIED_WEIGHTS_TAG)
            wte.weight = Tensor(to_device(table), requires_grad=True)

    # ------------------------------------------------------------------------------- compute
    def _forward(self, chunk: int, inp: Any, targets: Any) -> Tensor:
        """Stage chunk·p + rank on ``inp``: token ids on stage 0, else activations; the loss on the last stage."""
        stage, model = chunk * self.n_ranks + self.rank, self.model
        x = model.embed(to_device(inp)) if stage == 0 else inp
        for block in self.chunks[chunk]:
            x = block(x)
        return model.head(x, to_device(targets))[1] if stage == self.n_stages - 1 else x

    def run(self, engine: Any, x: np.ndarray, y: np.ndarray, m: int, loss_scale: float = 1.0) -> list[Any]:
        """Forward and backward of m microbatches of (x, y); returns their losses as 0-d xp arrays (on the last rank).

        Each chunk's backward passes but its last run under ``engine.no_sync()`` (module docstring). Backward
        starts from loss·loss_scale/m (float16 loss scaling; the losses returned are unscaled)."""
        xs, ys = np.split(x, m), np.split(y, m)
        if self.n_ranks == 1:
            return self._run_single_stage(engine, xs, ys, loss_scale)
        p, last_stage = self.n_ranks, self.n_stages - 1
        shape = (len(xs[0]), len(self.model.positions(x.shape[1])), self.model.config.n_embd)
        prev, nxt = (self.rank - 1) % p, (self.rank + 1) % p
        self._exchange_tied_embedding()
        order = schedule(self.kind, p, self.rank, m, self.v)
        split = any(a.kind == "W" for a in order)
        final = {}  # chunk -> index of the pass that completes its gradients
        for k, a in enumerate(order):
            if a.kind == ("W" if split else "B"):
                final[a.chunk] = k
        cost = costs(self.kind, self.v)
        inputs, outputs, weight_passes, losses, sends = {}, {}, {}, [], []
        clock, peak = 0.0, 0
        for k, (kind, i, chunk) in enumerate(order):
            stage, name = chunk * p + self.rank, f"{i}" + (f".{chunk}" if self.v > 1 else "")
            if kind == "F":
                if stage == 0:
                    inp = xs[i]
                else:
                    data, sent_at = self._recv(shape, prev, self._tag(i, stage), f"act {name}")
                    clock, inp = max(clock, sent_at), Tensor(data, requires_grad=True)
                with trace.span(f"F{name}", "forward"):
                    out = self._forward(chunk, inp, ys[i])
                clock += cost["F"]
                inputs[i, chunk], outputs[i, chunk] = inp, out
                peak = max(peak, len(outputs) + len(weight_passes))
                if stage == last_stage:
                    losses.append(out.data)
                else:
                    sends += self._send(out.data, nxt, self._tag(i, stage + 1), clock, "pp_activations")
                continue
            completes = final[chunk] == k
            if completes and chunk == 0 and self.tied and self.is_first:  # the head's share of the tied embedding
                wte = self.model.transformer.wte.weight
                head_grad = to_device(self.comm.recv(np.empty(wte.shape, self._dtype), p - 1, _TIED_GRAD_TAG))
                wte.grad = head_grad if wte.grad is None else wte.grad + head_grad
            with engine.no_sync() if not completes else contextlib.nullcontext():
                if kind == "W":
                    with trace.span(f"W{name}", "weights"):
                        weight_passes.pop((i, chunk)).run()
                    clock += cost["W"]
                    continue
                grad = None
                if stage < last_stage:
                    grad, sent_at = self._recv(shape, nxt, self._tag(i, stage) + 2, f"grad {name}")
                    clock = max(clock, sent_at)
                with trace.span(f"B{name}", "backward"):
                    out = outputs.pop((i, chunk))
                    deferred = (out * (loss_scale / m) if stage == last_stage else out).backward(
                        None if stage == last_stage else grad, defer=self.weights if split else None)
                if split:
                    weight_passes[i, chunk] = deferred
            clock += cost["B"]
            inp = inputs.pop((i, chunk))
            if stage > 0:
                sends += self._send(inp.grad, prev, self._tag(i, stage - 1) + 2, clock, "pp_gradients")
        if self.tied and self.is_last:
            sends.append(self.comm.isend(self.model.transformer.wte.weight.grad, 0, _TIED_GRAD_TAG, label="pp_embedding"))
        with trace.span("wait sends", "comm"):
            for handle in sends:
                handle.wait()
        makespan = float(self.comm.all_reduce(np.array([clock]), op="max", label="pp_clock")[0])
        busy = m * self.v * sum(cost[kind] for kind in ("FBW" if split else "FB"))
        self.stats = {"peak_microbatches_in_flight": peak, "logical_step_time": makespan,
                      "bubble": 1.0 - busy / makespan, "bubble_formula": bubble_formula(self.kind, p, m, self.v)}
        return losses

    def _run_single_stage(self, engine: Any, xs: list, ys: list, loss_scale: float) -> list[Any]:
        """No pipeline: plain gradient accumulation through the engine (which may be ZeRO-3's hooks)."""
        m, losses = len(xs), []
        for i, (xi, yi) in enumerate(zip(xs, ys)):
            with engine.no_sync() if i < m - 1 else contextlib.nullcontext():
                with trace.span(f"F{i}", "forward"):
                    _, loss = engine(xi, yi)
                with trace.span(f"B{i}", "backward"):
                    (loss * (loss_scale / m)).backward()
            losses.append(loss.data)  # a device scalar: read once per step, by the caller
        self.stats = {"peak_microbatches_in_flight": 1, "bubble": 0.0, "bubble_formula": 0.0}
        return losses

    def forward_only(self, engine: Any, x: np.ndarray, y: np.ndarray) -> float | None:
        """The loss of (x, y) without gradients (evaluation); a float on the last rank, None elsewhere."""
        if self.n_ranks == 1:
            with no_grad():
                return engine(x, y)[1].item()
        self._exchange_tied_embedding()
        shape = (len(x), len(self.model.positions(x.shape[1])), self.model.config.n_embd)
        p, out = self.n_ranks, None
        with no_grad():
            for chunk in range(self.v):
                stage = chunk * p + self.rank
                inp = x if stage == 0 else self._recv(shape, (self.rank - 1) % p, _EVAL_TAG + 2 * stage, "eval")[0]
                out = self._forward(chunk, inp, y)
                if stage < self.n_stages - 1:
                    self.comm.send(out.data, (self.rank + 1) % p, _EVAL_TAG + 2 * (stage + 1), label="pp_activations")
                    self.comm.send(np.array([0.0]), (self.rank + 1) % p, _EVAL_TAG + 2 * (stage + 1) + 1, label="pp_clock")
        return out.item() if self.is_last else None


def stage_state(local: dict[str, np.ndarray], comm: Communicator) -> dict[str, np.ndarray]:
    """Every stage's parameters by name, on every rank of the pipeline group (stages hold disjoint names)."""
    blob = b"".join(encode_safetensors({k: to_host(v) for k, v in local.items()}))
    merged = {}
    for stage_blob in comm.all_gather_bytes(blob, label="checkpoint"):
        merged.update(decode_safetensors(stage_blob)[0])
    return merged
