"""The automatic planner: every layout of a GPT on W devices — dp·cp·tp·pp degrees, sp, ep, the pipeline
schedule and its virtual stages, the ZeRO stage and shard group, microbatches and recomputation — its memory
and step time predicted from a cost model of the hardware, ranked.

Cost model, per optimizer step on the busiest device (t = b·T tokens per microbatch, b = B/(dp·m)):

    compute   per layer and microbatch  (2·t·12C² + 4·b·T²·C)·3 / tp  GEMM FLOPs at ``flops`` ×
              ``gemm_efficiency`` (×4/3 with full recomputation, + half the attention again with selective),
              + the memory-bound passes at ``bandwidth``: ``passes_act``·t·C/tp (inside the tp regions),
              ``passes_replicated``·t·C (layer norms, dropout, residuals: on every tp rank, ÷tp with sp) and
              ``passes_att``·b·H·T²/tp (unfused attention scores; the forward's 40% again with selective
              recomputation), + ``ops_per_layer`` launches at ``op_overhead``; the head adds 6·t·C·V/tp FLOPs and
              ``passes_logits``·t·V/tp passes, each microbatch ``microbatch_overhead`` (embedding, loss).
              12C² is cfg.layer_weights() (Llama's GQA and SwiGLU, DeepSeek's latent projections), 4·b·T²·C the
              core's 2·b·T²·H·(D_qk + D_v) (:func:`attention_core_flops`; DeepSeek's heads padded to one width);
              each of DeepSeek's D MTP modules adds a layer, its 2C → C projection and a head on the last stage
    tensor    4 ring all-reduces of t·C values per layer and microbatch (6 with full recomputation: the
              recomputed forward repeats its two): 2(tp−1)α + 2(tp−1)/tp·nβ each
    pipeline  m microbatch slots of the slowest stage stretched by the schedule's bubble f
              (the schedule object's ``bubble()``: 1F1B (p−1)/(m+p−1), interleaved (p−1)/(v·m+p−1), ZB-H1
              (p−1)/(3m+p−1), DualPipeV (p−1)/(6m+p−1)): m·slot/(1 − f); per microbatch and chunk boundary
              (v = 2 for DualPipeV's V) one activation
              forward, one gradient back: 2v(α + t·C·itemsize·β) (÷tp with ``p2p_split``)
    data      ring reduce-scatter + all-gather of the rank's Ψ_l = Ψ_stage/tp parameters, (dp−1)/dp·Ψ_l·itemsize·β
              each (a ZeRO-3 gather 1 byte per block Linear weight element under tensorwise FP8), of which
              ``overlap`` hides behind backward (hybrid sharding over K: the ring within K ranks, then an
              all-reduce of Ψ_l/K across the dp/K groups); ZeRO-2/3 reduce-scatter after each of the m
              microbatches (:func:`data_parallel_passes`); ZeRO-3 all-gathers Ψ_l per microbatch forward and
              backward, prefetched: exposed is what compute (× ``overlap``) cannot hide, at least one unit's
              gather; + the AdamW pass and ``step_overhead``
    context   cp ranks split each sequence: per rank t/cp tokens and 1/cp of the attention FLOPs (zigzag
              balances the causal work). Ring: per layer and microbatch cp−1 exchanges of K|V
              (t/cp·K'·(D_qk + D_v) values, K' = the K/V heads of a tp rank, never repeated to H:
              :func:`context_bytes`) forward, each hidden behind the attention of the block in hand
              (exposed: max(0, exchange − block attention)), and cp exchanges of K|V|dK|dV backward,
              not hidden. Ulysses: per layer, each way, all-to-alls of q|k|v and of the output — for GPT-2
              (3 + 1)·t·C/(cp·tp) values —, (cp−1)α + (cp−1)/cp·nβ each (grouped K/V heads: their own
              all-to-all, or one copy to each rank of the head its queries share).
    sequence  Megatron-SP turns each tp all-reduce into an all-gather + reduce-scatter: the same time
    experts   with E experts (top-k, capacity factor c; dropless: c = 1) the MLP computes the c·k·t rows of its
              capacity slots, whole on every tp rank: 2·c·k·t·W_e·3 FLOPs (W_e: one expert's matrices, SwiGLU
              3·C·I or GELU 2·C·I; + the shared experts' on every token) instead of 2·t·8C²·3/tp. Expert
              parallelism over ep of the dp ranks: per layer and microbatch a counts all-to-all, then
              dispatch and combine forward and both again backward, each a pairwise all-to-all of
              k·t·C·itemsize bytes ((ep−1)α + (ep−1)/ep·nβ); expert parameters are 1/ep per rank and
              reduce over dp·cp/ep ranks. Under tp a MoE MLP needs no all-reduce (2 per layer, not 4);
              under sp it gathers its input and the gradient of its output (1 all-reduce's worth more);
              under cp each MoE layer all-gathers the routing choices, t·k int64 per rank
    fp8       (--precision fp8) the block Linears' GEMMs at ``fp8_flops`` (the rest at the bf16 rate); ZeRO-3 gathers
              their weights in e4m3 under tensorwise (:func:`gathered_bytes`)
    links     a group inside one node (``devices_per_node``) uses ``intra``, else ``inter`` (α, β); a calibrated CPU
              profile has its own α and β per group size, measured with every rank busy (calibration.py)

Memory per device: model states (``model_state_bytes``; mixed precision 16Ψ_l (DP), 4Ψ_l + 12Ψ_l/dp (ZeRO-1),
2Ψ_l + 14Ψ_l/dp (ZeRO-2), 16Ψ_l/dp (ZeRO-3); float32 16Ψ_l, 8Ψ_l + 8Ψ_l/dp, 4Ψ_l + 12Ψ_l/dp, 16Ψ_l/dp)
(expert parameters: Ψ_e/ep sharded over dp·cp/ep); activations per layer and microbatch
s·b·h·(10 + 24/tp + 5·a·s/(h·tp)) at 2 bytes (Korthikanti et al. 2022; ×itemsize/2), with sequence
parallelism s·b·h·(34/tp + 5·a·s/(h·tp)), with context parallelism s = T/cp per rank (Ulysses keeps the
score term of the full T for a/cp heads: 5·a·T²/(cp·h·tp)), for the microbatches a stage holds at once
(the schedule's ``peak_microbatches()``: GPipe m, 1F1B and ZB-H1 min(pp, m), interleaved ((pp−1)·2 + (v−1)·pp + 1)/v,
DualPipeV (2pp + 1)/2),
less half of the block Linears' inputs under tensorwise FP8 (kept as 1-byte codes: ``cfg.fp8_input_units()``,
GPT (2 + 5/tp)·sbh), without the 5·a·s/h term under selective recomputation, or just the layer inputs (+ one layer) with full
recomputation, plus the logits of the last stage.
A mixture-of-experts MLP holds its intermediates for c·k·s·b rows, whole on every tp rank: 16·c·k·I/(4h)
instead of 16/tp of the linear term (I an expert's width; dropless: c = 1).

Deep dive, with measurements: docs/planner.md.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from minipar.parallel.layout import RECOMPUTE, Layout
from minipar.safetensors_io import atomic_write


@dataclass
class Link:
    alpha: float  # seconds per message
    beta: float   # seconds per byte


@dataclass
class Profile:
    name: str
    flops: float                 # GEMM FLOP/s per device: measured (CPU), or the datasheet peak (GPU) ...
    bandwidth: float             # bytes/s of memory-bound work
    op_overhead: float           # seconds per launched op (Python dispatch, kernel launch); calibrated: per layer
    memory: float                # bytes per device
    devices_per_node: int
    intra: Link
    inter: Link
    overlap: float = 0.5         # share of data-parallel communication hidden behind backward
    passes_act: float = 255.0    # memory-bound element passes per layer over t·C (fwd+bwd), minipar's ops, ÷tp
    passes_att: float = 39.0     # ... over b·H·T² (unfused attention; 0 with flash attention)
    passes_replicated: float = 0.0  # ... over t·C that every tp rank repeats unless --sp (layer norms, dropout, residuals)
    passes_logits: float = 4.0   # ... over the head's t·V/tp logits (softmax, cross-entropy and their gradients)
    p2p_split: bool = False      # pipeline sends split over the tp ranks (Megatron's scatter/gather), else whole on each
    ops_per_layer: float = 100.0
    microbatch_overhead: float = 0.0  # seconds per microbatch beyond its layers' and the head's (embedding, loss)
    step_overhead: float = 0.0   # seconds per step of the optimizer beyond its passes over the parameters
    optimizer_passes: float = 7.0  # the optimizer's float32 passes per parameter (AdamW: p, g, m, v read, p, m, v written)
    gemm_flops_by_rows: dict[str, float] = field(default_factory=dict)  # measured FLOP/s of an (M×C)(C×4C) GEMM by M
    alpha_by_group: dict[str, float] = field(default_factory=dict)      # ring step latency with every rank busy, by group size
    beta_by_group: dict[str, float] = field(default_factory=dict)       # s/byte a ring all-reduce adds to a computing rank
    gemm_efficiency: float = 1.0  # ... × the share of it a large GEMM reaches (GPU: fitted, validation.py)
    fp8_flops: float = 0.0       # FP8 GEMM FLOP/s, as ``flops`` is bf16's (0: no FP8 tensor cores — an A100 — the
                                 # GEMMs run at the bf16 rate); a CPU's: minipar's emulation, quantization included

    def gemm_flops(self, rows: float) -> float:
        """Achieved GEMM FLOP/s for ``rows``-row operands: log-interpolated from the calibration table, else ``flops``."""
        if not self.gemm_flops_by_rows:
            return self.flops * self.gemm_efficiency
        points = sorted((int(k), v) for k, v in self.gemm_flops_by_rows.items())
        xs, ys = np.log([p[0] for p in points]), [p[1] for p in points]
        return float(np.interp(np.log(max(rows, 1.0)), xs, ys)) * self.gemm_efficiency

    def fp8_gemm_flops(self, rows: float) -> float:
        """Achieved FP8 GEMM FLOP/s for ``rows``-row operands: :meth:`gemm_flops` × fp8_flops / flops."""
        return self.gemm_flops(rows) * (self.fp8_flops / self.flops if self.fp8_flops else 1.0)

    def link(self, group: int, span: int) -> Link:
        """The link of a ``group``-rank group spread over ``span`` consecutive ranks (latency as measured under load)."""
        base = self.intra if span <= self.devices_per_node else self.inter
        return Link(self.alpha_by_group.get(str(group), base.alpha), self.beta_by_group.get(str(group), base.beta))

    def save(self, path: str) -> None:
        atomic_write(path, [json.dumps(dataclasses.asdict(self), indent=1).encode()])

    @classmethod
    def load(cls, path: str) -> Profile:
        try:
            with open(path) as f:
                data = json.load(f)
            return cls(**{**data, "intra": Link(**data["intra"]), "inter": Link(**data["inter"])})
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{path}: not a minipar hardware profile ({type(e).__name__}: {e}); "
                             "recalibrate with plan --calibrate") from None


# Datasheet peaks (dense bf16 GEMM, HBM, NVLink per direction, one 200/400 Gb/s NIC per GPU) × the share a
# large GEMM reaches, ``gemm_efficiency``: fitted to Korthikanti et al. 2022's runs (validation.py; the
# H100 takes the A100's share — no published H100 run with a stated layout is in the validation set yet).
# Memory-bound passes per layer, fwd+bwd, with fused kernels: sharded over tp 30·t·C (QKV and GELU
# activations, bias-GELU, head transposes), on every tp rank 22·t·C (two layer norms and two bias-dropout-
# residual adds); attention scores never reach memory (flash attention) — Megatron-LM before flash attention
# made 16 passes over b·H·T² (scores, masked softmax, dropout and their gradients; validation.py).
SEARCHED_SCHEDULES = ("1f1b", "interleaved", "zb-h1", "dualpipev")  # GPipe: 1F1B's bubble, more memory

BUILTIN_PROFILES = {
    "a100-80gb": Profile("a100-80gb", flops=312e12, gemm_efficiency=0.75, bandwidth=0.8 * 2.0e12, op_overhead=8e-6,
                         memory=80e9, devices_per_node=8, intra=Link(8e-6, 1 / 240e9), inter=Link(15e-6, 1 / 23e9),
                         overlap=0.9, passes_act=30.0, passes_replicated=22.0, passes_att=0.0, ops_per_layer=30.0),
    "h100-80gb": Profile("h100-80gb", flops=989e12, gemm_efficiency=0.75, bandwidth=0.8 * 3.35e12, op_overhead=6e-6,
                         memory=80e9, devices_per_node=8, intra=Link(6e-6, 1 / 360e9), inter=Link(12e-6, 1 / 45e9),
                         overlap=0.9, passes_act=30.0, passes_replicated=22.0, passes_att=0.0, ops_per_layer=30.0,
                         fp8_flops=1979e12),
}


@dataclass
class Prediction:
    layout: Layout
    step_time: float
    memory: float
    feasible: bool
    breakdown: dict[str, float] = field(default_factory=dict)


def _ring_all_reduce(n_bytes: float, p: int, link: Link) -> float:
    return 0.0 if p == 1 else 2 * (p - 1) * link.alpha + 2 * (p - 1) / p * n_bytes * link.beta


def stage_parameters(cfg: Any, pp: int) -> float:
    """Parameters of the largest pipeline stage (the first: its blocks plus the embeddings)."""
    return cfg.num_parameters() if pp == 1 else cfg.num_parameters(math.ceil(cfg.n_layer / pp), final_norm=False)


def predict(cfg: Any, batch_size: int, layout: Layout, profile: Profile, itemsize: int = 4) -> Prediction:
    """Predicted step time (s) and memory (bytes) of ``layout`` for a GPT ``cfg`` and global ``batch_size``."""
    dp, tp, pp, m, cp = layout.dp, layout.tp, layout.pp, layout.microbatches, layout.cp
    world = dp * tp * pp * cp
    C, H, T, L = cfg.n_embd, cfg.n_head, cfg.block_size, cfg.n_layer
    V = math.ceil(cfg.vocab_size / tp) * tp
    b = batch_size / (dp * m)
    t = b * T / cp  # tokens per rank and microbatch
    recompute = layout.recompute
    passes = 4.0 if recompute == "full" else 3.0  # forward + backward (+ the forward again)

    attention_flops = attention_core_flops(cfg, b, layout)
    attention_weights, mlp_weights = cfg.layer_weights()
    layers_here = math.ceil(L / pp)  # the first stage's blocks: its dense ones first (first_dense_layers)
    moe_share = cfg.moe_blocks(layers_here) / layers_here
    if moe_share:  # a MoE MLP is whole on every tp rank: its capacity slots' rows of one expert's matrices, and
        expert, shared = expert_matrix_weights(cfg)  # the shared experts on every token
        mlp_flops = (1 - moe_share) * 2 * t / tp * mlp_weights + moe_share * 2 * (expert_rows(cfg, t) * expert
                                                                                 + t * shared)
    else:
        mlp_flops = 2 * t / tp * mlp_weights
    flops = profile.gemm_flops(t)
    linear_flops = (2 * t * attention_weights / tp + mlp_flops) * passes
    attention_flops_all = attention_flops * passes + (attention_flops / 2 if recompute == "selective" else 0.0)
    if layout.precision == "fp8":  # the block Linears' GEMMs in FP8 (a MoE's experts stay bf16: precision.py)
        fp8 = (2 * t * attention_weights / tp + (1 - moe_share) * 2 * t / tp * mlp_weights) * passes
        gemm_time = fp8 / profile.fp8_gemm_flops(t) + (linear_flops - fp8 + attention_flops_all) / flops
    else:
        gemm_time = (linear_flops + attention_flops_all) / flops
    attention_passes = profile.passes_att * (1 + 0.4 if recompute == "selective" else passes / 3)  # forward ≈ 40%
    replicated = profile.passes_replicated * t * C / (tp if layout.sp else 1)
    layer_bytes = ((profile.passes_act * t * C / tp + replicated) * passes / 3
                   + attention_passes * b * H * T * T / (cp * tp)) * itemsize
    head_time = 6 * t * C * V / tp / flops + profile.passes_logits * t * V / tp * itemsize / profile.bandwidth
    tp_link = profile.link(tp, tp)
    tp_time = ((tensor_all_reduces(cfg, layout) * L / pp + 2) * _ring_all_reduce(t * C * itemsize, tp, tp_link)
               if tp > 1 else 0.0)
    cp_link = profile.link(cp, cp * tp)
    cp_time = math.ceil(L / pp) * context_time(cfg, layout, t * itemsize, attention_flops / flops / cp,
                                               cp_link) if cp > 1 else 0.0
    if cp > 1 and cfg.n_expert:  # each MoE layer's routing: an all-gather of the k experts of t tokens (int64)
        route = (cp - 1) * (cp_link.alpha + t * cfg.expert_top_k * 8 * cp_link.beta)
        cp_time += cfg.moe_blocks(math.ceil(L / pp)) * route * (2 if recompute == "full" else 1)
    moe_layers = cfg.moe_blocks(math.ceil(L / pp))  # the busiest (first) stage's: its dense blocks come first
    ep_time = moe_layers * expert_time(cfg, layout, t * C * itemsize, profile.link(layout.ep, layout.ep * cp * tp))
    pp_link = profile.link(world, world)
    pipeline = layout.pipeline_schedule()
    pp_bytes = t * C * itemsize / (tp if profile.p2p_split else 1)
    pp_time = 2 * pipeline.v * (pp_link.alpha + pp_bytes * pp_link.beta) if pp > 1 else 0.0
    mtp = getattr(cfg, "mtp_depth", 0)  # DeepSeek's MTP modules, on the last stage: a block, the 2C → C projection
    blocks = math.ceil(L / pp) + mtp    # (whole on every tp rank) and the head, each
    head_gemm = 6 * t * C * V / tp / flops
    parts = {"gemm": blocks * gemm_time + (1 + mtp) * head_gemm + mtp * 3 * 2 * t * 2 * C * C / flops,
             "memory_bound": blocks * layer_bytes / profile.bandwidth + (1 + mtp) * (head_time - head_gemm),
             "op_overhead": blocks * profile.ops_per_layer * profile.op_overhead + (1 + mtp) * profile.microbatch_overhead}
    stage_compute = sum(parts.values())
    microbatch = stage_compute + tp_time + cp_time + ep_time + pp_time
    pipeline_time = m * microbatch / (1 - pipeline.bubble()) if pp > 1 else m * microbatch

    replicas = dp * cp  # gradients reduce, and ZeRO shards, over dp×cp (experts: over dp×cp/ep)
    reductions, gathers = data_parallel_passes(layout)
    reduce_time = gather_time = optimizer_words = 0.0
    for k, (psi, group, shards) in enumerate(local_parameter_groups(cfg, layout)):  # hybrid: RS/AG within K, then
        link = profile.link(shards, shards * tp)                                     # an all-reduce of Ψ/K across
        across = _ring_all_reduce(psi / shards * itemsize, group // shards, profile.link(group // shards, replicas * tp))
        reduce_time += reductions * (_ring_all_reduce(psi * itemsize, shards, link) / 2 + across)  # one RS: half
        gather_time += gathers * _ring_all_reduce(gathered_bytes(cfg, layout, psi, itemsize, k == 0), shards, link) / 2
        optimizer_words += profile.optimizer_passes * 4 * psi / (shards if layout.zero else 1)
    exposed_dp = (reduce_time + gather_time) * (1 - profile.overlap)
    if layout.zero == 3:  # each microbatch's gathers are prefetched one unit ahead: hidden behind compute, but the first
        units = math.ceil(L / pp) + 1
        exposed_dp = reduce_time * (1 - profile.overlap) + max(gather_time / units,
                                                               gather_time - profile.overlap * m * stage_compute)
    optimizer = optimizer_words / profile.bandwidth + profile.step_overhead
    step = pipeline_time + exposed_dp + optimizer

    states, activations = memory_per_rank(cfg, batch_size, layout, itemsize)
    memory = states + activations
    breakdown = {"compute": m * stage_compute, **{k: m * v for k, v in parts.items()},
                 "bubble": pipeline_time - m * microbatch, "tp_comm": m * tp_time,
                 "cp_comm": m * cp_time, "ep_comm": m * ep_time, "pp_comm": m * pp_time, "dp_comm_exposed": exposed_dp,
                 "optimizer": optimizer, "model_states": states, "activations": activations}
    return Prediction(layout, step, memory, memory <= profile.memory, breakdown)


def tensor_all_reduces(cfg: Any, layout: Layout) -> float:
    """Ring all-reduces of t·C values per block and microbatch on a tensor-parallel rank: forward, attention's one
    and the MLP's one — a MoE MLP none, or under sp its all-gather in (half an all-reduce); backward the same
    again, a fully recomputed forward once more. Under sp each is an all-gather plus a reduce-scatter: the same bytes."""
    forward = 1 + ((0.5 if layout.sp else 0.0) if cfg.n_expert else 1.0)
    return forward * (3 if layout.recompute == "full" else 2)


def communication_bytes(cfg: Any, batch_size: int, layout: Layout, itemsize: int = 4) -> dict[str, float]:
    """Bytes the busiest rank sends per optimizer step along each axis, as the engines send them over rings —
    (p−1)/p·n per reduce-scatter or all-gather of n, 2(p−1)/p·n per all-reduce, (p−1)/p of an all-to-all's buffer —
    with t = B/(dp·m)·T/cp tokens per microbatch, for the m microbatches and the L/pp blocks of a stage:

        dp  gradients and parameters over the dp·cp replicas: :func:`data_parallel_bytes`
        tp  :func:`tensor_all_reduces` per block of 2(tp−1)/tp·t·C values (sp: all-gathers + reduce-scatters, the
            same); the embedding's, head's and loss's few all-reduces are not counted
        cp  ring: cp−1 K|V blocks forward, cp K|V|dK|dV backward; Ulysses: the all-to-alls of q|k|v and of the
            output, each way (:func:`context_bytes`)
        ep  per MoE block the counts' all-to-all (E int64s) and dispatch + combine each way, k·t·C values each, as
            balanced routing fills the experts (the engine sends the rows routed to other ranks: data-dependent)

    A fully recomputed block repeats its forward's tp and ep exchanges (counted) and its cp ones (not counted)."""
    tp, cp, ep, m = layout.tp, layout.cp, layout.ep, layout.microbatches
    t = batch_size / (layout.dp * m) * cfg.block_size / cp
    blocks = math.ceil(cfg.n_layer / layout.pp)
    sent = {"dp": data_parallel_bytes(cfg, layout, itemsize) if layout.dp * cp > 1 else 0.0,
            "tp": m * blocks * tensor_all_reduces(cfg, layout) * 2 * (tp - 1) / tp * t * cfg.n_embd * itemsize}
    sizes, share = context_bytes(cfg, layout, t * itemsize), (cp - 1) / cp
    if cp == 1:
        sent["cp"] = 0.0
    elif layout.cp_kind == "ring":
        sent["cp"] = m * blocks * ((cp - 1) * sizes["kv"] + cp * 2 * sizes["kv"])
    else:
        kv = sizes["kv_sent_ulysses"] if sizes["kv_shared"] else share * sizes["kv"]
        sent["cp"] = m * blocks * 2 * (share * (sizes["q"] + sizes["out"]) + kv)
    moe = cfg.moe_blocks(blocks) if cfg.n_expert else 0
    again = layout.recompute == "full"  # a recomputed MoE block exchanges its counts and rows forward once more
    sent["ep"] = m * moe * (ep - 1) / ep * ((1 + again) * 8 * cfg.n_expert
                                            + (4 + 2 * again) * cfg.expert_top_k * t * cfg.n_embd * itemsize)
    return sent


