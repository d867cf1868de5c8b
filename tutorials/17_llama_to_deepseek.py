"""Tutorial 17: from Llama to DeepSeek-V3 — multi-head latent attention and multi-token prediction.

    mpiexec -n 2 python tutorials/17_llama_to_deepseek.py

1. What a token leaves behind. Multi-head attention caches every head's key and value (2·H·D numbers per token
   and layer), grouped-query attention 2·K·D, multi-head latent attention one latent c_KV and one shared rope key
   (r + R). The table for this tutorial's small models and for DeepSeek-V3's own dimensions.
2. Decoding from the latent cache: the up-projections absorbed into the query and the output projection give the
   same next-token logits as expanding every head's key and value, and as the uncached forward (float64).
3. Multi-token prediction: the same DeepSeek trained 60 steps with and without one MTP module on the default
   corpus (the two ranks run one each) — the main loss, and the MTP module's loss on token t+2.
4. Tensor parallelism over the 2 ranks: each keeps its heads' up-projections and the whole latent
   down-projections; the loss and a latent projection's gradient equal the unsplit model's (float64).
"""
import numpy as np

from minipar.autograd import no_grad
from minipar.comm import Communicator
from minipar.data import Batches, load_tokens
from minipar.models.deepseek import DeepSeek, DeepSeekConfig
from minipar.ops import cross_entropy
from minipar.optim import AdamW
from minipar.parallel.tensor_parallel import tensor_parallel

comm = Communicator()
r = comm.rank
say = print if r == 0 else (lambda *a, **k: None)
T, C, H = 32, 64, 4
small = dict(block_size=T, n_layer=2, n_head=H, n_embd=C, n_inner=128)

# ---- 1. the cache per token and layer, in numbers
say("1. what a token caches per layer (numbers)")
say(f"   {'model':<34}{'this tutorial':>14}{'DeepSeek-V3 dims':>18}")
v3 = DeepSeekConfig(n_embd=7168, n_head=128, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                    v_head_dim=128, q_lora_rank=1536, n_layer=1, block_size=8)
mla = DeepSeekConfig(**small, kv_lora_rank=32, qk_rope_head_dim=8)
rows = [("multi-head attention, 2·H·D", 2 * H * (C // H), 2 * 128 * 128),
        ("grouped-query, 2·K·D (K = 1; 8)", 2 * 1 * (C // H), 2 * 8 * 128),
        ("MLA, expanded: H·(N + R + V)", mla.cache_bytes_per_token(1, latent=False) // 2,
         v3.cache_bytes_per_token(1, latent=False)),
        ("MLA latent + rope key: r + R", mla.cache_bytes_per_token(1) // 2, v3.cache_bytes_per_token(1))]
for name, ours, theirs in rows:
    say(f"   {name:<34}{ours:>14,}{theirs:>18,}")
assert v3.cache_bytes_per_token(1) == 512 + 64 and mla.cache_bytes_per_token(8) == 2 * (32 + 8) * 8

# ---- 2. the latent cache decodes as the uncached forward
model = DeepSeek(DeepSeekConfig(**small, kv_lora_rank=32, qk_rope_head_dim=8, q_lora_rank=24, dtype="float64"), seed=1)
tokens = np.random.default_rng(0).integers(0, 256, (1, 20))
absorbed, expanded = model.decoder(absorbed=True), model.decoder(absorbed=False)
worst = 0.0
with no_grad():
    for t in range(4, 21):
        reference = model(tokens[:, :t])[0].data[:, -1]
        worst = max(worst, np.abs(absorbed(tokens[:, :t]) - reference).max(), np.abs(expanded(tokens[:, :t]) - reference).max())
say(f"\n2. decoding 17 tokens from the latent cache ({absorbed.bytes_per_token} bytes per token): largest logit "
    f"difference to the uncached forward {worst:.1e}")
assert worst < 1e-12 and absorbed.bytes_per_token == 2 * (32 + 8) * 8

# ---- 3. multi-token prediction: rank r trains with r MTP modules
tokens = load_tokens(None)
batches = Batches(tokens, block_size=T, batch_size=8, seed=0)
learner = DeepSeek(DeepSeekConfig(**small, mtp_depth=r, mtp_weight=0.3), seed=0)
optimizer = AdamW(learner.parameters(), lr=3e-3, weight_decay=0.0)
for step in range(60):
    x, y = batches(step)
    logits, loss = learner(x, y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
with no_grad():  # the main head's loss alone on a batch neither run trained on (inference ignores the MTP modules)
    x, y = batches(60)
    main = float(cross_entropy(learner(x)[0], y).data)
mains = comm.all_gather(np.array([main]), label="tutorial")
mtp = comm.broadcast(np.array(learner.mtp_losses or [0.0]), root=1, label="tutorial") if comm.size > 1 else [0.0]
say(f"\n3. 60 steps: main loss without MTP {mains[0]:.3f}, with one MTP module {mains[-1]:.3f}; "
    f"the module's loss on token t+2: {float(mtp[0]):.3f}")
assert np.all(np.isfinite(mains)) and (comm.size == 1 or float(mtp[0]) > mains[-1])  # t+2 is harder than t+1

# ---- 4. tensor parallelism: the latent down-projections whole, the up-projections by heads
if comm.size > 1:
    cfg = DeepSeekConfig(**small, kv_lora_rank=32, qk_rope_head_dim=8, q_lora_rank=24, dtype="float64")
    x = np.random.default_rng(1).integers(0, 256, (2, T))
    whole = DeepSeek(cfg, seed=2)
    _, loss = whole(x[:, :-1], x[:, 1:])
    loss.backward()
    split = tensor_parallel(DeepSeek(cfg, seed=2), comm)
    _, split_loss = split(x[:, :-1], x[:, 1:])
    split_loss.backward()
    attn = split.transformer.h[0].attn
    say(f"\n4. tp {comm.size}: rank 0 keeps kv_b_proj {tuple(attn.kv_b_proj.weight.shape)} of "
        f"{tuple(whole.transformer.h[0].attn.kv_b_proj.weight.shape)}, kv_a_proj whole "
        f"{tuple(attn.kv_a_proj.weight.shape)}; loss {split_loss.item():.12f} against {loss.item():.12f}")
    assert abs(split_loss.item() - loss.item()) < 1e-12
    np.testing.assert_allclose(attn.kv_a_proj.weight.grad, whole.transformer.h[0].attn.kv_a_proj.weight.grad,
                               rtol=1e-10, atol=1e-14)
say("\nall invariants hold")
