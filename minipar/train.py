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
import json
import math
import os
import signal
import sys
import tempfile
import time
import tracemalloc
from typing import Any

import numpy as np

from minipar import trace
from minipar.backend import KERNEL_MODES, memory_available, set_device, set_kernels, xp
from minipar.checkpoint import Checkpoint, load_checkpoint, prune_checkpoints, save_checkpoint
from minipar.comm import Communicator, start_watchdog
from minipar.data import Batches, load_tokens, shard_rows, split_tokens
from minipar.models.gpt import GPT, RECOMPUTE, GPTConfig, hf_config
from minipar.optim import AdamW, LossScaler, cosine_lr
from minipar.parallel.compression import COMPRESSIONS, make_compressor
from minipar.parallel.context_parallel import KINDS as CP_KINDS
from minipar.parallel.context_parallel import SPLITS as CP_SPLITS
from minipar.parallel.context_parallel import context_parallel, context_slice
from minipar.parallel.data_parallel import DataParallel
from minipar.parallel.expert_parallel import (expert_names, expert_parallel, expert_report, gather_expert_state,
                                              moe_layers, shard_expert_state)
from minipar.parallel.local_sgd import LocalSGD
from minipar.parallel import planner
from minipar.parallel.layout import Layout
from minipar.parallel.mesh import Mesh
from minipar.parallel.pipeline import Pipeline, stage_state
from minipar.parallel.schedules import SCHEDULES
from minipar.nn import LayerNorm
from minipar.parallel.tensor_parallel import (SequenceParallelLayerNorm, gather_tensor_parallel_state,
                                              shard_state_dict, tensor_parallel)
from minipar.parallel.zero import ZeRO


