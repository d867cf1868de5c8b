"""Mixed precision: 16-bit parameters, activations, gradients and messages with float32 master weights and
moments. Counted model state per rank equals the ZeRO paper's table (16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N) for
N = 2 and 4; AdamW's and ZeRO's float32 masters follow the float64 update; every engine trains within one unit
roundoff of float64; fp16 overflow skips the step and backs the loss scale off; a checkpoint keeps the float32
masters, so resuming continues the same run bit for bit."""
import numpy as np
import pytest

from minipar.checkpoint import load_checkpoint
from minipar.models.gpt import GPTConfig
from minipar.parallel import planner
from minipar.testing import run_ranks, train_cli

# unit roundoff u = 2^-(significand bits): the relative error of one rounding to the format
UNIT_ROUNDOFF = {"bf16-mixed": 2.0**-8, "fp16-mixed": 2.0**-11}

TINY = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "16", "--batch-size", "8",
        "--eval-interval", "0", "--json"]
CONSTANT_LR = ["--warmup", "0", "--min-lr", "2e-3"]  # = --lr: a run's first steps do not depend on --steps


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("zero,table", [(0, lambda n: 16), (1, lambda n: 4 + 12 / n), (2, lambda n: 2 + 14 / n),
                                        (3, lambda n: 16 / n)])
def test_model_state_is_the_papers_table(n, zero, table):
    records, _ = train_cli([*TINY, "--steps", "2", "--precision", "bf16-mixed", "--dp", str(n), "--zero", str(zero)], n)
    psi = GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=32).num_parameters()
    assert psi % n == 0  # Ψ = 34,176 divides by 2 and 4: every shard is exactly Ψ/N, the table holds with ==
    assert sum(records[-1]["model_state_bytes"].values()) == table(n) * psi
    assert planner.model_state_bytes(psi, n, zero, 2) == pytest.approx(table(n) * psi)  # what the planner plans with


@pytest.fixture(scope="module")
def fp64():
    return [r["loss"] for r in train_cli([*TINY, *CONSTANT_LR, "--steps", "10", "--dtype", "float64"], 1)[0]]


@pytest.mark.parametrize("ranks,layout", [(1, []), (2, ["--dp", "2"]), (2, ["--dp", "2", "--zero", "3"]),
                                          (2, ["--tp", "2", "--sp"]), (2, ["--pp", "2", "--microbatches", "2"]),
                                          (2, ["--pp", "2", "--microbatches", "2", "--schedule", "zb-h1"]),
                                          (2, ["--cp", "2"]), (2, ["--cp", "2", "--cp-kind", "ulysses", "--cp-split",
                                                                   "contiguous"])])
