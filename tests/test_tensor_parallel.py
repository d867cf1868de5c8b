"""Tensor parallelism reproduces single-process training (through the CLI), makes exactly the
collectives Megatron's analysis says, and handles a vocabulary that does not divide by tp."""
import sys

import numpy as np
import pytest
from mpi4py import MPI

from closed_forms import all_reduce_bytes

from minipar import Tensor, ops
from minipar.models.gpt import GPT, GPTConfig
from minipar.parallel.tensor_parallel import merge_state_dicts, shard_state_dict
from minipar.testing import assert_same_training, run_command, run_ranks, train_cli

L, B, T, C = 2, 8, 16, 16
MODEL = ["--n-layer", str(L), "--n-head", "4", "--n-embd", str(C), "--block-size", str(T), "--batch-size", str(B),
         "--steps", "20", "--eval-interval", "0", "--json", "--lr", "3e-3", "--warmup", "5", "--dtype", "float64"]


def train(tmp_path, name, ranks=1, extra=()):
    return train_cli([*MODEL, *extra], ranks, str(tmp_path / name))


@pytest.fixture(scope="module")
def odd_vocab_checkpoint(tmp_path_factory):
    """A starting checkpoint whose vocabulary (259) divides by neither 2 nor 4."""
    path = tmp_path_factory.mktemp("init") / "v259"
    GPT(GPTConfig(vocab_size=259, block_size=T, n_layer=L, n_head=4, n_embd=C, dtype="float64"), seed=7).save_hf(str(path))
    return str(path)


@pytest.mark.parametrize("layout", [["--tp", "2"], ["--tp", "4"], ["--tp", "2", "--dp", "2"],
                                    ["--tp", "2", "--dp", "2", "--zero", "3"]])
def test_matches_single_process(tmp_path, layout):
    reference = train(tmp_path, "single")
    ranks = int(np.prod([int(v) for k, v in zip(layout[::2], layout[1::2]) if k in ("--tp", "--dp")]))
    result = train(tmp_path, "tp", ranks, layout)
    assert_same_training(result, reference)
    tp = int(layout[1])
    for record in result[0]:  # per step: 2 forward + 2 backward all-reduces per layer, + embedding, head, loss
        calls = record["comm_calls_by_op"]
        assert (calls["tp_forward"], calls["tp_backward"]) == (2 * L, 2 * L)
        assert (calls["tp_embedding"], calls["tp_head"], calls["tp_cross_entropy"]) == (1, 1, 3)
        dp = 2 if "--dp" in layout else 1
        chosen = record["comm_algorithm_by_op"]  # the cost model's pick on this machine, per operation
        activation = all_reduce_bytes(chosen["tp_forward"], B // dp * T * C, tp, 8)  # one of B·T·C elements
        assert record["comm_bytes_by_op"]["tp_forward"] == 2 * L * activation
        assert record["comm_bytes_by_op"]["tp_backward"] == 2 * L * activation
        assert record["comm_bytes_by_op"]["tp_cross_entropy"] == 3 * all_reduce_bytes(
            chosen["tp_cross_entropy"], B // dp * T, tp, 8)


@pytest.mark.parametrize("tp", [2, 4])
def test_vocab_not_divisible_by_tp(tmp_path, odd_vocab_checkpoint, tp):
    init = ["--init-from", odd_vocab_checkpoint]
    assert_same_training(train(tmp_path, "tp", tp, [*init, "--tp", str(tp)]), train(tmp_path, "single", 1, init))


def test_shard_and_merge_round_trip():
    cfg = GPTConfig(vocab_size=11, block_size=4, n_layer=2, n_head=6, n_embd=12, dtype="float64")
    full = GPT(cfg, seed=1).state_dict()
    for tp in (1, 2, 3, 6):
        shards = [shard_state_dict(full, cfg, tp, r) for r in range(tp)]
        assert shards[0]["transformer.h.0.attn.c_attn.weight"].shape == (12, 36 // tp)
        assert shards[-1]["transformer.wte.weight"].shape == (-(-11 // tp), 12)  # padded rows
        merged = merge_state_dicts(shards, cfg)
        for name in full:
            np.testing.assert_array_equal(merged[name], full[name], err_msg=f"tp={tp} {name}")
        # every slice owns its memory: a view would keep the whole matrix alive on every rank
        assert all(a.base is None for shard in shards for a in shard.values())


def _vocab_parallel_ops_match_full():
    """tp = 3 ranks, vocabulary 7 (3 + 3 + 1 valid rows): lookup, logits, loss and gradients equal the unsplit ops."""
    from minipar.comm import Communicator
    from minipar.parallel.tensor_parallel import VocabParallelEmbedding, _vocab_rows

    comm = Communicator()
    cfg = GPTConfig(vocab_size=7, block_size=4, n_layer=1, n_head=3, n_embd=6, dtype="float64")
    rng = np.random.default_rng(0)
    table, h0 = rng.standard_normal((7, 6)), rng.standard_normal((2, 5, 6))
    idx, targets = rng.integers(0, 7, (2, 5)), rng.integers(0, 7, (2, 5))
    start, rows, valid = _vocab_rows(cfg, comm.size, comm.rank)
    local = np.zeros((rows, 6))
    local[:valid] = table[start:start + valid]
    emb = VocabParallelEmbedding(local, start, valid, comm)
    h = Tensor(h0.copy(), requires_grad=True)
    loss = emb.cross_entropy(emb.attend(emb(idx) + h), targets)

    w_full, h_full = Tensor(table.copy(), requires_grad=True), Tensor(h0.copy(), requires_grad=True)
    ref = ops.cross_entropy(ops.linear(ops.embedding(idx, w_full) + h_full, w_full, transposed=True), targets)
    np.testing.assert_allclose(loss.item(), ref.item(), rtol=1e-12)
    loss.backward()
    ref.backward()
    np.testing.assert_allclose(h.grad, h_full.grad, rtol=1e-10, atol=1e-14)
    np.testing.assert_allclose(emb.weight.grad[:valid], w_full.grad[start:start + valid], rtol=1e-10, atol=1e-14)
    assert not emb.weight.grad[valid:].any()  # padding rows learn nothing
    MPI.COMM_WORLD.Barrier()


def test_vocab_parallel_ops_three_ranks():
    run_ranks(3, _vocab_parallel_ops_match_full, timeout=60)


@pytest.mark.parametrize("args,message", [
    (["--tp", "3", "--n-head", "4"], "--tp 3 must divide n_head (4)"),
])
def test_bad_tp_config_fails_before_communicating(args, message):
    with pytest.raises(AssertionError) as err:
        run_command(3, [sys.executable, "-m", "minipar", "train", *args], timeout=60)
    assert str(err.value).count(message) == 1 and "exit 2" in str(err.value)  # refused by every rank, said once