class HelpWithDefaults(argparse.HelpFormatter):
    """``--help`` shows each option's default (except unset options and switches)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        unset = action.default is None or action.default is False or action.default == argparse.SUPPRESS
        if action.option_strings and not unset and "%(default)" not in text:
            text += " (default: %(default)s)"
        return text


def add_arguments(p: argparse.ArgumentParser) -> None:
    model = p.add_argument_group("model")
    model.add_argument("--n-layer", type=int, default=4, help="transformer blocks")
    model.add_argument("--n-head", type=int, default=4, help="attention heads")
    model.add_argument("--n-embd", type=int, default=128, help="model width C")
    model.add_argument("--block-size", type=int, default=128, help="context length T")
    model.add_argument("--init-from", metavar="DIR", help="start from a Hugging Face GPT-2 checkpoint directory")
    model.add_argument("--n-expert", type=int, default=0,
                       help="mixture of experts: every MLP becomes this many experts behind a router (0: dense GPT-2)")
    model.add_argument("--expert-top-k", type=int, default=2, help="experts per token (1: Switch gate, >1: renormalized)")
    model.add_argument("--capacity-factor", type=float, default=1.25,
                       help="each expert takes at most ⌈factor·k·tokens/E⌉ tokens per rank and microbatch; the rest drop")
    model.add_argument("--aux-loss-coef", type=float, default=0.01, help="weight of the load-balancing loss")

    run = p.add_argument_group("optimization")
    run.add_argument("--steps", type=int, default=300, help="optimizer steps")
    run.add_argument("--batch-size", type=int, default=16, help="global batch, in sequences")
    run.add_argument("--microbatches", type=int, default=1, help="gradient-accumulation steps per optimizer step")
    run.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    run.add_argument("--min-lr", type=float, help="learning rate at the end of the cosine decay (default: --lr/10)")
    run.add_argument("--warmup", type=int, default=30, help="linear warm-up steps")
    run.add_argument("--weight-decay", type=float, default=0.1, help="AdamW decoupled weight decay (matrices only)")
    run.add_argument("--grad-clip", type=float, default=1.0, help="max global gradient norm (0: off)")
    run.add_argument("--dtype", choices=["float32", "float64"], default="float32", help="parameters and activations")
    run.add_argument("--precision", choices=list(PRECISIONS), default="fp32",
                     help="bf16-mixed / fp16-mixed: 16-bit parameters, activations, gradients and messages, float32 "
                          "master weights and Adam moments (fp16 with dynamic loss scaling); fp32: --dtype throughout")
    run.add_argument("--loss-scale", type=float, default=2.0**16, help="fp16-mixed: the initial dynamic loss scale")
    run.add_argument("--reduce-dtype", choices=["auto", "float32"], default="auto",
                     help="data-parallel gradient reduction: auto = in the parameters' dtype (bfloat16 under "
                          "bf16-mixed), but float32 under fp16-mixed (loss-scaled gradients would overflow when "
                          "summed); float32 = upcast first (twice the bytes, no 16-bit rounding in the sum)")
    run.add_argument("--recompute", choices=list(RECOMPUTE), default=None,
                     help="activation recomputation: selective = attention probabilities, full = whole blocks "
                          "(default: none; with --auto, the planner's choice)")
    run.add_argument("--seed", type=int, default=0, help="initialization and data order")

    io = p.add_argument_group("data and output")
    io.add_argument("--data", metavar="PATH", help="any text file (default: this Python's standard-library source)")
    io.add_argument("--device", choices=["cpu", "gpu"], default="cpu", help="numpy or cupy arrays")
    io.add_argument("--kernels", choices=list(KERNEL_MODES), default="auto",
                    help="Triton kernels for matmul/attention: auto = on the GPU only")
    io.add_argument("--eval-interval", type=int, default=100, help="validation loss every N steps (0: never)")
    io.add_argument("--eval-batches", type=int, default=4, help="batches per validation loss")
    io.add_argument("--out", metavar="DIR", help="save the final model here (Hugging Face format)")
    io.add_argument("--save", metavar="DIR", help="write sharded training checkpoints (parameters + AdamW) here")
    io.add_argument("--save-interval", type=int, default=0, help="checkpoint every N steps (0: only at the end)")
    io.add_argument("--keep-last", type=int, default=0, metavar="N",
                    help="keep only the newest N checkpoints under --save (0: keep all)")
    io.add_argument("--resume", metavar="DIR", help="continue from a --save checkpoint (any parallel layout)")
    io.add_argument("--json", action="store_true", help="one JSON object per step instead of a text line")
    io.add_argument("--log-interval", type=int, default=1, metavar="N", help="print progress every N steps")
    io.add_argument("--log-file", metavar="RUN.jsonl", help="also write every step's JSON record to this file")
    io.add_argument("--comm-timeout", type=float, default=600.0, metavar="SECONDS",
                    help="abort the job when a rank waits longer than this for another in any collective or message "
                         "(a stopped, deadlocked or diverged rank), naming both; 0: wait forever (default: 600, as "
                         "NCCL's watchdog)")
    io.add_argument("--peak-memory", action="store_true",
                    help="trace host allocations (tracemalloc; slower) and report each step's peak bytes per rank")

    par = p.add_argument_group("parallelism")
    par.add_argument("--dp", type=int, help="data-parallel degree (default: world size / (tp·pp))")
    par.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    par.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree")
    par.add_argument("--ep", type=int, default=1,
                     help="expert-parallel degree: the experts split over this many data-parallel ranks (divides --dp)")
    par.add_argument("--cp", type=int, default=1, help="context-parallel degree: each sequence split over this many ranks")
    par.add_argument("--cp-kind", choices=list(CP_KINDS), default="ring",
                     help="context parallelism: ring attention (K/V blocks around the ring) or DeepSpeed-Ulysses")
    par.add_argument("--cp-split", choices=list(CP_SPLITS),
                     help="how a sequence is cut over the cp ranks (default: zigzag for ring, contiguous for ulysses)")
    par.add_argument("--sp", action="store_true",
                     help="sequence parallelism (Megatron-SP): layer norms and residuals on T/tp shards (with --tp)")
    par.add_argument("--schedule", choices=list(SCHEDULES), default="1f1b",
                     help="pipeline schedule (with --pp); interleaved needs --virtual-stages, zb-h1 splits backward, "
                          "dualpipev folds the stages into a V (2 per rank, >= 2·pp microbatches)")
    par.add_argument("--virtual-stages", type=int, default=1, metavar="V",
                     help="model chunks per pipeline rank (--schedule interleaved): rank r holds chunks r, r+pp, …")
    par.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=0, help="ZeRO stage (with --dp)")
    par.add_argument("--shard-group", type=int, metavar="K",
                     help="hybrid sharding (with --zero): shard within groups of K data-parallel ranks, replicate "
                          "across groups (default: shard over all of them)")
    par.add_argument("--no-prefetch", action="store_true",
                     help="ZeRO-3: gather each block's parameters only when it runs, not one block ahead")
    par.add_argument("--bucket-mb", type=float, default=25.0, help="gradient bucket size for DP / ZeRO-1/2")
    par.add_argument("--compression", choices=list(COMPRESSIONS), default="none",
                     help="compress data-parallel gradients (with --dp, --zero 0)")
    par.add_argument("--topk-ratio", type=float, default=0.01, help="share of entries top-k compression sends")
    par.add_argument("--powersgd-rank", type=int, default=4, help="rank of PowerSGD's low-rank factors")
    par.add_argument("--local-sgd", type=int, default=0, metavar="H",
                     help="local SGD / DiLoCo: average the replicas every H steps instead of the gradients every step")
    par.add_argument("--outer-lr", type=float, default=0.7, help="DiLoCo outer learning rate (1 + momentum 0: averaging)")
    par.add_argument("--outer-momentum", type=float, default=0.9, help="DiLoCo outer Nesterov momentum")
    par.add_argument("--staleness", type=int, default=0, help="local SGD: apply each round's average τ rounds later")
    par.add_argument("--trace", metavar="OUT.json", help="write a Chrome/Perfetto timeline")
    par.add_argument("--auto", action="store_true",
                     help="let the planner choose the layout (dp/tp/pp/cp/sp/ep, schedule, zero, shard group, microbatches, "
                          "and the recomputation unless --recompute is given) for this many ranks; a layout flag "
                          "given with it is refused (the plan would override it)")
    par.add_argument("--profile", help="hardware profile for --auto (default: this machine's, calibrated if missing)")


AUTO_CHOOSES = {"dp", "tp", "pp", "zero", "microbatches", "schedule", "cp", "cp_kind", "sp", "ep", "virtual_stages",
                "cp_split", "shard_group"}  # what --auto decides (and --recompute, unless given)


def choose_layout(args: argparse.Namespace, world: Communicator) -> None:
    """--auto: rank 0 plans (calibrating this machine if it has no profile yet, and saving that calibration
    for the next run and for ``plan``); every rank takes its choice. A layout flag written beside it is refused:
    the plan would silently replace it."""
    given = sorted(AUTO_CHOOSES & getattr(args, "explicit", set()))
    if given:
        raise ValueError(f"--auto chooses the layout itself: drop --{given[0].replace('_', '-')}")
    try:
        profile = planner.load_profile(args.profile, world.size)
    except FileNotFoundError:
        if args.profile:
            raise
        profile = planner.calibrate(world)  # every rank measures; rank 0's numbers decide
        if world.rank == 0:
            path = planner.save_calibration(profile, world.size)
            if not args.json:
                print(f"auto: calibrated this machine for {world.size} rank(s) -> {path}", flush=True)
    if world.rank == 0:
        cfg = model_config(args)
        modes = (args.recompute,) if args.recompute else RECOMPUTE  # the user's --recompute, else any
        ranked = planner.plan(cfg, world.size, args.batch_size, profile, planner.ITEMSIZE[model_dtype(args)], modes)
        best = ranked[0]
        if not best.feasible:
            raise ValueError(f"no layout of {world.size} ranks fits in {profile.memory / 1e9:.1f} GB per device")
        choice = {**dataclasses.asdict(best.layout), "step_ms": best.step_time * 1e3, "memory_gb": best.memory / 1e9,
                  "candidates": len(ranked)}
    else:
        choice = None
    choice = json.loads(world.all_gather_bytes(json.dumps(choice).encode(), label="plan")[0])
    layout = Layout(**{f.name: choice[f.name] for f in dataclasses.fields(Layout)})
    for name in sorted(AUTO_CHOOSES - {"shard_group"}) + ["recompute"]:  # the layout's choices become the arguments
        setattr(args, name, getattr(layout, name))
    args.shard_group = layout.shard_group or None
    if world.rank == 0 and not args.json:
        print(f"auto: {layout} of {choice['candidates']} layouts, predicted {choice['step_ms']:.1f} ms/step, "
              f"{choice['memory_gb']:.3f} GB per rank ({profile.name})", flush=True)


PRECISIONS = {"fp32": None, "bf16-mixed": "bfloat16", "fp16-mixed": "float16"}  # -> the model's storage dtype


def model_dtype(args: argparse.Namespace) -> str:
    """What parameters and activations are stored in: --dtype, or the 16-bit type of a mixed --precision."""
    return PRECISIONS[args.precision] or args.dtype


def model_config(args: argparse.Namespace, resumed: Checkpoint | None = None) -> GPTConfig:
    if resumed is not None:
        return dataclasses.replace(resumed.config, dtype=model_dtype(args))
    if args.init_from:
        return hf_config(args.init_from, dtype=model_dtype(args))
    return GPTConfig(vocab_size=256, block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head,
                     n_embd=args.n_embd, dtype=model_dtype(args), n_expert=args.n_expert, expert_top_k=args.expert_top_k,
                     capacity_factor=args.capacity_factor, aux_loss_coef=args.aux_loss_coef)


MODEL_FLAGS = ("n_layer", "n_head", "n_embd", "block_size", "n_expert", "expert_top_k", "capacity_factor",
               "aux_loss_coef")


# flags that only mean something in some mode: written without it, they are refused (name: (the mode, whether on))
FLAG_NEEDS: dict[str, tuple[str, Any]] = {
    "loss_scale": ("--precision fp16-mixed", lambda a: a.precision == "fp16-mixed"),
    "expert_top_k": ("--n-expert", lambda a: a.n_expert > 0 or bool(a.resume)),
    "capacity_factor": ("--n-expert", lambda a: a.n_expert > 0 or bool(a.resume)),
    "aux_loss_coef": ("--n-expert", lambda a: a.n_expert > 0 or bool(a.resume)),
    "topk_ratio": ("--compression topk", lambda a: a.compression == "topk"),
    "powersgd_rank": ("--compression powersgd", lambda a: a.compression == "powersgd"),
    "outer_lr": ("--local-sgd", lambda a: a.local_sgd > 0),
    "outer_momentum": ("--local-sgd", lambda a: a.local_sgd > 0),
    "staleness": ("--local-sgd", lambda a: a.local_sgd > 0),
    "cp_kind": ("--cp 2 or more", lambda a: a.cp > 1),
    "cp_split": ("--cp 2 or more", lambda a: a.cp > 1),
    "no_prefetch": ("--zero 3", lambda a: a.zero == 3),
    "save_interval": ("--save", lambda a: bool(a.save)),
}


def validate(args: argparse.Namespace, world_size: int, resumed: Checkpoint | None) -> tuple[GPTConfig, Layout]:
    """Reject bad input before anything is built or communicated (every rank reaches the same verdict): the run's
    own values here, the parallel layout's rules in :meth:`Layout.validate`. Fills in ``args.dp`` when it was left
    out: the ranks that tp·pp·cp leave, as Megatron-LM does."""
    for name in ("steps", "batch_size", "block_size", "bucket_mb", "eval_batches", "log_interval"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.min_lr is None:  # a tenth of the peak, whatever the peak (2e-4 for the default 2e-3)
        args.min_lr = args.lr / 10
    for name in ("lr", "min_lr", "warmup", "grad_clip", "weight_decay", "eval_interval", "save_interval", "keep_last",
                 "comm_timeout"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    explicit = getattr(args, "explicit", set())  # the flags written on the command line
    if args.min_lr > args.lr:
        raise ValueError(f"--min-lr {args.min_lr:g} is above --lr {args.lr:g}: the cosine schedule would raise the rate")
    if args.loss_scale <= 0:
        raise ValueError(f"--loss-scale must be positive, got {args.loss_scale:g}")
    for name, (needs, has) in FLAG_NEEDS.items():
        if name in explicit and not has(args):
            raise ValueError(f"--{name.replace('_', '-')} has no effect here: it needs {needs}")
    check_output_paths(args)
    layout = Layout.from_args(args, world_size)
    args.dp, args.cp_split = layout.dp, layout.cp_split
    make_compressor(args.compression, args.topk_ratio, args.powersgd_rank)  # validates the numbers
    if args.local_sgd < 0 or args.staleness < 0:
        raise ValueError("--local-sgd and --staleness must be >= 0")
    if args.keep_last and not args.save:
        raise ValueError("--keep-last prunes the checkpoints of --save: pass --save DIR too")
    if resumed is not None:
        if resumed.step >= args.steps:
            raise ValueError(f"{resumed.path} is at step {resumed.step}; --steps {args.steps} leaves nothing to train")
        for name in MODEL_FLAGS:
            if name in getattr(args, "explicit", ()) and getattr(args, name) != getattr(resumed.config, name):
                raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)} disagrees with the checkpoint "
                                 f"{resumed.path} ({name}={getattr(resumed.config, name)}): drop the flag to resume, "
                                 "or start a new run without --resume")
    if args.n_expert < 0 or (args.n_expert and not 1 <= args.expert_top_k <= args.n_expert):
        raise ValueError(f"--expert-top-k {args.expert_top_k} must be between 1 and --n-expert {args.n_expert}"
                         if args.n_expert > 0 else f"--n-expert must be >= 0, got {args.n_expert}")
    if args.precision != "fp32" and args.dtype != "float32":
        raise ValueError(f"--precision {args.precision} stores the model in 16 bits with float32 masters: "
                         f"drop --dtype {args.dtype} (it sets the pure modes)")
    if args.init_from and args.n_expert and resumed is None:
        raise ValueError("--init-from loads a dense Hugging Face GPT-2: it cannot be combined with --n-expert")
    cfg = model_config(args, resumed)
    if cfg.n_expert and args.out:
        raise ValueError("--out writes Hugging Face GPT-2, which has no mixture-of-experts layout: use --save")
    layout.validate(cfg, args.batch_size, world_size)
    check_memory(cfg, args, layout)
    return cfg, layout


def check_output_paths(args: argparse.Namespace) -> None:
    """Every path the run will write — the --out and --save folders, the --trace and --log-file files — is checked
    before any work, so that a bad path fails in one line at the start instead of losing the run at its end: the
    nearest folder that exists on the way to it must be a folder this process can create a file in (probed with a
    temporary file; nothing is left behind). Every rank checks the same paths, so every rank reaches the same
    verdict."""
    for flag, path, is_file in (("--out", args.out, False), ("--save", args.save, False), ("--trace", args.trace, True),
                                ("--log-file", args.log_file, True)):
        if not path:
            continue
        if is_file and os.path.isdir(path):
            raise ValueError(f"{flag} {path} is a directory: name a file")
        folder = os.path.dirname(os.path.abspath(path)) if is_file else os.path.abspath(path)
        while not os.path.exists(folder):
            folder = os.path.dirname(folder)
        try:
            if not os.path.isdir(folder):
                raise NotADirectoryError(20, "Not a directory")
            tempfile.TemporaryFile(dir=folder).close()
        except OSError as e:
            raise ValueError(f"{flag} {path}: cannot write there ({e.strerror})") from None


def check_memory(cfg: GPTConfig, args: argparse.Namespace, layout: Layout) -> None:
    """Refuse a run whose estimated peak (the planner's model states + activations per rank, for the ranks on
    this machine) exceeds the memory available here, instead of letting the OOM killer end it mid-step."""
    itemsize = planner.ITEMSIZE[model_dtype(args)]
    states, activations = planner.memory_per_rank(cfg, args.batch_size, layout, itemsize)
    per_rank = states + activations
    # on the CPU the ranks on this machine share its memory; on GPUs each rank has its own device
    ranks_here = int(os.environ.get("MPI_LOCALNRANKS", layout.world)) if args.device == "cpu" else 1
    available = memory_available()
    if per_rank * ranks_here > available:
        raise ValueError(f"this run needs about {per_rank / 1e9:.1f} GB per rank ({per_rank * ranks_here / 1e9:.1f} GB "
                         f"for {ranks_here} rank(s)) but {available / 1e9:.1f} GB is available on the {args.device}: "
                         "reduce --block-size, --batch-size or the model, or raise --microbatches / --tp / --pp")


def build_model(args: argparse.Namespace, cfg: GPTConfig, mesh: Mesh, resumed: Checkpoint | None) -> GPT:
    """The full model on every rank (same seed, HF checkpoint or training checkpoint), then this rank's tp slice."""
    if args.init_from and resumed is None:
        model = GPT.from_hf(args.init_from, dtype=args.dtype)
    else:
        model = GPT(cfg, seed=args.seed)
        if resumed is not None:
            model.load_state_dict(resumed.params)
    if mesh.tp > 1:
        model = tensor_parallel(model, mesh.tp_comm, args.sp)
    if mesh.ep > 1:
        model = expert_parallel(model, mesh.ep_comm)
    model.set_recompute(args.recompute)
    return context_parallel(model, mesh.cp_comm, args.cp_kind, args.cp_split) if mesh.cp > 1 else model


