"""DeepSeek-V3's multi-head latent attention and multi-token prediction (models/deepseek.py): against transformers'
DeepseekV3ForCausalLM and its MtpLayer in float64 (logits, loss, every gradient), by finite differences, a
checkpoint transformers wrote (interleaved RoPE), DeepSeek's MTP weight names, the refusals.

The transformers comparisons need ``pip install -e ".[hf]"``; without it they are skipped, saying why."""
import json
import os

import numpy as np
import pytest

from minipar.autograd import Tensor
from minipar.models import from_hf
from minipar.models.deepseek import DeepSeek, DeepSeekConfig
from minipar.testing import gradcheck

CONFIGS = [  # a plain query projection with v narrower than q·k; a query latent with v wider; tied, two MTP depths
    dict(vocab_size=40, block_size=12, n_layer=2, n_head=4, n_embd=16, n_inner=24, kv_lora_rank=12,
         qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5, rope_theta=500.0, layer_norm_epsilon=1e-5),
    dict(vocab_size=48, block_size=10, n_layer=3, n_head=2, n_embd=16, n_inner=20, q_lora_rank=8, kv_lora_rank=10,
         qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=8, mtp_depth=1),
    dict(vocab_size=32, block_size=10, n_layer=2, n_head=2, n_embd=8, n_inner=12, q_lora_rank=6, kv_lora_rank=6,
         qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4, tie_word_embeddings=True, mtp_depth=2,
         mtp_weight=0.5),
]


def test_defaults_follow_deepseek_v3s_proportions():
    """0 means DeepSeek-V3's ratios to the head width D = C/H: latent 4D, rope D/2, nope and v D."""
    cfg = DeepSeekConfig(n_embd=64, n_head=4)
    assert (cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim) == (64, 8, 16, 16)
    assert cfg.attention_scale(0) == 1 / np.sqrt(16 + 8) and cfg.q_lora_rank == 0
    model = DeepSeek(DeepSeekConfig(**CONFIGS[1], dtype="float64"))
    assert cfg.num_parameters() == DeepSeek(cfg).num_parameters()
    assert model.config.num_parameters() == model.num_parameters()  # counted, not read from the model: below
    C, H, r_q, r, N, R, V, I, L, Vocab = 16, 2, 8, 10, 4, 2, 8, 20, 3, 48
    block = (C * r_q + r_q + r_q * H * (N + R) + C * (r + R) + r + r * H * (N + V) + H * V * C + 3 * C * I + 2 * C)
    assert model.num_parameters() == L * block + 2 * Vocab * C + C + (block + 3 * C + 2 * C * C)


@pytest.mark.parametrize("cfg", CONFIGS[1:])
def test_mtp_gradients_by_finite_differences(cfg):
    """The multi-token prediction loss's gradient reaches the MTP module's projection and norms, its block, the
    main model's blocks and the shared embedding (through both the tokens and the shifted targets' embeddings)."""
    model = DeepSeek(DeepSeekConfig(**{**cfg, "n_embd": 8, "n_inner": 8, "block_size": 6}, dtype="float64"), seed=2)
    rng = np.random.default_rng(3)
    idx, targets = rng.integers(0, cfg["vocab_size"], (2, 6)), rng.integers(0, cfg["vocab_size"], (2, 6))
    names = ["mtp.0.eh_proj.weight", "mtp.0.enorm.weight", "mtp.0.norm.weight", "mtp.0.block.attn.kv_a_proj.weight",
             "transformer.h.0.attn.kv_b_proj.weight"]
    for name in names:
        *path, leaf = name.split(".")
        owner = model
        for part in path:
            owner = owner[int(part)] if part.isdigit() else getattr(owner, part)
        original = getattr(owner, leaf)

        def loss_of(w, owner=owner, leaf=leaf):
            setattr(owner, leaf, w)
            return model(idx, targets)[1]
        try:  # the model reads the swapped weight (else both gradients would be a vacuous 0)
            assert loss_of(Tensor(original.data * 0.5)).item() != loss_of(Tensor(original.data)).item()
            gradcheck(loss_of, original.data, rtol=1e-6, atol=1e-9)
        finally:
            setattr(owner, leaf, original)


