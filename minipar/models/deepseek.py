"""DeepSeek-V3 (DeepSeek-AI 2024, §2): Llama with two changes — multi-head latent attention and multi-token
prediction — each a few lines beside models/llama.py. (Its mixture of experts is the MoE layer's business.)

    idx (B, T) ──wte──> x (B, T, C)
    repeat n_layer:   x = x + attn(rms_1(x))         attn: multi-head latent attention (below)
                      x = x + mlp(rms_2(x))          SwiGLU, as Llama's
    h⁰ = rms_f(x);  logits = h⁰ @ lm_headᵀ           the main prediction, of token t+1
    repeat k = 1…D:   hᵏ = norm_k(block_k(M_k [enorm_k(wte(t+k)) ; hnorm_k(hᵏ⁻¹)]))   on T − k positions
                      logitsᵏ = hᵏ @ lm_headᵀ         multi-token prediction: of token t+k+1

1. **Multi-head latent attention (MLA).** Keys and values come from one latent per token, c_KV = rms(x W_DKV)
   of ``kv_lora_rank`` numbers: each head's "nope" key and its value are up-projections of it
   (k_h = c_KV W_UK,h, v_h = c_KV W_UV,h), and one more projection of x gives a rope key k_R of
   ``qk_rope_head_dim`` numbers that every head shares. A query is [q_nope,h | RoPE(q_R,h)], from x directly
   or through its own low-rank latent c_Q = rms(x W_DQ) (``q_lora_rank`` > 0); the key is
   [k_h | RoPE(k_R)]. Scores are q·k / √(nope + rope). What a token leaves for the tokens after it is
   c_KV and k_R — kv_lora_rank + qk_rope_head_dim numbers — where multi-head attention leaves 2·H·D: the
   point of MLA (generation's cache). Here the heads are built from the latent and attention runs on them;
   the attention core takes q|k|v of one head width, so q, k (nope + rope wide) and v (v_head_dim wide) are
   zero-padded to the larger of the two — zeros add nothing to q·k or to P·v, and the padding's output
   columns are dropped — and every core (flash, ring, Ulysses) works unchanged.
2. **Multi-token prediction (MTP).** Module k combines the previous depth's representation hᵏ⁻¹ (h⁰: the main
   model's normalized output) with the embedding of token t+k — each RMS-normalized, concatenated as
   [embedding ; hidden] (DeepSeek's checkpoints; the paper writes the other order) and projected 2C → C —
   runs one transformer block on the T − k positions that have a token k ahead, normalizes, and predicts
   token t+k+1 through the main model's head; the embedding and head are the main model's. Loss:
   L = L_main + λ/D · Σ_k L_k, each a mean over its own B·(T − k) targets (§2.2). The next depth receives
   hᵏ as the head reads it (normalized), as transformers' MtpModel and vLLM chain it (for DeepSeek-V3's
   D = 1 the choice does not arise). Generation uses the main head only.

Parameter names: the block's are Llama's (ln_1, ln_2, mlp.c_fc = gate | up, mlp.c_proj) with attention's
``q_proj`` (or ``q_a_proj``, ``q_a_norm``, ``q_b_proj``), ``kv_a_proj`` (C → kv_lora_rank + rope),
``kv_a_norm``, ``kv_b_proj`` (kv_lora_rank → H·(nope + v), each head's k_nope | v) and ``c_proj`` (H·v → C);
MTP module k is ``mtp.{k−1}.enorm / hnorm / eh_proj / block.* / norm``. :meth:`DeepSeek.from_hf` and
:meth:`DeepSeek.save_hf` translate to and from transformers' ``DeepseekV3ForCausalLM`` (model_type
``deepseek_v3``, dense layers) and DeepSeek's own names for the MTP modules (``model.layers.{n_layer + k − 1}``:
enorm, hnorm, eh_proj, shared_head.norm, and the block's weights), which transformers' model itself ignores.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from minipar import ops
from minipar.autograd import Tensor
from minipar.backend import to_device, xp
from minipar.data import save_tokenizer
from minipar.models.gpt import hf_dtype, hf_rope_theta, read_hf_config, refuse_unknown, refuse_values, require_fields
from minipar.models.llama import (Llama, LlamaBlock, LlamaConfig, LlamaTransformer, RotaryAttention,
                                  LLAMA_REQUIRED, embeddings_from_hf, embeddings_to_hf, refuse_leftovers)
from minipar.models.moe import stack_experts, unstack_experts
from minipar.nn import Embedding, Linear, Module, ModuleList, RMSNorm
from minipar.safetensors_io import DEFAULT_MAX_SHARD_BYTES, atomic_write, read_hf_weights, write_hf_weights

LATENT_NORM_EPS = 1e-6  # the latents' RMSNorms (transformers' q_a_layernorm, kv_a_layernorm: the class default)


@dataclass
class DeepSeekConfig(LlamaConfig):
    arch: str = "deepseek"
    q_lora_rank: int = 0        # the query latent's width; 0: queries from one projection of x
    kv_lora_rank: int = 0       # the key/value latent c_KV's width; 0: 4 × head_dim (DeepSeek-V3: 512 = 4 × 128)
    qk_nope_head_dim: int = 0   # a head's key/query dimensions without position; 0: head_dim (C/H)
    qk_rope_head_dim: int = 0   # the rotated dimensions, one key shared by all heads; 0: head_dim / 2 (V3: 64)
    v_head_dim: int = 0         # a head's value width; 0: head_dim
    mtp_depth: int = 0          # D multi-token prediction modules
    mtp_weight: float = 0.3     # λ (DeepSeek-V3: 0.3 for the first 10T tokens, then 0.1)

    def __post_init__(self) -> None:
        if self.n_kv_head not in (0, self.n_head):
            raise ValueError(f"n_kv_head ({self.n_kv_head}) is Llama's grouped-query attention: multi-head latent "
                             "attention gives every head its own key and value from the shared latent")
        D = self.n_embd // self.n_head
        for name, default in (("kv_lora_rank", 4 * D), ("qk_nope_head_dim", D), ("qk_rope_head_dim", D // 2),
                              ("v_head_dim", D)):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
            if not getattr(self, name):
                object.__setattr__(self, name, default)
        if self.q_lora_rank < 0 or self.mtp_depth < 0 or self.mtp_weight < 0:
            raise ValueError("q_lora_rank, mtp_depth and mtp_weight must be >= 0")
        if self.mtp_depth >= self.block_size:
            raise ValueError(f"mtp_depth {self.mtp_depth} needs sequences longer than that (block_size "
                             f"{self.block_size}): module k predicts token t+k+1")
        super().__post_init__()

    display_name = "DeepSeek"
    head_uses_embedding = property(lambda self: self.ties_embeddings or self.mtp_depth > 0)
    kv_heads = property(lambda self: self.n_head)
    rope_dim = property(lambda self: self.qk_rope_head_dim)
    qk_head_dim = property(lambda self: self.qk_nope_head_dim + self.qk_rope_head_dim)

    def attention_scale(self, layer: int) -> float:
        return 1.0 / float(np.sqrt(self.qk_head_dim))

    def cache_bytes_per_token(self, itemsize: int, latent: bool = True) -> int:
        """What generation keeps per token, all layers: the latent c_KV and the rope key, L·(r_kv + R)·itemsize —
        or (``latent=False``) the keys and values they expand to, L·H·(N + R + V)·itemsize."""
        per_layer = (self.kv_lora_rank + self.qk_rope_head_dim if latent
                     else self.n_head * (self.qk_head_dim + self.v_head_dim))
        return self.n_layer * per_layer * itemsize

    def layer_weights(self) -> tuple[int, int]:
        """(attention, dense MLP) weight-matrix parameters of one block (a token costs 2 FLOPs per weight)."""
        C, H, r_q, r_kv = self.n_embd, self.n_head, self.q_lora_rank, self.kv_lora_rank
        queries = C * r_q + r_q * H * self.qk_head_dim if r_q else C * H * self.qk_head_dim
        keys_values = C * (r_kv + self.qk_rope_head_dim) + r_kv * H * (self.qk_nope_head_dim + self.v_head_dim)
        return queries + keys_values + H * self.v_head_dim * C, 3 * C * self.mlp_width

    def attention_widths(self) -> tuple[int, int, int, int]:
        """The core's heads: H of every kind, q, k and v zero-padded to W = max(nope + rope, v) (LatentAttention)."""
        width = max(self.qk_head_dim, self.v_head_dim)
        return self.n_head, self.n_head, width, width

    def activation_units(self) -> tuple[float, float]:
        """Korthikanti et al.'s count (16-bit bytes per s·b·h) for MLA: whole on every tp rank — the two norms' and
        the attention's and MLP's inputs (8), the latents the down-projections make and their norms' outputs
        (2·(2·r_q + (r_kv + R) + r_kv)/h); split — q, k and v as the core receives them (padded to W) and its
        output (2·H·(3W + V)/h), the SwiGLU's gate | up and product (6·I/h)."""
        h, H, width = self.n_embd, self.n_head, self.attention_widths()[2]
        latents = 2 * self.q_lora_rank + 2 * self.kv_lora_rank + self.qk_rope_head_dim
        return 8 + 2 * latents / h, 2 * H * (3 * width + self.v_head_dim) / h + 6 * self.mlp_width / h

    def fp8_input_units(self) -> tuple[float, float]:
        """The FP8 Linears' inputs among them: whole — x into the down-projections (or q_proj), the latents into
        the up-projections, the MLP's input; split — the attention output (H·V) and the SwiGLU product (I)."""
        latents = 2 * (self.q_lora_rank + self.kv_lora_rank) / self.n_embd
        dense = 0.0 if self.n_expert else 2.0
        return 2.0 + latents + dense, 2 * self.n_head * self.v_head_dim / self.n_embd + dense * self.mlp_width / self.n_embd

    def num_parameters(self, layers: int | None = None, final_norm: bool = True) -> int:
        """Per block: the attention's matrices (layer_weights), its latent norms (q_lora_rank + kv_lora_rank), the
        SwiGLU's 3·C·I and two norms 2C; the embedding V·C (twice when untied), the final norm C; per MTP module
        a block, three norms 3C and the 2C → C projection (counted with the whole model only)."""
        C = self.n_embd
        attention, mlp = self.layer_weights()
        whole_model, layers = layers is None, self.n_layer if layers is None else layers
        block = attention + self.q_lora_rank + self.kv_lora_rank + 2 * C
        moe = self.moe_blocks(layers)
        blocks = layers * block + (layers - moe) * mlp + moe * sum(self.moe_parameters())
        table = self.vocab_size * C * (1 if self.tie_word_embeddings else 2)
        mtp = self.mtp_depth * (block + mlp + 3 * C + 2 * C * C) if whole_model else 0
        return blocks + table + (C if final_norm else 0) + mtp