def restore_optimizer(optimizer: Any, model: GPT, mesh: Mesh, resumed: Checkpoint) -> None:
    """Adam's moments from a checkpoint of any layout: this rank's tp slice of the full tensors."""
    moments = [resumed.exp_avg, resumed.exp_avg_sq, resumed.params]  # params: the float32 masters of a 16-bit model
    if mesh.tp > 1:
        moments = [shard_state_dict(m, model.config, mesh.tp, mesh.tp_rank) for m in moments]
    if mesh.ep > 1:
        moments = [shard_expert_state(m, mesh.ep, mesh.ep_rank, expert_names(model)) for m in moments]
    optimizer.import_state(*moments[:2], {id(p): n for n, p in model.named_parameters()}, resumed.optimizer_step,
                           master=moments[2])


def restore_training_state(resumed: Checkpoint, layout: Layout, world: Communicator, model: GPT, engine: Any,
                           optimizer: Any, scaler: LossScaler | None, local_sgd: LocalSGD | None, progress: Any) -> None:
    """The loss scaler's state, and each rank's own state when the layout is the one it was saved in (a
    compressor's error feedback belongs to its rank's buckets, local SGD's replica to its rank); in another
    layout that starts afresh, said once."""
    if scaler and "loss_scale" in resumed.training:
        scaler.load_state(resumed.training)
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
               layout: Layout, scaler: LossScaler | None, local_sgd: LocalSGD | None) -> str:
    """Save parameters and AdamW state in this layout (the first replica of each (pp, tp) slice writes them), the
    loss scaler's state, and what only each rank holds (a compressor's error feedback; local SGD's replica)."""
    names = {id(p): n for n, p in model.named_parameters()}
    own = {**engine.rank_state(), **(local_sgd.export_state(optimizer, names) if local_sgd else {})}
    params = {**engine.gathered_state_dict(), **optimizer.master_state(names)}  # a 16-bit model's float32 masters
    state = {"param": params, **optimizer.export_state(names)}
    if mesh.ep > 1:  # whole experts, from every ep rank's share
        experts = expert_names(model)
        state = {kind: gather_expert_state(tensors, mesh.ep_comm, experts) for kind, tensors in state.items()}
    state = state if mesh.grad_comm.rank == 0 else None
    saved = save_checkpoint(args.save, step, state, mesh, model.config, layout, optimizer.step_count,
                            training=scaler.state() if scaler else None, rank_state=own)
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
        if isinstance(module, (LayerNorm, SequenceParallelLayerNorm)):
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


