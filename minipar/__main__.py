"""``python -m minipar {train,generate,trace-plot,export} ...`` — run ``python -m minipar <command> --help`` for the flags."""
from __future__ import annotations

import argparse
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
    from minipar.trace import ascii_chart, load_events, png_chart

    events = load_events(args.trace)
    if not events:
        raise ValueError(f"{args.trace}: no events (was it written by --trace?)")
    print(ascii_chart(events, args.width))
    if args.o:
        png_chart(events, args.o)
        print(f"wrote {args.o}")


def export(args: argparse.Namespace) -> None:
    from minipar.checkpoint import load_checkpoint
    from minipar.models.gpt import GPT

    loaded = load_checkpoint(args.ckpt)
    GPT(loaded.config).save_hf(args.out, loaded.params)
    print(f"exported step {loaded.step} ({loaded.layout_name}) to {args.out}/ (config.json + model.safetensors)")


def build_parser() -> argparse.ArgumentParser:
    from minipar.train import add_arguments

    parser = argparse.ArgumentParser(prog="python -m minipar", description=__doc__.split("—")[0].strip(" `"))
    commands = parser.add_subparsers(dest="command", required=True, metavar="{train,generate,trace-plot,export}")
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
    plot = commands.add_parser("trace-plot", help="draw a --trace timeline (ASCII, or PNG with -o)",
                               description="Draw the per-rank timeline written by train --trace.")
    plot.add_argument("trace", metavar="TRACE.json")
    plot.add_argument("-o", metavar="OUT.png", help="also write the chart as a PNG")
    plot.add_argument("--width", type=int, default=100, help="columns of the ASCII chart")
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
            {"generate": generate, "trace-plot": trace_plot, "export": export}[args.command](args)
    except (ValueError, FileNotFoundError, KeyError, RuntimeError, OSError) as e:
        print(f"minipar {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