def expert_rows(cfg: Any, tokens: float) -> float:
    """Rows a mixture-of-experts MLP computes for ``tokens`` tokens: its capacity slots, c·k·tokens (dropless,
    c = 0: the k·tokens assignments, as balanced routing fills them)."""
    return (cfg.capacity_factor or 1.0) * cfg.expert_top_k * tokens


def expert_matrix_weights(cfg: Any) -> tuple[int, int]:
    """(one routed expert's, the shared experts') weight-matrix parameters: SwiGLU 3·C·I, GELU 2·C·I."""
    parts = 3 if cfg.mlp_parts == 2 else 2
    return parts * cfg.n_embd * cfg.expert_width, parts * cfg.n_embd * cfg.expert_width * cfg.n_shared_expert


def expert_time(cfg: Any, layout: Layout, token_bytes: float, link: Link) -> float:
    """Seconds of expert-parallel exchanges per layer and microbatch; ``token_bytes`` = t·C·itemsize on a rank."""
    ep = layout.ep
    if ep == 1 or not cfg.n_expert:
        return 0.0
    all_to_all = lambda n: (ep - 1) * link.alpha + (ep - 1) / ep * n * link.beta  # noqa: E731
    again = layout.recompute == "full"  # a recomputed forward exchanges its counts and rows once more
    return (1 + again) * all_to_all(8 * cfg.n_expert) + (4 + 2 * again) * all_to_all(cfg.expert_top_k * token_bytes)