def test_the_mtp_loss_is_main_plus_lambda_over_d_times_the_depths():
    """L = L_main + λ/D Σ_k L_k, each a mean over its own targets: depth k predicts y[:, k:] from T − k positions."""
    cfg = DeepSeekConfig(**CONFIGS[2], dtype="float64")
    model = DeepSeek(cfg, seed=4)
    rng = np.random.default_rng(5)
    idx, targets = rng.integers(0, 32, (3, 10)), rng.integers(0, 32, (3, 10))
    _, loss = model(idx, targets)
    depths = list(model.mtp_losses)
    main = DeepSeek(DeepSeekConfig(**{**CONFIGS[2], "mtp_depth": 0}, dtype="float64"), seed=4)
    main.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("mtp.")})
    assert len(depths) == 2 and loss.item() == pytest.approx(main(idx, targets)[1].item() + 0.5 / 2 * sum(depths),
                                                             rel=1e-14)
    assert np.array_equal(model(idx)[0].data, main(idx)[0].data)  # inference uses the main head only


@pytest.mark.parametrize("absorbed", [True, False])
def test_the_latent_cache_decodes_as_the_uncached_forward(absorbed):
    """Token by token from a 3-token prompt past block_size (the window then slides and the cache refills), the
    cached decoder's next-token logits equal the whole forward's on the same window to 1e-12 in float64 — with the
    up-projections absorbed into the query and the output projection, or expanded — and the cache holds
    kv_lora_rank + qk_rope_head_dim numbers per token and layer: L·(12 + 4)·8 bytes here."""
    from minipar.autograd import no_grad

    cfg = DeepSeekConfig(**{**CONFIGS[1], "block_size": 8, "qk_rope_head_dim": 4, "kv_lora_rank": 12},
                         dtype="float64")
    model = DeepSeek(cfg, seed=7)
    tokens = np.random.default_rng(8).integers(0, cfg.vocab_size, (2, 12))
    decode = model.decoder(absorbed)
    with no_grad():
        for t in range(3, 13):
            expected = model(tokens[:, max(0, t - 8):t])[0].data[:, -1]
            np.testing.assert_allclose(decode(tokens[:, :t]), expected, rtol=0, atol=1e-12)
            assert decode.length == min(t, 8)
    assert decode.bytes_per_token == 3 * (12 + 4) * 8 == cfg.cache_bytes_per_token(8)
    assert cfg.cache_bytes_per_token(8, latent=False) == 3 * 2 * (4 + 4 + 8) * 8  # L·H·(N + R + V)·8


@pytest.mark.parametrize("changes,message", [
    (dict(qk_rope_head_dim=3), "must be even: RoPE rotates pairs"),
    (dict(n_kv_head=2), "multi-head latent attention gives every head"),
    (dict(kv_lora_rank=-1), "kv_lora_rank must be >= 0"),
])
def test_bad_configs_are_refused_in_one_line(changes, message):
    with pytest.raises(ValueError, match=message):
        DeepSeekConfig(**{**CONFIGS[0], **changes})


def test_a_sequence_no_longer_than_the_mtp_depth_is_refused():
    model = DeepSeek(DeepSeekConfig(**CONFIGS[2]))
    with pytest.raises(ValueError, match="depth 2 needs sequences longer than that, got 2 tokens"):
        model(np.zeros((1, 2), np.int64), np.zeros((1, 2), np.int64))


def test_save_hf_round_trip_keeps_every_weight_under_deepseeks_names(tmp_path):
    """The MTP module k lives at model.layers.{n_layer + k − 1} under DeepSeek's names (enorm, hnorm, eh_proj,
    shared_head.norm, shared_head.head, embed_tokens, and the block's weights); loading it back gives every
    parameter bit for bit."""
    from minipar.safetensors_io import read_hf_weights

    model = DeepSeek(DeepSeekConfig(**CONFIGS[2], dtype="float64"), seed=6)
    model.save_hf(str(tmp_path))
    stored = read_hf_weights(str(tmp_path))
    for k, layer in ((0, 2), (1, 3)):
        p = f"model.layers.{layer}."
        for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                     "shared_head.head.weight", "embed_tokens.weight", "self_attn.kv_a_proj_with_mqa.weight"):
            assert p + name in stored, p + name
        np.testing.assert_array_equal(stored[p + "eh_proj.weight"], model.mtp[k].eh_proj.weight.data.T)
    back = from_hf(str(tmp_path))
    assert back.state_dict().keys() == model.state_dict().keys()
    for name, value in model.state_dict().items():
        np.testing.assert_array_equal(back.state_dict()[name], value, err_msg=name)


