"""The training loop behind ``python -m minipar train``.

One step:  for each of m microbatches: forward, loss/m, backward (gradients accumulate)
           → clip the global gradient norm → AdamW with the cosine learning rate.
Rank 0 prints one progress line per step (or one JSON object with ``--json``).
"""
from __future__ import annotations

import argparse
import json
import time
from typing import Any

import numpy as np

from minipar.autograd import no_grad
from minipar.backend import set_device
from minipar.data import Batches, load_tokens, split_tokens
from minipar.models.gpt import GPT, GPTConfig
from minipar.optim import AdamW, clip_grad_norm, cosine_lr


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
    io.add_argument("--eval-interval", type=int, default=100, help="validation loss every N steps (0: never)")
    io.add_argument("--eval-batches", type=int, default=4)
    io.add_argument("--out", metavar="DIR", help="save the final model here (Hugging Face format)")
    io.add_argument("--json", action="store_true", help="one JSON object per step instead of a text line")

    par = p.add_argument_group("parallelism")
    par.add_argument("--dp", type=int, default=1, help="data-parallel degree")
    par.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    par.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree")
    par.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=0, help="ZeRO stage")
    par.add_argument("--trace", metavar="OUT.json", help="write a Chrome/Perfetto timeline")


def validate(args: argparse.Namespace) -> None:
    """Reject bad input before anything is built or communicated."""
    for name in ("steps", "batch_size", "microbatches", "block_size", "dp", "tp", "pp"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.batch_size % args.microbatches:
        raise ValueError(f"--batch-size {args.batch_size} is not divisible by --microbatches {args.microbatches}")
    if (args.dp, args.tp, args.pp, args.zero) != (1, 1, 1, 0) or args.trace:
        raise ValueError("parallel training (--dp/--tp/--pp/--zero/--trace) is not implemented in this build yet; "
                         "run single-process")


def build_model(args: argparse.Namespace) -> GPT:
    if args.init_from:
        return GPT.from_hf(args.init_from, dtype=args.dtype)
    cfg = GPTConfig(vocab_size=256, block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head,
                    n_embd=args.n_embd, dtype=args.dtype)
    return GPT(cfg, seed=args.seed)


def evaluate(model: GPT, batches: Batches, n_batches: int) -> float:
    with no_grad():
        return float(np.mean([model(*batches(i))[1].item() for i in range(n_batches)]))  # the same batches every time


def report(record: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(record), flush=True)
    elif "val_loss" in record:
        print(f"eval step {record['step']:>5} | val loss {record['val_loss']:.4f}", flush=True)
    else:
        print(f"step {record['step']:>5}/{record['steps']} | loss {record['loss']:.4f} | lr {record['lr']:.2e} | "
              f"norm {record['grad_norm']:.3f} | {record['tokens_per_s']:>8,.0f} tok/s | {record['ms']:7.1f} ms", flush=True)


def train(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Run the training job described by ``args``; returns the per-step records it printed."""
    validate(args)
    set_device(args.device)
    tokens = load_tokens(args.data)
    model = build_model(args)
    block = model.config.block_size if args.init_from else args.block_size
    train_tokens, val_tokens = split_tokens(tokens)
    batches = Batches(train_tokens, args.batch_size, block, seed=args.seed)
    val_batches = Batches(val_tokens, args.batch_size, block, seed=args.seed + 1) if len(val_tokens) > block + 2 else None
    opt = AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    m = args.microbatches
    if not args.json:
        print(f"minipar: GPT {model.num_parameters():,} params (L={model.config.n_layer} H={model.config.n_head} "
              f"C={model.config.n_embd} T={block}), {len(tokens):,} tokens, batch {args.batch_size}×{block}, "
              f"{args.dtype} on {args.device}", flush=True)

    records = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        x, y = batches(step)
        loss_sum = 0.0
        for xs, ys in zip(np.split(x, m), np.split(y, m)):
            _, loss = model(xs, ys)
            (loss * (1.0 / m)).backward()
            loss_sum += loss.item()
        norm = clip_grad_norm(model.parameters(), args.grad_clip)
        opt.lr = cosine_lr(step, max_lr=args.lr, warmup_steps=args.warmup, total_steps=args.steps, min_lr=args.min_lr)
        opt.step()
        opt.zero_grad()
        ms = (time.perf_counter() - t0) * 1e3
        record = {"step": step + 1, "steps": args.steps, "loss": loss_sum / m, "lr": opt.lr, "grad_norm": norm,
                  "tokens_per_s": x.size / (ms / 1e3), "ms": ms}
        records.append(record)
        report(record, args.json)
        if val_batches and args.eval_interval and ((step + 1) % args.eval_interval == 0 or step + 1 == args.steps):
            val = {"step": step + 1, "val_loss": evaluate(model, val_batches, args.eval_batches)}
            records.append(val)
            report(val, args.json)
    if args.out:
        model.save_hf(args.out)
        if not args.json:
            print(f"saved {args.out}/model.safetensors and config.json", flush=True)
    return records
