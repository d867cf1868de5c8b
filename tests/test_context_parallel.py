"""Context parallelism — ring attention (zigzag and contiguous splits) and DeepSpeed-Ulysses — reproduces
single-process training (float64, 20 steps, losses and final parameters) alone and combined with dp, zero-3,
tp (+sp) and pp; its messages send what the formulas say; the zigzag split balances the causal attention
work; bad layouts are refused before any communication."""
import sys

import pytest

import numpy as np

from minipar.testing import assert_same_training, run_command, run_ranks, train_cli

L, B, T, H, C = 2, 8, 24, 12, 24


def model():
    return ["--n-layer", str(L), "--n-head", str(H), "--n-embd", str(C), "--block-size", str(T), "--batch-size", str(B),
            "--steps", "20", "--eval-interval", "0", "--json", "--lr", "3e-3", "--warmup", "5", "--dtype", "float64"]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return train_cli(model(), 1, str(tmp_path_factory.mktemp("single") / "out"))


ALONE = [["--cp", "2"], ["--cp", "3"], ["--cp", "4"]]
COMBINED = [["--cp", "2", "--dp", "2", "--zero", "3"], ["--cp", "2", "--tp", "2", "--sp"], ["--cp", "2", "--pp", "2"]]
CASES = ([(layout, "ring", "zigzag") for layout in ALONE + COMBINED]
         + [(layout, "ring", "contiguous") for layout in ALONE]
         + [(layout, "ulysses", "contiguous") for layout in ALONE + COMBINED])


@pytest.mark.parametrize("layout,kind,split", CASES)
def test_matches_single_process(tmp_path, single, layout, kind, split):
    flags = dict(zip([a for a in layout if a.startswith("--") and a != "--sp"],
                     map(int, [v for v in layout if not v.startswith("--")])))
    ranks = flags["--cp"] * flags.get("--dp", 1) * flags.get("--tp", 1) * flags.get("--pp", 1)
    result = train_cli([*model(), *layout, "--cp-kind", kind, "--cp-split", split], ranks, str(tmp_path / "cp"))
    assert_same_training(result, single)
    cp, dp, tp, pp = flags["--cp"], flags.get("--dp", 1), flags.get("--tp", 1), flags.get("--pp", 1)
    layers = L // pp  # rank 0's: the first pipeline stage
    local = B // dp * (T // cp) * C // tp  # this rank's q (or k, or v) elements per layer
    if kind == "ulysses":  # per layer and direction, an all-to-all of q|k|v (3·local) and one of the output
        # (local): each rank keeps 1/cp of what it holds and sends the other (cp−1)/cp (DeepSpeed-Ulysses §3)
        forward = backward = layers * (cp - 1) * (3 * local + local) // cp * 8
    else:  # K|V around the ring cp−1 times forward; K|V|dK|dV cp times backward
        forward, backward = layers * (cp - 1) * 2 * local * 8, layers * cp * 4 * local * 8
    for record in result[0]:
        assert record["comm_bytes_by_op"]["cp_forward"] == forward
        assert record["comm_bytes_by_op"]["cp_backward"] == backward
        report = record.get("context")  # ring attention's balance, each step (Ulysses' heads are balanced anyway)
        assert (report is not None) == (kind == "ring")
        if report:  # zigzag: every rank scores the same (query, key) pairs; contiguous: the last rank the most
            assert (report["attention_pairs_max"] == report["attention_pairs_min"]) == (split == "zigzag")


