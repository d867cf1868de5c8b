"""The training loop behind ``python -m minipar train``.

One step:  for each of m microbatches: forward, loss/m, backward (gradients accumulate)
           → clip the global gradient norm → AdamW with the cosine learning rate.
Rank 0 prints one progress line per step (or one JSON object with ``--json``).

Under ``mpiexec -n dp·tp`` the ranks form a mesh (tp fastest). A tensor-parallel group of tp
ranks shares one model, split layer by layer (``--tp``); the dp groups each train on their rows
of the global batch through DataParallel (``--zero 0``) or ZeRO stage 1-3. The step is the same
code in every layout: engine(x, y) → backward → engine.sync_gradients() → clip → optimizer.step().
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time
from typing import Any

import numpy as np

from minipar import trace
from minipar.backend import KERNEL_MODES, set_device, set_kernels, xp
from minipar.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from minipar.comm import Communicator
from minipar.data import Batches, load_tokens, shard_rows, split_tokens
from minipar.models.gpt import GPT, GPTConfig, hf_config
from minipar.optim import AdamW, cosine_lr
from minipar.parallel.compression import COMPRESSIONS, make_compressor
from minipar.parallel.data_parallel import DataParallel
from minipar.parallel.local_sgd import LocalSGD
from minipar.parallel import planner
from minipar.parallel.mesh import Mesh
from minipar.parallel.pipeline import SCHEDULES, Pipeline, stage_blocks, stage_state
from minipar.parallel.tensor_parallel import (check_tensor_parallel, gather_tensor_parallel_state, shard_state_dict,
                                              tensor_parallel)
from minipar.parallel.zero import ZeRO


def add_arguments(p: argparse.ArgumentParser) -> None:
    model = p.add_argument_group("model")
    model.add_argument("--n-layer", type=int, default=4)
    model.add_argument("--n-head", type=int, default=4)
    model.add_argument("--n-embd", type=int, default=128)
    model.add_argument("--block-size", type=int, default=128, help="context length T")
    model.add_argument("--init-from", metavar="DIR", help="start from a Hugging Face GPT-2 checkpoint directory")

    run = p.add_argument_group("optimization")
    run.add_argument("--steps", type=int, default=300)
    run.add_argument("--batch-size", type=int, default=16, help="global batch, in sequences")
    run.add_argument("--microbatches", type=int, default=1, help="gradient-accumulation steps per optimizer step")
    run.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    run.add_argument("--min-lr", type=float, default=2e-4)
    run.add_argument("--warmup", type=int, default=30, help="linear warm-up steps")
    run.add_argument("--weight-decay", type=float, default=0.1)
    run.add_argument("--grad-clip", type=float, default=1.0, help="max global gradient norm (0: off)")
    run.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    run.add_argument("--seed", type=int, default=0)

    io = p.add_argument_group("data and output")
    io.add_argument("--data", metavar="PATH", help="any text file (default: this Python's standard-library source)")
    io.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    io.add_argument("--kernels", choices=list(KERNEL_MODES), default="auto",
                    help="Triton kernels for matmul/attention: auto = on the GPU only")
    io.add_argument("--eval-interval", type=int, default=100, help="validation loss every N steps (0: never)")
    io.add_argument("--eval-batches", type=int, default=4)
    io.add_argument("--out", metavar="DIR", help="save the final model here (Hugging Face format)")
    io.add_argument("--save", metavar="DIR", help="write sharded training checkpoints (parameters + AdamW) here")
    io.add_argument("--save-interval", type=int, default=0, help="checkpoint every N steps (0: only at the end)")
    io.add_argument("--resume", metavar="DIR", help="continue from a --save checkpoint (any parallel layout)")
    io.add_argument("--json", action="store_true", help="one JSON object per step instead of a text line")

    par = p.add_argument_group("parallelism")
    par.add_argument("--dp", type=int, default=1, help="data-parallel degree")
    par.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    par.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree")
    par.add_argument("--schedule", choices=list(SCHEDULES), default="1f1b", help="pipeline schedule (with --pp)")
    par.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=0, help="ZeRO stage (with --dp)")
    par.add_argument("--bucket-mb", type=float, default=25.0, help="gradient bucket size for DP / ZeRO-1/2")
    par.add_argument("--compression", choices=list(COMPRESSIONS), default="none",
                     help="compress data-parallel gradients (with --dp, --zero 0)")
    par.add_argument("--topk-ratio", type=float, default=0.01, help="share of entries top-k compression sends")
    par.add_argument("--powersgd-rank", type=int, default=4)
    par.add_argument("--local-sgd", type=int, default=0, metavar="H",
                     help="local SGD / DiLoCo: average the replicas every H steps instead of the gradients every step")
    par.add_argument("--outer-lr", type=float, default=0.7, help="DiLoCo outer learning rate (1 + momentum 0: averaging)")
    par.add_argument("--outer-momentum", type=float, default=0.9, help="DiLoCo outer Nesterov momentum")
    par.add_argument("--staleness", type=int, default=0, help="local SGD: apply each round's average τ rounds later")
    par.add_argument("--trace", metavar="OUT.json", help="write a Chrome/Perfetto timeline")
    par.add_argument("--auto", action="store_true",
                     help="let the planner choose --dp/--tp/--pp/--zero/--microbatches for this many ranks")
    par.add_argument("--profile", help="hardware profile for --auto (default: this machine's, calibrated if missing)")


def choose_layout(args: argparse.Namespace, world: Communicator) -> None:
    """--auto: rank 0 plans (calibrating this machine if it has no profile yet); every rank takes its choice."""
    try:
        profile = planner.load_profile(args.profile, world.size)
    except FileNotFoundError:
        if args.profile:
            raise
        profile = planner.calibrate(world)  # every rank measures; rank 0's numbers decide
    if world.rank == 0:
        cfg = model_config(args)
        ranked = planner.plan(cfg, world.size, args.batch_size, profile, planner.ITEMSIZE[args.dtype])
        best = ranked[0]
        if not best.feasible:
            raise ValueError(f"no layout of {world.size} ranks fits in {profile.memory / 1e9:.1f} GB per device")
        choice = {**dataclasses.asdict(best.layout), "step_ms": best.step_time * 1e3, "memory_gb": best.memory / 1e9,
                  "candidates": len(ranked)}
    else:
        choice = None
    choice = json.loads(world.all_gather_bytes(json.dumps(choice).encode(), label="plan")[0])
    args.dp, args.tp, args.pp, args.zero = choice["dp"], choice["tp"], choice["pp"], choice["zero"]
    args.microbatches, args.schedule = choice["microbatches"], choice["schedule"]
    if world.rank == 0 and not args.json:
        print(f"auto: {planner.Layout(**{k: choice[k] for k in ('dp', 'tp', 'pp', 'zero', 'microbatches', 'schedule')})}"
              f" of {choice['candidates']} layouts, predicted {choice['step_ms']:.1f} ms/step, "
              f"{choice['memory_gb']:.3f} GB per rank ({profile.name})", flush=True)


def model_config(args: argparse.Namespace, resumed: Checkpoint | None = None) -> GPTConfig:
    if resumed is not None:
        return dataclasses.replace(resumed.config, dtype=args.dtype)
    if args.init_from:
        return hf_config(args.init_from, dtype=args.dtype)
    return GPTConfig(vocab_size=256, block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head,
                     n_embd=args.n_embd, dtype=args.dtype)


def validate(args: argparse.Namespace, world_size: int, resumed: Checkpoint | None) -> GPTConfig:
    """Reject bad input before anything is built or communicated (every rank reaches the same verdict)."""
    for name in ("steps", "batch_size", "microbatches", "block_size", "dp", "tp", "pp", "bucket_mb"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.dp * args.tp * args.pp != world_size:
        raise ValueError(f"world size {world_size} != dp·tp·pp = {args.dp}·{args.tp}·{args.pp}; "
                         f"launch with mpiexec -n {args.dp * args.tp * args.pp}")
    if args.batch_size % (args.dp * args.microbatches):
        raise ValueError(f"--batch-size {args.batch_size} is not divisible by --dp·--microbatches "
                         f"= {args.dp}·{args.microbatches}")
    if args.zero and args.dp == 1:
        raise ValueError("--zero shards over data-parallel ranks: it needs --dp >= 2")
    if args.compression != "none" and args.zero:
        raise ValueError("--compression plugs into plain data parallelism: use it with --zero 0")
    make_compressor(args.compression, args.topk_ratio, args.powersgd_rank)  # validates the numbers
    if args.local_sgd < 0 or args.staleness < 0:
        raise ValueError("--local-sgd and --staleness must be >= 0")
    if args.local_sgd and (args.tp > 1 or args.pp > 1 or args.zero or args.compression != "none" or args.save):
        raise ValueError("--local-sgd replaces the gradient all-reduce of plain data parallelism: use it with --dp "
                         "alone (no --tp/--pp/--zero/--compression/--save)")
    if args.zero >= 2 and args.pp > 1:
        raise ValueError("--zero 2/3 reduce-scatter every microbatch's gradients; with --pp use --zero 0 or 1 "
                         "(as DeepSpeed does)")
    if args.save_interval < 0:
        raise ValueError(f"--save-interval must be >= 0, got {args.save_interval}")
    if resumed is not None and resumed.step >= args.steps:
        raise ValueError(f"{resumed.path} is at step {resumed.step}; --steps {args.steps} leaves nothing to train")
    cfg = model_config(args, resumed)
    check_tensor_parallel(cfg, args.tp)
    stage_blocks(cfg.n_layer, args.pp, 0)
    return cfg


def build_model(args: argparse.Namespace, cfg: GPTConfig, mesh: Mesh, resumed: Checkpoint | None) -> GPT:
    """The full model on every rank (same seed, HF checkpoint or training checkpoint), then this rank's tp slice."""
    if args.init_from and resumed is None:
        model = GPT.from_hf(args.init_from, dtype=args.dtype)
    else:
        model = GPT(cfg, seed=args.seed)
        if resumed is not None:
            model.load_state_dict(resumed.params)
    return tensor_parallel(model, mesh.tp_comm) if mesh.tp > 1 else model


