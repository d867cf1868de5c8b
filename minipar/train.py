"""The training loop behind ``python -m minipar train``.

One step:  for each of m microbatches: forward, loss/m, backward (gradients accumulate)
           → clip the global gradient norm → AdamW with the cosine learning rate.
Rank 0 prints one progress line per step (or one JSON object with ``--json``).

Under ``mpiexec -n dp·cp·tp·pp`` the ranks form a mesh (parallel/mesh.py: tp fastest, then cp, dp, pp).
A tensor-parallel group of tp ranks shares one model, split layer by layer (``--tp``, ``--sp``); cp ranks
split each sequence (``--cp``); pp ranks hold consecutive stages and run a pipeline schedule (``--pp``);
the dp groups each train on their rows of the global batch through DataParallel (``--zero 0``) or
ZeRO stage 1-3, with experts spread over ep of them (``--ep``). The step is the same code in every
layout: pipeline.run(engine, x, y) → engine.sync_gradients() → clip → optimizer.step().

Deep dive, with measurements: docs/running.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import math
import os
import signal
import time
import tracemalloc
from typing import Any

import numpy as np

from minipar import trace
from minipar.backend import set_device, set_kernels, xp
from minipar.checkpoint import Checkpoint, load_checkpoint, prune_checkpoints, save_checkpoint, step_path
from minipar.cli import Progress, check_ranks_agree, choose_layout, validate
from minipar.comm import Communicator, start_watchdog
from minipar.data import Batches, load_tokens, save_tokenizer, shard_rows, split_tokens, tokenizer_for
from minipar import models
from minipar.models.gpt import GPT, GPTConfig
from minipar.optim import AdamW, LossScaler, cosine_lr
from minipar.parallel.compression import make_compressor
from minipar.parallel.context_parallel import context_parallel, context_slice
from minipar.parallel.data_parallel import DataParallel
from minipar.parallel.expert_parallel import (expert_parallel, expert_report, moe_layers)
from minipar.parallel.local_sgd import LocalSGD
from minipar.parallel.layout import Layout
from minipar.parallel.mesh import Mesh
from minipar.parallel.pipeline import Pipeline, stage_state
from minipar.nn import LayerNorm
from minipar.parallel.tensor_parallel import (tensor_parallel)
from minipar.parallel.zero import ZeRO


def build_model(args: argparse.Namespace, cfg: GPTConfig, mesh: Mesh, resumed: Checkpoint | None) -> GPT:
    """The full model on every rank (same seed, HF checkpoint or training checkpoint), then this rank's tp slice."""
    if args.init_from and resumed is None:
        model = models.from_hf(args.init_from, dtype=cfg.dtype)  # in the asked precision: 16 bits under mixed
    else:
        model = models.build_model(cfg, seed=args.seed)
        if resumed is not None:
            model.load_state_dict(resumed.params)
    if mesh.tp > 1:
        model = tensor_parallel(model, mesh.tp_comm, args.sp)
    if mesh.ep > 1:
        model = expert_parallel(model, mesh.ep_comm)
    model.set_recompute(args.recompute)
    return context_parallel(model, mesh.cp_comm, args.cp_kind, args.cp_split) if mesh.cp > 1 else model


def placements(model: GPT) -> dict[str, Any]:
    return {name: p.placement for name, p in model.named_parameters()}


def restore_optimizer(optimizer: Any, model: GPT, mesh: Mesh, resumed: Checkpoint) -> None:
    """Adam's moments from a checkpoint of any layout: this rank's pieces of the full tensors."""
    moments = [resumed.exp_avg, resumed.exp_avg_sq, resumed.params]  # params: the float32 masters of a 16-bit model
    moments = [mesh.local_state(m, placements(model)) for m in moments]
    optimizer.import_state(*moments[:2], {id(p): n for n, p in model.named_parameters()}, resumed.optimizer_step,
                           master=moments[2])


def lr_schedule(args: argparse.Namespace) -> dict[str, float]:
    """What decides the learning rate of every step: a checkpoint keeps it, a resumed run that differs says so."""
    return {"lr": args.lr, "min_lr": args.min_lr, "warmup": args.warmup, "decay_steps": args.decay_steps}


