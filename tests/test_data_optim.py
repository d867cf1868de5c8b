"""Tokenizers, deterministic batches, optimizers, LR schedule, clipping."""
import math

import numpy as np
import pytest

from minipar import backend
from minipar.data import BPETokenizer, Batches, ByteTokenizer, default_corpus, load_tokens, shard_rows, split_tokens
from minipar.nn import Parameter
from minipar.optim import SGD, AdamW, LossScaler, adamw_update, clip_grad_norm, cosine_lr


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "def f(x):\n    return 'é' * x  # ünïcode"
    ids = tok.encode(text)
    assert ids.max() < 256 and tok.decode(ids) == text


def test_bpe_tokenizer_merges_by_rank():
    # symbols of "low lower": 'l','o','w','Ġ','e','r'; merges learnt in this order
    merges = [("l", "o"), ("lo", "w"), ("e", "r"), ("Ġ", "low")]
    symbols = ["l", "o", "w", "e", "r", "Ġ", "lo", "low", "er", "Ġlow"]
    tok = BPETokenizer({s: i for i, s in enumerate(symbols)}, merges)
    ids = tok.encode("low lower")
    assert [tok.decoder[int(i)] for i in ids] == ["low", "Ġlow", "er"]
    assert tok.decode(ids) == "low lower"


def test_default_corpus_is_python_source():
    raw = default_corpus()
    assert len(raw) > 1_000_000 and b"def " in raw and b"import " in raw


def test_load_tokens_missing_file():
    with pytest.raises(FileNotFoundError, match="not found"):
        load_tokens("/no/such/file.txt")


def test_batches_are_a_function_of_seed_and_step():
    tokens = np.arange(1000) % 251
    a, b = Batches(tokens, 4, 16, seed=1), Batches(tokens, 4, 16, seed=1)
    x5, y5 = a(5)
    a(6)
    np.testing.assert_array_equal(b(5)[0], x5)  # no hidden state: step 5 is step 5
    np.testing.assert_array_equal(x5[:, 1:], y5[:, :-1])
    assert not np.array_equal(a(7)[0], x5)


def test_batches_draw_every_window_the_last_included():
    """T + 2 tokens hold two windows of T + 1: both are drawn, and T + 1 tokens (one window) are enough."""
    for n, starts in ((18, {0, 1}), (17, {0})):
        batches = Batches(np.arange(n), 4, 16)
        assert {int(row[0]) for step in range(20) for row in batches(step)[0]} == starts
    with pytest.raises(ValueError, match="block_size 16 needs at least 17"):
        Batches(np.arange(16), 4, 16)


def test_cache_blocks_tile_the_arrays_in_order():
    """Blocks of CACHE_BLOCK elements, matching views of every array, covering each once in order; an array of one
    block or less, or a non-contiguous one, comes back whole."""
    n = 5 * backend.CACHE_BLOCK // 2
    a, b = np.arange(n, dtype=np.float64), np.zeros(n)
    blocks = list(backend.cache_blocks(a, b))
    assert [len(x) for x, _ in blocks] == [backend.CACHE_BLOCK] * 2 + [n - 2 * backend.CACHE_BLOCK]
    for x, y in blocks:
        y += x  # views: writing a block writes the array
    np.testing.assert_array_equal(b, a)
    small, strided = np.ones(backend.CACHE_BLOCK), np.ones(3 * backend.CACHE_BLOCK)[::2]
    assert [len(list(backend.cache_blocks(whole))) for whole in (small, strided)] == [1, 1]


def test_an_unknown_device_is_refused():
    with pytest.raises(ValueError, match="unknown device 'tpu': expected 'cpu' or 'gpu'"):
        backend.set_device("tpu")
    assert backend.device() == "cpu"


def test_split_holds_out_the_last_tenth():
    train, val = split_tokens(np.arange(100))
    np.testing.assert_array_equal(train, np.arange(90))
    np.testing.assert_array_equal(val, np.arange(90, 100))


def test_shard_rows_partitions_the_global_batch():
    x = np.arange(24).reshape(8, 3)
    np.testing.assert_array_equal(np.concatenate([shard_rows(x, r, 4) for r in range(4)]), x)
    with pytest.raises(ValueError, match="divisible"):
        shard_rows(x, 0, 3)