def data_parallel_passes(layout: Layout) -> tuple[int, int]:
    """(reduce-scatters, all-gathers) of a rank's parameters per step over its data-parallel replicas, as the engines
    run them (an all-reduce is one of each): DP and ZeRO-1 reduce once — accumulating the microbatches' gradients
    locally under no_sync — and ZeRO-1/2 gather the updated parameters once; ZeRO-2/3 reduce-scatter after every
    microbatch's backward (m times: they keep no full gradient to accumulate into); ZeRO-3 gathers every unit in
    each microbatch's forward and backward (a fully recomputed forward runs inside the backward's gather)."""
    m = layout.microbatches
    if layout.zero == 3:
        return m, 2 * m
    return (m if layout.zero == 2 else 1), 1


def data_parallel_bytes(cfg: Any, layout: Layout, itemsize: int) -> float:
    """Bytes a rank sends per step for gradients and parameters over its data-parallel replicas (ring: (p−1)/p·n per
    reduce-scatter or all-gather of n, the mean over the ranks): :func:`data_parallel_passes` of each replica group of
    :func:`local_parameter_groups`, with hybrid sharding's all-reduce of the shard across the groups after each
    reduce-scatter."""
    reductions, gathers = data_parallel_passes(layout)
    total = 0.0
    for k, (psi, group, shards) in enumerate(local_parameter_groups(cfg, layout)):
        within = (shards - 1) / shards
        across = 2 * (group // shards - 1) / (group // shards) / shards
        total += reductions * (within + across) * psi * itemsize
        total += gathers * within * gathered_bytes(cfg, layout, psi, itemsize, k == 0)
    return total


def gathered_bytes(cfg: Any, layout: Layout, psi: float, itemsize: int, dense: bool) -> float:
    """Bytes of one all-gather of a group's Ψ parameters: itemsize each, but a byte for every block Linear weight
    element that tensorwise FP8 under ZeRO-3 gathers in e4m3 (zero.py: the attention's and a dense MLP's
    matrices of the stage's blocks; MoE experts and the rest stay 16-bit)."""
    if not (dense and layout.precision == "fp8" and layout.fp8_recipe == "tensorwise" and layout.zero == 3):
        return psi * itemsize
    attention, mlp = cfg.layer_weights()
    fp8 = math.ceil(cfg.n_layer / layout.pp) * (attention + (0 if cfg.n_expert else mlp)) / layout.tp
    return (psi - fp8) * itemsize + fp8


def local_parameter_groups(cfg: Any, layout: Layout) -> list[tuple[float, int, int]]:
    """(parameters on the busiest rank, the ranks their gradients reduce over, the ranks ZeRO shards them over)
    per replica group: the dense ones over dp·cp (÷tp, but for what every tp rank holds whole: layer norms,
    row-parallel biases, positions; the vocabulary padded to a multiple of tp), sharded over K (hybrid) or all;
    the experts (÷ep, whole on every tp rank) over dp·cp/ep, sharded within a group over its ranks with them."""
    C, tp, layers = cfg.n_embd, layout.tp, math.ceil(cfg.n_layer / layout.pp)
    total = stage_parameters(cfg, layout.pp)
    routed, rest = cfg.moe_parameters() if cfg.n_expert else (0, 0)
    experts = cfg.moe_blocks(layers) * routed
    whole = cfg.tp_replicated_parameters(layers, final_norm=layout.pp == 1) + cfg.moe_blocks(layers) * rest
    table = cfg.vocab_tables * cfg.vocab_size * C
    dense = (total - experts - whole - table) / tp + whole + cfg.vocab_tables * math.ceil(cfg.vocab_size / tp) * C
    replicas = layout.dp * layout.cp
    groups = [(dense, replicas, layout.shard_group or replicas)]
    expert_shards = min(layout.expert_shard_sizes()) if layout.shard_group else replicas // layout.ep
    return groups + ([(experts / layout.ep, replicas // layout.ep, expert_shards)] if experts else [])


def attention_core_flops(cfg: Any, b: float, layout: Layout) -> float:
    """Forward FLOPs of one layer's attention core on a rank: q·kᵀ and P·v, 2·b·T²·H·(D_qk + D_v)/(tp·cp)
    (4·b·T²·C for GPT-2; DeepSeek's heads as its core computes them, padded: cfg.attention_widths)."""
    H, _, d_qk, d_v = cfg.attention_widths()
    return 2 * b * cfg.block_size ** 2 * H * (d_qk + d_v) / (layout.tp * layout.cp)


def context_bytes(cfg: Any, layout: Layout, token_bytes: float) -> dict[str, float]:
    """Bytes per layer of context parallelism's blocks on a rank, ``token_bytes`` = t·itemsize (its t tokens):
    q (its H/tp heads), k|v (the K heads a tp rank holds — one, shared, when tp > K — as the engine sends them,
    never repeated to H), the output; Ulysses' share of k|v for each rank (K/cp heads, or the one its queries
    share: context_parallel.kv_heads_of)."""
    H, K, d_qk, d_v = cfg.attention_widths()
    tp, cp = layout.tp, layout.cp
    heads, kv = H // tp, max(1, K // tp)
    per_rank = kv // cp if kv >= cp else 1
    return {"q": token_bytes * heads * d_qk, "kv": token_bytes * kv * (d_qk + d_v), "out": token_bytes * heads * d_v,
            "kv_sent_ulysses": (cp - 1) * token_bytes * per_rank * (d_qk + d_v), "grouped": kv != heads,
            "kv_shared": kv < cp}


def context_time(cfg: Any, layout: Layout, token_bytes: float, block_attention: float, link: Link) -> float:
    """Exposed seconds of context parallelism per layer and microbatch (:func:`context_bytes`);
    ``block_attention`` the forward attention of one query block against one key block."""
    cp, sizes = layout.cp, context_bytes(cfg, layout, token_bytes)
    if layout.cp_kind == "ulysses":  # all-to-alls forward (q|k|v, output) and backward, pairwise
        all_to_all = lambda n: (cp - 1) * link.alpha + (cp - 1) / cp * n * link.beta  # noqa: E731
        if not sizes["grouped"]:  # q|k|v in one all-to-all
            return 2 * (all_to_all(sizes["q"] + sizes["kv"]) + all_to_all(sizes["out"]))
        kv = ((cp - 1) * link.alpha + sizes["kv_sent_ulysses"] * link.beta if sizes["kv_shared"]
              else all_to_all(sizes["kv"]))  # K/cp heads to each rank, or a copy of the one each rank's queries read
        return 2 * (all_to_all(sizes["q"]) + kv + all_to_all(sizes["out"]))
    exchange = lambda n: link.alpha + n * link.beta  # noqa: E731
    forward = (cp - 1) * max(0.0, exchange(sizes["kv"]) - block_attention)  # hidden behind the block in hand
    return forward + cp * exchange(2 * sizes["kv"])  # K|V|dK|dV around the ring, after each block's backward


def memory_per_rank(cfg: Any, batch_size: int, layout: Layout, itemsize: int = 4) -> tuple[float, float]:
    """(model-state bytes, activation bytes incl. logits) of the most loaded rank: parameters, gradients and
    Adam's two moments (16Ψ in fp32, sharded by ZeRO stage) and Korthikanti et al.'s per-layer activations
    sbh(34 + 5as/h), scaled to this dtype, for every microbatch a stage holds at once."""
    dp, tp, pp, m, cp = layout.dp, layout.tp, layout.pp, layout.microbatches, layout.cp
    C, H, T, L = cfg.n_embd, cfg.n_head, cfg.block_size, cfg.n_layer
    V = math.ceil(cfg.vocab_size / tp) * tp
    b = batch_size / (dp * m)
    s = T / cp  # positions per rank
    t = b * s
    states = 0.0
    for psi, _, shards in local_parameter_groups(cfg, layout):  # ZeRO shards each group over its shard ranks
        states += model_state_bytes(psi, shards, layout.zero, itemsize)
    whole, split = cfg.activation_units()
    linear = (whole + split) / tp if layout.sp else whole + split / tp
    if cfg.moe_blocks():  # its experts' activations, scaled from a 4h GELU MLP's to their width and rows
        linear += 16 * ((cfg.capacity_factor or 1.0) * cfg.expert_top_k * cfg.expert_width / (4 * C) - 1 / tp)
    scores = 5 * H * T * T / (cp * s * C * tp) if layout.cp_kind == "ulysses" else 5 * H * s / (C * tp)
    if layout.precision == "fp8" and layout.fp8().one_scale:  # tensorwise keeps its Linears' inputs in 1 byte
        whole, split = cfg.fp8_input_units()
        linear -= ((whole + split) / tp if layout.sp else whole + split / tp) / 2
    if layout.recompute == "selective":  # the attention probabilities are not kept (Korthikanti et al.)
        scores = 0.0
    per_layer_act = s * b * C * (linear + scores) * itemsize / 2
    in_flight = 1 if pp == 1 else layout.pipeline_schedule().peak_microbatches()
    layers = math.ceil(L / pp)
    if layout.recompute == "full":
        activations = layers * t * C * itemsize * in_flight + per_layer_act  # + the one layer being recomputed
    else:
        activations = layers * per_layer_act * in_flight
    logits = 2 * t * V / tp * itemsize
    mtp = getattr(cfg, "mtp_depth", 0)  # DeepSeek's MTP modules on the last stage: a block and logits per depth
    activations += mtp * (per_layer_act + logits)
    return states, activations + logits


def model_state_bytes(psi: float, n: int, zero: int, itemsize: int) -> float:
    """Bytes per rank of Ψ parameters' model states, ZeRO ``zero`` over n ranks: parameters and gradients of
    ``itemsize`` bytes, Adam's moments (and, for 16-bit parameters, the float32 master) — 2 + 2 + 12 = 16 per
    parameter mixed, 4 + 4 + 8 in float32: stage 1 shards the optimizer, 2 the gradients too, 3 everything
    (ZeRO paper, mixed precision: 16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N)."""
    optimizer = 12 if itemsize == 2 else 2 * itemsize
    return {0: (2 * itemsize + optimizer) * psi, 1: 2 * itemsize * psi + optimizer * psi / n,
            2: itemsize * psi + (itemsize + optimizer) * psi / n, 3: (2 * itemsize + optimizer) * psi / n}[zero]


def enumerate_layouts(cfg: Any, world: int, batch_size: int, recompute: bool | tuple[str, ...] = False,
                      context: bool = True, schedules: tuple[str, ...] = SEARCHED_SCHEDULES,
                      fp8_recipe: str | None = None) -> list[Layout]:
    """Every layout of the search space that :meth:`Layout.validate` accepts. The space: dp·tp·pp·cp = world;
    microbatches 1, 2, 4, … and B/dp (b = 1); ZeRO 0-3 and, for ZeRO-3, hybrid groups of 2, 4, … ranks;
    ring and Ulysses, with and without sp; with experts every ep that divides dp·cp; with pp ≥ 2 each of
    ``schedules`` (interleaved: 2 chunks per rank); ``recompute`` True for every mode, a tuple for those modes,
    False for none. ``context=False`` leaves out context and sequence parallelism. ``fp8_recipe``: every layout
    trains under ``--precision fp8`` with that recipe (what Layout refuses with it drops out)."""
    precision = dict(precision="fp8", fp8_recipe=fp8_recipe) if fp8_recipe else {}
    modes = recompute if isinstance(recompute, tuple) else RECOMPUTE if recompute else ("none",)
    layouts = []
    for tp in divisors(world):
        for cp in divisors(world // tp) if context else [1]:
            for pp in divisors(world // (tp * cp)):
                dp = world // (tp * cp * pp)
                if batch_size % dp:
                    continue
                counts = sorted({2**k for k in range(20) if 2**k <= batch_size // dp} | {batch_size // dp})
                counts = [m for m in counts if (batch_size // dp) % m == 0]
                experts = divisors(dp * cp) if cfg.n_expert else [1]  # ep is carved out of the dp·cp replicas
                kinds = ("ring", "ulysses") if cp > 1 else ("ring",)
                for kind, sp in itertools.product(kinds, (False, True) if context else (False,)):
                    for zero in range(4):
                        for m, r, ep in itertools.product(counts, modes, experts):
                            for schedule in schedules if pp > 1 else ("1f1b",):
                                for k in ([0, *(k for k in divisors(dp * cp) if k & (k - 1) == 0 and 1 < k < dp * cp)]
                                          if zero == 3 else [0]):
                                    layout = Layout(dp, tp, pp, zero, m, schedule, r, cp, kind, sp, ep,
                                                    2 if schedule == "interleaved" else 1, k, **precision)
                                    if layout.accepts(cfg, batch_size):
                                        layouts.append(layout)
    return layouts


def fp8_assumptions(recipe: str, profile: Profile) -> str:
    """What the planner assumed of FP8 training under ``recipe`` on ``profile``, in one line."""
    rate = (f"at {profile.fp8_flops / 1e12:,.4g} TFLOP/s peak (bf16: {profile.flops / 1e12:,.4g})" if profile.fp8_flops
            else f"at the bf16 rate ({profile.name} has no FP8 GEMM rate)")
    tensorwise = recipe == "tensorwise"
    return (f"fp8 {recipe}: the block Linears' GEMMs {rate}; embedding, head, attention and experts in bf16; ZeRO-3 "
            f"gathers weights in {'e4m3 (1 byte + a scale each)' if tensorwise else 'bf16 (FP8 gathers: tensorwise only)'}; "
            f"Linear inputs kept for backward in {'1 byte' if tensorwise else 'bf16'}")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def plan(cfg: Any, world: int, batch_size: int, profile: Profile, itemsize: int = 4,
         recompute: bool | tuple[str, ...] = False, context: bool = True,
         schedules: tuple[str, ...] = SEARCHED_SCHEDULES, fp8_recipe: str | None = None) -> list[Prediction]:
    """All layouts, feasible ones first, each group by predicted step time (``fp8_recipe``: under FP8 training,
    which stores in bf16: ``itemsize`` 2)."""
    predictions = [predict(cfg, batch_size, lay, profile, itemsize)
                   for lay in enumerate_layouts(cfg, world, batch_size, recompute, context, schedules, fp8_recipe)]
    if not predictions:
        raise ValueError(f"no layout of {world} ranks fits this model and batch (check n_head, n_layer, batch size)")
    return sorted(predictions, key=lambda p: (not p.feasible, p.step_time))


def steady_step_ms(records: list[dict[str, Any]]) -> float:
    """A run's step time as ``--check`` and the benchmarks measure it: the median over the second half of its steps (a
    CPU run settles after a few steps: the heap grows to its working set, caches and BLAS threads warm up)."""
    ms = [r["ms"] for r in records if "loss" in r]
    return float(np.median(ms[len(ms) // 2:]))


def check_steps_accepted(steps: int) -> None:
    """``--check-steps`` of plan and train: enough for :func:`steady_step_ms` to time two steps after the warm-up."""
    if steps < 4:
        raise ValueError(f"--check-steps must be >= 4 (the first half are warm-up), got {steps}")


def shortlist(predictions: list[Prediction], k: int, plain: Layout) -> list[Prediction]:
    """The ``k`` best feasible predictions, and the ``plain`` layout (data parallelism alone) after them if it is not
    among them: what ``plan --check`` and ``train --auto --check`` measure."""
    chosen = [p for p in predictions if p.feasible][:k]
    baseline = next((p for p in predictions if p.layout == plain and p.feasible), None)
    return chosen + ([baseline] if baseline is not None and baseline not in chosen else [])


def megatron_flops(cfg: Any, batch_size: int, recompute: bool = True) -> float:
    """Megatron-LM's count of FLOPs per iteration (Narayanan et al. 2021, eq. 3): 96·B·s·l·h²·(1 + s/(6h) +
    V/(16·l·h)) with activation recomputation (4 passes of 24·B·s·l·h²·(…)), 72·… without (3 passes) — with
    GPT's 24h² forward FLOPs per token and layer read as 2·(the block's weights) (cfg.layer_weights(): a
    Llama's grouped-query attention and SwiGLU), so that GPT-2's count is the paper's exactly."""
    B, s, L, h, V = batch_size, cfg.block_size, cfg.n_layer, cfg.n_embd, cfg.vocab_size
    scale = 96 if recompute else 72
    return scale / 24 * B * s * L * (2 * sum(cfg.layer_weights()) + 4 * s * h) + scale / 16 * B * s * h * V


PRESETS = {  # name -> the model's config fields (``arch`` picks GPT-2's or Llama's; minipar.models.config_from_dict)
    "gpt2-124m": dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50257),
    "gpt3-175b": dict(n_layer=96, n_head=96, n_embd=12288, block_size=2048, vocab_size=51200),
    # Meta's Llama 3 8B (config.json of meta-llama/Meta-Llama-3-8B): 8,030,261,248 parameters
    "llama3-8b": dict(arch="llama", n_layer=32, n_head=32, n_kv_head=8, n_embd=4096, n_inner=14336, block_size=8192,
                      vocab_size=128256, rope_theta=500000.0, layer_norm_epsilon=1e-5),
}
ITEMSIZE = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}


def format_plan(predictions: list[Prediction], top: int, model_flops: Any = None) -> str:
    """A table of the best ``top`` predictions, and TFLOP/s per device when ``model_flops(layout)``
    (FLOPs per step) is given."""
    head = (f"{'rank':>4}  {'layout':<44}{'step ms':>10}{'memory GB':>11}  {'compute':>8}{'bubble':>8}{'tp':>8}{'cp':>8}"
            f"{'ep':>8}{'pp':>8}{'dp':>8}")
    lines = [head + ("  TFLOP/s/dev" if model_flops else "")]
    for i, pr in enumerate(predictions[:top], start=1):
        b = pr.breakdown
        row = (f"{i:>4}  {str(pr.layout):<44}{pr.step_time * 1e3:>10.1f}{pr.memory / 1e9:>11.2f}"
               + ("  " if pr.feasible else "* ")
               + "".join(f"{b[k] * 1e3:>8.1f}" for k in ("compute", "bubble", "tp_comm", "cp_comm", "ep_comm",
                                                           "pp_comm", "dp_comm_exposed")))
        if model_flops:
            world = pr.layout.dp * pr.layout.tp * pr.layout.pp * pr.layout.cp
            row += f"  {model_flops(pr.layout) / pr.step_time / world / 1e12:>10.1f}"
        lines.append(row)
    lines.append("(times in ms; * = does not fit in device memory)")
    return "\n".join(lines)


def prediction_record(prediction: Prediction, train_flags: list[str]) -> dict[str, Any]:
    """One candidate as ``plan --json`` prints it: its layout and the ``train`` flags that run it, the predicted step
    time and its terms (compute = gemm + memory_bound + op_overhead; each axis's exposed communication; the
    bubble; the optimizer), in ms, and the memory per rank."""
    terms = {k: v * 1e3 for k, v in prediction.breakdown.items() if k not in ("model_states", "activations")}
    return {"layout": str(prediction.layout), "flags": [*prediction.layout.flags(), *train_flags],
            "step_ms": prediction.step_time * 1e3, "terms_ms": terms, "memory_gb": prediction.memory / 1e9,
            "memory_terms_gb": {k: prediction.breakdown[k] / 1e9 for k in ("model_states", "activations")},
            "feasible": prediction.feasible}


PROFILE_VERSION = 2  # what calibrate measures; a calibration of another version is not read (measured again)


def default_profile_path(world: int) -> str:
    """This machine's calibration for ``world`` ranks (latencies under load depend on how many share the cores)."""
    return os.path.join(os.path.expanduser("~"), ".cache", "minipar", f"profile-v{PROFILE_VERSION}-cpu-{world}ranks.json")


def save_calibration(profile: Profile, world: int, path: str | None = None) -> str:
    """Store a calibration where :func:`load_profile` finds it (or at ``path``); returns the path."""
    path = path or default_profile_path(world)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    profile.save(path)
    return path


def load_profile(name: str | None, world: int) -> Profile:
    """A built-in profile by name, a JSON file, or (None) this machine's calibration for ``world`` ranks."""
    if name in BUILTIN_PROFILES:
        return BUILTIN_PROFILES[name]
    path = name or default_profile_path(world)
    if os.path.isfile(path):
        return Profile.load(path)
    if name:
        raise FileNotFoundError(f"no profile {name!r}: expected one of {sorted(BUILTIN_PROFILES)} or a JSON file")
    raise FileNotFoundError(f"no calibrated profile at {path}: run "
                            f"`mpiexec -n {world} python -m minipar plan --calibrate` first")