def restore_training_state(resumed: Checkpoint, layout: Layout, world: Communicator, model: GPT, engine: Any,
                           optimizer: Any, scaler: LossScaler | None, local_sgd: LocalSGD | None, progress: Any,
                           schedule: dict[str, float]) -> None:
    """The loss scaler's state, and each rank's own state when the layout is the one it was saved in (a
    compressor's error feedback belongs to its rank's buckets, local SGD's replica to its rank); in another
    layout that starts afresh, said once. A ``schedule`` (this run's learning rates) other than the saved one
    is said too."""
    if scaler and "loss_scale" in resumed.training:
        scaler.load_state(resumed.training)
    saved = {name: resumed.training[name] for name in schedule if name in resumed.training}
    if saved and saved != schedule:
        progress.note(f"{resumed.path} was trained on another learning-rate schedule: "
                      + ", ".join(f"--{n.replace('_', '-')} {saved[n]:g} there, {v:g} here"
                                  for n, v in schedule.items() if saved.get(n) != v)
                      + f" (the rate changes from step {resumed.step + 1})")
    if resumed.rank_files:
        if resumed.layout == layout and len(resumed.rank_files) == world.size:
            own = resumed.rank_state(world.rank)
            engine.load_rank_state(own)
            if local_sgd:
                local_sgd.import_state(own, optimizer, {id(p): n for n, p in model.named_parameters()})
        else:
            progress.note(f"{resumed.path} was saved as {resumed.layout}: the per-rank state (error feedback, local "
                          "SGD's replicas) starts afresh in this layout")


def checkpoint(args: argparse.Namespace, step: int, engine: Any, optimizer: Any, model: GPT, mesh: Mesh,
               layout: Layout, scaler: LossScaler | None, local_sgd: LocalSGD | None, tokenizer: str | None) -> str:
    """Save parameters and AdamW state in this layout (the first replica of each (pp, tp) slice writes them), the
    loss scaler's state, what only each rank holds (a compressor's error feedback; local SGD's replica), and the
    tokenizer files (``tokenizer``'s BPE, or bytes), so that a resumed run, generate and export encode alike."""
    if mesh.world.rank == 0:  # before the manifest: a checkpoint that has one is complete
        os.makedirs(step_path(args.save, step), exist_ok=True)
        save_tokenizer(step_path(args.save, step), model.config.vocab_size, model.config.block_size, tokenizer)
    names = {id(p): n for n, p in model.named_parameters()}
    own = {**engine.rank_state(), **(local_sgd.export_state(optimizer, names) if local_sgd else {})}
    params = {**engine.gathered_state_dict(), **optimizer.master_state(names)}  # a 16-bit model's float32 masters
    state = {"param": params, **optimizer.export_state(names)}
    state = {kind: mesh.whole_state(tensors, placements(model), axes=("ep",))  # whole experts; tp slices as they are
             for kind, tensors in state.items()}
    state = state if mesh.grad_comm.rank == 0 else None
    saved = save_checkpoint(args.save, step, state, mesh, model.config, layout, optimizer.step_count,
                            training={**lr_schedule(args), **(scaler.state() if scaler else {})}, rank_state=own)
    if mesh.world.rank == 0:
        prune_checkpoints(args.save, args.keep_last)
    return saved


def build_engine(model: GPT, mesh: Mesh, args: argparse.Namespace) -> tuple[Any, Any]:
    """(engine, optimizer) over the data-parallel group: DataParallel + AdamW, or ZeRO, which is both; expert
    parameters reduce over their own replicas. With --local-sgd the replicas do not synchronize gradients at
    all (LocalSGD averages them later)."""
    comm, experts = mesh.grad_comm, (mesh.expert_grad_comm if mesh.ep > 1 else None)
    # loss-scaled float16 gradients are reduced in float32: their sum over the ranks can overflow where the one
    # process's gradient (their mean) does not, and the run would skip steps the one process takes
    reduce_dtype = np.float32 if args.reduce_dtype == "float32" or args.precision == "fp16-mixed" else None
    if args.local_sgd:
        alone = comm.split(color=comm.rank, name="local")
        return DataParallel(model, alone), AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    if args.zero:
        engine = ZeRO(model, mesh.shard_comm, args.zero, lr=args.lr, weight_decay=args.weight_decay,
                      bucket_mb=args.bucket_mb, expert_comm=mesh.expert_shard_comm if experts else None,
                      replicas=mesh.shard_replica_comm, prefetch=not args.no_prefetch, reduce_dtype=reduce_dtype,
                      expert_replicas=mesh.expert_shard_replica_comm)
        return engine, engine
    compression = make_compressor(args.compression, args.topk_ratio, args.powersgd_rank)
    return (DataParallel(model, comm, args.bucket_mb, compression=compression, expert_comm=experts,
                         reduce_dtype=reduce_dtype),
            AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay))