def _attention_work(split):
    """One forward with ring attention: the (query, key) pairs each rank scores, gathered everywhere."""
    from minipar.comm import Communicator
    from minipar.models.gpt import GPT, GPTConfig
    from minipar.parallel.context_parallel import context_parallel, context_slice

    comm = Communicator()
    N = comm.size
    gpt = context_parallel(GPT(GPTConfig(vocab_size=16, block_size=8 * N, n_layer=1, n_head=2, n_embd=8)), comm,
                           "ring", split)
    idx = np.arange(8 * N)[None, :] % 16
    gpt(context_slice(idx, comm, split))
    work = comm.mpi.allgather(gpt.context_work["pairs"])
    t = 8  # positions per rank; 2 heads, 1 sample
    if split == "zigzag":
        assert len(set(work)) == 1 and sum(work) == 2 * (8 * N) * (8 * N + 1) // 2
    else:  # rank r: r full blocks before its own triangle
        assert work == [2 * (r * t * t + t * (t + 1) // 2) for r in range(N)]
    if comm.rank == 0:
        print(f"{split}: attention work per rank max/min = {max(work) / min(work):.2f}")


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("split", ["zigzag", "contiguous"])
def test_zigzag_balances_the_causal_work(p, split):
    run_ranks(p, _attention_work, split, timeout=60)


@pytest.mark.parametrize("ranks,args,message", [
    (2, ["--cp", "2", "--block-size", "26"], "cuts each sequence into 4 chunks: the sequence length (--block-size 26)"),
    (2, ["--cp", "2", "--cp-split", "contiguous", "--block-size", "25"], "must be divisible by 2"),
    (2, ["--cp", "2", "--cp-kind", "ulysses", "--n-head", "3", "--n-embd", "24"], "n_head / tp = 3 must be divisible"),
    (2, ["--cp", "2", "--cp-kind", "ulysses", "--cp-split", "zigzag"], "use --cp-split contiguous"),
    (3, ["--cp", "2"], "world size 3 is not divisible by tp·pp·cp = 1·1·2"),
])
def test_bad_context_parallel_layouts(ranks, args, message):
    command = [sys.executable, "-m", "minipar", "train", *model(), *args]
    with pytest.raises(AssertionError) as err:
        run_command(ranks, command, timeout=60)
    assert str(err.value).count(message) == 1 and "exit 2" in str(err.value)


@pytest.mark.slow  # 5 s: the full suite runs it (the fast subset stays under 3 minutes)
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


GQA = ["--arch", "llama", "--n-layer", "2", "--n-head", "4", "--n-embd", "16", "--n-inner", "24", "--block-size", "16",
       "--batch-size", "2", "--steps", "2", "--dtype", "float64", "--eval-interval", "0", "--json"]


@pytest.mark.parametrize("kind,cp,kv", [("ring", 2, 1), ("ring", 4, 2), ("ulysses", 2, 2), ("ulysses", 4, 2),
                                        ("ulysses", 2, 1)])
def test_grouped_query_attention_sends_its_key_value_heads(tmp_path, kind, cp, kv):
    """A grouped-query Llama (H = 4 query heads, K = kv) under context parallelism equals one process, and sends the
    K key/value heads, never the H they serve: ring attention K|V of K heads forward (cp − 1 hops) and K|V|dK|dV
    backward (cp hops); Ulysses q as H heads (H/cp to each rank) and k|v as K heads — K/cp to each rank, or, with
    fewer K/V heads than ranks, the one each rank's queries share (a copy to every rank that needs it) — and the
    output back as H heads. Per layer and rank, t = T/cp tokens of each of the B rows, D = 4."""
    flags = [*GQA, "--n-kv-head", str(kv)]
    single = train_cli(flags, 1, str(tmp_path / "one"))
    result = train_cli([*flags, "--cp", str(cp), "--cp-kind", kind,
                        "--cp-split", "zigzag" if kind == "ring" else "contiguous"], cp, str(tmp_path / "cp"))
    assert_same_training(result, single)
    B, t, D, H, layers = 2, 16 // cp, 4, 4, 2
    if kind == "ring":
        forward, backward = (cp - 1) * 2 * B * kv * t * D, cp * 4 * B * kv * t * D
    else:
        shared = kv // cp if kv >= cp else 1  # the K/V heads each rank receives
        forward = backward = (cp - 1) * B * t * D * (2 * H // cp + 2 * shared)
    for record in result[0]:
        assert record["comm_bytes_by_op"]["cp_forward"] == layers * forward * 8
        assert record["comm_bytes_by_op"]["cp_backward"] == layers * backward * 8