def full_state_dict(engine: Any, model: GPT, mesh: Mesh) -> dict[str, np.ndarray]:
    """Every parameter whole, on every rank: gathered over the ZeRO shards, the tp slices, the pp stages."""
    local = engine.gathered_state_dict()
    if mesh.tp > 1:
        local = gather_tensor_parallel_state(local, model.config, mesh.tp_comm)
    return stage_state(local, mesh.pp_comm) if mesh.pp > 1 else local


def json_line(record: dict[str, Any]) -> str:
    """``record`` as strict JSON: a non-finite number (a diverged loss) becomes null, never a bare NaN."""
    def clean(v: Any) -> Any:
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [clean(x) for x in v]
        return v
    return json.dumps(clean(record), allow_nan=False)


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


class Progress:
    """What rank 0 reports: a text line (or a JSON object with ``--json``) every ``--log-interval`` steps and
    at the last, every record in ``--log-file``, elapsed time and ETA, and a closing summary."""

    def __init__(self, args: argparse.Namespace, lead: bool, first_step: int):
        self.lead, self.as_json, self.interval, self.steps = lead, args.json, args.log_interval, args.steps
        self.first_step, self.start, self.tokens, self.step_seconds = first_step, time.perf_counter(), 0, 0.0
        self.best_val: float | None = None
        self.written: list[str] = []
        self.log = open(args.log_file, "a" if first_step else "w", encoding="utf-8") if lead and args.log_file else None
        self.stdout_closed = False  # the reader went away (``minipar train | head``): the loop then stops quietly

    def _print(self, text: str, stream: Any = None) -> None:
        stream = stream or sys.stdout
        if stream is sys.stdout and self.stdout_closed:
            return
        try:
            print(text, file=stream, flush=True)
        except BrokenPipeError:
            self.stdout_closed = True
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python exits

    def say(self, text: str) -> None:
        """A line for people reading the console (not printed with --json)."""
        if self.lead and not self.as_json:
            self._print(text)

    def note(self, text: str) -> None:
        """A line nobody should miss: on stdout, or on stderr with --json (whose stdout stays pure JSON)."""
        if self.lead:
            self._print(text, sys.stderr if self.as_json else sys.stdout)

    def step(self, record: dict[str, Any]) -> None:
        self.tokens += record["tokens"]
        self.step_seconds += record["ms"] / 1e3
        elapsed = time.perf_counter() - self.start
        record["elapsed_s"] = elapsed
        record["eta_s"] = elapsed / (record["step"] - self.first_step) * (self.steps - record["step"])
        self._write(record)
        if self.lead and (record["step"] % self.interval == 0 or record["step"] == self.steps):
            self._print(json_line(record) if self.as_json else format_step(record))

    def evaluation(self, record: dict[str, Any]) -> None:
        if math.isfinite(record["val_loss"]):
            self.best_val = record["val_loss"] if self.best_val is None else min(self.best_val, record["val_loss"])
        self._write(record)
        if self.lead:
            self._print(json_line(record) if self.as_json else
                        f"eval step {record['step']:>5} | val loss {record['val_loss']:.4f}")

    def _write(self, record: dict[str, Any]) -> None:
        if self.log:
            self.log.write(json_line(record) + "\n")
            self.log.flush()

    def close(self, last_step: int, finished: bool) -> None:
        """Close the log; when the run ``finished``, print the summary (wall time, tokens/s, files)."""
        if self.log:
            self.log.close()
            self.written.append(f"step records: {self.log.name}")
        if not self.lead or self.as_json or not finished:
            return
        wall = time.perf_counter() - self.start
        trained = last_step - self.first_step
        summary = (f"done: {trained} steps in {_duration(wall)}, "
                   f"{self.tokens / max(self.step_seconds, 1e-9):,.0f} tokens/s on average")
        summary += f", best val loss {self.best_val:.4f}" if self.best_val is not None else ""
        self._print(summary)
        for line in self.written:
            self._print(f"  wrote {line}")