@pytest.mark.parametrize("changes,message", [
    (dict(first_k_dense_replace=1, scoring_func="softmax"), "scoring_func='softmax' is unsupported"),
    (dict(first_k_dense_replace=1, moe_layer_freq=2), "moe_layer_freq=2 is unsupported"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}), "rope_type='yarn' is unsupported"),
    (dict(hidden_act="gelu"), "hidden_act='gelu' is unsupported"),
    (dict(attention_bias=True), "attention_bias=True is unsupported"),
    (dict(some_new_field=1), "config field 'some_new_field' is not a DeepSeek-V3 field"),
])
def test_unsupported_checkpoint_fields_are_refused(tmp_path, changes, message):
    DeepSeek(DeepSeekConfig(**CONFIGS[0])).save_hf(str(tmp_path))
    path = os.path.join(tmp_path, "config.json")
    with open(path) as f:
        config = json.load(f)
    with open(path, "w") as f:
        json.dump({**config, **changes}, f)
    with pytest.raises(ValueError, match=message):
        from_hf(str(tmp_path))


# --------------------------------------------------------------------------------------------- transformers

def _transformers():
    torch = pytest.importorskip("torch", reason="the transformers comparison needs `pip install -e \".[hf]\"` (torch)")
    transformers = pytest.importorskip("transformers", reason="the comparison needs `pip install -e \".[hf]\"`")
    return torch, transformers


def _float64_deepseek(monkeypatch):
    """transformers computes RMSNorm and the RoPE angles in float32 even for a float64 model: the reference runs
    those steps in float64 (sdpa: a float64 softmax), so that the comparison can be at 1e-10."""
    _transformers()
    from float64_reference import float64_steps
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

    float64_steps(monkeypatch, ds.DeepseekV3RMSNorm, ds.DeepseekV3RotaryEmbedding)


def _pair(tmp_path, cfg, seed=0):
    torch, transformers = _transformers()
    ours = DeepSeek(DeepSeekConfig(**cfg, dtype="float64"), seed=seed)
    ours.save_hf(str(tmp_path))
    theirs = transformers.DeepseekV3ForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float64,
                                                                attn_implementation="sdpa").eval()
    return ours, theirs


def _hf_grad(grads, name, cfg):
    """transformers' gradient of minipar's parameter ``name`` (matrices as (in, out), gate|up packed)."""
    top = {"transformer.wte.weight": "model.embed_tokens.weight", "lm_head.weight": "lm_head.weight",
           "transformer.ln_f.weight": "model.norm.weight"}
    if name in top:
        return grads[top[name]]
    if name.startswith("mtp."):  # the reference MtpLayers' names
        k, rest = name.split(".")[1], ".".join(name.split(".")[2:])
        if rest in ("enorm.weight", "hnorm.weight", "norm.weight", "eh_proj.weight"):
            g = grads[f"mtp.{k}." + {"norm.weight": "post_norm.weight"}.get(rest, rest)]
            return g.T if rest == "eh_proj.weight" else g
        p, rest = f"mtp.{k}.mtp_block.", rest[len("block."):]
    else:
        p, rest = f"model.layers.{name.split('.')[2]}.", ".".join(name.split(".")[3:])
    a = p + "self_attn."
    table = {"ln_1.weight": p + "input_layernorm.weight", "ln_2.weight": p + "post_attention_layernorm.weight",
             "attn.q_a_norm.weight": a + "q_a_layernorm.weight", "attn.kv_a_norm.weight": a + "kv_a_layernorm.weight"}
    if rest in table:
        return grads[table[rest]]
    if rest == "mlp.c_fc.weight":
        return np.concatenate([grads[f"{p}mlp.{n}_proj.weight"].T for n in ("gate", "up")], 1)
    theirs = {"attn.q_proj.weight": "q_proj", "attn.q_a_proj.weight": "q_a_proj", "attn.q_b_proj.weight": "q_b_proj",
              "attn.kv_a_proj.weight": "kv_a_proj_with_mqa", "attn.kv_b_proj.weight": "kv_b_proj",
              "attn.c_proj.weight": "o_proj", "mlp.c_proj.weight": None}[rest]
    return (grads[p + "mlp.down_proj.weight"] if theirs is None else grads[f"{a}{theirs}.weight"]).T


