"""Measuring this machine for the planner: ``plan --calibrate`` (and ``train --auto`` on a machine without a profile)
runs :func:`calibrate` on every rank and stores the :class:`~minipar.parallel.planner.Profile` it returns.

A CPU rank trains while the other ranks train too — sharing the cores, their memory bandwidth and, on more ranks than
cores, the scheduler's slices — so every rate here is measured with every rank at it at once and with the BLAS
threads training gives it (backend.share_cores). What a layer costs beyond its GEMMs is not counted but fitted to
minipar's own GPT (:func:`fit_layer_costs`); what a collective costs is measured the way training meets it: between
bursts of compute, and while the rank computes.

Deep dive, with the predictions against measured step times: docs/planner.md.
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import numpy as np

from minipar.backend import physical_memory
from minipar.parallel.planner import Link, Profile
from minipar.precision import RECIPES, fake_quantize


PROBE_SHAPES = ((32, 32, 2, 2), (128, 32, 16, 2), (32, 256, 2, 4), (96, 96, 6, 4), (128, 128, 8, 4),
                (256, 64, 8, 4))  # (C, T, b, H) of the model probes: small ones for the fixed costs, larger for the rest


def calibrate(comm: Any, memory_bytes: float | None = None) -> Profile:
    """Measure this machine (all ranks must call; run with as many ranks as you will plan for, BLAS threads as
    training has them: backend.share_cores). A rank in training computes while the others compute too, so what
    it computes per second is measured that way — every rank at it at once, each with its BLAS threads (one
    process: both cores for its GEMMs, the rest on one; two ranks: a core each; four ranks on two cores: half a
    core each) —, and no contention factor is guessed:

    * GEMM FLOP/s for 16 … 4096-row operands (the slowest rank's), the bandwidth of an elementwise multiply;
    * minipar's own GPT, forward + backward, with 1 and 3 layers at each of :data:`PROBE_SHAPES`: what a layer
      spends beyond its GEMMs is fitted as elementwise passes over its t·C and b·H·T² values plus a fixed cost per
      layer, what a microbatch spends beyond its layers and the head's GEMM as passes over the t·V logits plus a
      fixed cost (:func:`fit_layer_costs`); an AdamW step on two model sizes: its passes over the parameters and
      the rest;
    * on rank 0 alone, an FP8 GEMM as minipar emulates it (both operands quantized tensorwise, then the float32
      GEMM): ``fp8_flops`` is the GEMM table's best × its ratio to the float32 GEMM of the same shape;
    * α, β of a ping-pong between ranks 0 and 1;
    * for groups of 2, 4, … ranks running side by side, with *every* rank busy as in training: the latency of one
      ring step between all-reduces 2 ms of compute apart (on an oversubscribed machine a message also waits for
      its receiver to be scheduled, which dominates small messages), and per byte what a 4 MB all-reduce adds to a
      rank computing meanwhile (:func:`_busy_ring_seconds_per_byte`).
    """
    slowest = lambda seconds: slowest_of(comm, seconds)  # noqa: E731
    rng = np.random.default_rng(comm.rank)
    gemm = {}
    for rows in (16, 64, 256, 1024, 4096):
        a, w = rng.standard_normal((rows, 256)).astype(np.float32), rng.standard_normal((256, 1024)).astype(np.float32)
        comm.barrier()
        gemm[str(rows)] = 2 * rows * 256 * 1024 / slowest(_sustained(lambda: a @ w))
    comm.barrier()
    bandwidth = 1 / slowest(_multiply_seconds_per_byte())
    probes = []
    for C, T, b, H in PROBE_SHAPES:
        timings = []
        for layers in (1, 3):
            comm.barrier()
            timings.append(slowest(_model_probe(C, T, b, H, layers)))
        probes.append((C, T, b, H, *timings))
    C, T, b, _ = PROBE_SHAPES[-2]
    comm.barrier()
    replicated = slowest(_replicated_probe(C, b * T))  # a layer's two layer norms and residual adds, forward + backward
    comm.barrier()
    optimizer = [(slowest(seconds), parameters) for seconds, parameters in (_optimizer_probe(64), _optimizer_probe(256))]
    fp8_ratio = None
    if comm.rank == 0:  # alone: the others wait without spinning
        a, w = rng.standard_normal((1024, 256)).astype(np.float32), rng.standard_normal((256, 1024)).astype(np.float32)
        tensorwise = RECIPES["tensorwise"]
        fp8_ratio = _fastest(lambda: a @ w) / _fastest(lambda: fake_quantize(a, tensorwise, "input")
                                                       @ fake_quantize(w, tensorwise, "weight", 0))
        for r in range(1, comm.size):
            comm.send(np.array([fp8_ratio]), r, tag=8, label="calibration")
    else:
        while not comm.mpi.Iprobe(source=0, tag=8):
            time.sleep(0.01)
        ratio = np.empty(1)
        comm.recv(ratio, 0, tag=8)
        fp8_ratio = float(ratio[0])
    alpha = beta = 0.0
    if comm.size > 1:
        alpha = _pingpong(comm, 8)
        beta = max(0.0, (_pingpong(comm, 8 << 20) - alpha) / (8 << 20))
    alpha_by_group, beta_by_group = {}, {}
    burst = np.random.default_rng(1).standard_normal((256, 256)).astype(np.float32)
    reps = max(1, round(2e-3 / _fastest(lambda: burst @ burst)))  # ≈ 2 ms of GEMMs: what a layer computes between two
    work = lambda: [burst @ burst for _ in range(reps)]  # noqa: E731  tensor-parallel all-reduces (a scheduler's slice)
    comm.barrier()
    alone = _sustained(work)  # with every rank at it: the share of the cores each has
    group = 2
    while group <= comm.size:
        if comm.size % group == 0:
            sub = comm.split(color=comm.rank // group, name=f"calibrate{group}")
            x = np.zeros(2 * group)
            sub.all_reduce(x, algorithm="ring")
            comm.barrier()
            t0 = time.perf_counter()
            for _ in range(20):
                work()
                sub.all_reduce(x, algorithm="ring", label="calibration")
            waited = (time.perf_counter() - t0) / 20 - alone
            alpha_by_group[str(group)] = slowest(max(waited, 1e-6) / (2 * (group - 1)))
            beta_by_group[str(group)] = slowest(_busy_ring_seconds_per_byte(sub, comm, rng))
        group *= 2
    link = Link(alpha, beta)
    profile = Profile("cpu (calibrated)", flops=max(gemm.values()), bandwidth=bandwidth, op_overhead=0.0,
                      ops_per_layer=1.0, memory=memory_bytes or physical_memory(), devices_per_node=max(comm.size, 64),
                      intra=link, inter=link, overlap=0.0, passes_replicated=0.0, gemm_flops_by_rows=gemm,
                      alpha_by_group=alpha_by_group, beta_by_group=beta_by_group, fp8_flops=max(gemm.values()) * fp8_ratio)
    costs = fit_layer_costs(probes, profile)
    costs["passes_replicated"] = min(costs["passes_act"], replicated * bandwidth / (4 * b * T * C))
    costs["passes_act"] -= costs["passes_replicated"]  # what tensor parallelism divides: the rest of the t·C passes
    profile = dataclasses.replace(profile, **costs)
    (small, few), (large, many) = optimizer  # an AdamW step: seconds per parameter, and the rest
    per_parameter = max(0.0, (large - small) / (many - few))
    return dataclasses.replace(profile, optimizer_passes=per_parameter * profile.bandwidth / 4,
                               step_overhead=max(0.0, small - per_parameter * few))


def _multiply_seconds_per_byte() -> float:
    """Seconds per byte moved (read + written) by an elementwise multiply of 32 MB of float32."""
    big = np.ones(8 << 20, np.float32)
    out = np.empty_like(big)
    return _sustained(lambda: np.multiply(big, 1.5, out=out)) / (2 * big.nbytes)


def _busy_ring_seconds_per_byte(group: Any, comm: Any, rng: np.random.Generator) -> float:
    """What a 4 MB ring all-reduce over ``group`` adds to a rank's time, per byte it moves, when it runs — started
    asynchronously, as the data-parallel engines start theirs — while the rank computes GEMMs (about twice its own
    time's worth), every group of ``comm`` at it at once: (async all-reduce + compute − compute) / (2(g−1)/g · 4 MB).
    A GPU's copy engines hide such an all-reduce behind compute; a CPU's ranks that already fill the cores lend its
    progress their cycles, and with more ranks than cores each ring step waits for a scheduled peer — this measures
    what that costs instead of guessing a share hidden (the profile's ``overlap`` is 0)."""
    payload = np.zeros(1 << 20, np.float32)
    moved = 2 * (group.size - 1) / group.size * payload.nbytes
    comm.barrier()
    alone = _per_call(lambda: group.all_reduce(payload, algorithm="ring", label="calibration"), 4)
    a = rng.standard_normal((256, 256)).astype(np.float32)
    reps = max(1, round(2 * alone / _fastest(lambda: a @ a)))
    compute = lambda: [a @ a for _ in range(reps)]  # noqa: E731
    comm.barrier()
    computing = _per_call(compute, 4)

    def both() -> None:
        handle = group.all_reduce(payload, async_op=True, algorithm="ring", label="calibration")
        compute()
        handle.wait()
    comm.barrier()
    return max(0.0, _per_call(both, 4) - computing) / moved


def slowest_of(comm: Any, seconds: float) -> float:
    """The largest of every rank's ``seconds`` (a collective: every rank calls it)."""
    return float(comm.all_reduce(np.array([seconds]), op="max", label="calibration")[0])


def fit_layer_costs(probes: list[tuple[int, int, int, int, float, float]], profile: Profile,
                    itemsize: int = 4, vocab: int = 256) -> dict[str, float]:
    """The profile's non-GEMM terms from timings of minipar's GPT, forward + backward: per probe (C, T, b, H, seconds
    with 1 layer, with 3 layers), t = b·T tokens. A layer's time is (3-layer − 1-layer)/2; less its GEMMs
    ((2·t·12C² + 4·b·T²·C)·3 FLOPs at ``profile.gemm_flops(t)``) it is fitted, least squares, as
    x₁·t·C + x₂·b·H·T² + x₃ — elementwise passes over the activations and the attention scores, and a fixed cost
    per layer (a term whose fitted value is negative is dropped and the rest refitted: noise, not a speed-up).
    The 1-layer model less one layer and the head's GEMM (6·t·C·V) is fitted as y₁·t·V + y₂. Returned in the
    profile's units: passes (x·bandwidth/itemsize), seconds per layer and per microbatch."""
    layer_rows, layer_rest, head_rows, head_rest = [], [], [], []
    for C, T, b, H, one, three in probes:
        t, per_layer = b * T, (three - one) / 2
        gemm = (2 * t * 12 * C * C + 4 * b * T * T * C) * 3 / profile.gemm_flops(t)
        layer_rows.append([t * C, b * H * T * T, 1.0])
        layer_rest.append(per_layer - gemm)
        head_rows.append([t * vocab, 1.0])
        head_rest.append(one - per_layer - 6 * t * C * vocab / profile.gemm_flops(t))
    x, y = _nonnegative_least_squares(layer_rows, layer_rest), _nonnegative_least_squares(head_rows, head_rest)
    per_pass = itemsize / profile.bandwidth  # seconds per element pass
    return {"passes_act": x[0] / per_pass, "passes_att": x[1] / per_pass, "op_overhead": x[2],
            "passes_logits": y[0] / per_pass, "microbatch_overhead": y[1]}


def _nonnegative_least_squares(rows: list[list[float]], values: list[float]) -> list[float]:
    """Least squares with every coefficient ≥ 0: solve, drop the columns that came out negative, solve again."""
    a, v = np.array(rows, float), np.array(values, float)
    keep = list(range(a.shape[1]))
    while True:
        scale = np.abs(a[:, keep]).max(axis=0)  # columns of t·C and of 1 differ by 10⁶: solve on scaled columns
        solution = np.linalg.lstsq(a[:, keep] / scale, v, rcond=None)[0] / scale
        if (solution >= 0).all() or len(keep) == 1:
            coefficients = [0.0] * a.shape[1]
            for k, value in zip(keep, solution):
                coefficients[k] = max(0.0, float(value))
            return coefficients
        keep = [k for k, value in zip(keep, solution) if value >= 0] or [keep[int(np.argmax(solution))]]


def _model_probe(C: int, T: int, b: int, H: int, layers: int) -> float:
    """Seconds of one forward + backward of minipar's GPT (float32, vocabulary 256), sustained (:func:`_sustained`)."""
    from minipar.models.gpt import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=256, block_size=T, n_layer=layers, n_head=H, n_embd=C), seed=0)
    idx = np.random.default_rng(0).integers(0, 256, (b, T))

    def step() -> None:
        model(idx, idx)[1].backward()
        for p in model.parameters():
            p.grad = None
    return _sustained(step, window=0.45, warmup=3)  # a model's first steps grow the heap


def _replicated_probe(C: int, tokens: int) -> float:
    """Seconds of what every tensor-parallel rank repeats in a layer (sequence parallelism splits it): two layer
    norms and two residual adds over (tokens, C), forward + backward."""
    from minipar.autograd import Tensor
    from minipar.nn import LayerNorm

    norms = [LayerNorm(C), LayerNorm(C)]
    x = np.random.default_rng(0).standard_normal((tokens, C)).astype(np.float32)

    def step() -> None:
        h = Tensor(x, requires_grad=True)
        for norm in norms:
            h = h + norm(h)
        h.sum().backward()
    return _sustained(step, window=0.2, warmup=3)


def _optimizer_probe(width: int) -> tuple[float, int]:
    """(seconds of an AdamW step and zero_grad on a 3-layer GPT of ``width``, its parameter count)."""
    from minipar.models.gpt import GPT, GPTConfig
    from minipar.optim import AdamW

    model = GPT(GPTConfig(vocab_size=256, block_size=32, n_layer=3, n_head=2, n_embd=width), seed=0)
    optimizer = AdamW(model.parameters(), lr=1e-3)
    grads = [np.ones_like(p.data) for p in model.parameters()]

    def step() -> None:
        for p, g in zip(model.parameters(), grads):
            p.grad = g
        optimizer.step()
        optimizer.zero_grad()
    return _sustained(step), model.num_parameters()


def _fastest(fn: Any, repeat: int = 7) -> float:
    """Seconds of ``fn()`` alone on the machine: the fastest of ``repeat`` runs after one untimed."""
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _per_call(fn: Any, calls: int) -> float:
    """Seconds per ``fn()`` over ``calls`` calls after one untimed (a fixed count: ``fn`` may be a collective)."""
    fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def _sustained(fn: Any, window: float = 0.3, warmup: int = 1, rounds: int = 3) -> float:
    """Seconds per ``fn()`` sustained over a window of calls (after ``warmup`` untimed): with more ranks than cores a
    rank computes in the scheduler's slices, so one call's time says nothing of its share; a window's does. The
    fastest of ``rounds`` windows of window/rounds seconds each: a shared VM has slow spells (its measurements
    are taken the same way: the fastest of runs)."""
    for _ in range(warmup):
        fn()
    best = math.inf
    for _ in range(rounds):
        calls, t0 = 0, time.perf_counter()
        while True:
            fn()
            calls += 1
            elapsed = time.perf_counter() - t0
            if elapsed >= window / rounds:
                break
        best = min(best, elapsed / calls)
    return best


def _pingpong(comm: Any, nbytes: int, reps: int = 20) -> float:
    buf = np.zeros(nbytes, np.uint8)
    comm.barrier()
    t0 = time.perf_counter()
    for _ in range(reps):
        if comm.rank == 0:
            comm.send(buf, 1, tag=7, label="calibration")
            comm.recv(buf, 1, tag=7)
        elif comm.rank == 1:
            comm.recv(buf, 0, tag=7)
            comm.send(buf, 0, tag=7, label="calibration")
    one_way = (time.perf_counter() - t0) / (2 * reps)
    return float(comm.broadcast(np.array([one_way]), root=0, label="calibration")[0])
