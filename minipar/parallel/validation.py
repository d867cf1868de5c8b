"""The planner against published large-scale training runs: ``python -m minipar plan --validate``.

Every row below is a run whose model, layout, batch and measured speed a paper states; the planner predicts
its step time from the A100 profile and the error is (predicted − published) / published step time. What a
paper leaves unstated (the microbatch count when no microbatch size is given; 1F1B or interleaved) is the
planner's own best choice among the layouts that fit in memory, as a practitioner would pick it.

Published speeds become step times through the paper's own FLOP count (Narayanan et al. 2021, eq. 3:
96·B·s·l·h²·(1 + s/6h + V/16lh) with full recomputation); Korthikanti et al. 2022 state iteration times.

The profile is first principles (datasheet peaks, ``planner.BUILTIN_PROFILES``) plus what the code base of
those runs did differently from minipar on a GPU, each a documented property of Megatron-LM, not a fit:
the data-parallel all-reduce runs after backward (no overlap), attention is unfused (16 passes over the
b·H·T² scores), and pipeline sends are split over the tp ranks (scatter/gather). One constant per code base
is free — the share of the dense bf16 peak its large GEMMs reach (2021 and 2022 differ: cuBLAS, fused
kernels) — fitted to its rows; ``leave_one_out`` fits it without each row in turn and predicts that row.

Not in the set: Table 2's ZeRO-3 rows (DeepSpeed, a different engine whose overlap of gathers and compute
this model does not describe; the 530B ones are the paper's own estimates), and H100 runs (none found with
their full layout stated).

Deep dive, with measurements: docs/planner.md.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import numpy as np

from minipar.models.gpt import GPTConfig
from minipar.parallel import planner

NARAYANAN_2021 = ("Narayanan et al. 2021, Efficient Large-Scale Language Model Training on GPU Clusters "
                  "Using Megatron-LM (SC'21, arXiv:2104.04473)")
KORTHIKANTI_2022 = ("Korthikanti et al. 2022, Reducing Activation Recomputation in Large Transformer Models "
                    "(MLSys'23, arXiv:2205.05198)")


@dataclass(frozen=True)
class PublishedRun:
    """One published training run: GPT (sequence 2048, vocabulary 51200) on A100-80GB GPUs, mixed precision."""
    source: str                       # where: paper and table
    n_layer: int
    n_head: int
    n_embd: int
    gpus: int
    batch_size: int                   # global batch, sequences
    tp: int
    pp: int
    recompute: str                    # "full" or "selective"
    tflops: float = 0.0               # published TFLOP/s per GPU (Megatron's count), or
    iteration_s: float = 0.0          # published seconds per iteration
    microbatch_size: int = 0          # 0: not stated
    sp: bool = False
    schedules: tuple[str, ...] = ("1f1b", "interleaved")

    @property
    def code_base(self) -> str:
        return "Megatron-LM " + ("2021" if self.source.startswith("Narayanan") else "2022")

    @property
    def config(self) -> GPTConfig:
        return GPTConfig(vocab_size=51200, block_size=2048, n_layer=self.n_layer, n_head=self.n_head, n_embd=self.n_embd)

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    @property
    def name(self) -> str:
        size = self.config.num_parameters() / 1e9
        return (f"{size:,.0f}B" if size >= 10 else f"{size:.1f}B") + f" on {self.gpus}"

    def published_seconds(self) -> float:
        if self.iteration_s:
            return self.iteration_s
        flops = planner.megatron_flops(self.config, self.batch_size, self.recompute == "full")
        return flops / (self.gpus * self.tflops * 1e12)


def _table1(params: str, heads: int, hidden: int, layers: int, tp: int, pp: int, gpus: int, batch: int,
            tflops: float) -> PublishedRun:
    return PublishedRun(f"{NARAYANAN_2021.split(',')[0]}, Table 1 ({params})", layers, heads, hidden, gpus, batch,
                        tp, pp, "full", tflops=tflops)


def _table2(params: str, heads: int, hidden: int, layers: int, tp: int, pp: int, gpus: int, batch: int,
            tflops: float) -> PublishedRun:
    return PublishedRun(f"{NARAYANAN_2021.split(',')[0]}, Table 2 ({params}, PTD-P)", layers, heads, hidden, gpus,
                        batch, tp, pp, "full", tflops=tflops, microbatch_size=1)


def _table5(params: str, heads: int, hidden: int, layers: int, tp: int, pp: int, gpus: int, batch: int,
            full_s: float, selective_s: float) -> list[PublishedRun]:
    source = f"{KORTHIKANTI_2022.split(',')[0]}, Tables 3 and 5 ({params}"
    return [PublishedRun(f"{source}, full recompute)", layers, heads, hidden, gpus, batch, tp, pp, "full",
                         iteration_s=full_s, microbatch_size=1),
            PublishedRun(f"{source}, SP + selective)", layers, heads, hidden, gpus, batch, tp, pp, "selective",
                         iteration_s=selective_s, microbatch_size=1, sp=True)]


PUBLISHED_RUNS: list[PublishedRun] = [
    # Narayanan et al. 2021, Table 1: weak scaling, full recomputation, microbatch size not stated.
    _table1("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137),
    _table1("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138),
    _table1("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142),
    _table1("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135),
    _table1("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138),
    _table1("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140),
    _table1("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148),
    _table1("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155),
    _table1("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 163),
    _table1("1008.0B", 160, 25600, 128, 8, 64, 3072, 3072, 163),
    # Table 2: PTD-P, microbatch 1 (model-parallel size 96 = tp 8 · pp 12, and 280 = 8 · 35).
    _table2("175B", 96, 12288, 96, 8, 12, 384, 1536, 153),
    _table2("175B", 96, 12288, 96, 8, 12, 768, 1536, 149),
    _table2("175B", 96, 12288, 96, 8, 12, 1536, 1536, 141),
    _table2("530B", 128, 20480, 105, 8, 35, 560, 2240, 171),
    _table2("530B", 128, 20480, 105, 8, 35, 1120, 2240, 167),
    _table2("530B", 128, 20480, 105, 8, 35, 2240, 2240, 159),
    # Korthikanti et al. 2022, Table 3 (layouts, microbatch 1) and Table 5 (iteration time, seconds).
    *_table5("22B", 64, 6144, 48, 8, 1, 8, 4, 1.42, 1.10),
    *_table5("175B", 96, 12288, 96, 8, 8, 64, 64, 18.13, 13.75),
    *_table5("530B", 128, 20480, 105, 8, 35, 280, 280, 49.05, 37.83),
    *_table5("1T", 160, 25600, 128, 8, 64, 512, 512, 94.42, 71.49),
]


# What Megatron-LM (2021/2022) did unlike minipar on a GPU: DP all-reduce after backward, unfused attention,
# pipeline sends split over the tp ranks.
MEGATRON = {"overlap": 0.0, "passes_att": 16.0, "p2p_split": True}


def run_profile(run: PublishedRun, profile: planner.Profile, efficiency: dict[str, float]) -> planner.Profile:
    """``profile`` as ``run``'s code base used it, at that code base's GEMM efficiency."""
    return dataclasses.replace(profile, **MEGATRON, gemm_efficiency=efficiency[run.code_base])


@functools.lru_cache(maxsize=None)
def candidate_layouts(run: PublishedRun) -> tuple[planner.Layout, ...]:
    """The planner's layouts that agree with everything ``run`` states."""
    layouts = tuple(dataclasses.replace(lay, sp=run.sp) for lay in planner.enumerate_layouts(
        run.config, run.gpus, run.batch_size, recompute=(run.recompute,), context=False, schedules=run.schedules)
        if (lay.tp, lay.pp, lay.zero) == (run.tp, run.pp, 0)
        and (not run.microbatch_size or lay.microbatches * run.microbatch_size * lay.dp == run.batch_size))
    if not layouts:
        raise ValueError(f"{run.source}: no layout of the planner matches the published one")
    return layouts