def count_layer_norm_bytes(model: GPT) -> dict[str, int]:
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


def context_report(model: GPT, cp_comm: Communicator) -> dict[str, float]:
    """Ring attention's balance across the cp ranks this step: (query, key) pairs scored, max and min over the
    ranks, and the forward's exposed communication (ms, the slowest rank)."""
    work = model.context_work
    gathered = cp_comm.all_gather(np.array([work["pairs"], work["wait_s"]], np.float64), label="cp_report").reshape(-1, 2)
    return {"attention_pairs_max": float(gathered[:, 0].max()), "attention_pairs_min": float(gathered[:, 0].min()),
            "ring_wait_ms": float(gathered[:, 1].max() * 1e3)}


def mean_loss(losses: list[float], mesh: Mesh) -> float:
    """The global mean of per-microbatch losses that live on the last pipeline stage of every replica (each
    dp·cp rank's loss is the mean over as many tokens, so the average of theirs is the mean over all)."""
    local = np.array([np.mean([float(v) for v in losses]) if losses else 0.0])  # the step's one device→host sync
    return float(mesh.grad_comm.all_reduce(mesh.pp_comm.all_reduce(local, label="loss"), op="avg", label="loss")[0])


def evaluate(engine: Any, pipeline: Pipeline, mesh: Mesh, batches: Batches, n_batches: int, split: str) -> float:
    """Mean validation loss over ``n_batches`` fixed batches, each data-parallel group scoring its rows."""
    losses = []
    for i in range(n_batches):
        x, y = (context_slice(shard_rows(a, mesh.dp_rank, mesh.dp), mesh.cp_comm, split) for a in batches(i))
        loss = pipeline.forward_only(engine, x, y)
        if loss is not None:
            losses.append(loss)
    return mean_loss(losses, mesh)


def group_sum(*comms: Communicator):
    """s -> Σ over the ranks of each of ``comms`` in turn (skipping single ranks): a gradient norm's squares
    across the axes that split the parameters (tp, pp, ep)."""
    def total(s: Any) -> Any:
        for comm in comms:
            if comm.size > 1:
                s = comm.all_reduce(xp.asarray(s, dtype=xp.float64).reshape(1), label="grad_norm")[0]
        return s
    return total


def full_state_dict(engine: Any, optimizer: Any, model: GPT, mesh: Mesh) -> dict[str, np.ndarray]:
    """Every parameter whole, on every rank: gathered over the ZeRO shards, the tp slices, the pp stages — a 16-bit
    model's as its float32 masters (the weights the run trained, as PyTorch's mixed precision saves them)."""
    names = {id(p): n for n, p in model.named_parameters()}
    local = {**engine.gathered_state_dict(), **optimizer.master_state(names)}
    return stage_state(mesh.whole_state(local, placements(model), axes=("tp",)), mesh.pp_comm)


class Interrupted(Exception):
    """SIGINT (Ctrl-C) or SIGTERM (a scheduler's preemption) arrived: every rank finished the same step, the job
    checkpointed (with --save) and stops; ``signum`` gives the exit status 128 + signum."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum


class InterruptWatch:
    """SIGINT and SIGTERM set a flag on the rank that gets them (a second one stops at once: KeyboardInterrupt);
    after each step the ranks agree with one 8-byte all-reduce (the larger signal number), so all of them finish
    that step, checkpoint (with --save) and stop together."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, world: Communicator):
        self.world, self.signum = world, 0
        self.previous = {s: signal.signal(s, self._handler) for s in self.SIGNALS}

    def _handler(self, signum: int, frame: Any) -> None:
        if self.signum:
            raise KeyboardInterrupt
        self.signum = signum

    def request(self, signum: int) -> None:
        """Stop at this step's end as if ``signum`` had arrived (SIGPIPE: rank 0's reader went away)."""
        self.signum = self.signum or signum

    def requested(self) -> int:
        """The signal every rank agrees on after this step (0: none)."""
        if self.world.size == 1:
            return self.signum
        return int(self.world.all_reduce(np.array([float(self.signum)]), op="max", label="interrupt")[0])

    def close(self) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)