@pytest.mark.parametrize("precision", ["bf16-mixed", "fp16-mixed"])
def test_every_engine_trains_within_one_unit_roundoff_of_float64(fp64, ranks, layout, precision):
    """Each step's loss within u (2^-8 bf16, 2^-11 fp16) of the float64 run, relatively. The loss is the mean of
    B·T = 128 token losses whose rounding errors (a few u each) average out, and the float32 masters keep every
    update, so 10 steps stay well inside one u (measured: 0.1u); an lr-0 run is 7u off at step 2 (no warm-up, so
    the first update counts in full) and fails. fp16 starts at a loss scale of 2^10: 2^16 overflows at step 5
    here, and a skipped step is a different trajectory, not a rounding error."""
    scale = ["--loss-scale", "1024"] if precision == "fp16-mixed" else []
    records, _ = train_cli([*TINY, *CONSTANT_LR, "--steps", "10", "--precision", precision, *scale, *layout], ranks)
    losses = [r["loss"] for r in records]
    np.testing.assert_allclose(losses, fp64, rtol=UNIT_ROUNDOFF[precision], atol=0)
    assert ("loss_scale" in records[0]) == (precision == "fp16-mixed")  # bf16 has float32's range: no scaling
    assert not any(r.get("skipped") for r in records)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_adamw_masters_follow_the_float64_update(dtype):
    """A 16-bit parameter under AdamW for 10 steps: the float32 master equals the float64 formula applied to the
    unscaled 16-bit gradients within 2·steps·2^-24 relatively (one float32 rounding of p per step, its update's
    few roundings far smaller), and the parameter is the master rounded to 16 bits. The numbers are chosen so
    that the usual mistakes are orders of magnitude outside: each update (about lr/2 = 10^-4, each element's
    gradient keeping its sign) is below half a 16-bit ulp near 1.0 (2^-12 in fp16, 2^-9 in bf16), so masters
    re-read from the rounded parameter never move; ε equals |g|, so a gradient still carrying the loss scale
    2^10 takes steps of lr instead of lr/2 (float16; bfloat16 is not loss-scaled)."""
    from minipar.backend import resolve_dtype
    from minipar.nn import Parameter
    from minipar.optim import AdamW

    rng, steps, lr, scale, eps = np.random.default_rng(0), 10, 2e-4, 2.0**10, 1e-4
    sign = rng.choice([-1.0, 1.0], size=(4, 3))
    p0 = (1.0 + 0.01 * rng.standard_normal((4, 3))).astype(resolve_dtype(dtype))
    w = Parameter(p0.copy())
    opt = AdamW([w], lr=lr, betas=(0.9, 0.99), eps=eps, weight_decay=0.1)
    if dtype == "float16":  # loss-scaled; bfloat16 has float32's range and runs with the default grad_scale, 1
        opt.grad_scale = 1.0 / scale
    else:
        scale = 1.0
    p, m, v = p0.astype(np.float64), 0.0, 0.0
    for t in range(1, steps + 1):
        g = sign * 1e-4 * (1 + 0.1 * rng.random((4, 3)))
        w.grad = (scale * g).astype(w.dtype)  # the loss-scaled 16-bit gradient
        opt.step()
        g = w.grad.astype(np.float64) / scale
        p = p * (1 - lr * 0.1)
        m, v = 0.9 * m + 0.1 * g, 0.99 * v + 0.01 * g * g
        p = p - lr * (m / (1 - 0.9**t)) / (np.sqrt(v / (1 - 0.99**t)) + eps)
    master = opt.master[0]
    assert master.dtype == np.float32
    np.testing.assert_allclose(master, p, rtol=2 * steps * 2.0**-24, atol=0)
    assert (w.data == master.astype(w.dtype)).all()
    assert np.abs(p - p0.astype(np.float64)).min() > 5e-4  # every master moved: ten steps of about lr/2


def _zero_masters_equal_adamw(stage):
    """Every rank backpropagates the same batch as its share 1/2 of the global tokens, so the sum of the ranks'
    16-bit gradients g/2 + g/2 = g exactly (halving is exact): ZeRO's float32 master shards must then equal single-process AdamW's masters bit for bit."""
    from minipar.comm import Communicator
    from minipar.models.gpt import GPT, GPTConfig
    from minipar.optim import AdamW
    from minipar.parallel.zero import ZeRO

    comm = Communicator()
    cfg = GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16, dtype="bfloat16")
    x = np.random.default_rng(0).integers(0, 64, (2, 8))
    reference, sharded = GPT(cfg, seed=0), GPT(cfg, seed=0)
    names = {id(p): n for n, p in reference.named_parameters()}
    adamw = AdamW(reference.parameters(), lr=1e-3)
    engine = ZeRO(sharded, comm, stage, lr=1e-3)
    for _ in range(4):
        for model, optimizer in ((reference, adamw), (engine, engine)):
            _, loss = model(x, x)
            (loss * (1 / comm.size if optimizer is engine else 1.0)).backward()
            if optimizer is engine:
                engine.sync_gradients()
            optimizer.step()
            optimizer.zero_grad()
    want, got = adamw.master_state(names), engine.master_state()
    assert want.keys() == got.keys() and len(want) == len(names)
    for name, value in want.items():
        assert (got[name] == value).all(), name


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_masters_equal_adamw_bit_for_bit(stage):
    run_ranks(2, _zero_masters_equal_adamw, stage)


def test_fp16_overflow_skips_the_step_and_backs_off():
    records, _ = train_cli([*TINY, "--steps", "16", "--precision", "fp16-mixed", "--loss-scale", str(2.0**26)], 1)
    skipped = [r["skipped"] for r in records]
    assert skipped[0] and not skipped[-1]  # 2^26 overflows fp16; halving brings the scale into range
    scales = [r["loss_scale"] for r in records]
    assert all(b == a / 2 for a, b, s in zip(scales, scales[1:], skipped) if s)
    assert all(np.isfinite(r["loss"]) for r in records)