def restore_optimizer(optimizer: Any, model: GPT, mesh: Mesh, resumed: Checkpoint) -> None:
    """Adam's moments from a checkpoint of any layout: this rank's tp slice of the full tensors."""
    moments = [resumed.exp_avg, resumed.exp_avg_sq]
    if mesh.tp > 1:
        moments = [shard_state_dict(m, model.config, mesh.tp, mesh.tp_rank) for m in moments]
    optimizer.import_state(*moments, {id(p): n for n, p in model.named_parameters()}, resumed.optimizer_step)


def checkpoint(args: argparse.Namespace, step: int, engine: Any, optimizer: Any, model: GPT, mesh: Mesh) -> str:
    """Save parameters and AdamW state in this layout; dp rank 0 of each (pp, tp) group writes its slice."""
    params = engine.gathered_state_dict()
    moments = optimizer.export_state({id(p): n for n, p in model.named_parameters()})
    state = {"param": params, **moments} if mesh.dp_rank == 0 else None
    return save_checkpoint(args.save, step, state, mesh, model.config, args.zero, optimizer.step_count)


def build_engine(model: GPT, comm: Communicator, args: argparse.Namespace) -> tuple[Any, Any]:
    """(engine, optimizer) over the data-parallel group: DataParallel + AdamW, or ZeRO, which is both.
    With --local-sgd the replicas do not synchronize gradients at all (LocalSGD averages them later)."""
    if args.local_sgd:
        alone = comm.split(color=comm.rank, name="local")
        return DataParallel(model, alone), AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    if args.zero:
        engine = ZeRO(model, comm, args.zero, lr=args.lr, weight_decay=args.weight_decay, bucket_mb=args.bucket_mb)
        return engine, engine
    compression = make_compressor(args.compression, args.topk_ratio, args.powersgd_rank)
    return (DataParallel(model, comm, args.bucket_mb, compression=compression),
            AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay))


