"""The command line of ``python -m minipar train``: its flags (argument groups, defaults in ``--help``), every
check made before any work (one line per refusal, the same verdict on every rank), ``--auto``'s planning, and
what rank 0 prints — a progress line or JSON object per step, evaluations, the closing summary.

``train.py`` assembles and runs the job; this module decides what the job is and reports on it.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import signal
import sys
import tempfile
import time
from typing import TYPE_CHECKING, Any, Callable

import numpy as np


from minipar.backend import KERNEL_MODES, memory_available
from minipar.checkpoint import Checkpoint
from minipar.comm import Communicator
from minipar.data import Batches, load_tokens, split_tokens, tokenizer_for
from minipar.models import config_from_hf, exports_experts
from minipar.models.gpt import RECOMPUTE, GPTConfig
from minipar.models.deepseek import DeepSeekConfig
from minipar.models.llama import LlamaConfig
from minipar.models.qwen3 import Qwen3Config
from minipar.parallel import planner
from minipar.parallel.calibration import calibrate
from minipar.parallel.compression import COMPRESSIONS
from minipar.parallel.context_parallel import KINDS as CP_KINDS
from minipar.parallel.context_parallel import SPLITS as CP_SPLITS
from minipar.parallel.layout import Layout
from minipar.parallel.schedules import SCHEDULES
from minipar.precision import RECIPES

if TYPE_CHECKING:  # annotations only
    from minipar.parallel.local_sgd import LocalSGD
    from minipar.parallel.mesh import Mesh
    from minipar.parallel.pipeline import Pipeline


class HelpWithDefaults(argparse.HelpFormatter):
    """``--help`` shows each option's default (except unset options and switches)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        unset = action.default is None or action.default is False or action.default == argparse.SUPPRESS
        if action.option_strings and not unset and "%(default)" not in text:
            text += " (default: %(default)s)"
        return text


def boolean(text: str) -> bool:
    """A true/false flag value."""
    if text.lower() not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return text.lower() == "true"