def format_step(record: dict[str, Any]) -> str:
    comm = ""
    if record["world"] > 1:
        tp_bytes = sum(v for k, v in record["comm_bytes_by_op"].items() if k.startswith(("tp_", "sp_")))
        if record["comm_formula_bytes"]:
            comm += f" | dp {record['comm_bytes'] / 1e6:.2f} MB (formula {record['comm_formula_bytes'] / 1e6:.2f})"
            if record["comm_bytes"] and record["comm_bytes"] < 0.99 * record["comm_formula_bytes"]:
                comm += f", {record['comm_formula_bytes'] / record['comm_bytes']:.1f}× compressed"
        if tp_bytes:
            comm += f" | tp {tp_bytes / 1e6:.2f} MB"
        for axis in ("cp", "ep"):
            axis_bytes = sum(v for k, v in record["comm_bytes_by_op"].items() if k.startswith(axis + "_"))
            if axis_bytes:
                comm += f" | {axis} {axis_bytes / 1e6:.2f} MB"
        pp_bytes = sum(v for k, v in record["comm_bytes_by_op"].items() if k.startswith("pp_"))
        if pp_bytes:
            comm += f" | pp {pp_bytes / 1e6:.2f} MB, bubble {record['pipeline']['bubble']:.0%}"
        comm += f" | state {sum(record['model_state_bytes'].values()) / 1e6:.2f} MB"
    if record.get("skipped"):
        comm = f" | skipped: fp16 gradients overflowed, loss scale now {record['loss_scale'] / 2:g}" + comm
    elif "loss_scale" in record:
        comm = f" | loss scale {record['loss_scale']:g}" + comm
    if "experts" in record:
        moe = record["experts"]
        comm = (f" | dropped {moe['dropped_fraction']:.1%}, expert load {moe['expert_load_min']}–"
                f"{moe['expert_load_max']}") + comm
    return (f"step {record['step']:>5}/{record['steps']} | loss {record['loss']:.4f} | lr {record['lr']:.2e} | "
            f"norm {record['grad_norm']:.3f} | {record['tokens_per_s']:>8,.0f} tok/s | {record['ms']:7.1f} ms | "
            f"{_duration(record['elapsed_s'])} elapsed, eta {_duration(record['eta_s'])}{comm}")


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