def mean_loss(losses: list[float], mesh: Mesh) -> float:
    """The global mean of per-microbatch losses that live on the last pipeline stage of every dp group."""
    local = np.array([np.mean([float(v) for v in losses]) if losses else 0.0])  # the step's one device→host sync
    return float(mesh.dp_comm.all_reduce(mesh.pp_comm.all_reduce(local, label="loss"), op="avg", label="loss")[0])


def evaluate(engine: Any, pipeline: Pipeline, mesh: Mesh, batches: Batches, n_batches: int) -> float:
    """Mean validation loss over ``n_batches`` fixed batches, each data-parallel group scoring its rows."""
    losses = []
    for i in range(n_batches):
        x, y = (shard_rows(a, mesh.dp_rank, mesh.dp) for a in batches(i))
        loss = pipeline.forward_only(engine, x, y)
        if loss is not None:
            losses.append(loss)
    return mean_loss(losses, mesh)


def group_sum(comm: Communicator):
    """s -> Σ over the ranks of ``comm`` (identity for one rank): a gradient norm's squares across a split."""
    if comm.size == 1:
        return lambda s: s
    return lambda s: comm.all_reduce(xp.asarray(s, dtype=xp.float64).reshape(1), label="grad_norm")[0]


def full_state_dict(engine: Any, model: GPT, mesh: Mesh) -> dict[str, np.ndarray]:
    """Every parameter whole, on every rank: gathered over the ZeRO shards, the tp slices, the pp stages."""
    local = engine.gathered_state_dict()
    if mesh.tp > 1:
        local = gather_tensor_parallel_state(local, model.config, mesh.tp_comm)
    return stage_state(local, mesh.pp_comm) if mesh.pp > 1 else local