def add_arguments(p: argparse.ArgumentParser) -> None:
    model = p.add_argument_group("model")
    model.add_argument("--arch", choices=["gpt2", "llama", "deepseek", "qwen3"], default="gpt2",
                       help="gpt2: learned positions, LayerNorm, GELU MLP, tied head; llama: RoPE, RMSNorm, SwiGLU, "
                            "grouped-query attention, no biases, untied head (models/llama.py); deepseek: Llama with "
                            "DeepSeek-V3's multi-head latent attention and multi-token prediction (models/deepseek.py); "
                            "qwen3: Llama with per-head QK-norm and its own head width (models/qwen3.py)")
    model.add_argument("--n-layer", type=int, default=4, help="transformer blocks")
    model.add_argument("--n-head", type=int, default=4, help="attention heads")
    model.add_argument("--n-kv-head", type=int, help="llama: key/value heads, a divisor of --n-head (default: --n-head)")
    model.add_argument("--n-inner", type=int, help="llama, deepseek: the SwiGLU width (default: Meta's rule, 8·C/3 "
                                                   "rounded up to a multiple of 256)")
    model.add_argument("--rope-theta", type=float, default=10000.0, help="llama, deepseek: the RoPE base θ")
    model.add_argument("--tie-embeddings", action="store_true",
                       help="llama, deepseek: the head shares the token embedding")
    model.add_argument("--n-head-dim", type=int, default=0,
                       help="qwen3: a head's width (0: C/H)")
    model.add_argument("--q-lora-rank", type=int, default=0,
                       help="deepseek: the query latent's width (0: queries from one projection)")
    model.add_argument("--kv-lora-rank", type=int, default=0,
                       help="deepseek: the key/value latent's width, what a token caches (0: 4·C/H, V3's ratio)")
    model.add_argument("--qk-nope-head-dim", type=int, default=0,
                       help="deepseek: a head's query/key dimensions without position (0: C/H)")
    model.add_argument("--qk-rope-head-dim", type=int, default=0,
                       help="deepseek: the rotated dimensions, one key shared by the heads (0: C/H/2), even")
    model.add_argument("--v-head-dim", type=int, default=0, help="deepseek: a head's value width (0: C/H)")
    model.add_argument("--mtp-depth", type=int, default=0,
                       help="deepseek: multi-token prediction modules D (module k predicts token t+k+1)")
    model.add_argument("--mtp-weight", type=float, default=0.3,
                       help="deepseek: λ, the loss is main + λ/D·Σ_k MTP loss_k (DeepSeek-V3: 0.3, later 0.1)")
    model.add_argument("--n-embd", type=int, default=128, help="model width C")
    model.add_argument("--block-size", type=int, default=128, help="context length T")
    model.add_argument("--init-from", metavar="DIR", help="start from a Hugging Face GPT-2, Llama or DeepSeek-V3 checkpoint directory")
    model.add_argument("--n-expert", type=int, default=0,
                       help="mixture of experts: every MLP becomes this many experts behind a router (0: dense GPT-2)")
    model.add_argument("--expert-top-k", type=int, default=2, help="experts per token (1: Switch gate, >1: renormalized)")
    model.add_argument("--capacity-factor", type=float, default=1.25,
                       help="each expert takes at most ⌈factor·k·tokens/E⌉ tokens per rank and microbatch; the rest drop")
    model.add_argument("--aux-loss-coef", type=float, default=0.01,
                       help="weight of the load-balancing loss (sigmoid router: DeepSeek-V3's sequence-wise one)")
    model.add_argument("--moe-inner", type=int, default=0,
                       help="an expert's width (0: the dense MLP's); narrow experts, many of them: fine-grained")
    model.add_argument("--n-shared-expert", type=int, default=0, help="always-on experts added to every token")
    model.add_argument("--first-dense-layers", type=int, default=0, help="blocks with a dense MLP before the MoE ones")
    model.add_argument("--router", choices=["softmax", "softmax-topk", "sigmoid"], default="softmax",
                       help="softmax: Switch/GShard; softmax-topk: Mixtral, Qwen3-MoE (gates over the k chosen); "
                            "sigmoid: DeepSeek-V3 (a balancing bias, groups, routed scaling)")
    model.add_argument("--norm-topk-prob", type=boolean, default=True, metavar="{true,false}",
                       help="softmax-topk and sigmoid: renormalize the chosen gates (false: Qwen3's "
                            "norm_topk_prob=false)")
    model.add_argument("--routed-scaling", type=float, default=1.0, help="sigmoid: the gates' factor (V3: 2.5)")
    model.add_argument("--expert-groups", type=int, default=1,
                       help="sigmoid: group-limited routing over this many groups of experts (V3: 8)")
    model.add_argument("--topk-groups", type=int, default=1,
                       help="sigmoid: the groups each token may use, the best by their two best scores (V3: 4)")
    model.add_argument("--bias-update", type=float, default=0.0,
                       help="sigmoid: γ of auxiliary-loss-free balancing, each step b_i += γ·sign(mean load − "
                            "load_i) (V3: 0.001; 0: the bias stays)")

    run = p.add_argument_group("optimization")
    run.add_argument("--steps", type=int, default=300, help="optimizer steps")
    run.add_argument("--batch-size", type=int, default=16, help="global batch, in sequences")
    run.add_argument("--microbatches", type=int, default=1, help="gradient-accumulation steps per optimizer step")
    run.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    run.add_argument("--min-lr", type=float, help="learning rate at the end of the cosine decay (default: --lr/10)")
    run.add_argument("--warmup", type=int, help="linear warm-up steps (default: 30, or the whole schedule when "
                                                "--decay-steps is shorter)")
    run.add_argument("--decay-steps", type=int,
                     help="the learning-rate schedule's length (warm-up + cosine decay; default: --steps), as "
                          "Megatron's --lr-decay-iters: give the final --steps on the first leg of a run that "
                          "--resume will continue, so that both legs follow one schedule; past it the rate is --min-lr")
    run.add_argument("--weight-decay", type=float, default=0.1, help="AdamW decoupled weight decay (matrices only)")
    run.add_argument("--grad-clip", type=float, default=1.0, help="max global gradient norm (0: off)")
    run.add_argument("--dtype", choices=["float32", "float64"], default="float32", help="parameters and activations")
    run.add_argument("--precision", choices=list(PRECISIONS), default="fp32",
                     help="bf16-mixed / fp16-mixed: 16-bit parameters, activations, gradients and messages, float32 "
                          "master weights and Adam moments (fp16 with dynamic loss scaling); fp8: bf16-mixed with every "
                          "block's Linear GEMMs on FP8 operands (--fp8-recipe); fp32: --dtype throughout")
    run.add_argument("--fp8-recipe", choices=list(RECIPES), default="tensorwise",
                     help="--precision fp8's scaling: tensorwise (a scale per tensor, e4m3/e5m2), rowwise (per row, "
                          "powers of two), blockwise (DeepSeek-V3: 1x128 tiles, 128x128 weight blocks), mxfp8 (OCP MX: "
                          "e8m0 scale per 32 values)")
    run.add_argument("--fp8-block", type=int, default=None, metavar="N",
                     help="--precision fp8: values per scale of blockwise (default 128) or mxfp8 (32)")
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
    io.add_argument("--local-save", metavar="DIR",
                    help="a fast local tier (e.g. under /dev/shm) checkpointed every --local-save-interval steps besides "
                         "--save; the newest two are kept (python -m minipar launch restarts from the newer tier)")
    io.add_argument("--local-save-interval", type=int, default=0, metavar="K", help="local checkpoint every K steps")
    io.add_argument("--sync-save", action="store_true",
                    help="write checkpoints inside the step (default: the step waits only for a copy in host memory, "
                         "a writer thread writes it)")
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
    par.add_argument("--no-moe-overlap", action="store_true",
                     help="--ep: block on the token exchanges instead of computing the shared experts while they "
                          "travel (to measure the overlap)")
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
    par.add_argument("--check", type=int, default=0, metavar="K",
                     help="--auto: train the K best predicted layouts and plain dp for --check-steps steps each, "
                          "then run the measured fastest")
    par.add_argument("--check-steps", type=int, default=16, help="--check: steps per trial (the first half not timed)")


