"""Mixed precision: 16-bit parameters, activations, gradients and messages with float32 master weights and
moments. Counted model state per rank equals the ZeRO paper's table (16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N) for
N = 2 and 4; every engine trains under it and stays close to float32; fp16 overflow skips the step and backs
the loss scale off; a checkpoint keeps the float32 masters, so resuming continues the same run."""
import numpy as np
import pytest

from minipar.checkpoint import load_checkpoint
from minipar.models.gpt import GPTConfig
from minipar.parallel import planner
from minipar.testing import train_cli

TINY = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "16", "--batch-size", "8",
        "--eval-interval", "0", "--json"]


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("zero,table", [(0, lambda n: 16), (1, lambda n: 4 + 12 / n), (2, lambda n: 2 + 14 / n),
                                        (3, lambda n: 16 / n)])
def test_model_state_is_the_papers_table(n, zero, table):
    records, _ = train_cli([*TINY, "--steps", "2", "--precision", "bf16-mixed", "--dp", str(n), "--zero", str(zero)], n)
    psi = GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=32).num_parameters()
    assert sum(records[-1]["model_state_bytes"].values()) == pytest.approx(table(n) * psi, rel=0.02)
    assert planner.model_state_bytes(psi, n, zero, 2) == pytest.approx(table(n) * psi)  # what the planner plans with


@pytest.fixture(scope="module")
def fp32():
    return [r["loss"] for r in train_cli([*TINY, "--steps", "10"], 1)[0]]


@pytest.mark.parametrize("ranks,layout", [(1, []), (2, ["--dp", "2"]), (2, ["--dp", "2", "--zero", "3"]),
                                          (2, ["--tp", "2", "--sp"]), (2, ["--pp", "2", "--microbatches", "2"]),
                                          (2, ["--pp", "2", "--microbatches", "2", "--schedule", "zb-h1"]),
                                          (2, ["--cp", "2"]), (2, ["--cp", "2", "--cp-kind", "ulysses", "--cp-split",
                                                                   "contiguous"])])
@pytest.mark.parametrize("precision", ["bf16-mixed", "fp16-mixed"])
def test_every_engine_trains_close_to_fp32(fp32, ranks, layout, precision):
    records, _ = train_cli([*TINY, "--steps", "10", "--precision", precision, *layout], ranks)
    losses = [r["loss"] for r in records]
    np.testing.assert_allclose(losses, fp32, rtol=2e-2)
    assert ("loss_scale" in records[0]) == (precision == "fp16-mixed")  # bf16 has float32's range: no scaling


def test_fp16_overflow_skips_the_step_and_backs_off():
    records, _ = train_cli([*TINY, "--steps", "16", "--precision", "fp16-mixed", "--loss-scale", str(2.0**26)], 1)
    skipped = [r["skipped"] for r in records]
    assert skipped[0] and not skipped[-1]  # 2^26 overflows fp16; halving brings the scale into range
    scales = [r["loss_scale"] for r in records]
    assert all(b == a / 2 for a, b, s in zip(scales, scales[1:], skipped) if s)
    assert all(np.isfinite(r["loss"]) for r in records)


def test_resume_keeps_the_float32_masters(tmp_path):
    whole, _ = train_cli([*TINY, "--steps", "6", "--precision", "bf16-mixed", "--dp", "2", "--zero", "1",
                          "--save", str(tmp_path / "a")], 2)
    train_cli([*TINY, "--steps", "6", "--precision", "bf16-mixed", "--save", str(tmp_path / "b"),
               "--save-interval", "3"], 1)
    resumed, _ = train_cli([*TINY, "--steps", "6", "--precision", "bf16-mixed", "--dp", "2", "--zero", "1",
                            "--resume", str(tmp_path / "b" / "step_000003")], 2)
    assert load_checkpoint(str(tmp_path / "a")).params["transformer.wte.weight"].dtype == np.float32  # masters
    np.testing.assert_allclose([r["loss"] for r in resumed], [r["loss"] for r in whole[3:]], rtol=1e-2)


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_float32_gradient_reduction_sends_float32_and_trains_alike(fp32, zero):
    """--reduce-dtype float32: the 16-bit gradients are upcast before the data-parallel reduction — twice the
    bytes of the 16-bit reduction, each rank's counted bytes still the formula's — and training stays with fp32."""
    runs = {reduce: train_cli([*TINY, "--steps", "3", "--precision", "bf16-mixed", "--dp", "2", "--zero", str(zero),
                               "--reduce-dtype", reduce], 2)[0] for reduce in ("auto", "float32")}
    grads = {reduce: records[-1]["comm_bytes_by_op"]["grads"] for reduce, records in runs.items()}
    assert grads["float32"] == 2 * grads["auto"]
    for records in runs.values():
        assert records[-1]["comm_bytes"] == pytest.approx(records[-1]["comm_formula_bytes"], rel=1e-6)
    np.testing.assert_allclose([r["loss"] for r in runs["float32"]], fp32[:3], rtol=2e-2)


def test_expert_parallel_trains_under_mixed_precision():
    moe = [*TINY, "--steps", "6", "--n-expert", "4", "--dp", "2", "--ep", "2"]
    reference = [r["loss"] for r in train_cli(moe, 2)[0]]
    records, _ = train_cli([*moe, "--precision", "bf16-mixed"], 2)
    np.testing.assert_allclose([r["loss"] for r in records], reference, rtol=2e-2)


def test_ring_attention_sends_16_bit_blocks():
    """Ring context parallelism computes each block in float32 but sends K|V (and dK|dV) in 16 bits."""
    ring = ["--steps", "2", "--cp", "2"]
    fp32_bytes, bf16_bytes = (train_cli([*TINY, *ring, "--precision", precision], 2)[0][-1]["comm_bytes_by_op"]
                              for precision in ("fp32", "bf16-mixed"))
    for direction in ("cp_forward", "cp_backward"):
        assert bf16_bytes[direction] * 2 == fp32_bytes[direction] > 0