def test_adamw_matches_formula():
    rng = np.random.default_rng(0)
    p0, grads = rng.standard_normal((3, 2)), [rng.standard_normal((3, 2)) for _ in range(3)]
    bias0 = rng.standard_normal(2)
    w, b = Parameter(p0.copy()), Parameter(bias0.copy())
    opt = AdamW([w, b], lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    p, m, v = p0.copy(), 0, 0
    for t, g in enumerate(grads, start=1):
        w.grad, b.grad = g.copy(), g[0].copy()
        opt.step()
        p = p * (1 - 0.01 * 0.1)
        m, v = 0.9 * m + 0.1 * g, 0.99 * v + 0.01 * g * g
        p = p - 0.01 * (m / (1 - 0.9**t)) / (np.sqrt(v / (1 - 0.99**t)) + 1e-8)
    np.testing.assert_allclose(w.data, p, rtol=1e-13)
    assert not np.allclose(b.data, bias0)  # biases are updated, without decay:
    mb = vb = 0
    bb = bias0.copy()
    for t, g in enumerate(grads, start=1):
        mb, vb = 0.9 * mb + 0.1 * g[0], 0.99 * vb + 0.01 * g[0] ** 2
        bb = bb - 0.01 * (mb / (1 - 0.9**t)) / (np.sqrt(vb / (1 - 0.99**t)) + 1e-8)
    np.testing.assert_allclose(b.data, bb, rtol=1e-13)


@pytest.mark.parametrize("decay", ["scalar", "per_element"])
def test_adamw_block_by_block_gives_the_whole_arrays_bits(monkeypatch, decay):
    """adamw_update walks p, g, m, v block by block (backend.cache_blocks): after three steps the same bits as
    one pass over whole arrays, for a size that is no multiple of the block, with ZeRO's per-element decay too."""
    rng = np.random.default_rng(1)
    p0, grads = rng.standard_normal(1000), [rng.standard_normal(1000) for _ in range(3)]
    weight_decay = 0.1 if decay == "scalar" else np.where(np.arange(1000) < 600, 0.1, 0.0)

    def run(block):
        monkeypatch.setattr(backend, "CACHE_BLOCK", block)
        p, m, v = p0.copy(), np.zeros(1000), np.zeros(1000)
        for step, g in enumerate(grads, start=1):
            adamw_update(p, g, m, v, step=step, lr=0.01, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=weight_decay)
        return p, m, v

    whole, blocked = run(10**9), run(96)
    assert all(np.array_equal(a, b) for a, b in zip(whole, blocked))
    assert not np.array_equal(whole[0], p0)


def test_loss_scaler_follows_pytorchs_grad_scaler():
    """PyTorch's GradScaler defaults (init_scale 2^16, growth ×2, backoff ×0.5, growth interval 2000); an overflow
    halves the scale and restarts the count of good steps; every growth_interval-th good step in a row doubles it."""
    default = LossScaler()
    assert (default.scale, default.growth, default.backoff, default.growth_interval) == (2.0**16, 2.0, 0.5, 2000)
    scaler = LossScaler(8.0, growth_interval=3)
    for finite, scale in [(True, 8), (True, 8), (True, 16), (False, 8), (True, 8), (True, 8), (True, 16), (True, 16)]:
        scaler.update(finite)
        assert scaler.scale == scale


def test_sgd_momentum():
    w = Parameter(np.array([1.0]))
    opt = SGD([w], lr=0.1, momentum=0.9)
    for _ in range(2):
        w.grad = np.array([1.0])
        opt.step()
    np.testing.assert_allclose(w.data, [1.0 - 0.1 * 1.0 - 0.1 * 1.9])


def test_cosine_lr():
    kw = dict(max_lr=1.0, warmup_steps=10, total_steps=110, min_lr=0.1)
    assert cosine_lr(0, **kw) == pytest.approx(0.1)
    assert cosine_lr(9, **kw) == pytest.approx(1.0)
    assert cosine_lr(10, **kw) == pytest.approx(1.0)
    assert cosine_lr(60, **kw) == pytest.approx(0.55)
    assert cosine_lr(110, **kw) == pytest.approx(0.1)
    assert cosine_lr(500, **kw) == pytest.approx(0.1)


def test_clip_grad_norm():
    a, b = Parameter(np.zeros(2)), Parameter(np.zeros(1))
    a.grad, b.grad = np.array([3.0, 0.0]), np.array([4.0])
    assert clip_grad_norm([a, b], 1.0) == 5.0
    clipped = 5.0 / (5.0 + 1e-6)  # scaled by max_norm / (norm + 1e-6): the 1e-6 guards a zero norm
    assert math.sqrt((a.grad**2).sum() + (b.grad**2).sum()) == pytest.approx(clipped, rel=1e-15)
    assert clip_grad_norm([a, b], 10.0) == pytest.approx(clipped, rel=1e-15)  # below the bound: untouched
    # a sharded gradient: the global sum of squares comes from the other ranks
    a.grad = np.array([3.0, 0.0])
    assert clip_grad_norm([a], 100.0, sum_squares=lambda s: s + 16.0) == pytest.approx(5.0)
