"""minipar's GPT-2 against transformers' GPT2LMHeadModel — the oracle the README names — in float64: logits and
loss, every parameter's gradient, three AdamW steps, greedy decoding, the BPE's ids against GPT2Tokenizer, and a
checkpoint `train --out` wrote, loaded by transformers.

Needs transformers and torch (``pip install -e ".[hf]"``); without them the module is skipped, saying why, and
the rest of the suite runs as always.
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the transformers comparison needs `pip install -e \".[hf]\"` (torch)")
transformers = pytest.importorskip("transformers", reason="the comparison needs `pip install -e \".[hf]\"`")

from minipar.data import BPETokenizer, default_corpus  # noqa: E402
from minipar.models.gpt import GPT, GPTConfig  # noqa: E402
from minipar.optim import AdamW  # noqa: E402
from minipar.testing import train_cli  # noqa: E402

CONFIGS = [dict(vocab_size=37, block_size=16, n_layer=2, n_head=2, n_embd=8),
           dict(vocab_size=64, block_size=12, n_layer=3, n_head=4, n_embd=16, scale_attn_by_inverse_layer_idx=True)]


def _pair(tmp_path, cfg, seed=0):
    """A random minipar GPT in float64 and the same weights in transformers, through save_hf / from_pretrained."""
    ours = GPT(GPTConfig(**cfg, dtype="float64"), seed=seed)
    ours.save_hf(str(tmp_path))
    theirs = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path), dtype=torch.float64)
    theirs.eval()  # no dropout: the deterministic function minipar computes
    return ours, theirs


@pytest.mark.parametrize("cfg", CONFIGS)
def test_logits_loss_and_every_gradient(tmp_path, cfg):
    ours, theirs = _pair(tmp_path, cfg)
    rng = np.random.default_rng(1)
    idx = rng.integers(0, cfg["vocab_size"], (3, cfg["block_size"]))
    targets = rng.integers(0, cfg["vocab_size"], (3, cfg["block_size"]))
    logits, loss = ours(idx, targets)
    loss.backward()
    out = theirs(torch.tensor(idx), labels=None)
    reference_loss = torch.nn.functional.cross_entropy(out.logits.reshape(-1, cfg["vocab_size"]),
                                                       torch.tensor(targets).reshape(-1))
    reference_loss.backward()
    np.testing.assert_allclose(logits.data, out.logits.detach().numpy(), rtol=0, atol=1e-12)
    assert abs(loss.item() - reference_loss.item()) <= 1e-12
    grads = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        np.testing.assert_allclose(p.grad, grads[name].grad.numpy(), rtol=0, atol=1e-12, err_msg=name)


def test_three_adamw_steps(tmp_path):
    """minipar's AdamW (decay on matrices only, as GPT-2/3) and torch's AdamW with the same parameter groups."""
    cfg = CONFIGS[0]
    ours, theirs = _pair(tmp_path, cfg, seed=3)
    decay = [p for p in theirs.parameters() if p.ndim >= 2]
    rest = [p for p in theirs.parameters() if p.ndim < 2]
    opt_ours = AdamW(ours.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    opt_theirs = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                   lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    rng = np.random.default_rng(4)
    for _ in range(3):
        idx = rng.integers(0, cfg["vocab_size"], (2, cfg["block_size"]))
        _, loss = ours(idx[:, :-1], idx[:, 1:])
        loss.backward()
        opt_ours.step()
        opt_ours.zero_grad()
        logits = theirs(torch.tensor(idx[:, :-1])).logits
        torch.nn.functional.cross_entropy(logits.reshape(-1, cfg["vocab_size"]),
                                          torch.tensor(idx[:, 1:]).reshape(-1)).backward()
        opt_theirs.step()
        opt_theirs.zero_grad()
    reference = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        np.testing.assert_allclose(p.data, reference[name].detach().numpy(), rtol=0, atol=1e-12, err_msg=name)


def test_greedy_decoding(tmp_path):
    ours, theirs = _pair(tmp_path, CONFIGS[1], seed=5)
    prompt = np.array([[3, 1, 4, 1, 5]])
    mine = ours.generate(prompt, max_new_tokens=7, top_k=1)  # top-1 sampling is the argmax
    reference = theirs.generate(torch.tensor(prompt), max_new_tokens=7, do_sample=False, pad_token_id=0)
    assert mine.tolist() == reference.tolist()


def test_bpe_ids_equal_gpt2_tokenizer(tmp_path):
    tokenizers = pytest.importorskip("tokenizers", reason="training the BPE needs the tokenizers package")
    trainer = tokenizers.ByteLevelBPETokenizer(add_prefix_space=False)
    trainer.train_from_iterator([default_corpus()[:200_000].decode("utf-8", errors="replace")], vocab_size=500,
                                min_frequency=2, show_progress=False)
    trainer.save_model(str(tmp_path))
    reference = transformers.GPT2Tokenizer(str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt"))
    ours = BPETokenizer.from_dir(str(tmp_path))
    text = default_corpus()[250_000:270_000].decode("utf-8", errors="replace") + " naïve café 3.14 I'm  x"
    assert ours.encode(text).tolist() == reference.encode(text)


def test_a_checkpoint_train_out_wrote(tmp_path):
    """`train --out` (float64): transformers loads it and computes minipar's logits for the trained weights."""
    out = str(tmp_path / "hf")
    train_cli(["--n-layer", "2", "--n-head", "2", "--n-embd", "16", "--block-size", "16", "--batch-size", "4",
               "--steps", "3", "--dtype", "float64", "--eval-interval", "0", "--json"], 1, out=out)
    ours = GPT.from_hf(out)
    theirs = transformers.GPT2LMHeadModel.from_pretrained(out, dtype=torch.float64).eval()
    idx = np.random.default_rng(6).integers(0, 256, (2, 16))
    np.testing.assert_allclose(ours(idx)[0].data, theirs(torch.tensor(idx)).logits.detach().numpy(), rtol=0, atol=1e-12)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)  # the byte tokenizer as a GPT-2 byte-level BPE
    text = "def naïve(x):\n    return x  # café ✓ <|endoftext|>"
    assert tokenizer.encode(text) == list(text.encode("utf-8")) and tokenizer.decode(tokenizer.encode(text)) == text
    assert theirs.config.bos_token_id is None and theirs.config.eos_token_id is None  # the byte vocabulary has none
