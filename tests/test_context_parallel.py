"""Context parallelism (DeepSpeed-Ulysses) reproduces single-process training (float64, 20 steps, losses and
final parameters) alone and combined with dp, zero-3, tp (+sp) and pp; its all-to-alls send what the formula
says; bad layouts are refused before any communication."""
import sys

import pytest

from minipar.comm.collectives import all_to_all_bytes_sent
from minipar.testing import assert_same_training, run_command, train_cli

L, B, T, H, C = 2, 8, 24, 12, 24


def model():
    return ["--n-layer", str(L), "--n-head", str(H), "--n-embd", str(C), "--block-size", str(T), "--batch-size", str(B),
            "--steps", "20", "--eval-interval", "0", "--json", "--lr", "3e-3", "--warmup", "5", "--dtype", "float64"]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return train_cli(model(), 1, str(tmp_path_factory.mktemp("single") / "out"))


@pytest.mark.parametrize("layout", [["--cp", "2"], ["--cp", "3"], ["--cp", "4"], ["--cp", "2", "--dp", "2", "--zero", "3"],
                                    ["--cp", "2", "--tp", "2", "--sp"], ["--cp", "2", "--pp", "2"]])
def test_ulysses_matches_single_process(tmp_path, single, layout):
    flags = dict(zip([a for a in layout if a.startswith("--") and a != "--sp"],
                     map(int, [v for v in layout if not v.startswith("--")])))
    ranks = flags["--cp"] * flags.get("--dp", 1) * flags.get("--tp", 1) * flags.get("--pp", 1)
    result = train_cli([*model(), *layout, "--cp-kind", "ulysses"], ranks, str(tmp_path / "cp"))
    assert_same_training(result, single)
    cp, dp, tp = flags["--cp"], flags.get("--dp", 1), flags.get("--tp", 1)
    if flags.get("--pp", 1) == 1:  # per layer and direction: q|k|v to heads, the output back, pairwise
        local = B // dp * (T // cp) * C // tp
        per_layer = (all_to_all_bytes_sent([3 * local // cp] * cp, 8, 0, "pairwise")
                     + all_to_all_bytes_sent([local // cp] * cp, 8, 0, "pairwise"))
        for record in result[0]:
            assert record["comm_bytes_by_op"]["cp_forward"] == record["comm_bytes_by_op"]["cp_backward"] == L * per_layer


@pytest.mark.parametrize("ranks,args,message", [
    (2, ["--cp", "2", "--block-size", "25"], "(--block-size 25) must be divisible by it"),
    (2, ["--cp", "2", "--n-head", "3", "--n-embd", "24"], "n_head / tp = 3 must be divisible by it"),
    (2, ["--cp", "2", "--cp-kind", "ring"], "only ['ulysses'] is implemented so far"),
    (3, ["--cp", "2"], "world size 3 is not divisible by tp·pp·cp = 1·1·2"),
])
def test_bad_context_parallel_layouts(ranks, args, message):
    command = [sys.executable, "-m", "minipar", "train", *model(), *args]
    with pytest.raises(AssertionError) as err:
        run_command(ranks, command, timeout=60)
    assert str(err.value).count(message) == 1 and "exit 2" in str(err.value)


def test_checkpoint_saved_under_cp_resumes_elsewhere(tmp_path, single):
    """Saved at step 10 with cp = 2 (zero-1 over dp·cp), resumed with cp = 3: the single-process trajectory."""
    save = str(tmp_path / "save")
    train_cli([*model(), "--cp", "2", "--zero", "1", "--save", save, "--save-interval", "10"], 2)
    records, params = train_cli([*model(), "--cp", "3", "--resume", f"{save}/step_000010"], 3, str(tmp_path / "resumed"))
    losses = {r["step"]: r["loss"] for r in records if "loss" in r}
    expected = {r["step"]: r["loss"] for r in single[0] if "loss" in r}
    assert sorted(losses) == list(range(11, 21))
    assert_same_training(([{"loss": losses[s]} for s in range(11, 21)], params),
                         ([{"loss": expected[s]} for s in range(11, 21)], single[1]))
