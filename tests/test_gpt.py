"""GPT-2: forward against an independent numpy implementation, gradients by finite differences,
Hugging Face checkpoint round trips."""
import json
import os

import numpy as np
import pytest

from minipar.safetensors_io import read_safetensors, write_safetensors
from minipar.models.gpt import GPT, GPTConfig
from minipar.testing import gradcheck

TINY = dict(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=8, dtype="float64")


def reference_forward(sd, cfg, idx):
    """GPT-2 written out longhand in numpy from the state dict (HF names)."""
    def ln(x, p):
        mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + cfg.layer_norm_epsilon) * sd[p + ".weight"] + sd[p + ".bias"]

    def lin(x, p):
        return x @ sd[p + ".weight"] + sd[p + ".bias"]

    B, T = idx.shape
    H, D = cfg.n_head, cfg.n_embd // cfg.n_head
    x = sd["transformer.wte.weight"][idx] + sd["transformer.wpe.weight"][:T]
    for i in range(cfg.n_layer):
        p = f"transformer.h.{i}"
        q, k, v = np.split(lin(ln(x, p + ".ln_1"), p + ".attn.c_attn"), 3, axis=-1)
        q, k, v = (a.reshape(B, T, H, D).transpose(0, 2, 1, 3) for a in (q, k, v))
        att = q @ k.transpose(0, 1, 3, 2) / np.sqrt(D) + np.triu(np.full((T, T), -np.inf), 1)
        att = np.exp(att - att.max(-1, keepdims=True))
        att /= att.sum(-1, keepdims=True)
        y = (att @ v).transpose(0, 2, 1, 3).reshape(B, T, H * D)
        x = x + lin(y, p + ".attn.c_proj")
        h = lin(ln(x, p + ".ln_2"), p + ".mlp.c_fc")
        h = 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h**3)))
        x = x + lin(h, p + ".mlp.c_proj")
    return ln(x, "transformer.ln_f") @ sd["transformer.wte.weight"].T


def test_forward_matches_reference():
    cfg = GPTConfig(**TINY)
    model = GPT(cfg, seed=3)
    idx = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 7))
    logits, loss = model(idx)
    assert loss is None and logits.shape == (2, 7, cfg.vocab_size)
    np.testing.assert_allclose(logits.data, reference_forward(model.state_dict(), cfg, idx), rtol=1e-11, atol=1e-13)


def test_config_counts_the_parameters():
    """The closed form (12C² + 13C per block, 4C² + 8C + E·(8C² + 6C) with E experts) against the arrays built."""
    for kw in (TINY, dict(TINY, n_layer=3, vocab_size=300), dict(TINY, n_expert=3, expert_top_k=2)):
        cfg = GPTConfig(**kw)
        assert cfg.num_parameters() == GPT(cfg).num_parameters() == sum(p.size for p in GPT(cfg).parameters())
        if not cfg.n_expert:  # the planner's FLOPs per token: 2 per weight-matrix entry of a (dense) block
            block = [p for name, p in GPT(cfg).named_parameters() if ".0." in name and p.ndim == 2]
            assert sum(cfg.layer_weights()) == sum(p.size for p in block)


def test_load_state_dict_names_what_is_missing_and_unexpected():
    """strict: a KeyError naming the first five missing and unexpected names, "..." when there are more."""
    model = GPT(GPTConfig(**TINY))
    names = sorted(dict(model.named_parameters()))
    with pytest.raises(KeyError) as err:
        model.load_state_dict({"extra": np.zeros(1)})
    assert err.value.args[0] == f"state_dict mismatch: missing {names[:5]}..., unexpected ['extra']"
    extra = {f"extra.{i}": np.zeros(1) for i in range(6)}
    with pytest.raises(KeyError) as err:
        model.load_state_dict({**{name: p.data for name, p in model.named_parameters() if name not in names[:5]}, **extra})
    assert err.value.args[0] == f"state_dict mismatch: missing {names[:5]}, unexpected {sorted(extra)[:5]}..."


def test_default_vocabulary_holds_every_byte():
    from minipar.data import ByteTokenizer

    assert GPTConfig().vocab_size == ByteTokenizer.vocab_size == 256


def test_parameter_names_are_hugging_face_names():
    names = [n for n, _ in GPT(GPTConfig(**TINY)).named_parameters()]
    assert names[:4] == ["transformer.wte.weight", "transformer.wpe.weight", "transformer.h.0.ln_1.weight",
                         "transformer.h.0.ln_1.bias"]
    assert "transformer.h.1.mlp.c_fc.weight" in names and names[-1] == "transformer.ln_f.bias"
    assert GPT(GPTConfig(**TINY)).transformer.h[0].attn.c_attn.weight.shape == (8, 24)  # Conv1D: (in, out)


def test_loss_gradients_by_finite_differences():
    cfg = GPTConfig(**TINY)
    model = GPT(cfg, seed=1)
    rng = np.random.default_rng(1)
    idx, targets = rng.integers(0, cfg.vocab_size, (2, 5)), rng.integers(0, cfg.vocab_size, (2, 5))
    # a sample of parameters: tied embedding, position embedding, attention, MLP, layer norms
    names = ["transformer.wte.weight", "transformer.wpe.weight", "transformer.h.0.attn.c_attn.weight",
             "transformer.h.1.mlp.c_proj.weight", "transformer.h.0.ln_2.weight", "transformer.ln_f.bias"]
    params = dict(model.named_parameters())

    def loss_of(*tensors):  # put gradcheck's tensors in the parameters' places
        for name, t in zip(names, tensors):
            owner = model
            for part in name.split(".")[:-1]:
                owner = getattr(owner, part)
            setattr(owner, name.rsplit(".", 1)[1], t)
        return model(idx, targets)[1]

    gradcheck(loss_of, *[params[n].data.copy() for n in names], rtol=1e-5, atol=1e-8)