def report(record: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(record), flush=True)
    elif "val_loss" in record:
        print(f"eval step {record['step']:>5} | val loss {record['val_loss']:.4f}", flush=True)
    else:
        comm = ""
        if record["world"] > 1:
            tp_bytes = sum(v for k, v in record["comm_bytes_by_op"].items() if k.startswith("tp_"))
            if record["comm_formula_bytes"]:
                comm += f" | dp {record['comm_bytes'] / 1e6:.2f} MB (formula {record['comm_formula_bytes'] / 1e6:.2f})"
                if record["comm_bytes"] and record["comm_bytes"] < 0.99 * record["comm_formula_bytes"]:
                    comm += f", {record['comm_formula_bytes'] / record['comm_bytes']:.1f}× compressed"
            if tp_bytes:
                comm += f" | tp {tp_bytes / 1e6:.2f} MB"
            pp_bytes = sum(v for k, v in record["comm_bytes_by_op"].items() if k.startswith("pp_"))
            if pp_bytes:
                comm += f" | pp {pp_bytes / 1e6:.2f} MB, bubble {record['pipeline']['bubble']:.0%}"
            comm += f" | state {sum(record['model_state_bytes'].values()) / 1e6:.2f} MB"
        print(f"step {record['step']:>5}/{record['steps']} | loss {record['loss']:.4f} | lr {record['lr']:.2e} | "
              f"norm {record['grad_norm']:.3f} | {record['tokens_per_s']:>8,.0f} tok/s | {record['ms']:7.1f} ms{comm}",
              flush=True)


