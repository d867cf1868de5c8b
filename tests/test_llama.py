"""The Llama family (models/llama.py): its three new ops by finite differences, the model against a numpy
reference written from the papers' formulas (RoPE as a complex rotation, each query head's K/V head looked up
one by one), every parallel axis equal to one process in float64, and the Hugging Face directory round trip.
The comparison with transformers' LlamaForCausalLM itself is in test_transformers.py (it needs torch)."""
import json
import os

import numpy as np
import pytest

from minipar import models, ops
from minipar.checkpoint import load_checkpoint
from minipar.models.llama import Llama, LlamaConfig, llama_inner
from minipar.testing import assert_same_training, gradcheck, train_cli

rng = np.random.default_rng(0)
SMALL = dict(vocab_size=40, block_size=12, n_layer=2, n_head=4, n_embd=16, n_inner=24, dtype="float64")


def test_rms_norm_swiglu_and_rope_gradients():
    x, w = rng.standard_normal((2, 3, 8)), rng.standard_normal(8)
    gradcheck(lambda a, b: ops.rms_norm(a, b, 1e-5), x, w)
    gradcheck(ops.swiglu, rng.standard_normal((2, 3, 10)))
    cos, sin = ops.rope_tables(np.array([0, 3, 7]), 8, 100.0, np.float64)
    gradcheck(lambda a: ops.rope(a, cos, sin), rng.standard_normal((2, 3, 4, 8)))