def test_hf_round_trip(tmp_path):
    model = GPT(GPTConfig(**TINY), seed=5)
    model.save_hf(str(tmp_path))
    hf = json.load(open(tmp_path / "config.json"))
    assert hf["model_type"] == "gpt2" and hf["activation_function"] == "gelu_new" and hf["n_positions"] == 8
    loaded = GPT.from_hf(str(tmp_path))
    idx = np.array([[1, 2, 3, 4]])
    np.testing.assert_array_equal(loaded(idx)[0].data, model(idx)[0].data)
    assert loaded.config == model.config


def test_from_hf_accepts_transformers_layouts(tmp_path):
    """Hub checkpoints omit the ``transformer.`` prefix, store causal-mask buffers and may store lm_head."""
    model = GPT(GPTConfig(**TINY), seed=6)
    model.save_hf(str(tmp_path))
    tensors = {k.removeprefix("transformer."): v for k, v in model.state_dict().items()}
    tensors["h.0.attn.bias"] = np.tril(np.ones((1, 1, 8, 8)))
    tensors["lm_head.weight"] = tensors["wte.weight"]
    write_safetensors(str(tmp_path / "model.safetensors"), tensors)
    np.testing.assert_array_equal(GPT.from_hf(str(tmp_path)).transformer.wte.weight.data, model.transformer.wte.weight.data)

    tensors["lm_head.weight"] = tensors["wte.weight"] + 1.0
    write_safetensors(str(tmp_path / "model.safetensors"), tensors)
    with pytest.raises(ValueError, match="ties its head"):
        GPT.from_hf(str(tmp_path))


def test_from_hf_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        GPT.from_hf(str(tmp_path))
    GPT(GPTConfig(**TINY)).save_hf(str(tmp_path))
    cfg = json.load(open(tmp_path / "config.json"))
    cfg["activation_function"] = "relu"
    json.dump(cfg, open(tmp_path / "config.json", "w"))
    with pytest.raises(ValueError, match="relu"):
        GPT.from_hf(str(tmp_path))


def test_safetensors_dtypes_and_truncation(tmp_path):
    path = str(tmp_path / "t.safetensors")
    tensors = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.array([1, -2], np.int64),
               "c": np.zeros((0, 4), np.float64), "d": np.array([True, False])}
    write_safetensors(path, tensors, {"note": "x"})
    back, meta = read_safetensors(path)
    assert meta == {"note": "x"}
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype
        np.testing.assert_array_equal(back[k], v)
    raw = open(path, "rb").read()
    assert (8 + int.from_bytes(raw[:8], "little")) % 8 == 0  # data 8-byte aligned
    open(path, "wb").write(raw[:-8])
    with pytest.raises(ValueError, match="truncated"):
        read_safetensors(path)
    assert not [f for f in os.listdir(tmp_path) if ".tmp-" in f]


def test_safetensors_reads_bf16(tmp_path):
    values = np.array([1.5, -2.0, 3.140625], np.float32)
    bf16 = (values.view(np.uint32) >> 16).astype("<u2").tobytes()
    header = json.dumps({"w": {"dtype": "BF16", "shape": [3], "data_offsets": [0, 6]}}).encode()
    path = tmp_path / "bf.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header + bf16)
    np.testing.assert_array_equal(read_safetensors(str(path))[0]["w"], values)


@pytest.mark.parametrize("bad,match", [(dict(n_embd=10, n_head=4), "divisible"), (dict(n_layer=0), "positive"),
                                       (dict(dtype="int8"), "dtype"),
                                       (dict(n_expert=2, capacity_factor=-0.5), "capacity_factor must be >= 0"),
                                       (dict(n_expert=2, aux_loss_coef=-0.1), "aux_loss_coef >= 0")])
def test_config_validation(bad, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(**{**TINY, **bad})


def test_generate_is_seeded_and_respects_block_size():
    model = GPT(GPTConfig(**TINY), seed=0)
    a = model.generate(np.array([[1, 2]]), 10, temperature=1.0, top_k=3, seed=4)
    b = model.generate(np.array([[1, 2]]), 10, temperature=1.0, top_k=3, seed=4)
    assert a.shape == (1, 12) and (a == b).all() and a.max() < 11


def test_greedy_generation_takes_the_last_positions_argmax():
    """top_k = 1: each new token is the argmax of the forward's logits at the last position."""
    model = GPT(GPTConfig(**TINY), seed=0)
    out = model.generate(np.array([[1, 2, 3]]), 6, top_k=1)
    for t in range(3, out.shape[1]):
        logits, _ = model(out[:, :t][:, -8:])
        assert out[0, t] == int(np.argmax(logits.data[0, -1]))


def test_top_k_samples_exactly_the_k_largest():
    """With a flat temperature, 200 seeds' first tokens cover exactly the k most likely tokens of the last position
    (a vocabulary of 256: numpy partitions tiny arrays by sorting them, which would hide a wrong partition)."""
    model = GPT(GPTConfig(**{**TINY, "vocab_size": 256}), seed=0)
    prompt = np.array([[1, 2, 3]])
    logits, _ = model(prompt)
    top3 = set(np.argsort(logits.data[0, -1])[-3:].tolist())
    drawn = {int(model.generate(prompt, 1, temperature=100.0, top_k=3, seed=s)[0, -1]) for s in range(200)}
    assert drawn == top3
