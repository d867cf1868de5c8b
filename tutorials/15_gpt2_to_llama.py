"""Tutorial 15: from GPT-2 to Llama — four changes, one at a time, and what each one means for TP and CP.

    mpiexec -n 4 python tutorials/15_gpt2_to_llama.py

1. Starting from GPT-2, swap in Llama's pieces one by one — RMSNorm, rotary positions (RoPE), the SwiGLU MLP,
   grouped-query attention — and train each model 60 steps on the default corpus (the ranks share the five
   runs). The parameter counts and the losses side by side.
2. Tensor parallelism over 4 ranks: what each rank keeps of a Llama's c_attn (its query heads; with 2 K/V heads
   for 4 ranks, one K/V head shared by two ranks) and of c_fc (its columns of gate *and* of up); forward and
   gradients equal the unsplit model's (float64).
3. Context parallelism over 4 ranks: each rank rotates q and k at the true positions of its zigzag chunks, so the
   loss is the unsplit model's.
"""
import numpy as np

from minipar.comm import Communicator
from minipar.data import Batches, load_tokens
from minipar.models.gpt import GPT, GPTConfig
from minipar.models.llama import Llama, LlamaConfig, RotaryAttention, SwiGLUMLP
from minipar.nn import RMSNorm
from minipar.optim import AdamW
from minipar.parallel.context_parallel import chunk_positions, context_parallel, context_slice
from minipar.parallel.tensor_parallel import shard_state_dict, tensor_parallel

comm = Communicator()
N, r = comm.size, comm.rank
say = print if r == 0 else (lambda *a, **k: None)
T, C, H = 32, 32, 4
gpt_cfg = GPTConfig(block_size=T, n_layer=2, n_head=H, n_embd=C)
llama_cfg = lambda K: LlamaConfig(block_size=T, n_layer=2, n_head=H, n_embd=C, n_kv_head=K,  # noqa: E731
                                  n_inner=8 * C // 3, tie_word_embeddings=True)


def rms_norms(model):
    """Change 1: x / √(mean(x²) + ε) · w instead of (x − μ)/σ · w + b — one statistic fewer, no bias."""
    for block in model.transformer.h:
        block.ln_1, block.ln_2 = RMSNorm(C), RMSNorm(C)
    model.transformer.ln_f = RMSNorm(C)
    return model


def rotary(model):
    """Change 2: no position table; each attention rotates q and k by the positions of its tokens."""
    for block in model.transformer.h:
        block.attn = RotaryAttention(llama_cfg(H), 0)
        block.attn.positions = lambda n: model.given_positions(n)
    del model.transformer.wpe
    model.embed = lambda idx: model.transformer.wte(idx)
    return model


def swiglu(model):
    """Change 3: silu(x W_gate) ⊙ (x W_up) W_down, 8C/3 wide: the 4C GELU MLP's parameter count, one more matrix."""
    for block in model.transformer.h:
        block.mlp = SwiGLUMLP(llama_cfg(H))
    return model


variants = [("GPT-2", lambda: GPT(gpt_cfg)),
            ("+ RMSNorm", lambda: rms_norms(GPT(gpt_cfg))),
            ("+ RoPE", lambda: rotary(rms_norms(GPT(gpt_cfg)))),
            ("+ SwiGLU", lambda: swiglu(rotary(rms_norms(GPT(gpt_cfg))))),
            ("+ GQA, 2 K/V heads = Llama", lambda: Llama(llama_cfg(2)))]

say(f"1. GPT-2 to Llama, one change at a time (L=2 H={H} C={C} T={T}, 60 AdamW steps on the default corpus):")
tokens = load_tokens()
results = {}
for i in range(r, len(variants), N):  # the ranks share the five runs
    name, build = variants[i]
    model = build()
    model._init_weights(seed=0)  # GPT-2's initialization for every variant (the new modules' too)
    batches = Batches(tokens, batch_size=8, block_size=T, seed=0)
    optimizer = AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    for step in range(60):
        _, loss = model(*batches(step))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    val = Batches(tokens, batch_size=8, block_size=T, seed=1)
    results[i] = (model.num_parameters(), float(np.mean([model(*val(k))[1].item() for k in range(4)])))
results = {k: v for part in comm.mpi.allgather(results) for k, v in part.items()}
for i, (name, _) in enumerate(variants):
    params, loss = results[i]
    assert np.isfinite(loss) and loss < np.log(256)  # each learned something (uniform guessing is ln 256)
    say(f"   {name:<28} {params:>7,} parameters   loss after 60 steps {loss:.3f}")
assert results[0][0] - results[1][0] == (2 * gpt_cfg.n_layer + 1) * C  # RMSNorm: no biases
assert results[1][0] - results[2][0] == T * C + gpt_cfg.n_layer * 4 * C  # RoPE: no position table, no attention biases
say("   RoPE drops the T×C position table (and the attention biases); GQA shares each K/V head among 2 queries")

say("2. tensor parallelism over 4 ranks of a Llama with 4 query heads and 2 K/V heads:")
cfg = LlamaConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=16, n_inner=24, dtype="float64")
full = Llama(cfg, seed=1)
x, y = (a % 64 for a in Batches(tokens, batch_size=2, block_size=16, seed=0)(0))
_, want_loss = full(x, y)
want_loss.backward()
want = {n: p.grad for n, p in full.named_parameters()}
D, I = cfg.head_dim, cfg.mlp_width
local = shard_state_dict(full.state_dict(), cfg, N, r)
c_attn, c_fc = full.state_dict()["transformer.h.0.attn.c_attn.weight"], full.state_dict()["transformer.h.0.mlp.c_fc.weight"]
kv = r * cfg.kv_heads // N  # the K/V head of this rank's query heads
mine = np.concatenate([c_attn[:, r * D:(r + 1) * D],                              # its query head
                       c_attn[:, (4 + kv) * D:(5 + kv) * D], c_attn[:, (6 + kv) * D:(7 + kv) * D]], axis=1)  # k, v
