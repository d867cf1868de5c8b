"""``python -m minipar {train,generate,plan,trace-plot,plot,export} ...`` — run ``python -m minipar <command> --help`` for the flags."""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys



def generate(args: argparse.Namespace) -> None:
    from minipar.backend import set_device
    from minipar.data import tokenizer_for
    from minipar.models.gpt import GPT

    set_device(args.device)
    model = GPT.from_hf(args.ckpt)
    tok = tokenizer_for(args.ckpt, model.config.vocab_size)
    prompt = tok.encode(args.prompt)
    if len(prompt) == 0:
        raise ValueError("--prompt must not be empty")
    for i in range(args.num_samples):
        out = model.generate(prompt[None, :], args.max_new_tokens, args.temperature, args.top_k, seed=args.seed + i)
        print(tok.decode(out[0]), flush=True)
        if i + 1 < args.num_samples:
            print("-" * 40)


def trace_plot(args: argparse.Namespace) -> None:
    from minipar.plot import ascii_chart, load_events, timeline_png

    events = load_events(args.trace)
    if not events:
        raise ValueError(f"{args.trace}: no events (was it written by --trace?)")
    print(ascii_chart(events, args.width))
    if args.o:
        timeline_png(events, args.o)
        print(f"wrote {args.o}")


def plot_command(args: argparse.Namespace) -> None:
    from minipar.plot import ascii_loss_chart, load_run, loss_png, summary

    names = [os.path.splitext(os.path.basename(p))[0] for p in args.runs]
    if len(set(names)) < len(names):
        names = list(args.runs)
    runs = {name: load_run(path) for name, path in zip(names, args.runs)}
    print(summary(runs))
    print(ascii_loss_chart(runs, args.width))
    if args.o:
        loss_png(runs, args.o)
        print(f"wrote {args.o}")


def export(args: argparse.Namespace) -> None:
    from minipar.checkpoint import load_checkpoint
    from minipar.models.gpt import GPT

    loaded = load_checkpoint(args.ckpt)
    GPT(loaded.config).save_hf(args.out, loaded.params)
    print(f"exported step {loaded.step} ({loaded.layout_name}) to {args.out}/ (config.json + model.safetensors)")


def plan_command(args: argparse.Namespace) -> None:
    from minipar.comm import Communicator
    from minipar.models.gpt import GPTConfig
    from minipar.parallel import planner

    if args.calibrate:
        comm = Communicator()
        profile = planner.calibrate(comm)
        if comm.rank == 0:
            path = args.profile or planner.default_profile_path(comm.size)
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            profile.save(path)
            print(f"calibrated on {comm.size} rank(s): {profile.flops / 1e9:.1f} GFLOP/s GEMM, "
                  f"{profile.bandwidth / 1e9:.1f} GB/s, {profile.op_overhead * 1e6:.0f} µs framework time per layer, "
                  f"α = {profile.intra.alpha * 1e6:.1f} µs, 1/β = {1 / max(profile.intra.beta, 1e-30) / 1e9:.2f} GB/s -> {path}")
        return
    if args.preset:
        L, H, C, T, V = planner.PRESETS[args.preset]
    else:
        L, H, C, T, V = args.n_layer, args.n_head, args.n_embd, args.block_size, 256
    cfg = GPTConfig(vocab_size=V, block_size=T, n_layer=L, n_head=H, n_embd=C)
    profile = planner.load_profile(args.profile, args.world)
    if args.memory_gb:
        profile = dataclasses.replace(profile, memory=args.memory_gb * 1e9)
    itemsize = planner.ITEMSIZE[args.dtype]
    predictions = planner.plan(cfg, args.world, args.batch_size, profile, itemsize, args.recompute)
    if args.layout:
        wanted = dict(part.split("=") for part in args.layout.split(","))
        predictions = [p for p in predictions if all(str(getattr(p.layout, k)) == v for k, v in wanted.items())]
        if not predictions:
            raise ValueError(f"no feasible-or-not layout matches {args.layout}")
    flops = lambda layout: planner.megatron_flops(cfg, args.batch_size, layout.recompute)  # noqa: E731
    print(f"GPT L={L} H={H} C={C} T={T} V={V} ({cfg.num_parameters() / 1e6:,.1f} M params), "
          f"batch {args.batch_size}, {args.dtype}, {args.world} × {profile.name} ({profile.memory / 1e9:.0f} GB)")
    print(planner.format_plan(predictions, args.top, flops))


