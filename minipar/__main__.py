"""``python -m minipar {train,generate,plan,trace-plot,plot,export} ...`` (or the ``minipar`` console script) — run
``python -m minipar <command> --help`` for the flags.

Failures under mpiexec. Any error on any rank ends the whole job within seconds. A rank that fails
waits up to AGREE_SECONDS for the others in a barrier on a communicator of its own: if every rank
fails at the same point (bad input, which every rank checks identically before communicating, or a
diverged step, whose loss every rank shares), rank 0 prints the error once and all exit with 2.
Otherwise the failing rank prints one line naming itself and calls MPI_Abort, which ends every rank.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
import traceback
from typing import Any

AGREE_SECONDS = 3.0


def generate(args: argparse.Namespace) -> None:
    import numpy as np

    from minipar.backend import set_device
    from minipar.data import tokenizer_for
    from minipar.models import build_model, from_hf

    set_device(args.device)
    source = args.ckpt  # where the tokenizer files are: the HF directory, or the training checkpoint's step
    if os.path.isfile(os.path.join(args.ckpt, "config.json")):
        model = from_hf(args.ckpt)
    else:  # a training checkpoint (train --save): its newest complete step, merged from any layout
        from minipar.checkpoint import load_checkpoint

        try:
            loaded = load_checkpoint(args.ckpt)
        except FileNotFoundError:
            raise FileNotFoundError(f"{args.ckpt}: no config.json (a Hugging Face directory) and no training "
                                    "checkpoint (a train --save directory)") from None
        model = build_model(loaded.config)
        model.load_state_dict(loaded.params)
        source = loaded.path
    if hasattr(model.config, "cache_bytes_per_token"):  # DeepSeek: what multi-head latent attention caches
        itemsize, cfg = np.dtype(model.config.dtype).itemsize, model.config
        print(f"latent KV cache: {cfg.cache_bytes_per_token(itemsize):,} bytes per token (L·(kv_lora_rank + "
              f"qk_rope_head_dim)·{itemsize}); expanded keys and values would take "
              f"{cfg.cache_bytes_per_token(itemsize, latent=False):,}", file=sys.stderr)
    tok = tokenizer_for(source, model.config.vocab_size)
    prompt = tok.encode(args.prompt)
    if len(prompt) == 0:
        raise ValueError("--prompt must not be empty")
    for i in range(args.num_samples):
        out = model.generate(prompt[None, :], args.max_new_tokens, args.temperature, args.top_k, seed=args.seed + i)
        print(tok.decode(out[0]), flush=True)
        if i + 1 < args.num_samples:
            print("-" * 40)


def figures(args: argparse.Namespace) -> None:
    from minipar.figures import make_all

    make_all(args.out, only=tuple(args.only))


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
    from minipar.models import build_model

    loaded = load_checkpoint(args.ckpt)
    build_model(loaded.config).save_hf(args.out, loaded.params, tokenizer=loaded.path)  # its tokenizer files, or bytes
    print(f"exported step {loaded.step} ({loaded.layout}) to {args.out}/ (config.json, model.safetensors and the "
          "tokenizer files)")


def plan_command(args: argparse.Namespace) -> None:
    from minipar.comm import Communicator
    from minipar.models import config_from_dict
    from minipar.parallel import planner
    from minipar.parallel.calibration import calibrate

    if args.calibrate:
        comm = Communicator()
        profile = calibrate(comm)
        if comm.rank == 0:
            path = planner.save_calibration(profile, comm.size, args.profile)
            link = (f", α = {profile.intra.alpha * 1e6:.1f} µs, 1/β = {1 / max(profile.intra.beta, 1e-30) / 1e9:.2f} GB/s"
                    if comm.size > 1 else "")
            print(f"calibrated on {comm.size} rank(s), each rank while all compute: {profile.flops / 1e9:.1f} GFLOP/s "
                  f"GEMM, {profile.bandwidth / 1e9:.1f} GB/s; a layer {profile.passes_act:.0f} passes over t·C, "
                  f"{profile.passes_att:.0f} over b·H·T², {profile.op_overhead * 1e6:.0f} µs; a microbatch "
                  f"{profile.microbatch_overhead * 1e6:.0f} µs{link} -> {path}")
        return
    if args.validate:
        from minipar.parallel import validation

        print("The planner against published runs (minipar/parallel/validation.py; A100-80GB profile):")
        print(validation.report(planner.BUILTIN_PROFILES["a100-80gb"]))
        return
    for name in ("world", "batch_size", "n_layer", "n_head", "n_embd", "block_size", "top"):
        if getattr(args, name, 1) is not None and getattr(args, name, 1) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.preset:
        fields = dict(planner.PRESETS[args.preset])
    else:
        fields = dict(arch=args.arch, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                      block_size=args.block_size, vocab_size=256)
        if args.arch == "llama":
            fields.update(n_kv_head=args.n_kv_head or 0, n_inner=args.n_inner or 0)
    cfg = config_from_dict({**fields, "n_expert": args.n_expert, "capacity_factor": args.capacity_factor,
                            "expert_top_k": min(args.expert_top_k, max(args.n_expert, 1))})
    L, H, C, T, V = cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.block_size, cfg.vocab_size
    profile = plan_profile(args)
    if args.memory_gb:
        profile = dataclasses.replace(profile, memory=args.memory_gb * 1e9)
    if args.fp8_recipe and args.dtype not in (None, "bfloat16"):
        raise ValueError(f"--fp8-recipe plans FP8 training, which stores in bfloat16: drop --dtype {args.dtype}")
    dtype = "bfloat16" if args.fp8_recipe else args.dtype or "float32"
    predictions = planner.plan(cfg, args.world, args.batch_size, profile, planner.ITEMSIZE[dtype], args.recompute,
                               not args.no_context, fp8_recipe=args.fp8_recipe)
    if args.layout:
        wanted = dict(part.split("=") for part in args.layout.split(","))
        predictions = [p for p in predictions if all(str(getattr(p.layout, k)) == v for k, v in wanted.items())]
        if not predictions:
            raise ValueError(f"no feasible-or-not layout matches {args.layout}")
    flops = lambda layout: planner.megatron_flops(cfg, args.batch_size, layout.recompute == "full")  # noqa: E731
    experts = f" E={cfg.n_expert} top-{cfg.expert_top_k}" if cfg.n_expert else ""
    kv = f" K={cfg.kv_heads}" if cfg.kv_heads != H else ""
    model_flags = plan_train_flags(args, cfg, dtype)
    if args.check:
        check_predictions(predictions, model_flags, args)
        return
    if args.json:
        for prediction in predictions[:args.top]:
            print(json.dumps(planner.prediction_record(prediction, model_flags)))
        return
    print(f"{cfg.display_name} L={L} H={H}{kv} C={C} T={T} V={V}{experts} ({cfg.num_parameters() / 1e6:,.1f} M params), "
          f"batch {args.batch_size}, {dtype}, {args.world} × {profile.name} ({profile.memory / 1e9:.0f} GB)")
    if args.fp8_recipe:
        print(planner.fp8_assumptions(args.fp8_recipe, profile))
    print(planner.format_plan(predictions, args.top, flops))


def plan_train_flags(args: argparse.Namespace, cfg: Any, dtype: str) -> list[str]:
    """The ``train`` flags of the planned model, batch and precision (a layout's own: Layout.flags)."""
    flags = ["--arch", cfg.arch, "--n-layer", str(cfg.n_layer), "--n-head", str(cfg.n_head), "--n-embd",
             str(cfg.n_embd), "--block-size", str(cfg.block_size), "--batch-size", str(args.batch_size)]
    if cfg.arch == "llama":
        flags += ["--n-kv-head", str(cfg.kv_heads), "--n-inner", str(cfg.mlp_width)]
    if cfg.n_expert:
        flags += ["--n-expert", str(cfg.n_expert), "--expert-top-k", str(cfg.expert_top_k), "--capacity-factor",
                  str(cfg.capacity_factor)]
    if args.fp8_recipe:
        return flags + ["--precision", "fp8", "--fp8-recipe", args.fp8_recipe]
    return flags + (["--precision", "bf16-mixed"] if dtype == "bfloat16" else ["--dtype", dtype])


def check_predictions(predictions: list[Any], model_flags: list[str], args: argparse.Namespace) -> None:
    """``plan --check K``: run the K best predicted layouts and plain data parallelism for ``--check-steps`` steps
    each, with the very flags ``train`` takes (``mpiexec -n WORLD python -m minipar train ...``), and print the
    predicted step time beside the measured one (planner.steady_step_ms), with the error; the measured best
    last. One run at a time: each has the machine."""
    from minipar.parallel.layout import Layout
    from minipar.parallel.planner import check_steps_accepted, shortlist, steady_step_ms
    from minipar.testing import train_cli

    chosen = shortlist(predictions, args.check, Layout(dp=args.world))
    check_steps_accepted(args.check_steps)
    print(f"{'layout':<44}{'predicted ms':>13}{'measured ms':>13}{'error':>8}", flush=True)
    measured = []
    for prediction in chosen:
        flags = [*prediction.layout.flags(), *model_flags, "--steps", str(args.check_steps), "--warmup", "1",
                 "--eval-interval", "0", "--json", "--log-interval", "1"]
        try:  # as the user's mpiexec runs it: each rank its share of the cores for BLAS
            records = train_cli(flags, args.world, timeout=args.check_timeout, one_thread=False)[0]
        except AssertionError as e:
            raise RuntimeError(f"{prediction.layout}: train failed: {str(e).strip().splitlines()[-1]}") from None
        ms = steady_step_ms(records)
        measured.append((ms, prediction))
        error = (prediction.step_time * 1e3 - ms) / ms
        print(f"{str(prediction.layout):<44}{prediction.step_time * 1e3:>13.1f}{ms:>13.1f}{error:>+8.0%}", flush=True)
    best_ms, best = min(measured, key=lambda pair: pair[0])
    print(f"measured best: {best.layout} ({best_ms:.1f} ms/step; predicted first: {chosen[0].layout}) -> train flags: "
          f"{' '.join(best.layout.flags())}")


def plan_profile(args: argparse.Namespace) -> Any:
    """--profile, else this machine's calibration for --world ranks — measured now (mpiexec -n WORLD, a few
    seconds) when missing and the world fits this machine; else the stated default, a100-80gb."""
    from minipar.parallel import planner
    from minipar.testing import mpiexec, rank_environment

    try:
        return planner.load_profile(args.profile, args.world)
    except FileNotFoundError:
        if args.profile:
            raise
    if args.world > 4 * (os.cpu_count() or 1):
        print(f"no profile given and {args.world} ranks is more than this machine can calibrate: "
              f"using --profile a100-80gb", file=sys.stderr, flush=True)
        return planner.BUILTIN_PROFILES["a100-80gb"]
    path = planner.default_profile_path(args.world)
    print(f"no calibration of this machine for {args.world} rank(s) yet: measuring it "
          f"(mpiexec -n {args.world} python -m minipar plan --calibrate) -> {path}", file=sys.stderr, flush=True)
    command = [mpiexec(), "-n", str(args.world), sys.executable, "-m", "minipar", "plan", "--calibrate", "--profile", path]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600,  # BLAS threads as train's ranks have
                          env=rank_environment(one_thread=False))
    if done.returncode:
        raise RuntimeError(f"calibration failed (exit {done.returncode}): {done.stderr.strip()[-500:]}")
    return planner.load_profile(path, args.world)