assert (local["transformer.h.0.attn.c_attn.weight"] == mine).all()
cols = slice(r * I // N, (r + 1) * I // N)
assert (local["transformer.h.0.mlp.c_fc.weight"] == np.concatenate([c_fc[:, :I][:, cols], c_fc[:, I:][:, cols]], 1)).all()
heads = comm.mpi.gather(kv)
say(f"   c_attn: rank r keeps query head r and K/V head r·2//4 — K/V heads by rank {heads}: each shared by two ranks,")
say("   whose gradients of it are summed (an all-reduce of C·2D per layer within each pair)")
say(f"   c_fc (gate | up, 2×{I} columns): rank r keeps columns r·{I // N}…(r+1)·{I // N} of gate AND of up — a split of")
say("   the packed matrix into 4 contiguous blocks would hand rank 0 only gate columns and break silu(gate)·up")
model = tensor_parallel(Llama(cfg, seed=1), comm)
_, loss = model(x, y)
loss.backward()
assert abs(loss.item() - want_loss.item()) < 1e-12
got = {n: p.grad for n, p in model.named_parameters()}
assert np.allclose(got["transformer.h.0.attn.c_attn.weight"][:, D:], want["transformer.h.0.attn.c_attn.weight"][
    :, [*range((4 + kv) * D, (5 + kv) * D), *range((6 + kv) * D, (7 + kv) * D)]], rtol=1e-9, atol=1e-13)
say(f"   loss {loss.item():.12f} = single process; every rank's K/V gradient is the whole head's")

say("3. context parallelism over 4 ranks (zigzag): RoPE's angles come from each token's true position")
model = context_parallel(Llama(cfg, seed=1), comm, "ring", "zigzag")
positions = chunk_positions(r, N, 16 // N, "zigzag")
assert (model.given_positions(16 // N) == positions).all()
zigzag = chunk_positions(0, N, 16 // N, "zigzag").tolist()
say(f"   rank 0 holds positions {zigzag}: its first token rotates by 0·θ^(−2i/D), its third by {zigzag[2]}·θ^(−2i/D)")
_, loss = model(context_slice(x, comm, "zigzag"), context_slice(y, comm, "zigzag"))
total = comm.all_reduce(np.array([loss.item()]), op="avg")[0]
assert abs(total - want_loss.item()) < 1e-12
model.given_positions = lambda n: np.arange(n)  # the mistake: every chunk rotated as if it began the sequence
_, wrong = model(context_slice(x, comm, "zigzag"), context_slice(y, comm, "zigzag"))
wrong = comm.all_reduce(np.array([wrong.item()]), op="avg")[0]
assert abs(wrong - want_loss.item()) > 1e-6
say(f"   loss {total:.12f} = single process; rotating each chunk at its local positions 0…3 gives {wrong:.12f}")
say("all invariants hold")