AUTO_CHOOSES = {"dp", "tp", "pp", "zero", "microbatches", "schedule", "cp", "cp_kind", "sp", "ep", "virtual_stages",
                "cp_split", "shard_group"}  # what --auto decides (and --recompute, unless given)


def choose_layout(args: argparse.Namespace, world: Communicator,
                  trial: Callable[[argparse.Namespace], list[dict[str, Any]]] | None = None) -> None:
    """--auto: rank 0 plans (calibrating this machine if it has no profile yet, and saving that calibration
    for the next run and for ``plan``); every rank takes its choice. A layout flag written beside it is refused:
    the plan would silently replace it. With ``--check K`` the K best predicted layouts (and plain data
    parallelism) each train ``--check-steps`` steps first — ``trial(args)`` runs them, in this world, with the code
    the run itself then runs — and the measured fastest is taken: autotuning by measurement."""
    given = sorted(AUTO_CHOOSES & getattr(args, "explicit", set()))
    if given:
        raise ValueError(f"--auto chooses the layout itself: drop --{given[0].replace('_', '-')}")
    if args.check:
        planner.check_steps_accepted(args.check_steps)
    try:
        profile = planner.load_profile(args.profile, world.size)
    except FileNotFoundError:
        if args.profile:
            raise
        profile = calibrate(world)  # every rank measures; rank 0's numbers decide
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
        shortlist = planner.shortlist(ranked, args.check, Layout(dp=world.size)) if args.check else [best]
        choice = [{**dataclasses.asdict(p.layout), "step_ms": p.step_time * 1e3, "memory_gb": p.memory / 1e9,
                   "candidates": len(ranked)} for p in shortlist]
    else:
        choice = None
    choice = json.loads(world.all_gather_bytes(json.dumps(choice).encode(), label="plan")[0])
    layouts = [Layout(**{f.name: c[f.name] for f in dataclasses.fields(Layout)}) for c in choice]
    say = print if world.rank == 0 and not args.json else lambda *a, **k: None
    pick = 0
    if args.check:
        assert trial is not None, "--check needs a trial runner"
        say(f"auto: checking the {len(layouts)} best predicted of {choice[0]['candidates']} layouts, "
            f"{args.check_steps} steps each", flush=True)
        times = []
        for layout, predicted in zip(layouts, choice):
            records = trial(layout_arguments(args, layout, steps=args.check_steps))
            times.append(planner.steady_step_ms(records))
            say(f"auto:   {str(layout):<44} predicted {predicted['step_ms']:8.1f} ms, measured {times[-1]:8.1f} ms "
                f"({(predicted['step_ms'] - times[-1]) / times[-1]:+.0%})", flush=True)
        times = world.broadcast(np.array(times), root=0, label="plan").tolist()  # rank 0's clock decides
        pick = int(np.argmin(times))
    layout, chosen = layouts[pick], choice[pick]
    take_layout(args, layout)
    if args.check:
        ranked_as = "the planner's first choice too" if pick == 0 else f"predicted first: {layouts[0]}"
        say(f"auto: {layout}, the measured best of {len(times)} checked ({times[pick]:.1f} ms/step measured, "
            f"{chosen['step_ms']:.1f} predicted; {ranked_as}), {chosen['memory_gb']:.3f} GB per rank ({profile.name})",
            flush=True)
    else:
        say(f"auto: {layout} of {chosen['candidates']} layouts, predicted {chosen['step_ms']:.1f} ms/step, "
            f"{chosen['memory_gb']:.3f} GB per rank ({profile.name})", flush=True)