def build_parser() -> argparse.ArgumentParser:
    from minipar.cli import HelpWithDefaults, add_arguments
    from minipar.precision import RECIPES

    parser = argparse.ArgumentParser(prog="python -m minipar", description=__doc__.split("(or")[0].strip(" `"))
    commands = parser.add_subparsers(dest="command", required=True, metavar="{train,generate,plan,trace-plot,plot,export}")
    train = commands.add_parser("train", help="train a GPT (single process or under mpiexec)", allow_abbrev=False,
                                formatter_class=HelpWithDefaults,
                                description="Train a GPT on the default corpus (this Python's standard library source) or --data.")
    add_arguments(train)
    gen = commands.add_parser("generate", help="sample text from a checkpoint",
                              formatter_class=HelpWithDefaults,
                              description="Sample text from a Hugging Face GPT-2 directory (train --out, export) or "
                                          "a training checkpoint (train --save).")
    gen.add_argument("--ckpt", required=True, metavar="DIR",
                     help="config.json + model.safetensors, or a train --save directory")
    gen.add_argument("--prompt", default="def ", help="text to continue")
    gen.add_argument("--max-new-tokens", type=int, default=200, help="tokens to sample")
    gen.add_argument("--temperature", type=float, default=0.8, help="softmax temperature")
    gen.add_argument("--top-k", type=int, default=40, help="sample among the k most likely tokens")
    gen.add_argument("--num-samples", type=int, default=1, help="independent samples")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed")
    gen.add_argument("--device", choices=["cpu", "gpu"], default="cpu", help="where to run")
    pl = commands.add_parser("plan", help="rank every parallel layout by predicted step time and memory",
                             formatter_class=HelpWithDefaults,
                             description="Predict step time and memory of every dp·tp·pp·zero·microbatch layout "
                                         "from a hardware profile, and rank them (minipar/parallel/planner.py).")
    pl.add_argument("--world", type=int, default=4, help="number of devices (ranks)")
    pl.add_argument("--preset", choices=["gpt2-124m", "gpt3-175b", "llama3-8b"],
                    help="a known model instead of the --arch/--n-* flags")
    pl.add_argument("--arch", choices=["gpt2", "llama"], default="gpt2", help="the architecture (as train's)")
    pl.add_argument("--n-layer", type=int, default=4, help="transformer blocks")
    pl.add_argument("--n-head", type=int, default=4, help="attention heads")
    pl.add_argument("--n-kv-head", type=int, help="llama: key/value heads (default: --n-head)")
    pl.add_argument("--n-inner", type=int, help="llama: the SwiGLU width (default: Meta's rule)")
    pl.add_argument("--n-embd", type=int, default=128, help="model width")
    pl.add_argument("--block-size", type=int, default=128, help="context length")
    pl.add_argument("--n-expert", type=int, default=0, help="mixture of experts per MLP (0: dense)")
    pl.add_argument("--expert-top-k", type=int, default=2, help="experts per token")
    pl.add_argument("--capacity-factor", type=float, default=1.25, help="expert capacity factor")
    pl.add_argument("--batch-size", type=int, default=16, help="global batch, in sequences")
    pl.add_argument("--dtype", choices=["float64", "float32", "bfloat16", "float16"],
                    help="activation and message element type (default: float32; bfloat16 with --fp8-recipe)")
    pl.add_argument("--fp8-recipe", choices=list(RECIPES),
                    help="plan --precision fp8 training under this recipe (its GEMMs at the profile's FP8 rate)")
    pl.add_argument("--profile", help="a100-80gb, h100-80gb, or a profile JSON (default: this machine's calibration "
                                      "for --world ranks, measured on first use)")
    pl.add_argument("--memory-gb", type=float, help="override the profile's device memory")
    pl.add_argument("--recompute", action="store_true", help="also consider activation recomputation (selective and full)")
    pl.add_argument("--layout", help="show only layouts matching e.g. dp=8,tp=8,pp=16 (or cp=2,sp=True, ep=2)")
    pl.add_argument("--no-context", action="store_true",
                    help="leave out context and sequence parallelism (the published 2021 runs had neither)")
    pl.add_argument("--top", type=int, default=10, help="layouts to print")
    pl.add_argument("--validate", action="store_true",
                    help="predict published large-scale runs (Megatron-LM 2021/2022) and print the errors")
    pl.add_argument("--calibrate", action="store_true",
                    help="measure this machine and save its profile (run under mpiexec -n WORLD)")
    pl.add_argument("--json", action="store_true",
                    help="one JSON object per candidate: its train flags, predicted step time and terms, memory")
    pl.add_argument("--check", type=int, default=0, metavar="K",
                    help="run the K best predicted layouts and plain dp with train on this machine, print predicted "
                         "against measured, and the measured best")
    pl.add_argument("--check-steps", type=int, default=16, help="--check: steps per run (the first half not timed)")
    pl.add_argument("--check-timeout", type=float, default=600.0, help="--check: seconds a run may take")
    la = commands.add_parser("launch", help="run train under mpiexec; restart it from the newest checkpoint when a rank "
                                            "dies, on fewer ranks if a host keeps failing", allow_abbrev=False,
                             formatter_class=HelpWithDefaults, usage="%(prog)s -n N [options] -- train TRAIN_FLAGS",
                             description="Supervise a training job: restart it from the newest complete checkpoint "
                                         "(--save, or --local-save when newer) after a fault, up to --max-restarts "
                                         "times; drop a host that fails twice in a row while --min-ranks allows. "
                                         "Ctrl-C stops the job at its step's end, and the launcher with it.")
    la.add_argument("-n", type=int, required=True, help="ranks to start")
    la.add_argument("--hosts", help="comma-separated hosts, filled --ppn ranks each in order (mpiexec -hosts)")
    la.add_argument("--ppn", type=int, help="ranks per host (with --hosts)")
    la.add_argument("--max-restarts", type=int, default=3, help="restarts before giving up")
    la.add_argument("--min-ranks", type=int, help="fewest ranks to go on with after dropping a failing host "
                                                  "(default: -n, never shrink)")
    la.add_argument("--bootstrap", help="how mpiexec starts remote ranks (its -launcher: ssh, rsh, fork, slurm, ...)")
    la.add_argument("command_line", nargs=argparse.REMAINDER, metavar="-- train ...",
                    help="the train command and its flags (--save required)")
    fig = commands.add_parser("figures", help="draw every figure of the docs from the engine's own objects (SVG)",
                              formatter_class=HelpWithDefaults,
                              description="Regenerate the docs' figures: pipeline schedules (planned and measured), ring "
                                          "collectives, ZeRO memory, the mesh, the planner against published runs, "
                                          "loss per precision, expert load, activation memory (needs: pip install "
                                          "'minipar[plot]').")
    fig.add_argument("--out", default=os.path.join("docs", "figures"), metavar="DIR", help="where the SVGs go")
    fig.add_argument("--only", nargs="+", default=(), metavar="NAME.svg", help="draw only these figures")
    tplot = commands.add_parser("trace-plot", help="draw a --trace timeline (text, and a PNG with -o)",
                                description="Draw the per-rank timeline written by train --trace.",
                                formatter_class=HelpWithDefaults)
    tplot.add_argument("trace", metavar="TRACE.json")
    tplot.add_argument("-o", metavar="OUT.png", help="also draw it as a picture (needs: pip install 'minipar[plot]')")
    tplot.add_argument("--width", type=int, default=100, help="columns of the text chart")
    lplot = commands.add_parser("plot", help="draw loss curves of one or more runs (text, and a PNG with -o)",
                                description="Draw the training and validation loss of runs recorded with "
                                            "train --json > RUN.jsonl (or --log-file RUN.jsonl), on one chart.",
                                formatter_class=HelpWithDefaults)
    lplot.add_argument("runs", nargs="+", metavar="RUN.jsonl")
    lplot.add_argument("-o", metavar="OUT.png", help="also draw it as a picture (needs: pip install 'minipar[plot]')")
    lplot.add_argument("--width", type=int, default=72, help="columns of the text chart")
    exp = commands.add_parser("export", help="write a sharded checkpoint as one Hugging Face GPT-2 directory",
                              formatter_class=HelpWithDefaults,
                              description="Merge a checkpoint saved by train --save (any dp/tp/pp/zero layout) into "
                                          "config.json + model.safetensors.")
    exp.add_argument("--ckpt", required=True, metavar="DIR", help="the --save directory, or one step_NNNNNN in it")
    exp.add_argument("--out", required=True, metavar="DIR", help="the Hugging Face directory to write")
    return parser


