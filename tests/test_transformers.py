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

from float64_reference import float64_steps  # noqa: E402

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


# ------------------------------------------------------------------------------------------------- Llama

LLAMA_CONFIGS = [dict(vocab_size=48, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=16, n_inner=24,
                      rope_theta=500.0, layer_norm_epsilon=1e-5),
                 dict(vocab_size=40, block_size=12, n_layer=3, n_head=4, n_kv_head=1, n_embd=16, n_inner=40,
                      tie_word_embeddings=True)]


def _float64_llama(monkeypatch):
    """transformers computes RMSNorm, the RoPE angles and (eager) softmax in float32 even for a float64 model: the
    reference runs those three steps in float64, so that the comparison can be at 1e-10."""
    from transformers.models.llama import modeling_llama as llama

    float64_steps(monkeypatch, llama.LlamaRMSNorm, llama.LlamaRotaryEmbedding)


def _llama_pair(tmp_path, cfg, seed=0):
    from minipar.models.llama import Llama, LlamaConfig

    ours = Llama(LlamaConfig(**cfg, dtype="float64"), seed=seed)
    ours.save_hf(str(tmp_path))
    theirs = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float64,
                                                           attn_implementation="sdpa").eval()  # sdpa: float64 softmax
    return ours, theirs


def _logits_loss_grads(ours, theirs, cfg, seed=1):
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, cfg["vocab_size"], (3, cfg["block_size"]))
    targets = rng.integers(0, cfg["vocab_size"], (3, cfg["block_size"]))
    logits, loss = ours(idx, targets)
    loss.backward()
    out = theirs(torch.tensor(idx))
    reference = torch.nn.functional.cross_entropy(out.logits.reshape(-1, cfg["vocab_size"]),
                                                  torch.tensor(targets).reshape(-1))
    reference.backward()
    grads = {name: p.grad.numpy() for name, p in theirs.named_parameters()}
    return logits.data, loss.item(), out.logits.detach().numpy(), reference.item(), grads


def _hf_grad(grads, name):
    """transformers' gradient of minipar's parameter ``name`` (q|k|v and gate|up packed, matrices as (in, out))."""
    if name == "transformer.wte.weight":
        return grads["model.embed_tokens.weight"]
    if name == "lm_head.weight":
        return grads["lm_head.weight"]
    if name == "transformer.ln_f.weight":
        return grads["model.norm.weight"]
    i, rest = name.split(".")[2], ".".join(name.split(".")[3:])
    p = f"model.layers.{i}."
    return {"ln_1.weight": lambda: grads[p + "input_layernorm.weight"],
            "ln_2.weight": lambda: grads[p + "post_attention_layernorm.weight"],
            "attn.c_attn.weight": lambda: np.concatenate([grads[f"{p}self_attn.{n}_proj.weight"].T for n in "qkv"], 1),
            "attn.c_proj.weight": lambda: grads[p + "self_attn.o_proj.weight"].T,
            "mlp.c_fc.weight": lambda: np.concatenate([grads[f"{p}mlp.{n}_proj.weight"].T for n in ("gate", "up")], 1),
            "mlp.c_proj.weight": lambda: grads[p + "mlp.down_proj.weight"].T}[rest]()


@pytest.mark.parametrize("cfg", LLAMA_CONFIGS)
def test_llama_logits_loss_and_every_gradient(tmp_path, monkeypatch, cfg):
    """Grouped-query (K = 2, untied, θ = 500, ε = 1e-5) and multi-query (K = 1, tied) Llamas: within 1e-4 of
    unmodified transformers (its float32 steps), within 1e-10 once those steps are float64 too."""
    ours, theirs = _llama_pair(tmp_path, cfg)
    logits, loss, ref_logits, ref_loss, _ = _logits_loss_grads(ours, theirs, cfg)
    np.testing.assert_allclose(logits, ref_logits, rtol=0, atol=1e-4)
    _float64_llama(monkeypatch)
    ours, theirs = _llama_pair(tmp_path, cfg)
    logits, loss, ref_logits, ref_loss, grads = _logits_loss_grads(ours, theirs, cfg)
    np.testing.assert_allclose(logits, ref_logits, rtol=0, atol=1e-10)
    assert abs(loss - ref_loss) <= 1e-10
    for name, p in ours.named_parameters():
        np.testing.assert_allclose(p.grad, _hf_grad(grads, name), rtol=0, atol=1e-10, err_msg=name)


