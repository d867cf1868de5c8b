"""Layout: every degree and option of a parallel run in one frozen dataclass — the one place that knows which
options combine (torchtitan's ``ParallelDims``).

    layout = Layout(dp=2, tp=2, pp=2, zero=1, microbatches=4, schedule="zb-h1")
    layout.validate(cfg, batch_size=16, world_size=8)   # ValueError: one line naming the flags, or nothing
    mesh = layout.mesh(world)                           # the (pp, dp, cp, tp) rank grid (mesh.py)
    model = layout.parallelize(model, mesh)             # this rank's part of the model: tp/sp, ep, recompute, cp
    engine, optimizer, local_sgd = layout.engine(model, mesh, lr=1e-3, weight_decay=0.1, bucket_mb=25)
    x = layout.local_rows(batch, mesh)                  # this rank's rows (dp) and positions (cp) of a batch
    str(layout)                                         # "dp2·tp2·pp2 zero1 m4 zb-h1"

``train`` builds one from the command line (:meth:`Layout.from_args`), the planner enumerates candidates and
keeps those :meth:`validate` accepts, checkpoints store the layout they were written under, and the tests
take one. What a run builds from its layout is built here too — the model's parallel form, the gradient engine
and optimizer, a batch's share, the per-step reports of the axes that have one — so ``train`` assembles without
asking which axes are on. A rule of the form "this option needs / excludes that one" is written here and nowhere else; an
engine's own arithmetic (tp divides the heads, cp the sequence, ep the experts) stays with the engine, in its
``check_*`` function, and a schedule's (its microbatches, its chunks) with its class in schedules.py; :meth:`validate`
calls them.

Deep dive, with measurements: docs/pipeline.md.
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from minipar.comm import Communicator
from minipar.data import shard_rows
from minipar.optim import AdamW, LossScaler
from minipar.precision import Recipe
from minipar.precision import recipe as fp8_recipe
from minipar.parallel.compression import make_compressor
from minipar.parallel.context_parallel import check_context_parallel, context_parallel, context_report, context_slice
from minipar.parallel.data_parallel import DataParallel
from minipar.parallel.expert_parallel import (check_expert_parallel, expert_parallel, expert_report, moe_layers,
                                              update_router_bias)
from minipar.parallel.local_sgd import LocalSGD
from minipar.parallel.mesh import Mesh
from minipar.parallel.pipeline import stage_blocks
from minipar.parallel.schedules import Schedule
from minipar.parallel.schedules import build as build_schedule
from minipar.parallel.tensor_parallel import check_tensor_parallel, tensor_parallel
from minipar.parallel.zero import ZeRO

RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0
    microbatches: int = 1
    schedule: str = "1f1b"
    recompute: str = "none"     # "none" | "selective" | "full", as --recompute
    cp: int = 1
    cp_kind: str = "ring"
    sp: bool = False
    ep: int = 1
    virtual_stages: int = 1
    shard_group: int = 0        # hybrid sharding: ZeRO shards within groups of this many replicas (0: all of them)
    cp_split: str = ""          # "zigzag" | "contiguous"; "" takes the kind's: zigzag for ring, contiguous for Ulysses
    precision: str = "fp32"     # "fp32" | "bf16-mixed" | "fp16-mixed" | "fp8"
    compression: str = "none"
    local_sgd: int = 0          # H: average the replicas every H steps instead of the gradients every step
    # each mode's own options (read only when the mode is on)
    prefetch: bool = True       # ZeRO-3 gathers the next layer's parameters while this one computes
    moe_overlap: bool = True    # --ep: the token exchanges travel while the shared experts compute
    reduce_dtype: str = "auto"  # "float32": gradients reduce in float32 (always so under fp16-mixed)
    topk_ratio: float = 0.01    # --compression topk: the share of entries sent
    powersgd_rank: int = 4      # --compression powersgd: the rank of the factors
    outer_lr: float = 0.7       # --local-sgd: DiLoCo's outer learning rate and Nesterov momentum
    outer_momentum: float = 0.9
    staleness: int = 0          # --local-sgd: each round's average applies this many rounds later
    fp8_recipe: str = "tensorwise"  # --precision fp8: the scaling recipe (precision.py)
    fp8_block: int = 0          # --precision fp8: values per scale (0: the recipe's own)

    def __post_init__(self) -> None:
        if not self.cp_split:
            object.__setattr__(self, "cp_split", "zigzag" if self.cp_kind == "ring" else "contiguous")

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @classmethod
    def from_args(cls, args: argparse.Namespace, world_size: int) -> Layout:
        """The layout the command line asks for; ``--dp`` left out takes the ranks that tp·pp·cp leave, as
        Megatron-LM does."""
        for name in ("tp", "pp", "cp", "ep", "virtual_stages", "microbatches"):
            if getattr(args, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
        if args.fp8_block is not None and args.fp8_block <= 0:
            raise ValueError(f"--fp8-block must be positive, got {args.fp8_block}")
        dp, others = args.dp, args.tp * args.pp * args.cp
        if dp is None:
            if world_size % others:
                raise ValueError(f"world size {world_size} is not divisible by tp·pp·cp = {args.tp}·{args.pp}·{args.cp}")
            dp = world_size // others
        return cls(dp=dp, tp=args.tp, pp=args.pp, zero=args.zero, microbatches=args.microbatches,
                   schedule=args.schedule, recompute=args.recompute or "none", cp=args.cp, cp_kind=args.cp_kind,
                   sp=args.sp, ep=args.ep, virtual_stages=args.virtual_stages, shard_group=args.shard_group or 0,
                   cp_split=args.cp_split or "", precision=args.precision, compression=args.compression,
                   local_sgd=args.local_sgd, prefetch=not args.no_prefetch, moe_overlap=not args.no_moe_overlap,
                   reduce_dtype=args.reduce_dtype,
                   topk_ratio=args.topk_ratio, powersgd_rank=args.powersgd_rank, outer_lr=args.outer_lr,
                   outer_momentum=args.outer_momentum, staleness=args.staleness, fp8_recipe=args.fp8_recipe,
                   fp8_block=args.fp8_block or 0)

    def validate(self, cfg: Any, batch_size: int, world_size: int | None = None) -> None:
        """Raise ValueError — one line naming the flags involved — if this layout cannot train ``cfg`` on a
        global batch of ``batch_size`` sequences (over ``world_size`` ranks, when given)."""
        if self.dp <= 0:
            raise ValueError(f"--dp must be positive, got {self.dp}")
        if world_size is not None and self.world != world_size:
            name = f"{self.dp}·{self.tp}·{self.pp}" + (f"·{self.cp}" if self.cp > 1 else "")
            raise ValueError(f"world size {world_size} != dp·tp·pp{'·cp' if self.cp > 1 else ''} = {name}; "
                             f"launch with mpiexec -n {self.world}")
        if batch_size % (self.dp * self.microbatches):
            raise ValueError(f"--batch-size {batch_size} is not divisible by --dp·--microbatches "
                             f"= {self.dp}·{self.microbatches}")
        replicas = self.dp * self.cp
        if self.zero and replicas == 1:
            raise ValueError("--zero shards over the data- and context-parallel ranks: it needs --dp or --cp >= 2")
        if self.shard_group:
            if not self.zero:
                raise ValueError("--shard-group chooses how ZeRO shards: use it with --zero 1, 2 or 3")
            if self.shard_group < 1 or replicas % self.shard_group:
                raise ValueError(f"--shard-group {self.shard_group} must divide the {replicas} data-parallel "
                                 "replicas (dp·cp)")
            if self.ep > 1 and len(self.expert_shard_sizes()) > 1:
                raise ValueError(f"--shard-group {self.shard_group} with --ep {self.ep}: each shard group (runs of "
                                 f"{self.shard_group} of the dp·cp replicas) must hold the same number of ranks of "
                                 "every expert group it holds; a multiple or a divisor of --ep does")
        make_compressor(self.compression, self.topk_ratio, self.powersgd_rank)  # the compressor checks its numbers
        if self.local_sgd < 0 or self.staleness < 0:
            raise ValueError("--local-sgd and --staleness must be >= 0")
        if self.compression != "none" and self.zero:
            raise ValueError("--compression plugs into plain data parallelism: use it with --zero 0")
        if self.local_sgd and (self.tp > 1 or self.pp > 1 or self.cp > 1 or self.zero or self.compression != "none"):
            raise ValueError("--local-sgd replaces the gradient all-reduce of plain data parallelism: use it with --dp "
                             "alone (no --tp/--pp/--cp/--zero/--compression)")
        if self.precision == "fp8":
            self.fp8()  # the recipe checks its name and block
            if (self.tp > 1 or self.cp > 1) and self.fp8_recipe in ("blockwise", "mxfp8"):
                raise ValueError(f"--precision fp8 --fp8-recipe {self.fp8_recipe} with --tp or --cp: its blocks along a "
                                 "cut dimension (features, or tokens) would have to start where the slices do "
                                 "(tensorwise and rowwise reduce their amax over the ranks instead)")
            if self.sp and hasattr(cfg, "kv_lora_rank"):
                raise ValueError("--precision fp8 with --arch deepseek and --sp: the latent down-projections run on "
                                 "sequence shards, so their FP8 scales would need an amax over the tp ranks (not built)")
            if self.tp > cfg.kv_heads:
                raise ValueError(f"--precision fp8 with --tp {self.tp} > --n-kv-head {cfg.kv_heads}: a K/V head shared "
                                 "by several tp ranks gets partial output gradients there, which FP8 would scale apart")
        check_tensor_parallel(cfg, self.tp, self.sp)
        if getattr(cfg, "mtp_depth", 0):  # DeepSeek's multi-token prediction (models/deepseek.py)
            if self.sp or self.cp > 1:
                raise ValueError("--mtp-depth with --sp or --cp: each depth reads every position's token k ahead and "
                                 "shifts the sequence by one, across the ranks' shards of it (not built)")
            if cfg.n_expert:
                raise ValueError("--mtp-depth with --n-expert: the MTP modules' MoE layers and their balancing loss "
                                 "are not built (DeepSeek-V3's MoE: issue #50)")
        check_expert_parallel(cfg, self.ep, self.dp * self.cp)
        if cfg.n_expert and cfg.router == "sigmoid" and cfg.aux_loss_coef and self.cp > 1:
            raise ValueError("--router sigmoid's sequence-wise balance loss with --cp: each sequence's expert counts "
                             "span the cp ranks (not built; --aux-loss-coef 0 balances by the bias alone)")
        if cfg.n_expert:
            if self.ep > 1 and (self.local_sgd or self.compression != "none"):
                raise ValueError("--ep reduces expert gradients over their own replicas: use it without --local-sgd "
                                 "and --compression")
        if self.recompute == "selective" and self.cp > 1:
            raise ValueError("--recompute selective recomputes the standard attention's probabilities; context "
                             "parallelism's attention keeps its own (use --recompute full or none with --cp)")
        if self.cp > 1:
            check_context_parallel(cfg, self.cp, self.tp, self.cp_kind, self.cp_split)
            if self.sp and (cfg.block_size // self.cp) % self.tp:
                raise ValueError(f"--sp shards each rank's T/cp = {cfg.block_size // self.cp} positions over --tp "
                                 f"{self.tp}: it must be divisible by it")
        pipeline = self.pipeline_schedule()  # the schedule's own arithmetic: microbatch groups, the V's 2·pp, …
        stage_blocks(cfg.n_layer, pipeline.n_stages, 0)

    def expert_shard_sizes(self) -> set[int]:
        """How many ranks shard the experts of one ep rank within one shard group, over every (group, ep rank) pair
        present: one size when the layout is valid (mesh.expert_shard_comm); replica = dp_rank·cp + cp_rank, its
        ep rank replica mod ep."""
        counts: dict[tuple[int, int], int] = {}
        run = self.shard_group or self.dp * self.cp
        for replica in range(self.dp * self.cp):
            key = (replica // run, replica % self.ep)
            counts[key] = counts.get(key, 0) + 1
        return set(counts.values())

    def pipeline_schedule(self) -> Schedule:
        """The schedule object of ``--schedule`` for these pp ranks, microbatches and virtual stages."""
        return build_schedule(self.schedule, self.pp, self.microbatches, self.virtual_stages)

    def accepts(self, cfg: Any, batch_size: int) -> bool:
        """Whether :meth:`validate` passes (the planner's filter)."""
        try:
            self.validate(cfg, batch_size)
        except ValueError:
            return False
        return True

    def fp8(self) -> Recipe:
        """The FP8 recipe of ``--precision fp8`` (precision.py), with ``--fp8-block``."""
        return fp8_recipe(self.fp8_recipe, self.fp8_block or None)

    def mesh(self, world: Communicator) -> Mesh:
        return Mesh(world, dp=self.dp, tp=self.tp, pp=self.pp, cp=self.cp, ep=self.ep,
                    shard_group=self.shard_group or None)

    # ---- what a run builds from its layout
    def parallelize(self, model: Any, mesh: Mesh) -> Any:
        """This rank's part of the whole ``model`` (the same on every rank): its tensor-parallel slice (with sequence
        parallelism), its experts, its recomputation, its attention across the sequence's cp ranks."""
        if self.tp > 1:
            model = tensor_parallel(model, mesh.tp_comm, self.sp)
        if self.ep > 1:
            model = expert_parallel(model, mesh.ep_comm, self.moe_overlap)
        model.set_recompute(self.recompute)
        if self.precision == "fp8":
            model.set_fp8(self.fp8())
        return context_parallel(model, mesh.cp_comm, self.cp_kind, self.cp_split) if self.cp > 1 else model

    def engine(self, model: Any, mesh: Mesh, lr: float, weight_decay: float, bucket_mb: float
               ) -> tuple[Any, Any, LocalSGD | None]:
        """(gradient engine, optimizer, local SGD or None) over the data-parallel replicas: DataParallel (with its
        compressor) + AdamW, or ZeRO, which is both; expert parameters reduce over their own replicas. Under local
        SGD the replicas do not synchronize gradients at all: LocalSGD averages the weights every H steps."""
        if self.local_sgd:
            alone = mesh.grad_comm.split(color=mesh.grad_comm.rank, name="local")
            optimizer = AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
            return DataParallel(model, alone), optimizer, LocalSGD(
                model, mesh.dp_comm, self.local_sgd, self.outer_lr, self.outer_momentum, staleness=self.staleness,
                masters=optimizer.master)
        experts = mesh.expert_grad_comm if mesh.ep > 1 else None
        # loss-scaled float16 gradients are reduced in float32: the sum is the one process's gradient, but a partial
        # sum of terms of both signs can exceed it, overflow in 16 bits, and skip a step the one process takes
        reduce_dtype = np.float32 if self.reduce_dtype == "float32" or self.precision == "fp16-mixed" else None
        if self.zero:
            engine = ZeRO(model, mesh.shard_comm, self.zero, lr=lr, weight_decay=weight_decay, bucket_mb=bucket_mb,
                          expert_comm=mesh.expert_shard_comm if experts else None, replicas=mesh.shard_replica_comm,
                          prefetch=self.prefetch, reduce_dtype=reduce_dtype,
                          expert_replicas=mesh.expert_shard_replica_comm,
                          fp8_all_gather=self.precision == "fp8" and self.fp8_recipe == "tensorwise")
            return engine, engine, None
        compression = make_compressor(self.compression, self.topk_ratio, self.powersgd_rank)
        return (DataParallel(model, mesh.grad_comm, bucket_mb, compression=compression, expert_comm=experts,
                             reduce_dtype=reduce_dtype),
                AdamW(model.parameters(), lr=lr, weight_decay=weight_decay), None)

    def loss_scaler(self, initial_scale: float) -> LossScaler | None:
        """fp16-mixed scales the loss (dynamically, from ``initial_scale``); the other precisions need no scaling."""
        return LossScaler(initial_scale) if self.precision == "fp16-mixed" else None

    def local_rows(self, batch: np.ndarray, mesh: Mesh) -> np.ndarray:
        """This rank's share of a global (B, T) batch: its data-parallel group's B/dp rows, its cp rank's
        positions of each (contiguous or zigzag chunks)."""
        return context_slice(shard_rows(batch, mesh.dp_rank, mesh.dp), mesh.cp_comm, self.cp_split)

    def loss_tokens(self, global_tokens: int) -> int:
        """The tokens each rank's loss is normalized by (Pipeline.run): all ``global_tokens`` of the global batch,
        whose gradients the data-parallel reduction sums — or, under local SGD, a replica's own B/dp rows' (its
        inner steps reduce nothing)."""
        return global_tokens // self.dp if self.local_sgd else global_tokens

    def update_router_bias(self, model: Any, mesh: Mesh) -> None:
        """After an optimizer step: the sigmoid routers' balancing bias, from the step's loads over the replicas."""
        if model.config.n_expert and model.config.bias_update:
            update_router_bias(model, mesh.grad_comm)

    def reset_reports(self, model: Any) -> None:
        """Zero the counters the step's reports read (ring attention's work, each MoE layer's routing tally)."""
        if self.cp > 1:
            model.context_work.update(pairs=0, wait_s=0.0)
        for layer in moe_layers(model):
            layer.reset_tally()
        if getattr(model.config, "mtp_depth", 0):
            model.reset_mtp_tally()

    def reports(self, model: Any, mesh: Mesh) -> dict[str, Any]:
        """The step's reports of the axes that keep one: ring attention's balance ("context"), the experts'
        routing ("experts"); each costs one small collective."""
        out = {}
        if self.cp > 1 and self.cp_kind == "ring":
            out["context"] = context_report(model, mesh.cp_comm)
        if model.config.n_expert:  # every stage takes part, with or without MoE layers of its own
            out["experts"] = expert_report(model, mesh.grad_comm, mesh.pp_comm)
        if getattr(model.config, "mtp_depth", 0):  # each multi-token prediction depth's loss (models/deepseek.py)
            out["mtp_loss"] = model.mtp_report(mesh.grad_comm, mesh.pp_comm)
        return out

    def flags(self) -> list[str]:
        """The command-line flags of every field that means something here (``train`` rebuilds this layout from
        them, and refuses a flag without its mode: the cp kind and split only with cp ≥ 2)."""
        return ["--recompute", self.recompute, "--dp", str(self.dp), "--tp", str(self.tp), "--pp", str(self.pp),
                "--zero", str(self.zero), "--microbatches", str(self.microbatches), "--schedule", self.schedule,
                "--cp", str(self.cp), *(["--cp-kind", self.cp_kind, "--cp-split", self.cp_split] if self.cp > 1 else []),
                *(["--sp"] if self.sp else []), "--ep", str(self.ep), "--virtual-stages", str(self.virtual_stages),
                *(["--shard-group", str(self.shard_group)] if self.shard_group else []),
                "--precision", self.precision, "--compression", self.compression, "--local-sgd", str(self.local_sgd),
                *(["--no-prefetch"] if not self.prefetch and self.zero == 3 else []),
                *(["--no-moe-overlap"] if not self.moe_overlap and self.ep > 1 else []),
                *(["--reduce-dtype", self.reduce_dtype] if self.reduce_dtype != "auto" else []),
                *(["--topk-ratio", str(self.topk_ratio)] if self.compression == "topk" else []),
                *(["--powersgd-rank", str(self.powersgd_rank)] if self.compression == "powersgd" else []),
                *(["--outer-lr", str(self.outer_lr), "--outer-momentum", str(self.outer_momentum), "--staleness",
                   str(self.staleness)] if self.local_sgd else []),
                *(["--fp8-recipe", self.fp8_recipe, *(["--fp8-block", str(self.fp8_block)] if self.fp8_block else [])]
                  if self.precision == "fp8" else [])]

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        cp = f"·cp{self.cp} {self.cp_kind}" if self.cp > 1 else ""
        cp += f"·ep{self.ep}" if self.ep > 1 else ""
        return (f"dp{self.dp}·tp{self.tp}{' sp' if self.sp else ''}·pp{self.pp}{cp} zero{self.zero} m{self.microbatches}"
                + (f" {self.schedule}" if self.pp > 1 else "") + (f" v{self.virtual_stages}" if self.virtual_stages > 1 else "")
                + (f" hsdp{self.shard_group}" if self.shard_group else "")
                + (f" recompute-{self.recompute}" if self.recompute != "none" else ""))


# one option each, at its smallest: (label, Layout fields, model fields)
OPTIONS: tuple[tuple[str, dict[str, Any], dict[str, Any]], ...] = (
    ("dp", {"dp": 2}, {}),
    ("ZeRO-1", {"dp": 2, "zero": 1}, {}),
    ("ZeRO-2", {"dp": 2, "zero": 2}, {}),
    ("ZeRO-3", {"dp": 2, "zero": 3}, {}),
    ("HSDP", {"dp": 4, "zero": 3, "shard_group": 2}, {}),
    ("tp", {"tp": 2}, {}),
    ("sp", {"tp": 2, "sp": True}, {}),
    ("cp ring", {"cp": 2, "cp_kind": "ring"}, {}),
    ("cp Ulysses", {"cp": 2, "cp_kind": "ulysses"}, {}),
    ("pp GPipe", {"pp": 2, "microbatches": 4, "schedule": "gpipe"}, {}),
    ("pp 1F1B", {"pp": 2, "microbatches": 4, "schedule": "1f1b"}, {}),
    ("pp interleaved", {"pp": 2, "microbatches": 4, "schedule": "interleaved", "virtual_stages": 2}, {}),
    ("pp ZB-H1", {"pp": 2, "microbatches": 4, "schedule": "zb-h1"}, {}),
    ("pp DualPipeV", {"pp": 2, "microbatches": 4, "schedule": "dualpipev"}, {}),
    ("MLA", {}, {"arch": "deepseek"}),
    ("MTP", {}, {"arch": "deepseek", "mtp_depth": 1}),
    ("MoE", {}, {"n_expert": 4}),
    ("MoE, ep", {"dp": 2, "ep": 2}, {"n_expert": 4}),
    ("MoE dropless, sigmoid", {}, {"n_expert": 4, "capacity_factor": 0.0, "router": "sigmoid", "bias_update": 0.01,
                                   "n_shared_expert": 1}),
    ("recompute selective", {"recompute": "selective"}, {}),
    ("recompute full", {"recompute": "full"}, {}),
    ("bf16-mixed", {"precision": "bf16-mixed"}, {}),
    ("fp16-mixed", {"precision": "fp16-mixed"}, {}),
    ("fp8", {"precision": "fp8"}, {}),
    ("compression", {"dp": 2, "compression": "powersgd"}, {}),
    ("local SGD", {"dp": 2, "local_sgd": 4}, {}),
)
CHOICES = ("zero", "cp_kind", "schedule", "recompute", "precision")  # one value per run: two are alternatives


TABLE_MODEL = dict(vocab_size=64, block_size=16, n_layer=8, n_head=4, n_embd=16)  # what the table checks against


def combine(a: tuple, b: tuple) -> tuple[Layout, dict[str, Any]] | None:
    """Two :data:`OPTIONS` put together — the larger degree where both set one — as (layout, model fields); None
    when they are two values of one choice (two ZeRO stages, two schedules, ...)."""
    (_, fa, ma), (_, fb, mb) = a, b
    if any(k in fa and k in fb for k in CHOICES):
        return None
    return Layout(**{**fa, **fb, **{k: max(fa[k], fb[k]) for k in fa.keys() & fb.keys()}}), {**ma, **mb}


def composition_table() -> str:
    """README's "what composes with what": every pair of :data:`OPTIONS` (:func:`combine`) put to
    :meth:`Layout.validate` on an 8-layer model: ✓ accepted, a number the refusal listed below the table, · two
    values of one choice (a ZeRO stage, a schedule, a precision, ...)."""
    from minipar.models import config_from_dict

    refusals: list[str] = []

    def cell(a: tuple, b: tuple) -> str:
        pair = combine(a, b)
        if pair is None:
            return "·"
        layout, model = pair
        try:
            layout.validate(config_from_dict({**TABLE_MODEL, **model}), batch_size=16 * layout.dp)
        except ValueError as refusal:
            if str(refusal) not in refusals:
                refusals.append(str(refusal))
            return str(refusals.index(str(refusal)) + 1)
        return "✓"

    rows = ["| | " + " | ".join(str(i + 1) for i in range(len(OPTIONS))) + " |", "|---" * (len(OPTIONS) + 1) + "|"]
    for i, a in enumerate(OPTIONS):
        rows.append(f"| {i + 1} {a[0]} | " + " | ".join("" if j == i else cell(a, b) for j, b in enumerate(OPTIONS)) + " |")
    return "\n".join(rows + [""] + [f"{i + 1}. {text}" for i, text in enumerate(refusals)])