def _reference(theirs, ours, cfg, idx, targets):
    """transformers' logits and loss: the main model, and for MTP transformers' own MtpLayer modules (DeepSeek's
    enorm | hnorm | eh_proj | block | shared_head.norm) with minipar's MTP weights, chained as its MtpModel chains
    them, on the T − k positions with a token k ahead; the loss L_main + λ/D Σ_k L_k."""
    torch, _ = _transformers()
    from transformers.masking_utils import create_causal_mask
    from transformers.modeling_layers import MtpLayer
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

    out = theirs(torch.tensor(idx), output_hidden_states=True)
    V = cfg["vocab_size"]
    ce = torch.nn.functional.cross_entropy
    loss = ce(out.logits.reshape(-1, V), torch.tensor(targets).reshape(-1))
    layers, h, T = [], out.hidden_states[-1], idx.shape[1]  # the main model's normalized output
    sd = ours.state_dict()
    for k in range(1, cfg.get("mtp_depth", 0) + 1):
        layer = MtpLayer(theirs.config, ds.DeepseekV3DecoderLayer, ds.DeepseekV3RMSNorm, 0).double()
        m = f"mtp.{k - 1}."
        block = {n[len(m + "block."):]: w for n, w in sd.items() if n.startswith(m + "block.")}
        from minipar.models.deepseek import _block_to_hf
        weights = {f"mtp_block.{n[len('x.'):]}": w for n, w in _block_to_hf(
            {f"b.{n}": w for n, w in block.items()}, "b.", "x.", ours.config).items()}
        weights.update({"enorm.weight": sd[m + "enorm.weight"], "hnorm.weight": sd[m + "hnorm.weight"],
                        "eh_proj.weight": sd[m + "eh_proj.weight"].T, "post_norm.weight": sd[m + "norm.weight"]})
        layer.load_state_dict({n: torch.tensor(np.ascontiguousarray(w)) for n, w in weights.items()}, strict=True)
        layers.append(layer)
        T -= 1
        pos = torch.arange(T)[None]
        embedded = theirs.model.embed_tokens(torch.tensor(targets[:, k - 1:k - 1 + T]))
        mask = create_causal_mask(config=theirs.config, inputs_embeds=embedded, attention_mask=None, cache=None,
                                  position_ids=pos)
        h = layer(embedded, h[:, :T], position_embeddings=theirs.model.rotary_emb(embedded, pos), attention_mask=mask,
                  position_ids=pos, cache=None)
        loss = loss + cfg.get("mtp_weight", 0.3) / cfg["mtp_depth"] * ce(theirs.lm_head(h).reshape(-1, V),
                                                                         torch.tensor(targets[:, k:k + T]).reshape(-1))
    return out.logits, loss, layers


@pytest.mark.parametrize("cfg", CONFIGS)
def test_logits_loss_and_every_gradient_equal_transformers(tmp_path, monkeypatch, cfg):
    """Every parameter's gradient, MTP modules included, within 1e-10 of transformers once its float32 steps are
    float64; the logits within 1e-4 of stock transformers."""
    torch, _ = _transformers()
    rng = np.random.default_rng(1)
    idx, targets = rng.integers(0, cfg["vocab_size"], (3, cfg["block_size"])), rng.integers(0, cfg["vocab_size"],
                                                                                          (3, cfg["block_size"]))
    ours, theirs = _pair(tmp_path, cfg)
    np.testing.assert_allclose(ours(idx)[0].data, theirs(torch.tensor(idx)).logits.detach().numpy(), rtol=0, atol=1e-4)
    _float64_deepseek(monkeypatch)
    ours, theirs = _pair(tmp_path, cfg)
    logits, loss = ours(idx, targets)
    loss.backward()
    ref_logits, ref_loss, layers = _reference(theirs, ours, cfg, idx, targets)
    ref_loss.backward()
    np.testing.assert_allclose(logits.data, ref_logits.detach().numpy(), rtol=0, atol=1e-10)
    assert abs(loss.item() - ref_loss.item()) <= 1e-10
    grads = {n: p.grad.numpy() for n, p in theirs.named_parameters()}
    grads.update({f"mtp.{k}.{n}": p.grad.numpy() for k, layer in enumerate(layers) for n, p in layer.named_parameters()})
    for name, p in ours.named_parameters():
        np.testing.assert_allclose(p.grad, _hf_grad(grads, name, cfg), rtol=0, atol=1e-10, err_msg=name)