def predict_run(run: PublishedRun, profile: planner.Profile) -> planner.Prediction:
    """The planner's prediction for ``run``: its stated layout, the planner's best choice for what is unstated."""
    predictions = [planner.predict(run.config, run.batch_size, lay, profile, itemsize=2) for lay in candidate_layouts(run)]
    return min(predictions, key=lambda p: (not p.feasible, p.step_time))


def relative_error(prediction: planner.Prediction, run: PublishedRun) -> float:
    """(predicted − published) / published step time."""
    return prediction.step_time / run.published_seconds() - 1


def errors(profile: planner.Profile, efficiency: dict[str, float], runs: list[PublishedRun]) -> np.ndarray:
    """:func:`relative_error` of each run's prediction."""
    return np.array([relative_error(predict_run(r, run_profile(r, profile, efficiency)), r) for r in runs])


def fit(profile: planner.Profile, runs: list[PublishedRun]) -> dict[str, float]:
    """Per code base, the GEMM efficiency that minimizes the mean absolute log error over its ``runs``."""
    fitted = {}
    for base in sorted({r.code_base for r in runs}):
        mine = [r for r in runs if r.code_base == base]
        loss = lambda eff: float(np.mean(np.abs(np.log1p(errors(profile, {base: eff}, mine)))))  # noqa: E731
        lo, hi = 0.3, 1.0
        for _ in range(24):  # golden-section search: the loss is unimodal in the efficiency
            a, b = hi - 0.618 * (hi - lo), lo + 0.618 * (hi - lo)
            lo, hi = (lo, b) if loss(a) < loss(b) else (a, hi)
        fitted[base] = (lo + hi) / 2
    return fitted


def leave_one_out(profile: planner.Profile, runs: list[PublishedRun] = PUBLISHED_RUNS) -> np.ndarray:
    """For each run: its error when its code base's constant is fitted on all the other runs."""
    return np.array([errors(profile, fit(profile, runs[:i] + runs[i + 1:]), [run])[0] for i, run in enumerate(runs)])


def report(profile: planner.Profile, runs: list[PublishedRun] = PUBLISHED_RUNS, loo: bool = True) -> str:
    """The validation table: each run, the layout predicted, published and predicted step time, the error."""
    efficiency = fit(profile, runs)
    lines = [f"{'run':<15}{'layout':<56}{'published s':>12}{'predicted s':>12}{'error':>8}  source"]
    errs = []
    for run in runs:
        pred = predict_run(run, run_profile(run, profile, efficiency))
        errs.append(relative_error(pred, run))
        lines.append(f"{run.name:<15}{str(pred.layout):<56}{run.published_seconds():>12.2f}{pred.step_time:>12.2f}"
                     f"{errs[-1]:>+8.1%}  {run.source}")
    errs = np.abs(errs)
    lines.append("GEMM efficiency fitted per code base: "
                 + ", ".join(f"{base} {eff:.3f}" for base, eff in efficiency.items()))
    if loo:
        held_out = np.abs(leave_one_out(profile, runs))
        lines.append(f"leave-one-out (each run predicted with its constant fitted on the others): "
                     f"max error {held_out.max():.1%}, mean absolute error {held_out.mean():.1%}")
    lines.append(f"max error {errs.max():.1%}, mean absolute error {errs.mean():.1%} over {len(runs)} runs")
    return "\n".join(lines)