def explicit_flags(argv: list[str]) -> set[str]:
    """The destinations of the long options written on the command line (abbreviations are disabled)."""
    return {token[2:].split("=", 1)[0].replace("-", "_") for token in argv if token.startswith("--")}


def parallel_world() -> Any:
    """Under mpiexec with more than one rank: a private duplicate of COMM_WORLD for agreeing on failures
    (made before any other communication, so it cannot be confused with the job's own); else None."""
    from mpi4py import MPI

    return MPI.COMM_WORLD.Dup() if MPI.COMM_WORLD.Get_size() > 1 else None


def fail(command: str, error: BaseException, agree: Any) -> int:
    """Report ``error`` once and end this rank's part of the job (see the module docstring)."""
    message = str(error) if isinstance(error, (ValueError, OSError, RuntimeError, KeyError)) else \
        f"{type(error).__name__}: {error}\n{traceback.format_exc()}"
    if agree is None:
        print(f"minipar {command}: error: {message}", file=sys.stderr, flush=True)
        return 2
    barrier, deadline = agree.Ibarrier(), time.monotonic() + AGREE_SECONDS
    while not barrier.Test():
        if time.monotonic() > deadline:
            print(f"minipar {command}: error on rank {agree.Get_rank()} of {agree.Get_size()}: {message}",
                  file=sys.stderr, flush=True)
            from mpi4py import MPI

            time.sleep(0.5)  # let mpiexec forward the line: MPI_Abort's kill can overtake the rank's output
            MPI.COMM_WORLD.Abort(2)
            os._exit(2)  # should MPI_Abort come back (seen once under load), the loop must not print again
        time.sleep(0.005)
    messages = agree.gather(message, root=0)  # every rank failed here: rank 0 speaks for all
    if agree.Get_rank() == 0:
        distinct = list(dict.fromkeys(messages))
        if len(distinct) == 1:
            print(f"minipar {command}: error: {message}", file=sys.stderr, flush=True)
        else:
            for rank, text in enumerate(messages):
                print(f"minipar {command}: error on rank {rank}: {text}", file=sys.stderr, flush=True)
    return 2


def parse(argv: list[str]) -> argparse.Namespace:
    """The command line's arguments, with the set of flags written on it (``explicit``)."""
    args = build_parser().parse_args(argv)
    args.explicit = explicit_flags(argv)
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    agree = parallel_world() if args.command in ("train", "plan") else None
    try:
        if args.command == "train":
            from minipar.train import train

            train(args)
        elif args.command == "launch":
            from minipar.launch import launch

            return launch(args, lambda flags: parse(["train", *flags]))
        else:
            {"generate": generate, "plan": plan_command, "figures": figures, "trace-plot": trace_plot,
             "plot": plot_command, "export": export}[args.command](args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 (whatever failed, no rank may be left waiting)
        from minipar.cli import Interrupted

        if isinstance(e, Interrupted):
            return 128 + e.signum  # stopped on request at a step's end: 130 for SIGINT, 143 for SIGTERM
        if agree is None and not isinstance(e, (ValueError, OSError, RuntimeError, KeyError)):
            raise  # a bug in a single process: the full traceback
        return fail(args.command, e, agree)
    return 0


if __name__ == "__main__":
    sys.exit(main())