def step_record(step: int, args: argparse.Namespace, loss: float, norm: float, ms: float, world: Communicator,
                comms: list[Communicator], engine: Any, local_sgd: LocalSGD | None, outer_round: bool,
                state_bytes: dict[str, int], pipeline: Pipeline, mesh: Mesh, lr: float, tokens: int,
                activation_bytes: dict[str, int]) -> dict[str, Any]:
    by_op: dict[str, Any] = {}
    for c in comms:
        for k, v in c.stats.items():
            by_op.setdefault(k, {"bytes": 0, "calls": 0, "algorithm": None})
            by_op[k]["bytes"] += v.bytes
            by_op[k]["calls"] += v.calls
            by_op[k]["algorithm"] = v.algorithm or by_op[k]["algorithm"]
    return {"step": step + 1, "steps": args.steps, "loss": loss, "lr": lr, "grad_norm": norm,
            "tokens": tokens, "tokens_per_s": tokens / (ms / 1e3), "ms": ms, "world": world.size,
            "comm_bytes": sum(by_op.get(k, {"bytes": 0})["bytes"] for k in ("grads", "params")),
            "comm_formula_bytes": (engine.formula_bytes() if not local_sgd else
                                   local_sgd.formula_bytes_per_round() * outer_round) if mesh.grad_comm.size > 1 else 0.0,
            "comm_bytes_by_op": {k: v["bytes"] for k, v in by_op.items()},
            "comm_calls_by_op": {k: v["calls"] for k, v in by_op.items()},
            "comm_algorithm_by_op": {k: v["algorithm"] for k, v in by_op.items() if v["algorithm"]},
            "model_state_bytes": state_bytes, "activation_bytes": dict(activation_bytes),
            "pipeline": pipeline.stats}


def tokenizer_source(args: argparse.Namespace, resumed: Checkpoint | None) -> str | None:
    """The directory whose tokenizer files the run encodes with: a resumed checkpoint's, or --init-from's."""
    return resumed.path if resumed is not None else args.init_from


def load_data(args: argparse.Namespace, cfg: GPTConfig, resumed: Checkpoint | None
              ) -> tuple[np.ndarray, Batches, Batches | None, str | None]:
    """(all tokens, training batches, validation batches or None, a note on rank 0's first lines or None). The
    tokens are bytes, or the BPE ids of the tokenizer a resumed checkpoint or --init-from directory came with."""
    block = cfg.block_size
    tokens = load_tokens(args.data, tokenizer_for(tokenizer_source(args, resumed), cfg.vocab_size))
    source = args.data or "the default corpus"
    train_tokens, val_tokens = split_tokens(tokens)
    if len(train_tokens) < block + 2:
        raise ValueError(f"{source} has {len(tokens)} tokens: its training split (the first 90%, {len(train_tokens)} "
                         f"tokens) needs at least block_size + 2 = {block + 2}; use more data or a smaller --block-size")
    batches = Batches(train_tokens, args.batch_size, block, seed=args.seed)
    if len(val_tokens) < block + 2:
        note = (f"note: the validation split of {source} (the last 10%, {len(val_tokens)} tokens) is shorter than "
                f"block_size + 2 = {block + 2}: no validation loss") if args.eval_interval else None
        return tokens, batches, None, note
    return tokens, batches, Batches(val_tokens, args.batch_size, block, seed=args.seed + 1), None