def take_layout(args: argparse.Namespace, layout: Layout) -> None:
    """The layout's choices become the arguments (what --auto decides, and the recomputation)."""
    for name in sorted(AUTO_CHOOSES - {"shard_group"}) + ["recompute"]:
        setattr(args, name, getattr(layout, name))
    args.shard_group = layout.shard_group or None


def layout_arguments(args: argparse.Namespace, layout: Layout, steps: int) -> argparse.Namespace:
    """``args`` for a trial of ``layout`` (--auto --check): its layout flags, ``steps`` steps, nothing saved, evaluated,
    traced or printed — the run itself, shortened."""
    trial = argparse.Namespace(**vars(args))
    take_layout(trial, layout)
    trial.auto, trial.check, trial.steps, trial.decay_steps, trial.warmup = False, 0, steps, None, None
    trial.save = trial.local_save = trial.out = trial.trace = trial.log_file = None
    trial.local_save_interval = trial.save_interval = trial.eval_interval = 0
    trial.peak_memory = False
    trial.explicit = getattr(args, "explicit", set()) - {
        "auto", "check", "check_steps", "profile", "steps", "decay_steps", "warmup", "save", "save_interval",
        "local_save", "local_save_interval", "sync_save", "keep_last", "out", "trace", "log_file", "eval_interval"}
    return trial


PRECISIONS = {"fp32": None, "bf16-mixed": "bfloat16", "fp16-mixed": "float16", "fp8": "bfloat16"}  # -> storage dtype


def model_dtype(args: argparse.Namespace) -> str:
    """What parameters and activations are stored in: --dtype, or the 16-bit type of a mixed --precision."""
    return PRECISIONS[args.precision] or args.dtype


def model_config(args: argparse.Namespace, resumed: Checkpoint | None = None) -> GPTConfig:
    if resumed is not None:
        return dataclasses.replace(resumed.config, dtype=model_dtype(args))
    if args.init_from:
        return config_from_hf(args.init_from, dtype=model_dtype(args))
    shared = dict(vocab_size=256, block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head,
                  n_embd=args.n_embd, dtype=model_dtype(args), n_expert=args.n_expert, expert_top_k=args.expert_top_k,
                  capacity_factor=args.capacity_factor, aux_loss_coef=args.aux_loss_coef,
                  **{name: getattr(args, name) for name in MOE_FLAGS})
    if args.arch in ("llama", "deepseek", "qwen3"):
        llama = dict(n_kv_head=args.n_kv_head or 0, n_inner=args.n_inner or 0, rope_theta=args.rope_theta,
                     tie_word_embeddings=args.tie_embeddings)
        if args.arch == "llama":
            return LlamaConfig(**shared, **llama)
        if args.arch == "qwen3":
            return Qwen3Config(**shared, **llama, n_head_dim=args.n_head_dim)
        return DeepSeekConfig(**shared, **llama, **{name: getattr(args, name) for name in DEEPSEEK_FLAGS})
    return GPTConfig(**shared)


MOE_FLAGS = ("moe_inner", "n_shared_expert", "first_dense_layers", "router", "norm_topk_prob", "routed_scaling",
             "expert_groups", "topk_groups", "bias_update")
DEEPSEEK_FLAGS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "mtp_depth",
                  "mtp_weight")