class LatentAttention(RotaryAttention):  # Llama's attention's interface: keep_heads, recompute_scores
    """Multi-head latent attention (module docstring, 1). Shapes per token: x (C) → c_KV (r_kv), k_R (R) →
    per head k_nope (N), v (V); q (N + R) per head; scores over N + R dimensions."""

    fp8_linears = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj", "kv_b_proj", "c_proj")

    def __init__(self, cfg: DeepSeekConfig, layer: int):
        C, H, dt = cfg.n_embd, cfg.n_head, cfg.dtype
        if cfg.q_lora_rank:
            self.q_a_proj = Linear(C, cfg.q_lora_rank, bias=False, dtype=dt)
            self.q_a_norm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS, dtype=dt)
            self.q_b_proj = Linear(cfg.q_lora_rank, H * cfg.qk_head_dim, bias=False, dtype=dt)
        else:
            self.q_proj = Linear(C, H * cfg.qk_head_dim, bias=False, dtype=dt)
        self.kv_a_proj = Linear(C, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False, dtype=dt)
        self.kv_a_norm = RMSNorm(cfg.kv_lora_rank, LATENT_NORM_EPS, dtype=dt)
        self.kv_b_proj = Linear(cfg.kv_lora_rank, H * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False, dtype=dt)
        self.c_proj = Linear(H * cfg.v_head_dim, C, bias=False, dtype=dt)
        self.n_head, self.theta, self.scale = H, cfg.rope_theta, cfg.attention_scale(layer)
        self.nope, self.rope_dim, self.v_dim, self.rank = (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                                                            cfg.v_head_dim, cfg.kv_lora_rank)
        self.core = ops.causal_self_attention
        self.positions = lambda T: xp.arange(T)  # the model points it at its own given positions

    def keep_heads(self, tp: int) -> None:
        self.n_head //= tp

    def queries(self, x: Tensor) -> Tensor:
        """(B, T, H, N + R): [q_nope | q_R] per head, before RoPE."""
        q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x))) if hasattr(self, "q_a_proj") else self.q_proj(x)
        B, T, _ = q.shape
        return q.reshape(B, T, self.n_head, self.nope + self.rope_dim)

    # the shared rope key on its way to the heads: as it is, or (tensor parallelism) through the op that sums its
    # gradient over the ranks' heads — under sequence parallelism the one that gathers the sequence
    rope_key_use = staticmethod(lambda k: k)

    def latent(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(c_KV (B, T, r_kv) normalized, k_R (B, T, 1, R) before RoPE): what a token keeps for later tokens."""
        a = self.kv_a_proj(x)
        k_rope = self.rope_key_use(a[:, :, self.rank:])
        B, T, R = k_rope.shape
        return self.kv_a_norm(a[:, :, :self.rank]), k_rope.reshape(B, T, 1, R)

    def forward(self, x: Tensor) -> Tensor:
        H, N, R, V = self.n_head, self.nope, self.rope_dim, self.v_dim
        q = self.queries(x)
        B, T = q.shape[:2]  # the whole sequence (under sequence parallelism x is this rank's shard of it)
        cos, sin = ops.rope_tables(self.positions(T), R, self.theta, xp.float64 if x.dtype == xp.float64 else xp.float32)
        q = ops.concat([q[:, :, :, :N], ops.rope(q[:, :, :, N:], cos, sin)], axis=3)
        c_kv, k_rope = self.latent(x)
        kv = self.kv_b_proj(c_kv).reshape(B, T, H, N + V)
        k_rope = ops.rope(k_rope, cos, sin) * xp.ones((1, 1, H, 1), dtype=k_rope.dtype)  # one key for every head
        k = ops.concat([kv[:, :, :, :N], k_rope], axis=3)
        width = max(N + R, V)  # one head width for the core: zero columns add nothing
        packed = ops.concat([_pad(q, width), _pad(k, width), _pad(kv[:, :, :, N:], width)], axis=2)
        y = self.core(packed.reshape(B, T, 3 * H * width), H, self.scale).reshape(B, T, H, width)
        return self.c_proj((y[:, :, :, :V] if V < width else y).reshape(B, T, H * V))


class LatentDecoder:
    """Generation with MLA's cache (module docstring, 1): per layer and token it keeps c_KV and the rotated k_R —
    kv_lora_rank + qk_rope_head_dim numbers where multi-head attention keeps 2·H·D. A call with one token more than
    the last runs that token alone against the cache; any other call (the first, a window past block_size) fills
    the cache from the last block_size tokens, as the uncached forward sees them.

    ``absorbed`` (DeepSeek-V2 §2.1.3): attention runs in the latent space. W_UK folds into the query —
    q̃_h = q_nope,h W_UK,hᵀ, r numbers per head, so a score is q̃_h · c_KV,t + q_R,h · k_R,t and no key is ever
    expanded — and W_UV into the output projection: y = Σ_h (Σ_t p_h,t c_KV,t) (W_UV,h W_O,h). Without it the
    cache is expanded into every head's k_nope and v at each step. Both equal the uncached forward (1e-12 in
    float64, tests/test_deepseek.py)."""

    def __init__(self, model: DeepSeek, absorbed: bool = True):
        self.model, self.absorbed = model, absorbed
        self.cache: list[tuple[Any, Any]] = []  # per layer: c_KV (B, t, r), rotated k_R (B, t, R)
        self.folded: dict[int, Any] = {}  # per layer: W_UV,h W_O,h, (H, r, C)
        self.length = 0

    @property
    def bytes_per_token(self) -> int:
        """The cache's bytes per token, all layers: measured from its arrays."""
        return sum(c.nbytes + k.nbytes for c, k in self.cache) // (self.cache[0][0].shape[0] * self.length)

    def __call__(self, idx: Any) -> Any:
        model, block_size = self.model, self.model.config.block_size
        if not self.cache or idx.shape[1] != self.length + 1 or idx.shape[1] > block_size:
            new, self.cache, self.length = idx[:, -block_size:], [], 0
        else:
            new = idx[:, -1:]
        positions = xp.arange(self.length, self.length + new.shape[1])
        x = model.transformer.wte(to_device(new))
        for layer, block in enumerate(model.transformer.h):
            x = x + self.attend(block.attn, block.ln_1(x), positions, layer)
            x = x + block.mlp(block.ln_2(x))
        self.length += new.shape[1]
        return model.head(x[:, -1:])[0].data[:, -1, :]

    def attend(self, attn: LatentAttention, h: Tensor, positions: Any, layer: int) -> Tensor:
        """Attention of the new tokens ``h`` (B, n, C) at ``positions`` over every cached token and themselves."""
        H, N, R, V, r = attn.n_head, attn.nope, attn.rope_dim, attn.v_dim, attn.rank
        cos, sin = ops.rope_tables(positions, R, attn.theta, xp.float64 if h.dtype == xp.float64 else xp.float32)
        q = attn.queries(h).data
        q_nope, q_rope = q[..., :N], ops.rope(q[..., N:], cos, sin).data
        c_kv, k_rope = attn.latent(h)
        entry = (c_kv.data, ops.rope(k_rope, cos, sin).data[:, :, 0])
        if layer < len(self.cache):
            entry = tuple(xp.concatenate([old, new], axis=1) for old, new in zip(self.cache[layer], entry))
            self.cache[layer] = entry
        else:
            self.cache.append(entry)
        c_all, k_all = entry
        w = attn.kv_b_proj.weight.data.reshape(r, H, N + V)
        w_uk, w_uv = w[..., :N], w[..., N:]
        if self.absorbed:
            scores = xp.einsum("bnhr,btr->bhnt", xp.einsum("bnhd,rhd->bnhr", q_nope, w_uk), c_all)
        else:
            scores = xp.einsum("bnhd,bhtd->bhnt", q_nope, xp.einsum("btr,rhd->bhtd", c_all, w_uk))
        scores = (scores + xp.einsum("bnhd,btd->bhnt", q_rope, k_all)) * attn.scale
        scores = xp.where(xp.arange(c_all.shape[1])[None, :] > positions[:, None], -xp.inf, scores)
        p = xp.exp(scores - scores.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        if self.absorbed:
            if layer not in self.folded:
                w_o = attn.c_proj.weight.data.reshape(H, V, -1)
                self.folded[layer] = xp.einsum("rhv,hvc->hrc", w_uv, w_o)
            return Tensor(xp.einsum("bhnr,hrc->bnc", xp.einsum("bhnt,btr->bhnr", p, c_all), self.folded[layer]))
        y = xp.einsum("bhnt,bhtv->bnhv", p, xp.einsum("btr,rhv->bhtv", c_all, w_uv))
        return attn.c_proj(Tensor(y.reshape(*y.shape[:2], H * V)))


def _pad(a: Tensor, width: int) -> Tensor:
    """(B, T, H, w) zero-padded to (B, T, H, width) along the last axis."""
    B, T, H, w = a.shape
    return a if w == width else ops.concat([a, xp.zeros((B, T, H, width - w), dtype=a.dtype)], axis=3)


class DeepSeekBlock(LlamaBlock):
    Attention = LatentAttention


class DeepSeekTransformer(LlamaTransformer):
    Block = DeepSeekBlock


class MTPModule(Module):
    """One multi-token prediction depth (module docstring, 2): hᵏ = norm(block(eh_proj([enorm(e) ; hnorm(h)])))."""

    def __init__(self, cfg: DeepSeekConfig, layer: int):
        C, eps, dt = cfg.n_embd, cfg.layer_norm_epsilon, cfg.dtype
        self.enorm, self.hnorm = RMSNorm(C, eps, dtype=dt), RMSNorm(C, eps, dtype=dt)
        self.eh_proj = Linear(2 * C, C, bias=False, dtype=dt)
        self.block = DeepSeekBlock(cfg, layer)
        self.norm = RMSNorm(C, eps, dtype=dt)

    def forward(self, h: Tensor, embedded: Tensor) -> Tensor:
        return self.norm(self.block(self.eh_proj(ops.concat([self.enorm(embedded), self.hnorm(h)], axis=2))))


class DeepSeek(Llama):
    """Llama's interface on DeepSeek-V3's attention, with ``mtp`` modules when ``mtp_depth`` > 0."""

    def __init__(self, cfg: DeepSeekConfig, seed: int = 0):
        self.config = cfg
        self.transformer = DeepSeekTransformer(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = Embedding(cfg.vocab_size, cfg.n_embd, dtype=cfg.dtype)
        blocks = list(self.transformer.h)
        if cfg.mtp_depth:
            self.mtp = ModuleList([MTPModule(cfg, cfg.n_layer + k) for k in range(cfg.mtp_depth)])
            blocks += [module.block for module in self.mtp]
        for block in blocks:  # late-bound: context parallelism replaces given_positions
            block.attn.positions = lambda T: self.given_positions(T)
        self.mtp_losses: list[float] = []  # the last forward's, per depth
        self.mtp_tally = np.zeros(cfg.mtp_depth + 1)  # per depth the sum of its losses over forwards, the count
        self._init_weights(seed)

    def mtp_report(self, replicas: Any, stages: Any) -> list[float]:
        """Each depth's loss in the forwards since the last :meth:`reset_mtp_tally` (the step's microbatches),
        averaged over the data-parallel ``replicas`` and brought from the pipeline's last stage (the only one that
        counts any) to all ``stages``: two all-reduces of D + 1 numbers."""
        tally = replicas.all_reduce(self.mtp_tally.copy(), op="sum", label="report")
        tally = stages.all_reduce(tally, op="sum", label="report")
        return [float(v) for v in tally[:-1] / max(tally[-1], 1.0)]

    def reset_mtp_tally(self) -> None:
        self.mtp_tally[:] = 0.0

    def mtp_loss(self, h: Tensor, targets: Any, embedding: Any) -> Tensor:
        """λ/D · Σ_k L_k from h⁰ (B, T, C, normalized) and the main targets y (y_t = token t+1): module k reads
        h^(k−1) at positions 0 … T−k−1 and the ``embedding`` of y[:, k−1 : T−1] (token t+k), and predicts
        y[:, k : T] (token t+k+1) through the main head. Each depth's loss is kept in ``mtp_losses``."""
        if h.shape[1] <= self.config.mtp_depth:
            raise ValueError(f"multi-token prediction of depth {self.config.mtp_depth} needs sequences longer "
                             f"than that, got {h.shape[1]} tokens")
        table = embedding if self.config.ties_embeddings else self.lm_head
        total, self.mtp_losses = None, []
        for k, module in enumerate(self.mtp, start=1):
            T = h.shape[1] - 1
            h = module(h[:, :T], embedding(targets[:, k - 1:k - 1 + T]))
            loss = table.cross_entropy(table.attend(h), targets[:, k:k + T])
            self.mtp_losses.append(float(loss.data))
            total = loss if total is None else total + loss
        self.mtp_tally += [*self.mtp_losses, 1.0]
        return total * (self.config.mtp_weight / self.config.mtp_depth)

    def head(self, x: Tensor, targets: Any = None, embedding: Any = None) -> tuple[Tensor, Tensor | None]:
        """Llama's head, and with ``targets`` the multi-token prediction modules on its normalized input;
        ``embedding``: the token embedding's mirror on a pipeline's last stage (GPT.head)."""
        h = self.transformer.ln_f(x)
        table = (embedding or self.transformer.wte) if self.config.ties_embeddings else self.lm_head
        logits = table.attend(h)
        if targets is None:
            return logits, None
        loss = table.cross_entropy(logits, targets)
        if self.config.mtp_depth:
            loss = loss + self.mtp_loss(h, targets, embedding or self.transformer.wte)
        return logits, loss

    def decoder(self, absorbed: bool = True) -> LatentDecoder:
        """Generation's next-token logits with MLA's latent cache (:class:`LatentDecoder`)."""
        return LatentDecoder(self, absorbed)

    def named_blocks(self) -> list[tuple[str, Any]]:
        return super().named_blocks() + [(f"mtp.{k}.block.", m.block) for k, m in enumerate(getattr(self, "mtp", ()))]

    # ---- Hugging Face checkpoints ----
    @classmethod
    def from_hf(cls, directory: str, dtype: str | None = None) -> DeepSeek:
        """Load a ``DeepseekV3ForCausalLM`` directory — its MoE layers (per-expert matrices, the router's bias) and
        its MTP modules under DeepSeek's names."""
        cfg, interleaved = hf_deepseek_config(directory, dtype)
        hf = read_hf_weights(directory)
        state = embeddings_from_hf(hf, cfg, directory)
        for i in range(cfg.n_layer):
            state.update(_block_from_hf(hf, f"model.layers.{i}.", f"transformer.h.{i}.", cfg, interleaved,
                                        moe=bool(cfg.n_expert) and i >= cfg.first_dense_layers))
        for k in range(cfg.mtp_depth):
            p, m = f"model.layers.{cfg.n_layer + k}.", f"mtp.{k}."
            for ours, theirs in (("enorm", "enorm"), ("hnorm", "hnorm"), ("norm", "shared_head.norm")):
                state[f"{m}{ours}.weight"] = hf.pop(f"{p}{theirs}.weight")
            state[m + "eh_proj.weight"] = hf.pop(p + "eh_proj.weight").T
            for shared in ("embed_tokens.weight", "shared_head.head.weight"):  # copies of the main model's
                hf.pop(p + shared, None)
            state.update(_block_from_hf(hf, p, m + "block.", cfg, interleaved))
        refuse_leftovers(hf, directory, "a DeepSeek model")
        model = cls(cfg)
        model.load_state_dict({name: np.ascontiguousarray(value) for name, value in state.items()})
        return model

    def save_hf(self, directory: str, state: dict[str, np.ndarray] | None = None,
                max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, tokenizer: str | None = None) -> None:
        """Write ``config.json`` + safetensors that ``DeepseekV3ForCausalLM.from_pretrained`` loads (every matrix
        (out, in); RoPE in the half-split layout, ``rope_interleave: false``), the MTP modules under DeepSeek's
        names (with copies of the embedding and head, as DeepSeek's checkpoints carry them), the tokenizer."""
        cfg = self.config
        if cfg.n_expert and not routes_as_v3(cfg):
            raise ValueError(f"DeepseekV3ForCausalLM routes by sigmoid: a DeepSeek with --router {cfg.router} has no "
                             "Hugging Face layout (save it with --save)")
        state = {**(state if state is not None else self.state_dict()), **self.buffer_state()}
        hf = embeddings_to_hf(state, cfg)
        for i in range(cfg.n_layer):
            hf.update(_block_to_hf(state, f"transformer.h.{i}.", f"model.layers.{i}.", cfg,
                                   moe=bool(cfg.n_expert) and i >= cfg.first_dense_layers))
        for k in range(cfg.mtp_depth):
            p, m = f"model.layers.{cfg.n_layer + k}.", f"mtp.{k}."
            for ours, theirs in (("enorm", "enorm"), ("hnorm", "hnorm"), ("norm", "shared_head.norm")):
                hf[f"{p}{theirs}.weight"] = state[f"{m}{ours}.weight"]
            hf[p + "eh_proj.weight"] = state[m + "eh_proj.weight"].T
            hf[p + "embed_tokens.weight"] = state["transformer.wte.weight"]
            hf[p + "shared_head.head.weight"] = state["transformer.wte.weight" if cfg.tie_word_embeddings
                                                      else "lm_head.weight"]
            hf.update(_block_to_hf(state, m + "block.", p, cfg))
        os.makedirs(directory, exist_ok=True)
        end_of_text = save_tokenizer(directory, cfg.vocab_size, cfg.block_size, tokenizer)
        config = {
            "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.n_embd, "intermediate_size": cfg.mlp_width,
            "num_hidden_layers": cfg.n_layer, "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.n_head,
            "q_lora_rank": cfg.q_lora_rank or None, "kv_lora_rank": cfg.kv_lora_rank,
            "qk_nope_head_dim": cfg.qk_nope_head_dim, "qk_rope_head_dim": cfg.qk_rope_head_dim,
            "v_head_dim": cfg.v_head_dim, "first_k_dense_replace": cfg.first_dense_layers if cfg.n_expert else cfg.n_layer,
            "n_routed_experts": cfg.n_expert or 1, "n_shared_experts": cfg.n_shared_expert if cfg.n_expert else 0,
            "num_experts_per_tok": cfg.expert_top_k if cfg.n_expert else 1, "moe_intermediate_size": cfg.expert_width,
            "n_group": cfg.expert_groups, "topk_group": cfg.topk_groups, "norm_topk_prob": cfg.norm_topk_prob,
            "routed_scaling_factor": cfg.routed_scaling,
            "num_nextn_predict_layers": cfg.mtp_depth, "hidden_act": "silu",
            "max_position_embeddings": cfg.block_size, "rms_norm_eps": cfg.layer_norm_epsilon,
            "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default"}, "rope_theta": cfg.rope_theta,
            "rope_interleave": False, "attention_bias": False, "attention_dropout": 0.0, "pretraining_tp": 1,
            "initializer_range": 0.02, "tie_word_embeddings": cfg.tie_word_embeddings,
            "bos_token_id": end_of_text, "eos_token_id": end_of_text,
            "dtype": cfg.dtype, "torch_dtype": cfg.dtype, "minipar": asdict(cfg),
        }
        write_hf_weights(directory, {n: np.ascontiguousarray(w) for n, w in hf.items()}, max_shard_bytes)
        atomic_write(os.path.join(directory, "config.json"), [json.dumps(config, indent=2).encode()])


def routes_as_v3(cfg: DeepSeekConfig) -> bool:
    """Whether a MoE DeepSeek computes what DeepseekV3ForCausalLM computes: sigmoid routing (models/moe.py)."""
    return cfg.router == "sigmoid"


def _deinterleave(R: int) -> np.ndarray:
    """The column order that turns RoPE's interleaved pairs (0, 1), (2, 3), … into the half-split layout
    [0, 2, 4, … | 1, 3, 5, …] (transformers' apply_rotary_pos_emb_interleave): scores are unchanged, since q and
    k are permuted alike."""
    return np.concatenate([np.arange(0, R, 2), np.arange(1, R, 2)])


def _block_from_hf(hf: dict[str, np.ndarray], p: str, h: str, cfg: DeepSeekConfig, interleaved: bool,
                   moe: bool = False) -> dict[str, np.ndarray]:
    """A decoder layer's weights (transformers' names under ``p``) under minipar's names (under ``h``)."""
    H, N, R = cfg.n_head, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    a = p + "self_attn."
    query = "q_b_proj" if cfg.q_lora_rank else "q_proj"
    q = hf.pop(f"{a}{query}.weight").T  # (in, H·(N + R))
    kv_a = hf.pop(a + "kv_a_proj_with_mqa.weight").T  # (C, r_kv + R)
    if interleaved:  # minipar rotates half-split pairs: reorder the rope columns of q (per head) and k_R
        order = _deinterleave(R)
        q = q.reshape(-1, H, N + R)[:, :, np.concatenate([np.arange(N), N + order])].reshape(q.shape)
        kv_a = kv_a[:, np.concatenate([np.arange(cfg.kv_lora_rank), cfg.kv_lora_rank + order])]
    out = {h + "ln_1.weight": hf.pop(p + "input_layernorm.weight"),
           h + "ln_2.weight": hf.pop(p + "post_attention_layernorm.weight"),
           f"{h}attn.{query}.weight": q, h + "attn.kv_a_proj.weight": kv_a,
           h + "attn.kv_a_norm.weight": hf.pop(a + "kv_a_layernorm.weight"),
           h + "attn.kv_b_proj.weight": hf.pop(a + "kv_b_proj.weight").T,
           h + "attn.c_proj.weight": hf.pop(a + "o_proj.weight").T}
    if not moe:
        out[h + "mlp.c_fc.weight"] = np.concatenate([hf.pop(f"{p}mlp.{n}_proj.weight").T for n in ("gate", "up")], 1)
        out[h + "mlp.c_proj.weight"] = hf.pop(p + "mlp.down_proj.weight").T
    else:  # the router (weight, and the balancing bias it keeps in float32), the routed and the shared experts
        m = p + "mlp."
        out[h + "mlp.router.weight"] = hf.pop(m + "gate.weight").T
        out[h + "mlp.score_bias"] = hf.pop(m + "gate.e_score_correction_bias").astype(np.float32)
        experts = [[hf.pop(f"{m}experts.{j}.{n}_proj.weight") for j in range(cfg.n_expert)] for n in ("gate", "up", "down")]
        out[h + "mlp.c_fc.weight"], out[h + "mlp.c_proj.weight"] = stack_experts(*experts)
        if cfg.n_shared_expert:
            shared = [hf.pop(f"{m}shared_experts.{n}_proj.weight") for n in ("gate", "up", "down")]
            out[h + "mlp.shared.c_fc.weight"] = np.concatenate([shared[0].T, shared[1].T], axis=1)
            out[h + "mlp.shared.c_proj.weight"] = shared[2].T
    if cfg.q_lora_rank:
        out[h + "attn.q_a_proj.weight"] = hf.pop(a + "q_a_proj.weight").T
        out[h + "attn.q_a_norm.weight"] = hf.pop(a + "q_a_layernorm.weight")
    return out


def _block_to_hf(state: dict[str, np.ndarray], h: str, p: str, cfg: DeepSeekConfig, moe: bool = False
                 ) -> dict[str, np.ndarray]:
    """The inverse of :func:`_block_from_hf` (half-split RoPE: no reordering; experts one by one, as DeepSeek's)."""
    a, m = p + "self_attn.", p + "mlp."
    query = "q_b_proj" if cfg.q_lora_rank else "q_proj"
    if moe:
        out = {m + "gate.weight": state[h + "mlp.router.weight"].T, m + "gate.e_score_correction_bias":
               state[h + "mlp.score_bias"].astype(np.float32)}
        for j, weights in enumerate(unstack_experts(state[h + "mlp.c_fc.weight"], state[h + "mlp.c_proj.weight"])):
            out.update({f"{m}experts.{j}.{n}_proj.weight": w for n, w in zip(("gate", "up", "down"), weights)})
        if cfg.n_shared_expert:
            gate, up = np.split(state[h + "mlp.shared.c_fc.weight"], 2, axis=1)
            out.update({m + "shared_experts.gate_proj.weight": gate.T, m + "shared_experts.up_proj.weight": up.T,
                        m + "shared_experts.down_proj.weight": state[h + "mlp.shared.c_proj.weight"].T})
    else:
        gate, up = np.split(state[h + "mlp.c_fc.weight"], 2, axis=1)
        out = {m + "gate_proj.weight": gate.T, m + "up_proj.weight": up.T,
               m + "down_proj.weight": state[h + "mlp.c_proj.weight"].T}
    out.update({p + "input_layernorm.weight": state[h + "ln_1.weight"],
           p + "post_attention_layernorm.weight": state[h + "ln_2.weight"],
           f"{a}{query}.weight": state[f"{h}attn.{query}.weight"].T,
           a + "kv_a_proj_with_mqa.weight": state[h + "attn.kv_a_proj.weight"].T,
           a + "kv_a_layernorm.weight": state[h + "attn.kv_a_norm.weight"],
           a + "kv_b_proj.weight": state[h + "attn.kv_b_proj.weight"].T,
           a + "o_proj.weight": state[h + "attn.c_proj.weight"].T})
    if cfg.q_lora_rank:
        out[a + "q_a_proj.weight"] = state[h + "attn.q_a_proj.weight"].T
        out[a + "q_a_layernorm.weight"] = state[h + "attn.q_a_norm.weight"]
    return out


# Every DeepseekV3Config field: implemented, refused unless it has the value minipar computes, or without effect on
# the function the weights compute (transformers' generic keys are gpt.py's _HF_GENERIC)
_IMPLEMENTED = {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_parameters",
                "rope_scaling", "rope_interleave", "tie_word_embeddings", "q_lora_rank", "kv_lora_rank",
                "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "first_k_dense_replace",
                "num_nextn_predict_layers", "num_mtp_layers", "head_dim", "qk_head_dim", "dtype", "torch_dtype"}
_REQUIRED_VALUE = {
    "model_type": (("deepseek_v3",), "this is minipar's DeepSeek-V3 loader"),
    "hidden_act": (("silu",), "minipar's SwiGLU gates with silu"),
    "attention_bias": ((False,), "minipar's DeepSeek linears have no bias"),
    "pretraining_tp": ((1,), "the weights are stored whole"),
}
# the MoE layers' fields: without effect while every layer is dense (first_k_dense_replace >= num_hidden_layers)
_MOE_FIELDS = {"moe_intermediate_size", "n_shared_experts", "n_routed_experts", "routed_scaling_factor", "n_group",
               "topk_group", "num_experts_per_tok", "norm_topk_prob", "output_router_logits", "router_aux_loss_coef",
               "topk_method", "scoring_func", "seq_aux", "moe_layer_freq", "ep_size", "aux_loss_alpha"}
_NO_EFFECT = {"attention_dropout", "initializer_range", "use_cache", "bos_token_id", "eos_token_id", "pad_token_id",
              "architectures", "transformers_version", "minipar", "auto_map", "quantization_config"}


def hf_deepseek_config(directory: str, dtype: str | None = None) -> tuple[DeepSeekConfig, bool]:
    """(the DeepSeekConfig of a Hugging Face ``deepseek_v3`` directory, whether its RoPE pairs are interleaved):
    every field implemented or refused in one line."""
    path, hf = read_hf_config(directory)
    refuse_values(path, hf, _REQUIRED_VALUE)
    if "quantization_config" in hf:
        raise ValueError(f"{path}: quantization_config is unsupported (DeepSeek's released FP8 weights: dequantize "
                         "them to bf16 first)")
    refuse_unknown(path, hf, _IMPLEMENTED | set(_REQUIRED_VALUE) | _MOE_FIELDS | _NO_EFFECT, "DeepSeek-V3")
    require_fields(path, hf, (*LLAMA_REQUIRED, "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    L, H = hf["num_hidden_layers"], hf["num_attention_heads"]
    dense = hf.get("first_k_dense_replace", 3)
    for field, accepted, why in (("moe_layer_freq", 1, "every layer after the dense ones is a MoE layer"),
                                 ("scoring_func", "sigmoid", "DeepSeek-V3's router"),
                                 ("topk_method", "noaux_tc", "group-limited top-k over the biased scores")):
        if dense < L and hf.get(field, accepted) != accepted:
            raise ValueError(f"{path}: {field}={hf[field]!r} is unsupported ({why})")
    if hf.get("num_key_value_heads", H) not in (None, H):
        raise ValueError(f"{path}: num_key_value_heads={hf['num_key_value_heads']} != num_attention_heads={H} is "
                         "unsupported (multi-head latent attention: every head its own key and value)")
    theta = hf_rope_theta(path, hf, "minipar implements the default RoPE; YaRN's rotary tables and its mscale on "
                                    "the softmax scale are not built")
    mtp = hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers", 0)) or 0
    cfg = DeepSeekConfig(vocab_size=hf["vocab_size"], block_size=hf["max_position_embeddings"], n_layer=L, n_head=H,
                         n_embd=hf["hidden_size"], n_inner=hf["intermediate_size"],
                         layer_norm_epsilon=hf.get("rms_norm_eps", 1e-6), rope_theta=theta,
                         tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                         q_lora_rank=hf.get("q_lora_rank") or 0, kv_lora_rank=hf["kv_lora_rank"],
                         qk_nope_head_dim=hf["qk_nope_head_dim"], qk_rope_head_dim=hf["qk_rope_head_dim"],
                         v_head_dim=hf["v_head_dim"], mtp_depth=mtp, **_hf_moe_fields(hf, dense < L),
                         mtp_weight=hf.get("minipar", {}).get("mtp_weight", 0.3),
                         dtype=hf_dtype(directory, hf, dtype))
    return cfg, bool(hf.get("rope_interleave", True))


def _hf_moe_fields(hf: dict[str, Any], moe: bool) -> dict[str, Any]:
    """The MoE fields of a DeepseekV3Config as DeepSeekConfig's: dropless sigmoid routing with the bias (updated only
    when the stored minipar config says so), the sequence-wise loss's α (DeepSeek's aux_loss_alpha; none in
    transformers' config: 0, as transformers computes none)."""
    if not moe:
        return {}
    own = hf.get("minipar", {})
    return dict(n_expert=hf["n_routed_experts"], expert_top_k=hf.get("num_experts_per_tok", 8),
                moe_inner=hf["moe_intermediate_size"], n_shared_expert=hf.get("n_shared_experts", 0) or 0,
                first_dense_layers=hf.get("first_k_dense_replace", 3), router="sigmoid",
                norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
                routed_scaling=float(hf.get("routed_scaling_factor", 1.0)), expert_groups=hf.get("n_group") or 1,
                topk_groups=hf.get("topk_group") or 1, capacity_factor=0.0,
                aux_loss_coef=float(own.get("aux_loss_coef", hf.get("aux_loss_alpha", 0.0))),
                bias_update=float(own.get("bias_update", 0.0)))