@pytest.mark.parametrize("interleave", [True, False])
def test_a_checkpoint_transformers_wrote_loads(tmp_path, monkeypatch, interleave):
    """A DeepseekV3ForCausalLM transformers initialized and saved (dense layers, a query latent, RoPE pairs
    interleaved as DeepSeek stores them, or not): minipar's logits within 1e-10. Reading interleaved weights as
    half-split ones (a misread rope_interleave) is caught by orders of magnitude."""
    torch, transformers = _transformers()
    _float64_deepseek(monkeypatch)
    config = transformers.DeepseekV3Config(
        vocab_size=30, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=6,
        first_k_dense_replace=2, max_position_embeddings=16, rope_interleave=interleave, num_mtp_layers=0)
    torch.manual_seed(0)
    theirs = transformers.DeepseekV3ForCausalLM(config).double().eval()
    theirs.save_pretrained(str(tmp_path))
    idx = np.random.default_rng(2).integers(0, 30, (2, 16))
    reference = theirs(torch.tensor(idx)).logits.detach().numpy()
    np.testing.assert_allclose(from_hf(str(tmp_path))(idx)[0].data, reference, rtol=0, atol=1e-10)
    if interleave:
        path = os.path.join(tmp_path, "config.json")
        with open(path) as f:
            stored = json.load(f)
        with open(path, "w") as f:
            json.dump({**stored, "rope_interleave": False}, f)
        assert np.abs(from_hf(str(tmp_path))(idx)[0].data - reference).max() > 1e-6