MODEL_FLAGS = ("arch", "n_layer", "n_head", "n_embd", "block_size", "n_expert", "expert_top_k", "capacity_factor",
               "aux_loss_coef", "n_kv_head", "n_inner", "rope_theta", "tie_embeddings", "n_head_dim", *MOE_FLAGS,
               *DEEPSEEK_FLAGS)
FLAG_FIELDS = {"n_kv_head": "kv_heads", "n_inner": "mlp_width", "tie_embeddings": "tie_word_embeddings"}


# flags that only mean something in some mode: written without it, they are refused (name: (the mode, whether on))
FLAG_NEEDS: dict[str, tuple[str, Any]] = {
    "loss_scale": ("--precision fp16-mixed", lambda a: a.precision == "fp16-mixed"),
    "fp8_recipe": ("--precision fp8", lambda a: a.precision == "fp8"),
    "fp8_block": ("--precision fp8", lambda a: a.precision == "fp8"),
    "expert_top_k": ("--n-expert", lambda a: a.n_expert > 0 or bool(a.resume)),
    "capacity_factor": ("--n-expert", lambda a: a.n_expert > 0 or bool(a.resume)),
    "aux_loss_coef": ("--n-expert", lambda a: a.n_expert > 0 or bool(a.resume)),
    **{name: ("--n-expert", lambda a: a.n_expert > 0 or bool(a.resume)) for name in MOE_FLAGS},
    "topk_ratio": ("--compression topk", lambda a: a.compression == "topk"),
    "powersgd_rank": ("--compression powersgd", lambda a: a.compression == "powersgd"),
    "check": ("--auto", lambda a: a.auto),
    "check_steps": ("--auto --check K", lambda a: a.auto and a.check > 0),
    "outer_lr": ("--local-sgd", lambda a: a.local_sgd > 0),
    "outer_momentum": ("--local-sgd", lambda a: a.local_sgd > 0),
    "staleness": ("--local-sgd", lambda a: a.local_sgd > 0),
    "cp_kind": ("--cp 2 or more", lambda a: a.cp > 1),
    "cp_split": ("--cp 2 or more", lambda a: a.cp > 1),
    "no_prefetch": ("--zero 3", lambda a: a.zero == 3),
    "no_moe_overlap": ("--ep 2 or more", lambda a: a.ep > 1),
    "save_interval": ("--save", lambda a: bool(a.save)),
    "local_save_interval": ("--local-save", lambda a: bool(a.local_save)),
    "local_save": ("--local-save-interval K", lambda a: a.local_save_interval > 0),
    "sync_save": ("--save or --local-save", lambda a: bool(a.save or a.local_save)),
    **{name: ("--arch llama, deepseek or qwen3", lambda a: a.arch in ("llama", "deepseek", "qwen3") or bool(a.resume))
       for name in ("n_inner", "rope_theta", "tie_embeddings")},
    "n_kv_head": ("--arch llama or qwen3", lambda a: a.arch in ("llama", "qwen3") or bool(a.resume)),
    "n_head_dim": ("--arch qwen3", lambda a: a.arch == "qwen3" or bool(a.resume)),
    **{name: ("--arch deepseek", lambda a: a.arch == "deepseek" or bool(a.resume)) for name in DEEPSEEK_FLAGS},
}