def build_parser() -> argparse.ArgumentParser:
    from minipar.train import add_arguments

    parser = argparse.ArgumentParser(prog="python -m minipar", description=__doc__.split("—")[0].strip(" `"))
    commands = parser.add_subparsers(dest="command", required=True, metavar="{train,generate,plan,trace-plot,plot,export}")
    train = commands.add_parser("train", help="train a GPT (single process or under mpiexec)",
                                description="Train a GPT on the default corpus (this Python's standard library source) or --data.")
    add_arguments(train)
    gen = commands.add_parser("generate", help="sample text from a checkpoint",
                              description="Sample text from a minipar or Hugging Face GPT-2 checkpoint directory.")
    gen.add_argument("--ckpt", required=True, metavar="DIR", help="directory with config.json + model.safetensors")
    gen.add_argument("--prompt", default="def ")
    gen.add_argument("--max-new-tokens", type=int, default=200)
    gen.add_argument("--temperature", type=float, default=0.8)
    gen.add_argument("--top-k", type=int, default=40)
    gen.add_argument("--num-samples", type=int, default=1)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    pl = commands.add_parser("plan", help="rank every parallel layout by predicted step time and memory",
                             description="Predict step time and memory of every dp·tp·pp·zero·microbatch layout "
                                         "from a hardware profile, and rank them (minipar/parallel/planner.py).")
    pl.add_argument("--world", type=int, default=4, help="number of devices (ranks)")
    pl.add_argument("--preset", choices=["gpt2-124m", "gpt3-175b"], help="a known model instead of the --n-* flags")
    pl.add_argument("--n-layer", type=int, default=4)
    pl.add_argument("--n-head", type=int, default=4)
    pl.add_argument("--n-embd", type=int, default=128)
    pl.add_argument("--block-size", type=int, default=128)
    pl.add_argument("--batch-size", type=int, default=16)
    pl.add_argument("--dtype", choices=["float64", "float32", "bfloat16", "float16"], default="float32")
    pl.add_argument("--profile", help="a100-80gb, h100-80gb, or a profile JSON (default: this machine's calibration)")
    pl.add_argument("--memory-gb", type=float, help="override the profile's device memory")
    pl.add_argument("--recompute", action="store_true", help="also consider activation recomputation (what-if)")
    pl.add_argument("--layout", help="show only layouts matching e.g. dp=8,tp=8,pp=16")
    pl.add_argument("--top", type=int, default=10)
    pl.add_argument("--calibrate", action="store_true",
                    help="measure this machine and save its profile (run under mpiexec -n WORLD)")
    tplot = commands.add_parser("trace-plot", help="draw a --trace timeline (text, and a PNG with -o)",
                                description="Draw the per-rank timeline written by train --trace.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    tplot.add_argument("trace", metavar="TRACE.json")
    tplot.add_argument("-o", metavar="OUT.png", help="also draw it as a picture (needs: pip install 'minipar[plot]')")
    tplot.add_argument("--width", type=int, default=100, help="columns of the text chart")
    lplot = commands.add_parser("plot", help="draw loss curves of one or more runs (text, and a PNG with -o)",
                                description="Draw the training and validation loss of runs recorded with "
                                            "train --json > RUN.jsonl (or --log-file RUN.jsonl), on one chart.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    lplot.add_argument("runs", nargs="+", metavar="RUN.jsonl")
    lplot.add_argument("-o", metavar="OUT.png", help="also draw it as a picture (needs: pip install 'minipar[plot]')")
    lplot.add_argument("--width", type=int, default=72, help="columns of the text chart")
    exp = commands.add_parser("export", help="write a sharded checkpoint as one Hugging Face GPT-2 directory",
                              description="Merge a checkpoint saved by train --save (any dp/tp/pp/zero layout) into "
                                          "config.json + model.safetensors.")
    exp.add_argument("--ckpt", required=True, metavar="DIR", help="the --save directory, or one step_NNNNNN in it")
    exp.add_argument("--out", required=True, metavar="DIR")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "train":
            from minipar.train import train

            train(args)
        else:
            {"generate": generate, "plan": plan_command, "trace-plot": trace_plot, "plot": plot_command,
             "export": export}[args.command](args)
    except (ValueError, FileNotFoundError, KeyError, RuntimeError, OSError) as e:
        print(f"minipar {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