def train(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Run the training job described by ``args`` on every rank; returns the per-step records.

    Stops with an error (the same on every rank) when a step's loss or gradient norm is not finite —
    before anything of that step is saved — and raises :class:`Interrupted` at the end of a step on SIGINT or
    SIGTERM, after checkpointing with --save.
    """
    world = Communicator()
    check_ranks_agree(world, "arguments", {k: v for k, v in vars(args).items() if k != "explicit"})
    start_watchdog(args.comm_timeout)
    if args.auto:
        choose_layout(args, world)
    args.recompute = args.recompute or "none"
    resumed = load_checkpoint(args.resume) if args.resume else None
    set_device(args.device)
    cfg, layout = validate(args, world.size, resumed)
    set_kernels(args.kernels)
    block = cfg.block_size
    tokens, batches, val_batches, data_note = load_data(args, cfg, resumed)
    tokenizer_dir = tokenizer_source(args, resumed)
    check_ranks_agree(world, "data", {"data": f"{args.data or 'the embedded corpus'} (sha256 "
                                              f"{hashlib.sha256(np.ascontiguousarray(tokens).tobytes()).hexdigest()[:12]})"})
    if args.peak_memory:  # after the corpus is loaded, before the model is built: the peak includes the model state
        tracemalloc.start()
    mesh = layout.mesh(world)
    comms = list(dict.fromkeys([world, mesh.dp_comm, mesh.cp_comm, mesh.tp_comm, mesh.pp_comm, mesh.grad_comm,
                                mesh.ep_comm, mesh.expert_grad_comm, mesh.shard_comm,
                                *([mesh.shard_replica_comm] if mesh.shard_replica_comm else [])]))
    model = build_model(args, cfg, mesh, resumed)
    pipeline = Pipeline(model, mesh.pp_comm, layout.pipeline_schedule())
    engine, optimizer = build_engine(model, mesh, args)
    local_sgd = LocalSGD(model, mesh.dp_comm, args.local_sgd, args.outer_lr, args.outer_momentum,
                         staleness=args.staleness, masters=optimizer.master) if args.local_sgd else None
    if resumed is not None:
        restore_optimizer(optimizer, model, mesh, resumed)
    split_sum = group_sum(mesh.tp_comm, mesh.pp_comm, mesh.ep_comm)
    scaler = LossScaler(args.loss_scale) if args.precision == "fp16-mixed" else None
    # a non-finite value is the loop's to report: the fp16 scaler skips an overflowed step, and a diverged loss or
    # gradient norm stops the run with one line — numpy's RuntimeWarnings would only print ahead of it
    np.seterr(over="ignore", invalid="ignore", divide="ignore")
    lead, first_step = world.rank == 0, resumed.step if resumed else 0
    progress = Progress(args, lead, first_step)
    norm_bytes = count_layer_norm_bytes(model)
    experts = f" E={cfg.n_expert} top-{cfg.expert_top_k}" if cfg.n_expert else ""
    progress.say(f"minipar: {cfg.display_name} {cfg.num_parameters():,} params (L={cfg.n_layer} H={cfg.n_head} C={cfg.n_embd} "
                 f"T={block}{experts}), {len(tokens):,} tokens, batch {args.batch_size}×{block}, "
                 f"{args.dtype if args.precision == 'fp32' else args.precision} on {args.device}, {layout}")
    if resumed is not None:
        for skipped in resumed.skipped:
            progress.note(f"skipped damaged checkpoint {skipped}")
        progress.note(f"resumed from {resumed.path} (step {resumed.step}, saved as {resumed.layout})")
        restore_training_state(resumed, layout, world, model, engine, optimizer, scaler, local_sgd, progress,
                               lr_schedule(args))
    if data_note:
        progress.note(data_note)

    interrupt = InterruptWatch(world)
    if args.trace:
        trace.start(world)
    records, step, finished = [], first_step, False
    try:
        for step in range(first_step, args.steps):
            t0 = time.perf_counter()
            if args.peak_memory:
                tracemalloc.reset_peak()
            for c in comms:
                c.reset_stats()
            norm_bytes["layer_norm"] = 0
            if mesh.cp > 1:
                model.context_work.update(pairs=0, wait_s=0.0)
            for layer in moe_layers(model):
                layer.reset_tally()
            x, y = (context_slice(shard_rows(a, mesh.dp_rank, mesh.dp), mesh.cp_comm, args.cp_split) for a in batches(step))
            loss_scale = scaler.scale if scaler else 1.0
            engine.loss_scale = loss_scale  # the factor the gradients carry (a compressor's error feedback)
            losses = pipeline.run(engine, x, y, loss_scale=loss_scale)
            with trace.span("sync gradients", "comm"):
                engine.sync_gradients()
            with trace.span("optimizer", "optimizer"):
                optimizer.grad_scale = 1.0 / scaler.scale if scaler else 1.0
                norm = optimizer.clip_grad_norm(args.grad_clip, split_sum)  # of the unscaled gradients
                optimizer.lr = cosine_lr(step, max_lr=args.lr, warmup_steps=args.warmup, total_steps=args.decay_steps,
                                         min_lr=args.min_lr)
                overflow = scaler is not None and not math.isfinite(float(norm))
                if scaler:
                    scale = scaler.scale
                    scaler.update(finite=not overflow)
                if not overflow:  # an fp16 step whose gradients overflowed is skipped, the scale backs off
                    optimizer.step()
            outer_round = local_sgd.step() if local_sgd else False
            state_bytes = engine.model_state_bytes(optimizer)
            optimizer.zero_grad()
            loss = mean_loss(losses, mesh)
            record = step_record(step, args, loss, float(norm), (time.perf_counter() - t0) * 1e3, world, comms, engine,
                                 local_sgd, outer_round, state_bytes, pipeline, mesh, optimizer.lr,
                                 args.batch_size * block, norm_bytes)
            if mesh.cp > 1 and args.cp_kind == "ring":
                record["context"] = context_report(model, mesh.cp_comm)
            if cfg.n_expert:
                record["experts"] = expert_report(model, mesh.grad_comm, mesh.pp_comm)
            if scaler:
                record["loss_scale"], record["skipped"] = scale, overflow
            if args.peak_memory:
                peaks = world.all_gather(np.array([tracemalloc.get_traced_memory()[1]], np.int64), label="peak")
                record["peak_bytes"] = {"rank0": int(peaks[0]), "max": int(peaks.max())}
            records.append(record)
            progress.step(record)
            if not (math.isfinite(record["loss"]) and (math.isfinite(record["grad_norm"]) or record.get("skipped"))):
                raise RuntimeError(f"step {step + 1}: the loss ({record['loss']}) or gradient norm "
                                   f"({record['grad_norm']}) is not finite — training diverged; nothing of this step "
                                   "was saved (try a lower --lr, a longer --warmup or --grad-clip)")
            last = step + 1 == args.steps
            if val_batches and args.eval_interval and ((step + 1) % args.eval_interval == 0 or last):
                val_loss = evaluate(engine, pipeline, mesh, val_batches, args.eval_batches, args.cp_split)
                val = {"step": step + 1, "val_loss": val_loss}
                records.append(val)
                progress.evaluation(val)
            if progress.stdout_closed:
                interrupt.request(signal.SIGPIPE)
            stop = interrupt.requested()
            if args.save and (stop or last or (args.save_interval and (step + 1) % args.save_interval == 0)):
                saved = checkpoint(args, step + 1, engine, optimizer, model, mesh, layout, scaler, local_sgd,
                                   tokenizer_dir)
                progress.say(f"checkpoint {saved}")
                if last or stop:
                    progress.written.append(f"checkpoint: {saved} (resume with --resume {args.save})")
            if stop:
                saved_to = f"; checkpoint saved to {saved} (resume with --resume {args.save})" if args.save else ""
                progress.note(f"interrupted at step {step + 1} ({signal.Signals(stop).name}){saved_to}")
                world.barrier()  # no rank exits before rank 0 has said so: mpiexec kills the rest at the first exit
                raise Interrupted(stop, f"interrupted at step {step + 1}")
        if local_sgd:
            local_sgd.finish()  # the outstanding rounds: every replica ends equal
        if args.trace:
            trace.write(args.trace, world)
            progress.written.append(f"timeline: {args.trace} (ui.perfetto.dev, or python -m minipar trace-plot "
                                    f"{args.trace})")
        if args.out:
            state = full_state_dict(engine, optimizer, model, mesh)
            if lead:  # the config says the dtype the weights are in (float32 masters under mixed precision)
                models.build_model(dataclasses.replace(cfg, dtype=str(next(iter(state.values())).dtype))).save_hf(
                    args.out, state, tokenizer=tokenizer_dir)
            progress.written.append(f"model: {args.out}/ (Hugging Face {cfg.display_name}; python -m minipar generate --ckpt "
                                    f"{args.out})")
        finished = True
    finally:
        interrupt.close()
        if args.peak_memory:
            tracemalloc.stop()
        progress.close(step + 1 if records else first_step, finished)
    return records