@pytest.mark.parametrize("mutation", ["rms_norm_eps", "interleaved rope", "kv grouping"])
def test_the_llama_comparison_catches_each_misreading(tmp_path, monkeypatch, mutation):
    """The comparison above fails for a misread rms_norm_eps, RoPE's interleaved layout instead of the half-split
    one, and query head h using K/V head h mod K instead of h // (H/K)."""
    from minipar import ops

    cfg = LLAMA_CONFIGS[0]
    _float64_llama(monkeypatch)
    if mutation == "rms_norm_eps":
        monkeypatch.setattr(ops, "rms_norm", lambda x, w, eps: ops.RMSNorm.apply(x, w, 1e-6))
    elif mutation == "interleaved rope":
        rope = ops.rope

        def interleaved(x, cos, sin):  # pairs (2i, 2i+1) rotated by frequency i
            perm = np.arange(x.shape[-1]).reshape(-1, 2).T.reshape(-1)  # the even dimensions, then the odd
            return rope(x[..., perm], cos, sin)[..., np.argsort(perm)]
        monkeypatch.setattr(ops, "rope", interleaved)
    else:
        def modulo(a, H):  # head h uses K/V head h mod K
            return a if a.shape[1] == H else np.tile(a, (1, H // a.shape[1], 1, 1))
        monkeypatch.setattr(ops, "repeat_heads", modulo)
    ours, theirs = _llama_pair(tmp_path, cfg)
    logits, _, ref_logits, _, _ = _logits_loss_grads(ours, theirs, cfg)
    assert np.abs(logits - ref_logits).max() > 1e-6  # the comparison at 1e-10 fails by orders of magnitude


def test_a_llama_checkpoint_train_out_wrote(tmp_path, monkeypatch):
    """`train --arch llama --out` (float64, untied, K = 2): LlamaForCausalLM loads it and computes minipar's logits."""
    from minipar.models import from_hf

    out = str(tmp_path / "hf")
    train_cli(["--arch", "llama", "--n-layer", "2", "--n-head", "4", "--n-kv-head", "2", "--n-embd", "16",
               "--n-inner", "24", "--block-size", "16", "--batch-size", "4", "--steps", "3", "--dtype", "float64",
               "--eval-interval", "0", "--json"], 1, out=out)
    _float64_llama(monkeypatch)
    theirs = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float64, attn_implementation="sdpa").eval()
    idx = np.random.default_rng(7).integers(0, 256, (2, 16))
    np.testing.assert_allclose(from_hf(out)(idx)[0].data, theirs(torch.tensor(idx)).logits.detach().numpy(), rtol=0,
                               atol=1e-10)


def test_weights_shard_where_save_pretrained_does():
    """save_hf's default shard size is save_pretrained's, read from its signature ("50GB": decimal, as transformers
    reads it)."""
    import inspect

    from minipar.safetensors_io import DEFAULT_MAX_SHARD_BYTES

    default = inspect.signature(transformers.PreTrainedModel.save_pretrained).parameters["max_shard_size"].default
    assert default.endswith("GB") and int(default[:-2]) * 10**9 == DEFAULT_MAX_SHARD_BYTES


# ------------------------------------------------------------------------------------------------ Mixtral

MIXTRAL = dict(vocab_size=40, block_size=12, n_layer=2, n_head=4, n_kv_head=2, n_embd=16, n_inner=12, n_expert=4,
               expert_top_k=2, router="softmax-topk", capacity_factor=0.0, aux_loss_coef=0.0)


def _float64_mixtral(monkeypatch):
    """Mixtral's RMSNorm, rotary tables and router softmax run in float32 in transformers: float64 here."""
    from transformers.models.mixtral import modeling_mixtral as mixtral

    float64_steps(monkeypatch, mixtral.MixtralRMSNorm, mixtral.MixtralRotaryEmbedding, mixtral.MixtralTopKRouter)


def test_a_moe_llama_that_routes_otherwise_has_no_mixtral_layout(tmp_path):
    from minipar.models.llama import Llama, LlamaConfig

    with pytest.raises(ValueError, match="saves as MixtralForCausalLM when it routes as Mixtral does"):
        Llama(LlamaConfig(**{**MIXTRAL, "capacity_factor": 1.25})).save_hf(str(tmp_path))


# ------------------------------------------------------------------------------------------------ Qwen3-MoE

QWEN3 = dict(vocab_size=40, block_size=12, n_layer=3, n_head=4, n_kv_head=2, n_embd=16, n_inner=20, n_head_dim=6,
             n_expert=8, expert_top_k=2, moe_inner=6, first_dense_layers=1, router="softmax-topk",
             norm_topk_prob=False, capacity_factor=0.0, aux_loss_coef=0.0, layer_norm_epsilon=1e-5)


def _float64_qwen3(monkeypatch):
    """Qwen3-MoE's RMSNorms (the QK-norm's too), rotary tables and router softmax run in float32 in transformers."""
    from transformers.models.qwen3_moe import modeling_qwen3_moe as qwen

    float64_steps(monkeypatch, qwen.Qwen3MoeRMSNorm, qwen.Qwen3MoeRotaryEmbedding, qwen.Qwen3MoeTopKRouter)


def _moe_family(family):
    """(minipar model, transformers class, the float64 patch) of a MoE family with a Hugging Face layout."""
    from minipar.models.llama import Llama, LlamaConfig
    from minipar.models.qwen3 import Qwen3, Qwen3Config

    if family == "mixtral":
        return Llama(LlamaConfig(**MIXTRAL, dtype="float64"), seed=2), transformers.MixtralForCausalLM, _float64_mixtral
    return Qwen3(Qwen3Config(**QWEN3, dtype="float64"), seed=4), transformers.Qwen3MoeForCausalLM, _float64_qwen3


def _expert_grad(grads, name):
    """transformers' gradient of a MoE layer's parameter (router (E, C); fused experts gate|up (E, 2I, C), down)."""
    m = f"model.layers.{name.split('.')[2]}.mlp."
    return {"router": lambda: grads[m + "gate.weight"].T,
            "c_fc": lambda: grads[m + "experts.gate_up_proj"].transpose(0, 2, 1),
            "c_proj": lambda: grads[m + "experts.down_proj"].transpose(0, 2, 1)}[name.split(".")[4]]()


@pytest.mark.parametrize("family", ["qwen3", pytest.param("mixtral", marks=pytest.mark.slow)])
def test_moe_checkpoints_logits_loss_and_every_gradient(tmp_path, monkeypatch, family):
    """Mixtral (a MoE Llama routed as Mixtral: softmax over the 2 chosen, dropless; per-expert w1 | w3 | w2) and
    Qwen3-MoE (QK-norm, heads 6 wide on a 16-wide model, a dense first block, 8 fine-grained experts, gates left
    unnormalized) save as MixtralForCausalLM / Qwen3MoeForCausalLM: within 1e-4 of stock transformers, within 1e-10
    — logits, loss, every gradient — once its float32 norms, rotary tables and router run in float64; loaded back
    bit for bit; greedy decoding equal. (minipar's balancing loss is Switch's per layer, transformers' over all
    layers' tokens at once: the comparison runs with aux_loss_coef 0.)"""
    from minipar.models import from_hf

    ours, cls, float64 = _moe_family(family)
    ours.save_hf(str(tmp_path))
    load = lambda: cls.from_pretrained(  # noqa: E731  (eager experts: grouped_mm has no float64)
        str(tmp_path), dtype=torch.float64, attn_implementation="sdpa", experts_implementation="eager").eval()
    cfg = {"vocab_size": 40, "block_size": 12}
    idx = np.random.default_rng(3).integers(0, 40, (3, 12))
    np.testing.assert_allclose(ours(idx)[0].data, load()(torch.tensor(idx)).logits.detach().numpy(), rtol=0, atol=1e-4)
    float64(monkeypatch)
    theirs = load()
    logits, loss, ref_logits, ref_loss, grads = _logits_loss_grads(ours, theirs, cfg, seed=5)
    np.testing.assert_allclose(logits, ref_logits, rtol=0, atol=1e-10)
    assert abs(loss - ref_loss) <= 1e-10
    for name, p in ours.named_parameters():
        layer = int(name.split(".")[2]) if name.startswith("transformer.h.") else None
        if name.endswith(("attn.q_norm.weight", "attn.k_norm.weight")):
            expected = grads[f"model.layers.{layer}.self_attn.{name.split('.')[4]}.weight"]
        elif ".mlp." in name and layer >= ours.config.first_dense_layers:
            expected = _expert_grad(grads, name)
        else:
            expected = _hf_grad(grads, name)
        np.testing.assert_allclose(p.grad, expected, rtol=0, atol=1e-10, err_msg=name)
    back = from_hf(str(tmp_path))
    assert (back.config.n_expert, back.config.router, back.config.capacity_factor) == (
        ours.config.n_expert, "softmax-topk", 0)
    assert (back.config.head_dim, back.config.first_dense_layers, back.config.norm_topk_prob) == (
        ours.config.head_dim, ours.config.first_dense_layers, ours.config.norm_topk_prob)
    for name, value in ours.state_dict().items():
        np.testing.assert_array_equal(back.state_dict()[name], value, err_msg=name)
    prompt = np.array([[3, 1, 4, 1, 5]])
    expected = theirs.generate(torch.tensor(prompt), max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert ours.generate(prompt, max_new_tokens=4, top_k=1).tolist() == expected.tolist()