def test_rope_rotates_pairs_by_position_times_frequency():
    """Head dimensions i and i + D/2 are one pair, rotated by p·θ^(−2i/D): q·k then depends on the distance only."""
    D, theta = 8, 50.0
    q, k = rng.standard_normal(D), rng.standard_normal(D)

    def at(v, p):
        cos, sin = ops.rope_tables(np.array([p]), D, theta, np.float64)
        return ops.rope(v.reshape(1, 1, 1, D), cos, sin).data.reshape(D)

    z = (q[:D // 2] + 1j * q[D // 2:]) * np.exp(1j * 5 * theta ** (-np.arange(0, D, 2) / D))
    np.testing.assert_allclose(at(q, 5), np.concatenate([z.real, z.imag]), rtol=0, atol=1e-15)
    assert abs(at(q, 9) @ at(k, 4) - at(q, 6) @ at(k, 1)) < 1e-12


def reference_logits(model: Llama, idx: np.ndarray) -> np.ndarray:
    """Llama's forward in numpy, written independently of the model's ops."""
    cfg, sd = model.config, model.state_dict()
    B, T = idx.shape
    H, K, D, eps = cfg.n_head, cfg.kv_heads, cfg.head_dim, cfg.layer_norm_epsilon

    def rms(x, name):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * sd[name]

    def rotate(v):  # (B, T, heads, D): the pairs (i, i + D/2) as complex numbers, times e^{i·p·θ^(−2i/D)}
        z = (v[..., :D // 2] + 1j * v[..., D // 2:]) * np.exp(
            1j * np.arange(T)[:, None, None] * cfg.rope_theta ** (-np.arange(0, D, 2) / D))
        return np.concatenate([z.real, z.imag], axis=-1)

    x = sd["transformer.wte.weight"][idx]
    for i in range(cfg.n_layer):
        p = f"transformer.h.{i}."
        qkv = rms(x, p + "ln_1.weight") @ sd[p + "attn.c_attn.weight"]
        q = rotate(qkv[..., :H * D].reshape(B, T, H, D))
        k = rotate(qkv[..., H * D:(H + K) * D].reshape(B, T, K, D))
        v = qkv[..., (H + K) * D:].reshape(B, T, K, D)
        heads = []
        for h in range(H):
            g = h // (H // K)  # the K/V head of query head h
            s = q[:, :, h] @ k[:, :, g].transpose(0, 2, 1) / np.sqrt(D) + np.triu(np.full((T, T), -np.inf), 1)
            s = np.exp(s - s.max(-1, keepdims=True))
            heads.append((s / s.sum(-1, keepdims=True)) @ v[:, :, g])
        x = x + np.concatenate(heads, axis=-1) @ sd[p + "attn.c_proj.weight"]
        gate, up = np.split(rms(x, p + "ln_2.weight") @ sd[p + "mlp.c_fc.weight"], 2, axis=-1)
        x = x + (gate / (1 + np.exp(-gate)) * up) @ sd[p + "mlp.c_proj.weight"]
    head = sd["transformer.wte.weight"] if cfg.tie_word_embeddings else sd["lm_head.weight"]
    return rms(x, "transformer.ln_f.weight") @ head.T


@pytest.mark.parametrize("kv,tied", [(4, False), (2, True), (1, False)])
def test_forward_equals_the_reference_and_gradients_the_finite_differences(kv, tied):
    """Multi-head (K = H), grouped (K = 2) and multi-query (K = 1) attention; tied and untied heads."""
    model = Llama(LlamaConfig(**SMALL, n_kv_head=kv, tie_word_embeddings=tied, rope_theta=30.0), seed=1)
    idx = rng.integers(0, 40, (2, 12))
    logits, loss = model(idx[:, :-1], idx[:, 1:])
    np.testing.assert_allclose(logits.data, reference_logits(model, idx[:, :-1]), rtol=0, atol=1e-12)
    loss.backward()
    for name, p in model.named_parameters():  # a few entries of every parameter, by central differences
        for flat in rng.choice(p.data.size, 3, replace=False):
            where = np.unravel_index(flat, p.shape)
            saved, h = p.data[where], 1e-6
            p.data[where] = saved + h
            up = model(idx[:, :-1], idx[:, 1:])[1].item()
            p.data[where] = saved - h
            down = model(idx[:, :-1], idx[:, 1:])[1].item()
            p.data[where] = saved
            assert abs((up - down) / (2 * h) - p.grad[where]) < 1e-8, name


def test_parameter_count_and_the_default_width():
    cfg = LlamaConfig(**{**SMALL, "n_inner": 0}, n_kv_head=2)
    assert cfg.mlp_width == llama_inner(16) == 256 and llama_inner(4096) == 11008  # Llama 2 7B's intermediate size
    for config in (cfg, LlamaConfig(**SMALL, tie_word_embeddings=True), LlamaConfig(**SMALL, n_expert=3)):
        model = Llama(config)
        assert config.num_parameters() == sum(p.size for p in model.parameters())
        if not config.n_expert:  # the planner's FLOPs per token: 2 per weight-matrix entry of a (dense) block
            block = [p for name, p in model.named_parameters() if ".0." in name and p.ndim == 2]
            assert sum(config.layer_weights()) == sum(p.size for p in block)


def test_hugging_face_directory_round_trip_and_refusals(tmp_path):
    model = Llama(LlamaConfig(**SMALL, n_kv_head=2, rope_theta=500.0), seed=2)
    model.save_hf(str(tmp_path / "hf"))
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == "llama" and config["num_key_value_heads"] == 2
    assert config["rope_parameters"] == {"rope_theta": 500.0, "rope_type": "default"}
    back = models.from_hf(str(tmp_path / "hf"))
    assert isinstance(back, Llama) and back.config == model.config
    assert all((back.state_dict()[k] == v).all() for k, v in model.state_dict().items())
    for field, value, message in [("rope_scaling", {"rope_type": "linear", "factor": 2.0}, "rope_type='linear'"),
                                  ("attention_bias", True, "attention_bias=True is unsupported"),
                                  ("hidden_act", "gelu", "hidden_act='gelu'"),
                                  ("sliding_window", 4, "'sliding_window' is not a Llama field"),
                                  ("head_dim", 8, "head_dim=8 is unsupported")]:
        (tmp_path / "bad").mkdir(exist_ok=True)
        for name in os.listdir(tmp_path / "hf"):
            (tmp_path / "bad" / name).write_bytes((tmp_path / "hf" / name).read_bytes())
        (tmp_path / "bad" / "config.json").write_text(json.dumps({**config, field: value}))
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
            models.from_hf(str(tmp_path / "bad"))


@pytest.mark.parametrize("dtype,code", [("bfloat16", "BF16"), ("float32", "F32"), ("float64", "F64")])
def test_save_hf_writes_each_dtype_and_reads_it_back(tmp_path, dtype, code):
    """bfloat16 weights are written as BF16 (and read back widened to float32, bit for bit), float32 and float64
    as themselves; tied and untied heads."""
    from minipar.safetensors_io import stored_dtypes

    model = Llama(LlamaConfig(**{**SMALL, "dtype": dtype}, tie_word_embeddings=dtype == "float32"), seed=3)
    model.save_hf(str(tmp_path))
    assert stored_dtypes(str(tmp_path)) == {code}
    back = models.from_hf(str(tmp_path)).state_dict()
    assert back.keys() == model.state_dict().keys() and ("lm_head.weight" in back) == (dtype != "float32")
    assert all((back[k] == v.astype(back[k].dtype)).all() for k, v in model.state_dict().items())


LLAMA = ["--arch", "llama", "--n-layer", "4", "--n-head", "4", "--n-kv-head", "2", "--n-embd", "16", "--n-inner", "24",
         "--block-size", "16", "--batch-size", "8", "--steps", "4", "--warmup", "2", "--lr", "3e-3", "--dtype",
         "float64", "--eval-interval", "0", "--json"]
MOE = ["--n-expert", "4", "--capacity-factor", "0.5"]
# (ranks, flags, flags the one-process reference shares, its microbatches)
LAYOUTS = {
    "dp2 zero3": (2, ["--dp", "2", "--zero", "3"], [], 2),
    "tp2": (2, ["--tp", "2"], [], 1),
    "tp2 sp": (2, ["--tp", "2", "--sp"], [], 1),
    "tp4 > K=2, replicated K/V heads": (4, ["--tp", "4"], [], 1),
    "tp2 sp > K=1, multi-query": (2, ["--tp", "2", "--sp", "--n-kv-head", "1"], ["--n-kv-head", "1"], 1),
    "cp2 ring zigzag": (2, ["--cp", "2"], [], 1),
    "cp2 ulysses": (2, ["--cp", "2", "--cp-kind", "ulysses", "--cp-split", "contiguous"], [], 1),
    "tp2 cp2 sp": (4, ["--tp", "2", "--cp", "2", "--sp"], [], 1),
    "pp2 1f1b untied": (2, ["--pp", "2", "--microbatches", "4"], [], 4),
    "pp2 gpipe": (2, ["--pp", "2", "--microbatches", "2", "--schedule", "gpipe"], [], 2),
    "pp2 dualpipev tied": (2, ["--pp", "2", "--microbatches", "4", "--schedule", "dualpipev", "--tie-embeddings"],
                           ["--tie-embeddings"], 4),
    "pp2 interleaved": (2, ["--pp", "2", "--microbatches", "4", "--schedule", "interleaved", "--virtual-stages", "2"],
                        [], 4),
    "dp2 pp2 zb-h1 zero2": (4, ["--dp", "2", "--pp", "2", "--zero", "2", "--microbatches", "2", "--schedule", "zb-h1"],
                            [], 4),
    "tp2 pp2": (4, ["--tp", "2", "--pp", "2", "--microbatches", "2"], [], 2),
    "MoE dp2 ep2": (2, ["--dp", "2", "--ep", "2", *MOE], MOE, 2),
    "recompute full": (1, ["--recompute", "full"], [], 1),
    "recompute selective": (1, ["--recompute", "selective"], [], 1),
}
FAST = ("tp2", "tp4 > K=2, replicated K/V heads", "cp2 ring zigzag", "pp2 1f1b untied")


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in FAST else pytest.mark.slow) for n in LAYOUTS])
def test_every_axis_equals_one_process(tmp_path, name):
    """Losses and final parameters (float64, rtol 1e-9) of a grouped-query Llama: tensor parallelism keeps each
    rank's K/tp key/value heads, context parallelism rotates each chunk at its true positions, the pipeline keeps
    the untied lm_head on the last stage (or mirrors the tied table)."""
    ranks, flags, shared, microbatches = LAYOUTS[name]
    parallel = train_cli([*LLAMA, *flags, "--save", str(tmp_path / "p")], ranks, timeout=240)[0]
    single = train_cli([*LLAMA, *shared, "--microbatches", str(microbatches), "--save", str(tmp_path / "s")], 1)[0]
    assert_same_training((parallel, load_checkpoint(str(tmp_path / "p")).params),
                         (single, load_checkpoint(str(tmp_path / "s")).params))