def load_data(args: argparse.Namespace, block: int) -> tuple[np.ndarray, Batches, Batches | None, str | None]:
    """(all tokens, training batches, validation batches or None, a note on rank 0's first lines or None)."""
    tokens = load_tokens(args.data)
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


def check_ranks_agree(world: Communicator, what: str, values: dict[str, Any]) -> None:
    """Raise the same one-line ValueError on every rank if the ranks were started with different ``values`` (their
    flags; the digest of their data) — a job whose ranks disagree would hang or train something else."""
    if world.size == 1:
        return
    mine = json.dumps(values, sort_keys=True, default=str).encode()
    every = [json.loads(b) for b in world.all_gather_bytes(mine, label="startup")]
    for key in sorted(values):
        seen = [json.dumps(v.get(key)) for v in every]
        if len(set(seen)) > 1:
            flag = f"--{key.replace('_', '-')} " if what == "arguments" else ""
            per_rank = ", ".join(f"{json.loads(v) if v != 'null' else 'not given'} on rank {r}"
                                 for r, v in enumerate(seen[:8]))
            raise ValueError(f"ranks' {what} differ: {flag}{per_rank}{', ...' if len(seen) > 8 else ''}")


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
    tokens, batches, val_batches, data_note = load_data(args, block)
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
    if scaler:  # overflowing fp16 gradients are expected; the scaler detects them and skips the step
        np.seterr(over="ignore", invalid="ignore")
    m, lead, first_step = args.microbatches, world.rank == 0, resumed.step if resumed else 0
    progress = Progress(args, lead, first_step)
    norm_bytes = count_layer_norm_bytes(model)
    experts = f" E={cfg.n_expert} top-{cfg.expert_top_k}" if cfg.n_expert else ""
    progress.say(f"minipar: GPT {cfg.num_parameters():,} params (L={cfg.n_layer} H={cfg.n_head} C={cfg.n_embd} "
                 f"T={block}{experts}), {len(tokens):,} tokens, batch {args.batch_size}×{block}, "
                 f"{args.dtype if args.precision == 'fp32' else args.precision} on {args.device}, {layout}")
    if resumed is not None:
        for skipped in resumed.skipped:
            progress.note(f"skipped damaged checkpoint {skipped}")
        progress.note(f"resumed from {resumed.path} (step {resumed.step}, saved as {resumed.layout})")
        restore_training_state(resumed, layout, world, model, engine, optimizer, scaler, local_sgd, progress)
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
                optimizer.lr = cosine_lr(step, max_lr=args.lr, warmup_steps=args.warmup, total_steps=args.steps,
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
                saved = checkpoint(args, step + 1, engine, optimizer, model, mesh, layout, scaler, local_sgd)
                progress.say(f"checkpoint {saved}")
                if last or stop:
                    progress.written.append(f"checkpoint: {saved} (resume with --resume {args.save})")
            if stop:
                saved_to = f"; checkpoint saved to {saved} (resume with --resume {args.save})" if args.save else ""
                progress.note(f"interrupted at step {step + 1} ({signal.Signals(stop).name}){saved_to}")
                raise Interrupted(stop, f"interrupted at step {step + 1}")
        if local_sgd:
            local_sgd.finish()  # the outstanding rounds: every replica ends equal
        if args.trace:
            trace.write(args.trace, world)
            progress.written.append(f"timeline: {args.trace} (ui.perfetto.dev, or python -m minipar trace-plot "
                                    f"{args.trace})")
        if args.out:
            state = full_state_dict(engine, model, mesh)
            if lead:
                GPT(cfg).save_hf(args.out, state)
            progress.written.append(f"model: {args.out}/ (Hugging Face GPT-2; python -m minipar generate --ckpt "
                                    f"{args.out})")
        finished = True
    finally:
        interrupt.close()
        if args.peak_memory:
            tracemalloc.stop()
        progress.close(step + 1 if records else first_step, finished)
    return records