def validate(args: argparse.Namespace, world_size: int, resumed: Checkpoint | None) -> tuple[GPTConfig, Layout]:
    """Reject bad input before anything is built or communicated (every rank reaches the same verdict): the run's
    own values here, the parallel layout's rules (and its modes' numbers) in :meth:`Layout.validate`."""
    for name in ("steps", "batch_size", "block_size", "bucket_mb", "eval_batches", "log_interval"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.min_lr is None:  # a tenth of the peak, whatever the peak (2e-4 for the default 2e-3)
        args.min_lr = args.lr / 10
    if args.decay_steps is None:
        args.decay_steps = args.steps
    if args.decay_steps <= 0:
        raise ValueError(f"--decay-steps must be positive, got {args.decay_steps}")
    if args.warmup is None:
        args.warmup = min(30, args.decay_steps)
    for name in ("lr", "min_lr", "warmup", "grad_clip", "weight_decay", "eval_interval", "save_interval", "keep_last",
                 "local_save_interval", "comm_timeout"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    explicit = getattr(args, "explicit", set())  # the flags written on the command line
    if args.min_lr > args.lr:
        raise ValueError(f"--min-lr {args.min_lr:g} is above --lr {args.lr:g}: the cosine schedule would raise the rate")
    if args.loss_scale <= 0:
        raise ValueError(f"--loss-scale must be positive, got {args.loss_scale:g}")
    if args.warmup > args.decay_steps:
        raise ValueError(f"--warmup {args.warmup} is longer than the schedule ({args.decay_steps} steps, "
                         f"{'--decay-steps' if 'decay_steps' in explicit else '--steps'}): the rate would never reach "
                         "--lr; shorten --warmup, or give a run that --resume will continue --decay-steps")
    for name, (needs, has) in FLAG_NEEDS.items():
        if name in explicit and not has(args):
            raise ValueError(f"--{name.replace('_', '-')} has no effect here: it needs {needs}")
    check_output_paths(args)
    layout = Layout.from_args(args, world_size)
    if args.keep_last and not args.save:
        raise ValueError("--keep-last prunes the checkpoints of --save: pass --save DIR too")
    if resumed is not None:
        if resumed.step >= args.steps:
            raise ValueError(f"{resumed.path} is at step {resumed.step}; --steps {args.steps} leaves nothing to train")
        for name in MODEL_FLAGS:
            field = FLAG_FIELDS.get(name, name)  # the config's value in effect (a default resolved)
            saved = getattr(resumed.config, field, None)
            if name in getattr(args, "explicit", ()) and getattr(args, name) != saved:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)} disagrees with the checkpoint "
                                 f"{resumed.path} ({field}={saved}): drop the flag to resume, "
                                 "or start a new run without --resume")
    if args.n_expert < 0 or (args.n_expert and not 1 <= args.expert_top_k <= args.n_expert):
        raise ValueError(f"--expert-top-k {args.expert_top_k} must be between 1 and --n-expert {args.n_expert}"
                         if args.n_expert > 0 else f"--n-expert must be >= 0, got {args.n_expert}")
    if args.precision != "fp32" and args.dtype != "float32":
        raise ValueError(f"--precision {args.precision} stores the model in 16 bits with float32 masters: "
                         f"drop --dtype {args.dtype} (it sets the pure modes)")
    if args.init_from and args.n_expert and resumed is None:
        raise ValueError("--init-from loads a dense Hugging Face model: it cannot be combined with --n-expert")
    cfg = model_config(args, resumed)
    if cfg.n_expert and args.out and not exports_experts(cfg):
        raise ValueError("--out writes a Hugging Face checkpoint, where this mixture of experts has no layout (GPT-2 has "
                         "none; a Llama's routes as Mixtral: --router softmax-topk, --capacity-factor 0, k >= 2, no "
                         "shared experts or dense first layers; a DeepSeek's as V3: --router sigmoid): use --save")
    layout.validate(cfg, args.batch_size, world_size)
    check_memory(cfg, args, layout)
    return cfg, layout


def check_output_paths(args: argparse.Namespace) -> None:
    """Every path the run will write — the --out and --save folders, the --trace and --log-file files — is checked
    before any work, so that a bad path fails in one line at the start instead of losing the run at its end: the
    nearest folder that exists on the way to it must be a folder this process can create a file in (probed with a
    temporary file; nothing is left behind). Every rank checks the same paths, so every rank reaches the same
    verdict."""
    for flag, path, is_file in (("--out", args.out, False), ("--save", args.save, False),
                                ("--local-save", args.local_save, False), ("--trace", args.trace, True),
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
    need = Batches.tokens_needed(block)
    if len(train_tokens) < need:
        raise ValueError(f"{source} has {len(tokens)} tokens: its training split (the first 90%, {len(train_tokens)} "
                         f"tokens) needs at least block_size + 1 = {need}; use more data or a smaller --block-size")
    batches = Batches(train_tokens, args.batch_size, block, seed=args.seed)
    if len(val_tokens) < need:
        note = (f"note: the validation split of {source} (the last 10%, {len(val_tokens)} tokens) is shorter than "
                f"block_size + 1 = {need}: no validation loss") if args.eval_interval else None
        return tokens, batches, None, note
    return tokens, batches, Batches(val_tokens, args.batch_size, block, seed=args.seed + 1), None