# The issue's configuration: its ranks' local float16 backward overflowed when each rank's loss was the mean over
# its own rows (every activation gradient dp times the one process's); the global-token normalization makes them
# the one process's. From 2^20 the one process skips its first steps and backs off, so skips are tested both ways.
OVERFLOW = ["--n-layer", "2", "--n-head", "2", "--n-embd", "16", "--block-size", "16", "--warmup", "2", "--steps", "12",
            "--precision", "fp16-mixed", "--loss-scale", str(2.0**20), "--eval-interval", "0", "--json"]


@pytest.fixture(scope="module")
def fp16_one_process():
    runs = {}
    return lambda batch: runs.setdefault(batch, train_cli([*OVERFLOW, "--batch-size", str(batch)], 1)[0])


@pytest.mark.parametrize("batch,ranks,layout", [
    (4, 2, ["--dp", "2"]),
    (6, 3, ["--dp", "3", "--zero", "1"]),
    (8, 4, ["--dp", "4", "--zero", "2"]),
    (8, 2, ["--dp", "2", "--zero", "3", "--microbatches", "2"]),
    (12, 3, ["--dp", "3", "--microbatches", "4"]),
    (8, 4, ["--dp", "2", "--pp", "2", "--microbatches", "2", "--schedule", "1f1b"]),
    (8, 4, ["--dp", "2", "--zero", "1", "--pp", "2", "--microbatches", "2", "--schedule", "zb-h1"]),
    (4, 4, ["--dp", "2", "--cp", "2"]),
    (4, 2, ["--dp", "2", "--local-sgd", "1", "--outer-lr", "1", "--outer-momentum", "0"]),
])
def test_fp16_data_parallel_skips_what_one_process_skips(fp16_one_process, batch, ranks, layout):
    """Each rank's backward starts from its tokens / the global batch's tokens (Pipeline.run), so every
    activation gradient of every rank is the one process's and the float16 backward overflows where the one
    process's does: the same skipped steps and loss scales exactly, any dp, ZeRO stage, microbatch count,
    schedule or cp, and each loss within one fp16 unit roundoff. (Local SGD with H = 1, η_out = 1, μ = 0 averages
    each step's update: its inner gradient is the replica's own mean, normalized over its own rows.)"""
    reference = fp16_one_process(batch)
    records, _ = train_cli([*OVERFLOW, "--batch-size", str(batch), *layout], ranks)
    skipped = [r["skipped"] for r in reference]
    assert any(skipped) and not all(skipped)
    assert [r["skipped"] for r in records] == skipped
    assert [r["loss_scale"] for r in records] == [r["loss_scale"] for r in reference]
    if "--local-sgd" not in layout:  # averaging the replicas' Adam updates is not the one process's step
        np.testing.assert_allclose([r["loss"] for r in records], [r["loss"] for r in reference],
                                   rtol=UNIT_ROUNDOFF["fp16-mixed"])