@pytest.mark.slow
def test_a_checkpoint_reshards_and_exports(tmp_path):
    """Saved as tp2 (each rank's K/V heads and gate|up columns), resumed as pp2, exported: the same numbers as one
    process; the export loads as a Llama and `generate` and `train --init-from` accept it."""
    steps = ["--steps", "6", "--decay-steps", "6"]
    single = train_cli([*LLAMA, *steps, "--out", str(tmp_path / "single")], 1)[0]
    train_cli([*LLAMA, *steps, "--steps", "3", "--tp", "2", "--save", str(tmp_path / "c")], 2)
    resumed = train_cli([*LLAMA, *steps, "--pp", "2", "--resume", str(tmp_path / "c"), "--save", str(tmp_path / "c")], 2)[0]
    np.testing.assert_allclose([r["loss"] for r in resumed], [r["loss"] for r in single[3:]], rtol=1e-9)
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "minipar", "export", "--ckpt", str(tmp_path / "c"), "--out",
                          str(tmp_path / "hf")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    exported, reference = (models.from_hf(str(tmp_path / d)).state_dict() for d in ("hf", "single"))
    assert exported.keys() == reference.keys() and "lm_head.weight" in exported
    for key in exported:
        np.testing.assert_allclose(exported[key], reference[key], rtol=1e-9, err_msg=key)
    gen = subprocess.run([sys.executable, "-m", "minipar", "generate", "--ckpt", str(tmp_path / "hf"), "--prompt", "de",
                          "--max-new-tokens", "4"], capture_output=True, text=True, timeout=120)
    assert gen.returncode == 0 and gen.stdout.startswith("de"), gen.stderr
    again = train_cli(["--init-from", str(tmp_path / "hf"), "--steps", "1", "--batch-size", "8", "--json",
                       "--eval-interval", "0", "--dtype", "float64"], 1)[0]
    assert len(again) == 1