def test_greedy_decoding_equals_transformers(tmp_path, monkeypatch):
    """minipar's cached, absorbed decoding and transformers' generate (its own cache) pick the same tokens."""
    torch, _ = _transformers()
    _float64_deepseek(monkeypatch)
    ours, theirs = _pair(tmp_path, CONFIGS[1], seed=9)
    prompt = np.array([[3, 1, 4, 1, 5]])
    reference = theirs.generate(torch.tensor(prompt), max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert ours.generate(prompt, max_new_tokens=4, top_k=1).tolist() == reference.tolist()


def test_transformers_loads_a_checkpoint_with_mtp_modules(tmp_path):
    """DeepseekV3ForCausalLM loads save_hf's directory, MTP layers beside it (which it does not use), and computes
    minipar's main logits."""
    torch, transformers = _transformers()
    ours, theirs = _pair(tmp_path, CONFIGS[2])
    idx = np.random.default_rng(3).integers(0, 32, (2, 10))
    np.testing.assert_allclose(ours(idx)[0].data, theirs(torch.tensor(idx)).logits.detach().numpy(), rtol=0, atol=1e-4)



# ------------------------------------------------------------------------------------------- every axis

DEEPSEEK = ["--arch", "deepseek", "--n-layer", "4", "--n-head", "4", "--n-embd", "16", "--n-inner", "24",
            "--q-lora-rank", "8", "--kv-lora-rank", "12", "--qk-nope-head-dim", "4", "--qk-rope-head-dim", "2",
            "--v-head-dim", "6", "--block-size", "16", "--batch-size", "4", "--steps", "3", "--dtype", "float64",
            "--eval-interval", "0", "--json"]
MTP = ["--mtp-depth", "2"]
# (ranks, flags, flags the one-process reference shares, its microbatches)
LAYOUTS = {
    "tp2 MTP": (2, ["--tp", "2", *MTP], MTP, 1),
    "dp3 zero3 MTP, batch 6": (3, ["--dp", "3", "--zero", "3", "--batch-size", "6", *MTP], ["--batch-size", "6", *MTP], 3),
    "tp3 sp, 3 heads": (3, ["--tp", "3", "--sp", "--n-head", "3", "--n-embd", "18", "--block-size", "18"],
                        ["--n-head", "3", "--n-embd", "18", "--block-size", "18"], 1),
    "dp2 zero3 MTP": (2, ["--dp", "2", "--zero", "3", *MTP], MTP, 2),
    "tp2 sp": (2, ["--tp", "2", "--sp"], [], 1),
    "tp4 sp, no query latent": (4, ["--tp", "4", "--sp", "--q-lora-rank", "0"], ["--q-lora-rank", "0"], 1),
    "cp2 ring zigzag": (2, ["--cp", "2"], [], 1),
    "tp2 sp cp2 ulysses": (4, ["--tp", "2", "--sp", "--cp", "2", "--cp-kind", "ulysses"], [], 1),
    "pp2 1f1b MTP": (2, ["--pp", "2", "--microbatches", "4", *MTP], MTP, 4),
    "dp2 pp2 gpipe zero3 MTP": (4, ["--pp", "2", "--dp", "2", "--zero", "3", "--microbatches", "2", "--schedule", "gpipe",
                               *MTP], MTP, 4),
    "pp2 dualpipev MTP tied": (2, ["--pp", "2", "--microbatches", "4", "--schedule", "dualpipev", "--tie-embeddings",
                                   *MTP], ["--tie-embeddings", *MTP], 4),
    "dp2 pp2 interleaved zero1 MTP": (4, ["--dp", "2", "--pp", "2", "--zero", "1", "--microbatches", "2", "--schedule",
                                          "interleaved", "--virtual-stages", "2", *MTP], MTP, 4),
    "tp2 pp2 zb-h1 MTP": (4, ["--tp", "2", "--pp", "2", "--microbatches", "2", "--schedule", "zb-h1", *MTP], MTP, 2),
    "recompute selective MTP": (1, ["--recompute", "selective", *MTP], MTP, 1),
    "recompute full MTP": (1, ["--recompute", "full", *MTP], MTP, 1),
    "MoE dp2 ep2": (2, ["--dp", "2", "--ep", "2", "--n-expert", "4", "--capacity-factor", "0.5"],
                    ["--n-expert", "4", "--capacity-factor", "0.5"], 2),
}
FAST = ("tp2 MTP",)


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in FAST else pytest.mark.slow) for n in LAYOUTS])
def test_every_axis_equals_one_process(tmp_path, name):
    """Losses, each MTP depth's loss and the final parameters (float64, rtol 1e-9): tensor parallelism splits the
    up-projections by heads and keeps the latent down-projections whole, sequence parallelism gathers the latents,
    context parallelism attends over the padded heads, a pipeline keeps the MTP modules on its last stage with a
    mirror of the token embedding (its gradient sent back to the first stage, as a tied head's)."""
    from minipar.checkpoint import load_checkpoint
    from minipar.testing import assert_same_training, train_cli

    ranks, flags, shared, microbatches = LAYOUTS[name]
    parallel = train_cli([*DEEPSEEK, *flags, "--save", str(tmp_path / "p")], ranks, timeout=240)[0]
    single = train_cli([*DEEPSEEK, *shared, "--microbatches", str(microbatches), "--save", str(tmp_path / "s")], 1)[0]
    assert_same_training((parallel, load_checkpoint(str(tmp_path / "p")).params),
                         (single, load_checkpoint(str(tmp_path / "s")).params))
    if "--mtp-depth" in flags:
        depths = [r["mtp_loss"] for r in parallel if "mtp_loss" in r]
        assert len(depths) == 3 and all(len(d) == 2 for d in depths)
        np.testing.assert_allclose(depths, [r["mtp_loss"] for r in single if "mtp_loss" in r], rtol=1e-9)


@pytest.mark.parametrize("flags,message", [
    (["--arch", "llama", "--mtp-depth", "1"], "--mtp-depth has no effect here: it needs --arch deepseek"),
    (["--arch", "deepseek", "--n-kv-head", "2"], "--n-kv-head has no effect here: it needs --arch llama"),
    (["--arch", "deepseek", "--mtp-depth", "1", "--n-expert", "4"], "--mtp-depth with --n-expert"),
    (["--arch", "deepseek", "--qk-rope-head-dim", "3"], "rotated dimension 3 must be even"),
    (["--arch", "deepseek", "--mtp-depth", "16", "--block-size", "16"], "mtp_depth 16 needs sequences longer"),
])
def test_bad_deepseek_flags_are_refused_in_one_line(flags, message):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "minipar", "train", "--steps", "1", *flags], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode != 0 and message in out.stderr.strip().splitlines()[-1], out.stderr


@pytest.mark.parametrize("layout,depth,message", [
    (dict(tp=2, sp=True), 1, "--mtp-depth with --sp or --cp"),
    (dict(cp=2), 1, "--mtp-depth with --sp or --cp"),
    (dict(tp=3), 0, "--tp 3 must divide n_head"),
    (dict(tp=2, sp=True, precision="fp8"), 0, "fp8 with --arch deepseek and --sp"),
])
def test_layouts_that_cannot_hold_deepseek_are_refused(layout, depth, message):
    from minipar.parallel.layout import Layout

    with pytest.raises(ValueError, match=message):
        Layout(**layout).validate(DeepSeekConfig(**CONFIGS[0], mtp_depth=depth), batch_size=4)


