"""The training loop behind ``python -m minipar train``.

One step:  for each of m microbatches: forward, loss·(its tokens / the global batch's), backward (gradients
           accumulate; the data-parallel reduction sums them)
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

from minipar import models, trace
from minipar.backend import set_device, set_kernels
from minipar.checkpoint import (LOCAL_KEEP, Checkpoint, CheckpointWriter, checkpoint, load_checkpoint, lr_schedule,
                                placements, restore_optimizer, restore_training_state)
from minipar.cli import (InterruptWatch, Interrupted, Progress, check_ranks_agree, choose_layout, load_data, step_record,
                         tokenizer_source, validate)
from minipar.comm import Communicator, start_watchdog
from minipar.data import Batches
from minipar.launch import announce_rank
from minipar.models.gpt import GPT, GPTConfig
from minipar.nn import count_layer_norm_bytes
from minipar.optim import cosine_lr, group_sum
from minipar.parallel.layout import Layout
from minipar.parallel.mesh import Mesh
from minipar.parallel.pipeline import Pipeline, stage_state


def build_model(args: argparse.Namespace, cfg: GPTConfig, resumed: Checkpoint | None) -> GPT:
    """The full model, the same on every rank: from a Hugging Face directory, a training checkpoint, or the seed."""
    if args.init_from and resumed is None:
        return models.from_hf(args.init_from, dtype=cfg.dtype)  # in the asked precision: 16 bits under mixed
    model = models.build_model(cfg, seed=args.seed)
    if resumed is not None:
        model.load_state_dict(resumed.params)
    return model


def mean_loss(losses: list[float], mesh: Mesh) -> float:
    """The global mean of per-microbatch losses that live on the last pipeline stage of every replica (each
    dp·cp rank's loss is the mean over as many tokens, so the average of theirs is the mean over all)."""
    local = np.array([np.mean([float(v) for v in losses]) if losses else 0.0])  # the step's one device→host sync
    return float(mesh.grad_comm.all_reduce(mesh.pp_comm.all_reduce(local, label="loss"), op="avg", label="loss")[0])


def evaluate(engine: Any, pipeline: Pipeline, mesh: Mesh, layout: Layout, batches: Batches, n_batches: int) -> float:
    """Mean validation loss over ``n_batches`` fixed batches, each data-parallel group scoring its rows."""
    losses = []
    for i in range(n_batches):
        x, y = (layout.local_rows(a, mesh) for a in batches(i))
        loss = pipeline.forward_only(engine, x, y)
        if loss is not None:
            losses.append(loss)
    return mean_loss(losses, mesh)


def full_state_dict(engine: Any, optimizer: Any, model: GPT, mesh: Mesh) -> dict[str, np.ndarray]:
    """Every parameter whole, on every rank: gathered over the ZeRO shards, the tp slices, the pp stages — a 16-bit
    model's as its float32 masters (the weights the run trained, as PyTorch's mixed precision saves them)."""
    names = {id(p): n for n, p in model.named_parameters()}
    local = {**engine.gathered_state_dict(), **optimizer.master_state(names), **model.buffer_state()}
    return stage_state(mesh.whole_state(local, placements(model), axes=("tp",)), mesh.pp_comm)


def train(args: argparse.Namespace, quiet: bool = False) -> list[dict[str, Any]]:
    """Run the training job described by ``args`` on every rank; returns the per-step records.

    Stops with an error (the same on every rank) when a step's loss or gradient norm is not finite —
    before anything of that step is saved — and raises :class:`Interrupted` at the end of a step on SIGINT or
    SIGTERM, after checkpointing with --save. ``quiet``: print nothing (a trial of ``--auto --check``).
    """
    world = Communicator()
    announce_rank(world.rank)
    check_ranks_agree(world, "arguments", {k: v for k, v in vars(args).items() if k != "explicit"})
    start_watchdog(args.comm_timeout)
    if args.auto:
        choose_layout(args, world, trial=lambda trial_args: train(trial_args, quiet=True))
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
    comms = mesh.communicators()
    model = layout.parallelize(build_model(args, cfg, resumed), mesh)
    pipeline = Pipeline(model, mesh.pp_comm, layout.pipeline_schedule())
    engine, optimizer, local_sgd = layout.engine(model, mesh, args.lr, args.weight_decay, args.bucket_mb)
    if resumed is not None:
        restore_optimizer(optimizer, model, mesh, resumed)
    split_sum = group_sum(mesh.tp_comm, mesh.pp_comm, mesh.ep_comm)
    scaler = layout.loss_scaler(args.loss_scale)
    # a non-finite value is the loop's to report: the fp16 scaler skips an overflowed step, and a diverged loss or
    # gradient norm stops the run with one line — numpy's RuntimeWarnings would only print ahead of it
    np.seterr(over="ignore", invalid="ignore", divide="ignore")
    lead, first_step = world.rank == 0, resumed.step if resumed else 0
    progress = Progress(args, lead and not quiet, first_step)
    norm_bytes = count_layer_norm_bytes(model)
    experts = f" E={cfg.n_expert} top-{cfg.expert_top_k}" if cfg.n_expert else ""
    progress.say(f"minipar: {cfg.display_name} {cfg.num_parameters():,} params (L={cfg.n_layer} H={cfg.n_head} C={cfg.n_embd} "
                 f"T={block}{experts}), {len(tokens):,} tokens, batch {args.batch_size}×{block}, "
                 f"{args.dtype if layout.precision == 'fp32' else layout.precision}"
                 f"{f' {layout.fp8_recipe}' if layout.precision == 'fp8' else ''} on {args.device}, {layout}")
    if resumed is not None:
        for skipped in resumed.skipped:
            progress.note(f"skipped damaged checkpoint {skipped}")
        progress.note(f"resumed from {resumed.path} (step {resumed.step}, saved as {resumed.layout})")
        restore_training_state(resumed, layout, world, model, engine, optimizer, scaler, local_sgd, progress,
                               lr_schedule(args))
    if data_note:
        progress.note(data_note)

    interrupt = InterruptWatch(world)
    writer = CheckpointWriter(background=not args.sync_save)
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
            layout.reset_reports(model)
            x, y = (layout.local_rows(a, mesh) for a in batches(step))
            loss_scale = scaler.scale if scaler else 1.0
            engine.loss_scale = loss_scale  # the factor the gradients carry (a compressor's error feedback)
            losses = pipeline.run(engine, x, y, loss_scale=loss_scale, tokens=layout.loss_tokens(args.batch_size * block))
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
                    layout.update_router_bias(model, mesh)
            outer_round = local_sgd.step() if local_sgd else False
            state_bytes = engine.model_state_bytes(optimizer)
            optimizer.zero_grad()
            loss = mean_loss(losses, mesh)
            record = step_record(step, args, loss, float(norm), (time.perf_counter() - t0) * 1e3, world, comms, engine,
                                 local_sgd, outer_round, state_bytes, pipeline, mesh, optimizer.lr,
                                 args.batch_size * block, norm_bytes)
            record.update(layout.reports(model, mesh))
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
                val_loss = evaluate(engine, pipeline, mesh, layout, val_batches, args.eval_batches)
                val = {"step": step + 1, "val_loss": val_loss}
                records.append(val)
                progress.evaluation(val)
            if progress.stdout_closed:
                interrupt.request(signal.SIGPIPE)
            stop = interrupt.requested()
            durable = args.save and (stop or last or (args.save_interval and (step + 1) % args.save_interval == 0))
            local = args.local_save and ((args.local_save_interval and (step + 1) % args.local_save_interval == 0)
                                         or (stop and not args.save))
            if durable or local:  # the step waits for the copy; the writer thread writes (one save at a time)
                saved = checkpoint(args, args.save if durable else args.local_save, step + 1, engine, optimizer, model,
                                   mesh, layout, scaler, local_sgd, tokenizer_dir, writer,
                                   args.keep_last if durable else LOCAL_KEEP)
                progress.say(f"checkpoint {saved}")
                if last or stop:
                    writer.wait()
                    progress.written.append(f"checkpoint: {saved} (resume with --resume {os.path.dirname(saved)})")
            if stop:
                saved_to = (f"; checkpoint saved to {saved} (resume with --resume {os.path.dirname(saved)})"
                            if durable or local else "")
                progress.note(f"interrupted at step {step + 1} ({signal.Signals(stop).name}){saved_to}")
                world.barrier()  # no rank exits before rank 0 has said so: mpiexec kills the rest at the first exit
                raise Interrupted(stop, f"interrupted at step {step + 1}")
        writer.wait()  # a save in flight completes (or raises its error) before the run ends
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
        writer.wait(raise_error=finished)  # on an error, the save in flight still completes; the error is the run's
        interrupt.close()
        if args.peak_memory:
            tracemalloc.stop()
        progress.close(step + 1 if records else first_step, finished)
    return records