@pytest.mark.parametrize("ranks,layout", [(1, []), (2, ["--dp", "2", "--zero", "1"])])
def test_resume_keeps_the_float32_masters(tmp_path, ranks, layout):
    """6 steps in one go equal 3 steps, a checkpoint, and 3 resumed steps bit for bit — losses and the float32
    masters — in the same layout: a resume that re-derived the masters from the rounded 16-bit parameters would
    differ from step 4 on."""
    run = [*TINY, "--steps", "6", "--precision", "bf16-mixed", *layout]
    whole, _ = train_cli([*run, "--save", str(tmp_path / "a")], ranks)
    train_cli([*run, "--steps", "3", "--decay-steps", "6", "--save", str(tmp_path / "b")], ranks)
    resumed, _ = train_cli([*run, "--resume", str(tmp_path / "b"), "--save", str(tmp_path / "b")], ranks)
    assert [r["loss"] for r in resumed] == [r["loss"] for r in whole[3:]]
    a, b = (load_checkpoint(str(tmp_path / d)).params for d in ("a", "b"))
    assert a["transformer.wte.weight"].dtype == np.float32  # the masters, not the 16-bit parameters
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_float32_gradient_reduction_sends_float32_and_trains_alike(fp64, zero):
    """--reduce-dtype float32: the 16-bit gradients are upcast before the data-parallel reduction — twice the
    bytes of the 16-bit reduction, each rank's counted bytes the closed form (p = 2, Ψ counted from the model's
    arrays, r the reduction's bytes per element, parameters gathered in bf16): DP 2·½·Ψ·r, ZeRO-1 ½·Ψ·(r + 2),
    ZeRO-3 ½·Ψ·(r + 2·2) — and training stays within one unit roundoff of float64 (see above)."""
    from minipar.models.gpt import GPT

    psi = sum(p.size for p in GPT(GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=32)).parameters())
    runs = {reduce: train_cli([*TINY, *CONSTANT_LR, "--steps", "3", "--precision", "bf16-mixed", "--dp", "2",
                               "--zero", str(zero),
                               "--reduce-dtype", reduce], 2)[0] for reduce in ("auto", "float32")}
    grads = {reduce: records[-1]["comm_bytes_by_op"]["grads"] for reduce, records in runs.items()}
    assert grads["float32"] == 2 * grads["auto"]
    for reduce, records in runs.items():
        r = 4 if reduce == "float32" else 2
        closed = {0: 2 * 0.5 * psi * r, 1: 0.5 * psi * (r + 2), 3: 0.5 * psi * (r + 2 * 2)}[zero]
        assert records[-1]["comm_bytes"] == pytest.approx(closed, rel=1e-3)  # rank 0: ≤ 1 element more per bucket
    for records in runs.values():
        np.testing.assert_allclose([r["loss"] for r in records], fp64[:3], rtol=UNIT_ROUNDOFF["bf16-mixed"], atol=0)


@pytest.mark.slow  # the fast subset keeps under 3 minutes; the module has faster tests
def test_expert_parallel_trains_under_mixed_precision():
    """Within one bf16 unit roundoff of the float64 run (the router's top-k choices agree at these sizes)."""
    moe = [*TINY, *CONSTANT_LR, "--steps", "6", "--n-expert", "4", "--dp", "2", "--ep", "2"]
    reference = [r["loss"] for r in train_cli([*moe, "--dtype", "float64"], 2)[0]]
    records, _ = train_cli([*moe, "--precision", "bf16-mixed"], 2)
    np.testing.assert_allclose([r["loss"] for r in records], reference, rtol=UNIT_ROUNDOFF["bf16-mixed"], atol=0)


def test_ring_attention_sends_16_bit_blocks():
    """Ring context parallelism computes each block in float32 but sends K|V (and dK|dV) in 16 bits."""
    ring = ["--steps", "2", "--cp", "2"]
    fp32_bytes, bf16_bytes = (train_cli([*TINY, *ring, "--precision", precision], 2)[0][-1]["comm_bytes_by_op"]
                              for precision in ("fp32", "bf16-mixed"))
    for direction in ("cp_forward", "cp_backward"):
        assert bf16_bytes[direction] * 2 == fp32_bytes[direction] > 0


@pytest.mark.parametrize("precision,ranks,layout", [("bf16-mixed", 1, []), ("fp16-mixed", 2, ["--dp", "2", "--zero", "3"]),
                                                    ("bf16-mixed", 2, ["--tp", "2"])])
def test_out_writes_the_float32_masters(tmp_path, precision, ranks, layout):
    """--out under mixed precision (it crashed writing bfloat16) writes the weights the run trained: the float32
    masters, bit for bit those of its own checkpoint, with a config that says float32; they load and generate."""
    from minipar.models.gpt import GPT
    from minipar.safetensors_io import read_safetensors

    out, save = str(tmp_path / "hf"), str(tmp_path / "ckpt")
    train_cli([*TINY, "--steps", "3", "--precision", precision, "--save", save, *layout], ranks, out=out)
    weights = read_safetensors(f"{out}/model.safetensors")[0]
    masters = load_checkpoint(save).params
    assert weights.keys() == masters.keys() and all(w.dtype == np.float32 for w in weights.values())
    assert all((weights[name] == masters[name]).all() for name in weights)
    assert GPT.from_hf(out).config.dtype == "float32"