@pytest.mark.slow  # a 2-rank run: the full suite; the fast subset has the grouped-query bytes
def test_ring_attention_sends_the_expanded_heads(tmp_path):
    """Under ring context parallelism minipar's MLA sends every head's k and v (padded to W = max(N + R, V) = 6
    here), as the planner counts them: (cp − 1)·2·B·H·W·t values per layer forward, cp·4·B·H·W·t backward. The
    latent and rope key (r_kv + R = 14 values per token, against 2·H·W = 48) would be 14/48 of it — docs/
    architecture.md says why minipar does not send them (each rank would expand every other rank's latent)."""
    from minipar.parallel import planner
    from minipar.testing import train_cli

    records = train_cli([*DEEPSEEK, "--steps", "1", "--cp", "2"], 2, timeout=120)[0]
    B, H, W, t, L, cp = 4, 4, 6, 8, 4, 2
    sent = records[0]["comm_bytes_by_op"]
    assert sent["cp_forward"] == L * (cp - 1) * 2 * B * H * W * t * 8
    assert sent["cp_backward"] == L * cp * 4 * B * H * W * t * 8
    cfg = DeepSeekConfig(n_layer=4, n_head=4, n_embd=16, n_inner=24, q_lora_rank=8, kv_lora_rank=12,
                         qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=6, block_size=16)
    assert planner.context_bytes(cfg, planner.Layout(cp=2), B * t * 8)["kv"] == 2 * B * H * W * t * 8
    assert (cfg.kv_lora_rank + cfg.qk_rope_head_dim) / (2 * H * W) == 14 / 48


# ------------------------------------------------------------------------------- DeepSeek-V3's MoE layers

MOE = dict(vocab_size=40, block_size=10, n_layer=3, n_head=2, n_embd=16, n_inner=24, q_lora_rank=8, kv_lora_rank=8,
           qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4, n_expert=8, expert_top_k=2, moe_inner=6,
           n_shared_expert=1, first_dense_layers=1, router="sigmoid", expert_groups=4, topk_groups=2,
           routed_scaling=2.5, capacity_factor=0.0, aux_loss_coef=0.0)


def _float64_router(monkeypatch):
    """transformers' DeepseekV3TopkRouter casts the hidden states and its weight to float32: the reference runs the
    same steps in the model's float64 (its bias stays the float32 buffer transformers keeps)."""
    torch, _ = _transformers()
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

    def route(self, hidden_states):
        hidden_states = hidden_states.view(-1, self.hidden_dim)
        logits = torch.nn.functional.linear(hidden_states, self.weight)
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias
        groups = choice.view(-1, self.num_group, self.num_experts // self.num_group).topk(2, dim=-1)[0].sum(dim=-1)
        mask = torch.zeros_like(groups).scatter_(1, torch.topk(groups, k=self.topk_group, dim=-1)[1], 1)
        mask = mask.unsqueeze(-1).expand(-1, self.num_group, self.num_experts // self.num_group).reshape(
            -1, self.num_experts)
        chosen = torch.topk(choice.masked_fill(~mask.bool(), float("-inf")), k=self.top_k, dim=-1)[1]
        weights = scores.gather(1, chosen)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) if self.norm_topk_prob else weights
        return logits, weights * self.routed_scaling_factor, chosen

    monkeypatch.setattr(ds.DeepseekV3TopkRouter, "forward", route)