def train(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Run the training job described by ``args`` on every rank; returns the per-step records."""
    world = Communicator()
    if args.auto:
        choose_layout(args, world)
    resumed = load_checkpoint(args.resume) if args.resume else None
    cfg = validate(args, world.size, resumed)
    set_device(args.device)
    set_kernels(args.kernels)
    tokens = load_tokens(args.data)
    mesh = Mesh(world, dp=args.dp, tp=args.tp, pp=args.pp)
    comms = [world, mesh.dp_comm, mesh.tp_comm, mesh.pp_comm]
    model = build_model(args, cfg, mesh, resumed)
    pipeline = Pipeline(model, mesh.pp_comm, args.schedule)
    block = cfg.block_size
    train_tokens, val_tokens = split_tokens(tokens)
    batches = Batches(train_tokens, args.batch_size, block, seed=args.seed)
    val_batches = Batches(val_tokens, args.batch_size, block, seed=args.seed + 1) if len(val_tokens) > block + 2 else None
    n_params = cfg.num_parameters()
    engine, optimizer = build_engine(model, mesh.dp_comm, args)
    local_sgd = LocalSGD(model, mesh.dp_comm, args.local_sgd, args.outer_lr, args.outer_momentum,
                         staleness=args.staleness) if args.local_sgd else None
    if resumed is not None:
        restore_optimizer(optimizer, model, mesh, resumed)
    tp_sum, pp_sum = group_sum(mesh.tp_comm), group_sum(mesh.pp_comm)
    m, lead = args.microbatches, world.rank == 0
    if lead and not args.json:
        layout = "".join(f", {k}={v}" for k, v in (("dp", mesh.dp), ("tp", mesh.tp), ("pp", mesh.pp)) if v > 1)
        layout += f" {args.schedule}" if mesh.pp > 1 else ""
        layout += f" zero-{args.zero}" if args.zero else ""
        print(f"minipar: GPT {n_params:,} params (L={cfg.n_layer} H={cfg.n_head} C={cfg.n_embd} T={block}), "
              f"{len(tokens):,} tokens, batch {args.batch_size}×{block}, {args.dtype} on {args.device}{layout}", flush=True)
        if resumed is not None:
            print(f"resumed from {resumed.path} (step {resumed.step}, saved as {resumed.layout_name})", flush=True)

    if args.trace:
        trace.start(world)
    records = []
    for step in range(resumed.step if resumed else 0, args.steps):
        t0 = time.perf_counter()
        for c in comms:
            c.reset_stats()
        x, y = (shard_rows(a, mesh.dp_rank, mesh.dp) for a in batches(step))
        losses = pipeline.run(engine, x, y, m)
        with trace.span("sync gradients", "comm"):
            engine.sync_gradients()
        with trace.span("optimizer", "optimizer"):
            norm = optimizer.clip_grad_norm(args.grad_clip, lambda s: pp_sum(tp_sum(s)))
            optimizer.lr = cosine_lr(step, max_lr=args.lr, warmup_steps=args.warmup, total_steps=args.steps,
                                     min_lr=args.min_lr)
            optimizer.step()
        outer_round = local_sgd.step() if local_sgd else False
        state_bytes = engine.model_state_bytes(optimizer)
        optimizer.zero_grad()
        loss = mean_loss(losses, mesh)
        ms = (time.perf_counter() - t0) * 1e3
        by_op: dict[str, Any] = {}
        for c in comms:
            for k, v in c.stats.items():
                by_op.setdefault(k, {"bytes": 0, "calls": 0})
                by_op[k]["bytes"] += v.bytes
                by_op[k]["calls"] += v.calls
        record = {"step": step + 1, "steps": args.steps, "loss": loss, "lr": optimizer.lr, "grad_norm": float(norm),
                  "tokens_per_s": args.batch_size * block / (ms / 1e3), "ms": ms, "world": world.size,
                  "comm_bytes": sum(by_op.get(k, {"bytes": 0})["bytes"] for k in ("grads", "params")),
                  "comm_formula_bytes": (engine.formula_bytes() if not local_sgd else
                                         local_sgd.formula_bytes_per_round() * outer_round) if mesh.dp > 1 else 0.0,
                  "comm_bytes_by_op": {k: v["bytes"] for k, v in by_op.items()},
                  "comm_calls_by_op": {k: v["calls"] for k, v in by_op.items()}, "model_state_bytes": state_bytes,
                  "pipeline": pipeline.stats}
        records.append(record)
        if lead:
            report(record, args.json)
        if val_batches and args.eval_interval and ((step + 1) % args.eval_interval == 0 or step + 1 == args.steps):
            val = {"step": step + 1, "val_loss": evaluate(engine, pipeline, mesh, val_batches, args.eval_batches)}
            records.append(val)
            if lead:
                report(val, args.json)
        if args.save and ((args.save_interval and (step + 1) % args.save_interval == 0) or step + 1 == args.steps):
            saved = checkpoint(args, step + 1, engine, optimizer, model, mesh)
            if lead and not args.json:
                print(f"checkpoint {saved}", flush=True)
    if local_sgd:
        local_sgd.finish()  # the outstanding rounds: every replica ends equal
    if args.trace:
        trace.write(args.trace, world)
        if lead and not args.json:
            print(f"wrote {args.trace} (open in ui.perfetto.dev, or: python -m minipar trace-plot {args.trace})", flush=True)
    if args.out:
        state = full_state_dict(engine, model, mesh)
        if lead:
            GPT(cfg).save_hf(args.out, state)
            if not args.json:
                print(f"saved {args.out}/model.safetensors and config.json", flush=True)
    return records