@pytest.mark.parametrize("flags,message", [
    (["--arch", "llama", "--n-kv-head", "3"], "n_kv_head (3) must divide n_head (4)"),
    (["--n-kv-head", "2"], "--n-kv-head has no effect here: it needs --arch llama"),
    (["--arch", "llama", "--n-head", "4", "--n-embd", "12"], "must be even: RoPE rotates pairs"),
    (["--arch", "llama", "--rope-theta", "0"], "rope_theta > 0"),
])
def test_bad_llama_flags_are_refused_in_one_line(flags, message):
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "minipar", "train", *flags, "--steps", "1"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_tensor_parallelism_splits_or_shares_the_key_value_heads():
    from minipar.parallel.layout import Layout

    Layout(tp=4).validate(LlamaConfig(**SMALL, n_kv_head=2), 8, 4)  # each K/V head on two ranks
    with pytest.raises(ValueError, match="--tp 4 and --n-kv-head 3: one must divide the other"):
        Layout(tp=4).validate(LlamaConfig(**{**SMALL, "n_head": 12, "n_embd": 24}, n_kv_head=3), 8, 4)


@pytest.mark.slow
@pytest.mark.parametrize("ranks,layout", [(1, []), (2, ["--tp", "2", "--sp"]), (2, ["--cp", "2"])])
def test_mixed_precision_trains_within_one_unit_roundoff_of_float64(ranks, layout):
    """bf16-mixed Llama (RMSNorm, RoPE and SwiGLU computed in float32 from 16-bit inputs, float32 masters): each
    step's loss within u = 2^-8 of the float64 run, relatively, as test_mixed_precision requires of GPT-2."""
    model = [*LLAMA[:LLAMA.index("--dtype")], "--eval-interval", "0", "--json", "--warmup", "0", "--min-lr", "3e-3",
             "--steps", "8"]
    fp64 = [r["loss"] for r in train_cli([*model, "--dtype", "float64"], 1)[0]]
    bf16 = [r["loss"] for r in train_cli([*model, "--precision", "bf16-mixed", *layout], ranks)[0]]
    np.testing.assert_allclose(bf16, fp64, rtol=2.0**-8, atol=0)
