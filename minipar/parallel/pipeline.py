"""Pipeline parallelism: the transformer's blocks split into pp consecutive stages, one per rank;
a batch is cut into m microbatches that flow through the stages like a pipeline.

    stage 0: wte, wpe, blocks[0:k]      stage s: blocks[...]      stage p−1: blocks[...], ln_f, head + loss

Forward, stage s receives microbatch i's activations (b, T, C) from s − 1 and sends its output
to s + 1; backward runs the other way with the gradients of those activations. Messages are
point-to-point (``isend`` so a stage never blocks on its own sends; blocking ``recv``), each tagged
by microbatch, b·T·C·itemsize bytes per hop.

Schedules (for stage s of p, m microbatches; generated, with interleaved 1F1B and ZB-H1, and verified
by the simulator in schedules.py):

    GPipe   F0 F1 … F(m−1)  B0 B1 … B(m−1)                 keeps m microbatches' activations
    1F1B    p−s−1 warm-up forwards, then alternate F, B, then the remaining B's
                                                            keeps at most p − s ≤ p microbatches'

Both take (m + p − 1)·(t_F + t_B) for m·(t_F + t_B) of work per stage, so the idle "bubble" is
(p − 1)/(m + p − 1) of the step. ``Pipeline.stats`` measures it on a logical clock — every
forward costs 1, every backward 2, and each message carries its sender's clock, so a stage starts
an operation at max(its own clock, the clock of the data it waits for) — which is the schedule's
own bubble, free of this machine's noise; ``--trace`` shows the wall-clock one.

Tied embeddings. The head of the last stage reuses the first stage's token embedding. The last
stage keeps a mirror (not a parameter): at the start of each step the first stage sends it the
table, and after its final backward the last stage sends the table's gradient back, which the
first stage adds in before its own final backward — so the first stage's ``wte.grad`` is
the single-process gradient (embedding + head) when data parallelism reduces it.
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
from minipar.parallel.schedules import bubble_formula, schedule
from minipar.safetensors_io import decode_safetensors, encode_safetensors

SCHEDULES = ("1f1b", "gpipe")  # what this engine runs; schedules.py also generates interleaved and zb-h1
_TIED_WEIGHTS_TAG, _TIED_GRAD_TAG, _EVAL_TAG = 60000, 60001, 60002
_FORWARD_COST, _BACKWARD_COST = 1.0, 2.0


def stage_blocks(n_layer: int, n_stages: int, stage: int) -> range:
    """The blocks of ``stage``: a balanced contiguous split (``numpy.array_split``)."""
    if n_layer < n_stages:
        raise ValueError(f"--pp {n_stages} needs at least {n_stages} transformer layers (n_layer={n_layer})")
    base, extra = divmod(n_layer, n_stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


class Pipeline:
    """This rank's stage of ``model`` (pruned in place) and the schedule that runs a step's microbatches."""

    def __init__(self, model: GPT, comm: Communicator, kind: str = "1f1b"):
        if kind not in SCHEDULES:
            raise ValueError(f"unknown pipeline schedule {kind!r}: this engine runs {SCHEDULES}")
        self.model, self.comm, self.kind = model, comm, kind
        self.stage, self.n_stages = comm.rank, comm.size
        self.is_first, self.is_last = self.stage == 0, self.stage == self.n_stages - 1
        cfg, t = model.config, model.transformer
        blocks = stage_blocks(cfg.n_layer, self.n_stages, self.stage)
        t.h = ModuleList([t.h[i] for i in blocks], start=blocks.start)
        if not self.is_first:
            del t.wpe
        if not self.is_last:
            del t.ln_f
        if not (self.is_first or self.is_last):
            del t.wte
        self.tied = self.n_stages > 1
        if self.tied and self.is_last:
            t.wte.weight = Tensor(t.wte.weight.data)  # a mirror of stage 0's table, refreshed every step
        self.stats: dict[str, float] = {}

    # ------------------------------------------------------------------------------- messages
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
        """Stage 0's current token-embedding table to the last stage's mirror."""
        if not self.tied:
            return
        if self.is_first:
            self.comm.send(self.model.transformer.wte.weight.data, self.n_stages - 1, _TIED_WEIGHTS_TAG, label="pp_embedding")
        elif self.is_last:
            wte = self.model.transformer.wte
            table = self.comm.recv(np.empty(wte.weight.shape, self._dtype), 0, _TIED_WEIGHTS_TAG)
            wte.weight = Tensor(to_device(table), requires_grad=True)

    # ------------------------------------------------------------------------------- compute
    def _forward(self, inp: Any, targets: Any) -> Tensor:
        model = self.model
        x = model.embed(to_device(inp)) if self.is_first else inp
        for block in model.transformer.h:
            x = block(x)
        return model.head(x, to_device(targets))[1] if self.is_last else x

    def run(self, engine: Any, x: np.ndarray, y: np.ndarray, m: int) -> list[Any]:
        """Forward and backward of m microbatches of (x, y); returns their losses as 0-d xp arrays (on the last stage).

        Every backward but the last runs under ``engine.no_sync()``, so data parallelism
        communicates once, during the final one.
        """
        xs, ys = np.split(x, m), np.split(y, m)
        if self.n_stages == 1:
            return self._run_single_stage(engine, xs, ys)
        shape = (len(xs[0]), len(self.model.positions(x.shape[1])), self.model.config.n_embd)
        prev, nxt = self.stage - 1, self.stage + 1
        self._exchange_tied_embedding()
        inputs, outputs, losses, sends = {}, {}, [], []
        clock, peak = 0.0, 0
        for kind, i, _ in schedule(self.kind, self.n_stages, self.stage, m):
            final = kind == "B" and i == m - 1
            if kind == "F":
                if self.is_first:
                    inp = xs[i]
                else:
                    data, sent_at = self._recv(shape, prev, 4 * i, f"act {i}")
                    clock, inp = max(clock, sent_at), Tensor(data, requires_grad=True)
                with trace.span(f"F{i}", "forward"):
                    out = self._forward(inp, ys[i])
                clock += _FORWARD_COST
                inputs[i], outputs[i] = inp, out
                peak = max(peak, len(outputs))
                if self.is_last:
                    losses.append(out.data)
                else:
                    sends += self._send(out.data, nxt, 4 * i, clock, "pp_activations")
                continue
            grad = None
            if not self.is_last:
                grad, sent_at = self._recv(shape, nxt, 4 * i + 2, f"grad {i}")
                clock = max(clock, sent_at)
            if final and self.tied and self.is_first:  # the head's share of the tied embedding's gradient
                wte = self.model.transformer.wte.weight
                head_grad = to_device(self.comm.recv(np.empty(wte.shape, self._dtype), self.n_stages - 1, _TIED_GRAD_TAG))
                wte.grad = head_grad if wte.grad is None else wte.grad + head_grad
            with engine.no_sync() if not final else contextlib.nullcontext(), trace.span(f"B{i}", "backward"):
                out = outputs.pop(i)
                if self.is_last:
                    (out * (1.0 / m)).backward()
                else:
                    out.backward(grad)
            clock += _BACKWARD_COST
            inp = inputs.pop(i)
            if not self.is_first:
                sends += self._send(inp.grad, prev, 4 * i + 2, clock, "pp_gradients")
            if final and self.tied and self.is_last:
                sends.append(self.comm.isend(self.model.transformer.wte.weight.grad, 0, _TIED_GRAD_TAG, label="pp_embedding"))
        with trace.span("wait sends", "comm"):
            for handle in sends:
                handle.wait()
        makespan = float(self.comm.all_reduce(np.array([clock]), op="max", label="pp_clock")[0])
        busy = m * (_FORWARD_COST + _BACKWARD_COST)
        self.stats = {"peak_microbatches_in_flight": peak, "logical_step_time": makespan,
                      "bubble": 1.0 - busy / makespan, "bubble_formula": bubble_formula(self.kind, self.n_stages, m)}
        return losses

    def _run_single_stage(self, engine: Any, xs: list, ys: list) -> list[Any]:
        """No pipeline: plain gradient accumulation through the engine (which may be ZeRO-3's hooks)."""
        m, losses = len(xs), []
        for i, (xi, yi) in enumerate(zip(xs, ys)):
            with engine.no_sync() if i < m - 1 else contextlib.nullcontext():
                with trace.span(f"F{i}", "forward"):
                    _, loss = engine(xi, yi)
                with trace.span(f"B{i}", "backward"):
                    (loss * (1.0 / m)).backward()
            losses.append(loss.data)  # a device scalar: read once per step, by the caller
        self.stats = {"peak_microbatches_in_flight": 1, "bubble": 0.0, "bubble_formula": 0.0}
        return losses

    def forward_only(self, engine: Any, x: np.ndarray, y: np.ndarray) -> float | None:
        """The loss of (x, y) without gradients (evaluation); a float on the last stage, None elsewhere."""
        if self.n_stages == 1:
            with no_grad():
                return engine(x, y)[1].item()
        self._exchange_tied_embedding()
        shape = (len(x), len(self.model.positions(x.shape[1])), self.model.config.n_embd)
        with no_grad():
            inp = x if self.is_first else self._recv(shape, self.stage - 1, _EVAL_TAG, "eval")[0]
            out = self._forward(inp, y)
            if not self.is_last:
                self.comm.send(out.data, self.stage + 1, _EVAL_TAG, label="pp_activations")
                self.comm.send(np.array([0.0]), self.stage + 1, _EVAL_TAG + 1, label="pp_clock")
                return None
        return out.item()


def stage_state(local: dict[str, np.ndarray], comm: Communicator) -> dict[str, np.ndarray]:
    """Every stage's parameters by name, on every rank of the pipeline group (stages hold disjoint names)."""
    blob = b"".join(encode_safetensors({k: to_host(v) for k, v in local.items()}))
    merged = {}
    for stage_blob in comm.all_gather_bytes(blob, label="checkpoint"):
        merged.update(decode_safetensors(stage_blob)[0])
    return merged