def test_moe_layers_equal_transformers(tmp_path, monkeypatch):
    """DeepSeek-V3's MoE layers — a dense first layer, 8 routed SwiGLU experts in 4 groups (2 per token), a shared
    expert, sigmoid scores with a random bias, routed scaling 2.5 — through save_hf, from_pretrained and back:
    within 1e-4 of stock transformers (its float32 router); with those steps float64, every expert chosen as
    transformers chooses it, logits, loss and every gradient within 1e-10 (router, bias-free
    scores, experts, shared expert), the bias loaded as it was saved. Ties: minipar ranks equal scores by the lower
    expert index; torch.topk's order among ties is unspecified, so the two agree wherever scores differ."""
    torch, transformers = _transformers()
    ours = DeepSeek(DeepSeekConfig(**MOE, dtype="float64"), seed=3)
    rng = np.random.default_rng(4)
    for layer in (ours.transformer.h[1], ours.transformer.h[2]):
        layer.mlp.score_bias = (rng.standard_normal(8) * 0.3).astype(np.float32)
    ours.save_hf(str(tmp_path))
    stock = transformers.DeepseekV3ForCausalLM.from_pretrained(  # its float32 router, norms and rotary tables
        str(tmp_path), dtype=torch.float64, attn_implementation="sdpa", experts_implementation="eager").eval()
    probe = rng.integers(0, 40, (2, 10))
    np.testing.assert_allclose(ours(probe)[0].data, stock(torch.tensor(probe)).logits.detach().numpy(), rtol=0,
                               atol=1e-4)
    _float64_deepseek(monkeypatch)
    _float64_router(monkeypatch)
    theirs = transformers.DeepseekV3ForCausalLM.from_pretrained(  # eager experts: grouped_mm has no float64
        str(tmp_path), dtype=torch.float64, attn_implementation="sdpa", experts_implementation="eager").eval()
    for i in (1, 2):  # transformers keeps the router's weight in float32 (_keep_in_fp32_modules_strict): the
        gate = theirs.model.layers[i].mlp.gate  # reference takes minipar's float64 one back
        gate.weight = torch.nn.Parameter(torch.tensor(ours.transformer.h[i].mlp.router.weight.data.T.copy()))
    idx, targets = rng.integers(0, 40, (3, 10)), rng.integers(0, 40, (3, 10))
    chosen = {}
    for i in (1, 2):  # each MoE layer's choices, in both
        theirs.model.layers[i].mlp.gate.register_forward_hook(
            lambda module, inputs, out, i=i: chosen.__setitem__(("theirs", i), np.sort(out[2].numpy(), axis=1)))
        route = ours.transformer.h[i].mlp.route
        ours.transformer.h[i].mlp.route = lambda logits, i=i, route=route: (
            lambda r: (chosen.__setitem__(("ours", i), np.sort(r[1], axis=1)), r)[1])(route(logits))
    logits, loss = ours(idx, targets)
    loss.backward()
    out = theirs(torch.tensor(idx))
    reference = torch.nn.functional.cross_entropy(out.logits.reshape(-1, 40), torch.tensor(targets).reshape(-1))
    reference.backward()
    for i in (1, 2):
        np.testing.assert_array_equal(chosen[("ours", i)], chosen[("theirs", i)])
    np.testing.assert_allclose(logits.data, out.logits.detach().numpy(), rtol=0, atol=1e-10)
    assert abs(loss.item() - reference.item()) <= 1e-10
    grads = {n: p.grad.numpy() for n, p in theirs.named_parameters() if p.grad is not None}
    for name, p in ours.named_parameters():
        layer = name.split(".")[2] if name.startswith("transformer.h.") else None
        m = f"model.layers.{layer}.mlp."
        if ".mlp.router." in name:
            expected = grads[m + "gate.weight"].T
        elif ".mlp.c_fc." in name and int(layer) >= 1:
            expected = grads[m + "experts.gate_up_proj"].transpose(0, 2, 1)
        elif ".mlp.c_proj." in name and int(layer) >= 1:
            expected = grads[m + "experts.down_proj"].transpose(0, 2, 1)
        elif ".mlp.shared.c_fc." in name:
            expected = np.concatenate([grads[m + f"shared_experts.{n}_proj.weight"].T for n in ("gate", "up")], 1)
        elif ".mlp.shared.c_proj." in name:
            expected = grads[m + "shared_experts.down_proj.weight"].T
        else:
            expected = _hf_grad(grads, name, MOE)
        np.testing.assert_allclose(p.grad, expected, rtol=0, atol=1e-10, err_msg=name)
    prompt = np.array([[3, 1, 4, 1, 5]])  # greedy decoding through the latent cache and the MoE layers
    expected = theirs.generate(torch.tensor(prompt), max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert ours.generate(prompt, max_new_tokens=4, top_k=1).tolist() == expected.tolist()
    back = from_hf(str(tmp_path))
    for i in (1, 2):
        np.testing.assert_array_equal(back.transformer.h[i].mlp.score_bias, ours.transformer.h[i].mlp.score_bias)
    assert back.config.n_expert == 8 and back.config.first_dense_layers == 1 and back.config.router == "sigmoid"
