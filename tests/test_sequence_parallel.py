"""Megatron sequence parallelism (--sp with --tp) reproduces single-process training (float64, 20 steps,
losses and final parameters), sends per layer what tensor parallelism's all-reduces send, and keeps the
layer-norm activations on T/tp shards."""
import sys

import numpy as np
import pytest

from closed_forms import all_reduce_bytes
from minipar.testing import assert_same_training, run_command, train_cli

L, B, T = 2, 8, 24


def model(heads=12, width=24):
    return ["--n-layer", str(L), "--n-head", str(heads), "--n-embd", str(width), "--block-size", str(T),
            "--batch-size", str(B), "--steps", "20", "--eval-interval", "0", "--json", "--lr", "3e-3", "--warmup", "5",
            "--dtype", "float64"]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return train_cli(model(), 1, str(tmp_path_factory.mktemp("single") / "out"))


def _ring_pair_bytes(n, tp):
    """A ring all-gather plus a ring reduce-scatter of n elements (float64), (p−1)/p·n each: one ring all-reduce's."""
    return all_reduce_bytes("ring", n, tp, 8)


@pytest.mark.parametrize("layout", [["--tp", "2"], ["--tp", "3"], ["--tp", "4"], ["--tp", "2", "--dp", "2"],
                                    ["--tp", "2", "--dp", "2", "--zero", "3"], ["--tp", "2", "--pp", "2"]])
def test_matches_single_process(tmp_path, single, layout):
    flags = dict(zip(layout[::2], map(int, layout[1::2])))
    ranks = flags["--tp"] * flags.get("--dp", 1) * flags.get("--pp", 1)
    result = train_cli([*model(), *layout, "--sp"], ranks, str(tmp_path / "sp"))
    assert_same_training(result, single)
    tp, dp, width = flags["--tp"], flags.get("--dp", 1), 24
    activation = B // dp * T * width  # per layer: 2 gathers + 2 reduce-scatters forward, the same backward
    for record in result[0]:
        if flags.get("--pp", 1) == 1:
            assert record["comm_bytes_by_op"]["sp_forward"] == 2 * L * _ring_pair_bytes(activation, tp)
            assert record["comm_bytes_by_op"]["sp_backward"] == 2 * L * _ring_pair_bytes(activation, tp)
            assert record["comm_calls_by_op"]["sp_forward"] == record["comm_calls_by_op"]["sp_backward"] == 4 * L
        assert record["activation_bytes"]["layer_norm"] > 0


def test_layer_norm_activations_shrink_by_tp(tmp_path):
    tp_only = train_cli([*model(), "--tp", "3", "--steps", "2", "--warmup", "2"], 3, None)[0]
    with_sp = train_cli([*model(), "--tp", "3", "--steps", "2", "--warmup", "2", "--sp"], 3, None)[0]
    full = B * T * 24 * 8 * (2 * L + 1)  # ln_1, ln_2 per layer and ln_f, each (B, T, C) float64
    assert tp_only[0]["activation_bytes"]["layer_norm"] == full
    assert with_sp[0]["activation_bytes"]["layer_norm"] == full // 3
    # the same collectives' bytes: TP's all-reduces (ring) vs SP's gather + reduce-scatter pairs
    np.testing.assert_allclose([r["loss"] for r in with_sp], [r["loss"] for r in tp_only], rtol=1e-9)


@pytest.mark.parametrize("ranks,args,message", [
    (1, ["--sp"], "--sp splits the sequence over the tensor-parallel ranks: it needs --tp >= 2"),
    (2, ["--tp", "2", "--sp", "--block-size", "25"], "(--block-size 25) must be divisible by it"),
])
def test_bad_sequence_parallel_layouts(ranks, args, message):
    command = [sys.executable, "-m", "minipar", "train", *model(), *args]
    with pytest.raises(AssertionError) as err:
        run_command(ranks, command, timeout=60)
    assert str(err.value).count(message) == 1 and "exit 2" in str(err.value)
