"""GPT-2, small enough to read in ten minutes.

    idx (B, T) ──wte + wpe──> x (B, T, C)
    repeat n_layer:   x = x + attn(ln_1(x))          attn: c_attn (C→3C), causal softmax, c_proj (C→C)
                      x = x + mlp(ln_2(x))           mlp:  c_fc (C→4C), gelu(tanh), c_proj (4C→C)
    logits = ln_f(x) @ wteᵀ                         (the head is tied to the token embedding)
    loss   = cross_entropy(logits, targets)

Parameter names and layouts are Hugging Face's (``transformer.h.0.attn.c_attn.weight`` of shape
(C, 3C): Conv1D stores W as (in, out)), so :meth:`GPT.from_hf` and :meth:`GPT.save_hf` move
checkpoints to and from ``transformers`` without renaming or transposing anything.

Initialization (GPT-2 paper): weights ~ N(0, 0.02), residual projections ~ N(0, 0.02/√(2·n_layer)),
biases 0, layer-norm weights 1. Drawn on the host in parameter order from one seeded generator,
so every device and every parallel layout starts from the same numbers.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from minipar import ops
from minipar.autograd import Tensor, no_grad, release_unread
from minipar.backend import resolve_dtype, to_device, to_host, xp
from minipar.safetensors_io import (DEFAULT_MAX_SHARD_BYTES, atomic_write, read_hf_weights, stored_dtypes,
                                    write_hf_weights)
from minipar.data import save_tokenizer
from minipar.models.moe import MoEMLP
from minipar.nn import Embedding, LayerNorm, Linear, Module, ModuleList


@dataclass
class GPTConfig:
    vocab_size: int = 256  # byte-level tokens
    block_size: int = 128  # longest context (n_positions)
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    layer_norm_epsilon: float = 1e-5
    dtype: str = "float32"
    scale_attn_weights: bool = True  # attention scores q·kᵀ / √head_dim (False: unscaled)
    scale_attn_by_inverse_layer_idx: bool = False  # and / (layer index + 1)
    n_expert: int = 0  # > 0: every MLP is a mixture of this many experts (models/moe.py); 0: GPT-2's dense MLP
    expert_top_k: int = 2
    capacity_factor: float = 1.25  # 0: dropless (every assignment kept)
    aux_loss_coef: float = 0.01
    moe_inner: int = 0  # an expert's width; 0: the dense MLP's (mlp_width)
    n_shared_expert: int = 0  # always-on experts (DeepSeek-V3: 1), one MLP n_shared_expert·moe_inner wide
    first_dense_layers: int = 0  # blocks with the dense MLP before the MoE ones (DeepSeek-V3: 3)
    router: str = "softmax"  # models/moe.py ROUTERS: softmax (Switch), softmax-topk (Mixtral, Qwen3), sigmoid (V3)
    norm_topk_prob: bool = True  # softmax-topk, sigmoid: the chosen gates renormalized
    routed_scaling: float = 1.0  # sigmoid: the gates' factor (DeepSeek-V3: 2.5)
    expert_groups: int = 1  # sigmoid: group-limited routing over this many groups of experts (V3: 8) ...
    topk_groups: int = 1  # ... of which each token uses this many (V3: 4)
    bias_update: float = 0.0  # sigmoid: γ of auxiliary-loss-free balancing (V3: 0.001); 0: the bias stays
    arch: str = "gpt2"  # "llama": models/llama.py's LlamaConfig (minipar.models.config_from_dict picks the class)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if self.n_expert < 0 or (self.n_expert and not 1 <= self.expert_top_k <= self.n_expert):
            raise ValueError(f"expert_top_k ({self.expert_top_k}) must be between 1 and n_expert ({self.n_expert})")
        if self.n_expert:
            self._check_experts()
        resolve_dtype(self.dtype)

    def _check_experts(self) -> None:
        """The MoE fields' rules (models/moe.py), one line each."""
        from minipar.models.moe import ROUTERS

        E, k = self.n_expert, self.expert_top_k
        if self.capacity_factor < 0 or self.aux_loss_coef < 0:
            raise ValueError("capacity_factor must be >= 0 (0: dropless) and aux_loss_coef >= 0")
        if self.router not in ROUTERS:
            raise ValueError(f"unknown router {self.router!r}: expected one of {', '.join(ROUTERS)}")
        if min(self.moe_inner, self.n_shared_expert, self.first_dense_layers, self.bias_update) < 0:
            raise ValueError("moe_inner, n_shared_expert, first_dense_layers and bias_update must be >= 0")
        if self.first_dense_layers >= self.n_layer:
            raise ValueError(f"first_dense_layers {self.first_dense_layers} leaves no MoE layer of n_layer "
                             f"{self.n_layer}: use n_expert 0 for a dense model")
        if self.expert_groups < 1 or E % self.expert_groups:
            raise ValueError(f"expert_groups {self.expert_groups} must divide n_expert {E}")
        if not 1 <= self.topk_groups <= self.expert_groups:
            raise ValueError(f"topk_groups {self.topk_groups} must be between 1 and expert_groups {self.expert_groups}")
        if k > self.topk_groups * (E // self.expert_groups):
            raise ValueError(f"expert_top_k {k} > the {self.topk_groups * (E // self.expert_groups)} experts of the "
                             f"topk_groups {self.topk_groups} groups a token may use")
        if (self.expert_groups > 1 or self.bias_update or self.routed_scaling != 1.0) and self.router != "sigmoid":
            raise ValueError(f"expert groups, a bias update and routed scaling are the sigmoid router's (DeepSeek-V3): "
                             f"router {self.router!r} has no bias")

    expert_width = property(lambda self: self.moe_inner or self.mlp_width, doc="an expert's hidden width")

    def moe_blocks(self, layers: int | None = None) -> int:
        """How many of the first ``layers`` blocks (default all) are MoE layers."""
        layers = self.n_layer if layers is None else layers
        return max(0, layers - self.first_dense_layers) if self.n_expert else 0

    def moe_parameters(self) -> tuple[int, int]:
        """(the routed experts', the rest's) parameters of one MoE MLP: E experts of 3·C·I (SwiGLU) or 2·C·I + I + C
        (GELU) each; the router C·E and the shared experts, one MLP n_shared·I wide."""
        C, I, S = self.n_embd, self.expert_width, self.n_shared_expert * self.expert_width
        mlp = (lambda width: 3 * C * width) if self.mlp_parts == 2 else (lambda width: 2 * C * width + width + C)
        return self.n_expert * mlp(I), C * self.n_expert + (mlp(S) if S else 0)

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    # the shapes the parallel engines split (a Llama config answers differently)
    kv_heads = property(lambda self: self.n_head, doc="key/value heads (grouped-query attention: fewer than n_head)")
    mlp_width = property(lambda self: 4 * self.n_embd, doc="the MLP's hidden width")
    mlp_parts = 1  # c_fc's output: one block of mlp_width columns (Llama's: gate | up)
    ties_embeddings = True  # the LM head is the token embedding's table
    head_uses_embedding = property(lambda self: self.ties_embeddings,
                                   doc="the head reads the token embedding (a pipeline mirrors it on the last stage)")
    display_name = "GPT"

    # what the planner's cost model needs of an architecture (parallel/planner.py)
    def layer_weights(self) -> tuple[int, int]:
        """(attention, dense MLP) weight-matrix parameters of one block: a token costs 2 FLOPs per weight."""
        C = self.n_embd
        return 4 * C * C, 8 * C * C

    def attention_widths(self) -> tuple[int, int, int, int]:
        """(query heads, key/value heads, q·k width, v width per head) as the attention core computes them."""
        return self.n_head, self.kv_heads, self.head_dim, self.head_dim

    def tp_replicated_parameters(self, layers: int, final_norm: bool) -> int:
        """Parameters every tp rank holds whole: per block the two layer norms and the two row-parallel biases
        (6C), the position table, ln_f."""
        return layers * 6 * self.n_embd + self.block_size * self.n_embd + (2 * self.n_embd if final_norm else 0)

    vocab_tables = 1  # (V, C) tables split by vocabulary rows: the tied embedding

    def activation_units(self) -> tuple[float, float]:
        """Korthikanti et al.'s per-layer activations in units of s·b·h 16-bit values (sbh·(34 + 5as/h) in all):
        (what every tp rank keeps whole — layer-norm inputs, the inputs of c_attn and c_fc, dropout masks —,
        what tensor parallelism splits — q, k, v, the attention output, the MLP's 4h-wide activations)."""
        return 10.0, 24.0

    def fp8_input_units(self) -> tuple[float, float]:
        """Of :meth:`activation_units`, the inputs of the block's FP8 Linears, (whole, split): c_attn's and a dense
        c_fc's (2 + 2); the attention output c_proj takes (2) and the MLP's mlp_width-wide input of its c_proj
        (2·width/h) — what tensorwise FP8 keeps as 1-byte codes instead (precision.FP8Linear), half of these."""
        dense = 0.0 if self.n_expert else 2.0
        return 2.0 + dense, 2.0 + dense * self.mlp_width / self.n_embd

    def attention_scale(self, layer: int) -> float:
        """The factor on layer ``layer``'s attention scores, as Hugging Face's GPT-2 computes it."""
        scale = 1.0 / math.sqrt(self.head_dim) if self.scale_attn_weights else 1.0
        return scale / (layer + 1) if self.scale_attn_by_inverse_layer_idx else scale

    def num_parameters(self, layers: int | None = None, final_norm: bool = True) -> int:
        """Parameter count: 12C² + 13C per block (a MoE block: 4C² + 8C + its MoE MLP, moe_parameters), V·C + T·C
        for the embeddings (the head is tied), 2C for ln_f."""
        C = self.n_embd
        layers = self.n_layer if layers is None else layers
        moe = self.moe_blocks(layers)
        blocks = (layers - moe) * (12 * C * C + 13 * C) + moe * (4 * C * C + 8 * C + sum(self.moe_parameters()))
        return blocks + self.vocab_size * C + self.block_size * C + (2 * C if final_norm else 0)


class CausalSelfAttention(Module):
    fp8_linears = ("c_attn", "c_proj")  # the projections --precision fp8 computes in FP8 (precision.py)

    def __init__(self, cfg: GPTConfig, layer: int):
        self.c_attn = Linear(cfg.n_embd, 3 * cfg.n_embd, dtype=cfg.dtype)
        self.c_proj = Linear(cfg.n_embd, cfg.n_embd, dtype=cfg.dtype)
        self.n_head = cfg.n_head
        self.scale = cfg.attention_scale(layer)
        self.core = ops.causal_self_attention  # context parallelism swaps in one that attends across ranks

    def forward(self, x: Tensor) -> Tensor:
        return self.c_proj(self.core(self.c_attn(x), self.n_head, self.scale))

    def keep_heads(self, tp: int) -> None:
        """Tensor parallelism: this rank computes 1/tp of the heads."""
        self.n_head //= tp

    def recompute_scores(self) -> None:
        """Selective recomputation: the attention probabilities are computed again in backward, not kept."""
        if self.core is not ops.causal_self_attention:
            raise ValueError("selective recomputation needs the standard attention (not context parallelism's)")
        self.core = lambda qkv, n_head, scale, kv_heads=None: ops.causal_self_attention(qkv, n_head, scale, True,
                                                                                         kv_heads)


class MLP(Module):
    def __init__(self, cfg: GPTConfig):
        self.c_fc = Linear(cfg.n_embd, 4 * cfg.n_embd, dtype=cfg.dtype)
        self.c_proj = Linear(4 * cfg.n_embd, cfg.n_embd, dtype=cfg.dtype)

    def forward(self, x: Tensor) -> Tensor:
        return self.c_proj(ops.gelu(self.c_fc(x)))


class Block(Module):
    # the three pieces an architecture chooses (models/llama.py: RMSNorm, RotaryAttention, SwiGLUMLP)
    Norm, Attention, DenseMLP = LayerNorm, CausalSelfAttention, MLP

    def __init__(self, cfg: GPTConfig, layer: int):
        self.ln_1 = self.Norm(cfg.n_embd, cfg.layer_norm_epsilon, dtype=cfg.dtype)
        self.attn = self.Attention(cfg, layer)
        self.ln_2 = self.Norm(cfg.n_embd, cfg.layer_norm_epsilon, dtype=cfg.dtype)
        self.mlp = MoEMLP.for_config(cfg) if cfg.n_expert and layer >= cfg.first_dense_layers else self.DenseMLP(cfg)

    recompute = False  # full recomputation: keep only the block's input, run it again in backward
    keeps_fp8_inputs = False  # set_fp8 with a one-scale recipe: the Linears keep codes, not inputs (precision.py)

    def projections(self) -> list[Module]:
        """The attention's and a dense MLP's Linears (or their tensor-parallel slices): what FP8 computes in FP8 —
        not a MoE layer's router and experts."""
        found = [getattr(self.attn, name, None) for name in self.attn.fp8_linears]
        found += [getattr(self.mlp, name, None) for name in ("c_fc", "c_proj")]  # a MoE layer's are expert weights
        return [linear for linear in found if hasattr(linear, "fp8")]

    def forward(self, x: Tensor) -> Tensor:
        if not self.recompute:
            y = self.body(x)
            if self.keeps_fp8_inputs:  # its FP8 Linears keep their inputs' codes: give the arrays back
                release_unread(y, x)
            return y
        side = getattr(self.mlp, "aux_loss", False) is not False  # a MoE layer: its balancing loss rides along
        y = ops.recompute(self.body, x, (lambda: self.mlp.aux_loss) if side else None)
        if side:
            self.mlp.aux_loss = ops.recomputed_side(y, self.mlp.aux_loss)
        return y

    def body(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Transformer(Module):
    def __init__(self, cfg: GPTConfig):
        self.wte = Embedding(cfg.vocab_size, cfg.n_embd, dtype=cfg.dtype)
        self.wpe = Embedding(cfg.block_size, cfg.n_embd, dtype=cfg.dtype)
        self.h = ModuleList([Block(cfg, layer) for layer in range(cfg.n_layer)])
        self.ln_f = LayerNorm(cfg.n_embd, cfg.layer_norm_epsilon, dtype=cfg.dtype)


RECOMPUTE = ("none", "selective", "full")


def activation_elements(cfg: GPTConfig, batch: int, recompute: str = "none") -> int:
    """Array elements one forward keeps for backward (one process, dense MLP, s = T, b = batch, h = C, a = heads):
    every op's output stays alive in the graph until backward frees it. Per block: ln_1's x̂ and output (2sbh),
    q|k|v (3sbh), the attention output (sbh) and probabilities (a·s²·b), c_proj (sbh), the residual (sbh), ln_2
    (2sbh), c_fc (4sbh), GELU's output and tanh (8sbh), c_proj (sbh), the residual (sbh): 24sbh + a·s²·b, plus
    2sb of layer-norm 1/σ. Around the blocks: the token and position embeddings and their sum (2sbh + sh),
    ln_f (2sbh + sb), logits and probabilities (2bsV). Selective recomputation drops a·s²·b; full keeps only each block's output (sbh), and
    in backward holds one block's activations at a time on top."""
    s, b, h, a, L = cfg.block_size, batch, cfg.n_embd, cfg.n_head, cfg.n_layer
    block = 24 * s * b * h + 2 * s * b + (0 if recompute == "selective" else a * s * s * b)
    around = 4 * s * b * h + s * h + s * b + 2 * b * s * cfg.vocab_size
    return L * (s * b * h if recompute == "full" else block) + around


class GPT(Module):
    # the positions of the T tokens this rank is given: 0 … T−1, or its chunks of each sequence (context parallelism)
    given_positions = staticmethod(lambda T: xp.arange(T))
    sequence_shard = (0, 1)  # (j, m): of those, this rank computes shard j of m (sequence parallelism)

    def __init__(self, cfg: GPTConfig, seed: int = 0):
        self.config = cfg
        self.transformer = Transformer(cfg)
        self._init_weights(seed)

    def named_blocks(self) -> list[tuple[str, Block]]:
        """Every transformer block with its parameters' name prefix — what the parallel engines split and
        recompute (DeepSeek adds its multi-token prediction modules' blocks)."""
        return [(f"transformer.h.{n}.", block) for n, block in zip(self.transformer.h._numbers, self.transformer.h)]

    def set_recompute(self, mode: str) -> GPT:
        """Activation recomputation: "none"; "selective" (Korthikanti et al. 2022: the attention probabilities,
        the largest and cheapest activations, are computed again in backward); "full" (every block keeps only
        its input and runs again in backward)."""
        if mode not in RECOMPUTE:
            raise ValueError(f"unknown recomputation {mode!r}: expected one of {RECOMPUTE}")
        for _, block in self.named_blocks():
            block.recompute = mode == "full"
            if mode == "selective":
                block.attn.recompute_scores()
        return self

    def set_fp8(self, recipe: Any) -> GPT:
        """Every block's attention and dense-MLP Linear computes its GEMMs under the FP8 ``recipe`` (precision.py);
        the embedding, the head, MoE routers and experts stay in bf16 (precision.py)."""
        for _, block in self.named_blocks():
            for linear in block.projections():
                linear.fp8 = recipe
            block.keeps_fp8_inputs = recipe.one_scale
        return self

    def _init_weights(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, p in self.named_parameters():
            if p.ndim >= 2:  # Linear, Embedding, router and expert weights; biases (0), layer norms (1, 0) as they are
                std = residual_std if name.endswith("c_proj.weight") else 0.02
                p.data = to_device(rng.normal(0.0, std, size=p.shape), dtype=p.dtype)

    # ---- forward, in three pieces so a pipeline stage can run just its share ----
    def positions(self, T: int) -> Any:
        """The positions of the T tokens this rank is given that it computes: all of them — 0 … T−1, or its
        chunks of each sequence under context parallelism — or its shard of them under sequence parallelism
        (whose embedding returns just those rows)."""
        j, m = self.sequence_shard
        return self.given_positions(T)[j * T // m:(j + 1) * T // m]

    def embed(self, idx: Any) -> Tensor:
        T = idx.shape[1]
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        return self.transformer.wte(idx) + self.transformer.wpe(self.positions(T))

    def head(self, x: Tensor, targets: Any = None, embedding: Any = None) -> tuple[Tensor, Tensor | None]:
        """Logits and loss from the last block's output; ``embedding`` is the tied table's module (default: the
        token embedding — or an untied model's ``lm_head`` —; a pipeline whose head is not on the embedding's stage
        passes its mirror)."""
        table = embedding or (self.transformer.wte if self.config.ties_embeddings else self.lm_head)
        logits = table.attend(self.transformer.ln_f(x))
        if targets is None:
            return logits, None
        return logits, table.cross_entropy(logits, targets)

    def balance_loss(self, blocks: Any) -> Tensor | None:
        """aux_loss_coef × the sum of the load-balancing losses of ``blocks``' MoE layers in their last forward
        (None for dense blocks): the model's loss adds it for all blocks, a pipeline stage for its own."""
        aux = [block.mlp.aux_loss for block in blocks if getattr(block.mlp, "aux_loss", None) is not None]
        return ops.sum(ops.concat([a.reshape(1) for a in aux])) * self.config.aux_loss_coef if aux else None

    def forward(self, idx: Any, targets: Any = None) -> tuple[Tensor, Tensor | None]:
        """``idx`` (B, T) int -> (logits (B, T, vocab), mean cross-entropy loss or None)."""
        idx = to_device(idx)
        x = self.embed(idx)
        for block in self.transformer.h:
            x = block(x)
        logits, loss = self.head(x, None if targets is None else to_device(targets))
        balance = self.balance_loss(self.transformer.h) if loss is not None else None
        return logits, loss if balance is None else loss + balance

    def decoder(self) -> Any:
        """What generation asks for each token: a function of the tokens so far (B, t) -> the next token's logits
        (B, vocab). Here the whole forward on the last block_size tokens; a model with a cache keeps its state
        between calls (DeepSeek's latent cache)."""
        return lambda idx: self(idx[:, -self.config.block_size:])[0].data[:, -1, :]

    @no_grad()
    def generate(self, idx: Any, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 seed: int = 0) -> np.ndarray:
        """Sample ``max_new_tokens`` tokens after ``idx`` (B, T); returns the extended (B, T + n) array."""
        rng = np.random.default_rng(seed)
        idx = np.asarray(idx, dtype=np.int64)
        next_logits = self.decoder()
        for _ in range(max_new_tokens):
            last = to_host(next_logits(idx)).astype(np.float64) / max(temperature, 1e-8)
            if top_k is not None and top_k < last.shape[-1]:
                kth = np.partition(last, -top_k, axis=-1)[:, -top_k][:, None]
                last = np.where(last < kth, -np.inf, last)
            probs = np.exp(last - last.max(axis=-1, keepdims=True))
            probs /= probs.sum(axis=-1, keepdims=True)
            nxt = np.array([[rng.choice(len(p), p=p)] for p in probs])
            idx = np.concatenate([idx, nxt], axis=1)
        return idx

    # ---- Hugging Face checkpoints ----
    @classmethod
    def from_hf(cls, directory: str, dtype: str | None = None) -> GPT:
        """Load a directory written by transformers (GPT2LMHeadModel.save_pretrained) or :meth:`save_hf`:
        ``config.json`` and ``model.safetensors`` or its shards with ``model.safetensors.index.json``."""
        cfg, tied = hf_config(directory, dtype), _hf_ties_embeddings(directory)
        state = {}
        for key, value in read_hf_weights(directory).items():
            name = key if key.startswith("transformer.") or key == "lm_head.weight" else f"transformer.{key}"
            if name.endswith((".attn.bias", ".attn.masked_bias")):
                continue  # GPT-2's stored causal-mask buffers, not parameters
            state[name] = value
        lm_head = state.pop("lm_head.weight", None)
        if not tied and lm_head is None:
            raise ValueError(f"{directory}: tie_word_embeddings is false but there is no lm_head.weight")
        if lm_head is not None and not np.array_equal(lm_head, state.get("transformer.wte.weight")):
            raise ValueError(f"{directory}: tie_word_embeddings=false with an lm_head.weight that differs from "
                             "transformer.wte.weight is unsupported: minipar's GPT ties its head to the embedding")
        model = cls(cfg)
        model.load_state_dict(state)
        return model

    def save_hf(self, directory: str, state: dict[str, np.ndarray] | None = None,
                max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, tokenizer: str | None = None) -> None:
        """Write ``config.json`` + ``model.safetensors`` (sharded above ``max_shard_bytes``, with the index)
        that ``GPT2LMHeadModel.from_pretrained`` loads, and the tokenizer files ``AutoTokenizer`` loads
        (data.save_tokenizer: ``tokenizer``'s BPE files, or the byte tokenizer of a 256-token model); the config's
        bos/eos ids are the tokenizer's end-of-text token (null without one).

        ``state`` (default: this model's ``state_dict()``) lets a sharded run save the parameters it gathered.
        """
        cfg = self.config
        if cfg.n_expert:
            raise ValueError("a mixture-of-experts GPT has no Hugging Face GPT-2 layout: save it with --save instead")
        os.makedirs(directory, exist_ok=True)
        end_of_text = save_tokenizer(directory, cfg.vocab_size, cfg.block_size, tokenizer)
        hf = {
            "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
            "vocab_size": cfg.vocab_size, "n_positions": cfg.block_size, "n_ctx": cfg.block_size,
            "n_embd": cfg.n_embd, "n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_inner": None,
            "activation_function": "gelu_new", "layer_norm_epsilon": cfg.layer_norm_epsilon,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "initializer_range": 0.02,
            "scale_attn_weights": cfg.scale_attn_weights,
            "scale_attn_by_inverse_layer_idx": cfg.scale_attn_by_inverse_layer_idx,
            "reorder_and_upcast_attn": False, "add_cross_attention": False, "tie_word_embeddings": True,
            "bos_token_id": end_of_text, "eos_token_id": end_of_text,
            "dtype": cfg.dtype, "torch_dtype": cfg.dtype, "minipar": asdict(cfg),
        }
        write_hf_weights(directory, state if state is not None else self.state_dict(), max_shard_bytes)
        atomic_write(os.path.join(directory, "config.json"), [json.dumps(hf, indent=2).encode()])


# Every GPT2Config field, and what minipar does with it. A field is implemented (it shapes GPTConfig),
# refused unless it has the value minipar computes, or has no effect on the function the weights compute.
_HF_IMPLEMENTED = {"vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "layer_norm_epsilon",
                   "scale_attn_weights", "scale_attn_by_inverse_layer_idx", "dtype", "torch_dtype",
                   "tie_word_embeddings"}  # tie_word_embeddings: checked against the weights in from_hf
_HF_REQUIRED_VALUE = {  # field: (accepted values, what minipar implements instead)
    "model_type": (("gpt2",), "minipar loads GPT-2 checkpoints"),
    "activation_function": (("gelu_new", "gelu_pytorch_tanh"), "minipar implements GPT-2's tanh GELU"),
    "add_cross_attention": ((False,), "minipar's GPT is decoder-only, with no encoder to attend to"),
    "is_encoder_decoder": ((False,), "minipar's GPT is decoder-only"),
    "pruned_heads": (({},), "every layer has n_head heads in minipar"),
}
# reorder_and_upcast_attn only reorders the scaling and upcasts to float32 for half-precision weights: the
# same function (minipar computes attention in float32 or float64). Dropout is a training-time regularizer:
# the loaded model is the deterministic (evaluation-mode) function, and minipar trains without dropout.
# summary_* configure GPT2DoubleHeadsModel's classification head, which GPT2LMHeadModel does not have;
# n_ctx is a legacy alias that transformers ignores (n_positions sizes the position table); the rest are
# initialization, generation and bookkeeping settings; gradient_checkpointing is a training-time memory setting
# (minipar's is the --recompute flag).
_HF_NO_EFFECT = {"reorder_and_upcast_attn", "resid_pdrop", "embd_pdrop", "attn_pdrop", "summary_type",
                 "summary_use_proj", "summary_activation", "summary_proj_to_labels", "summary_first_dropout", "n_ctx",
                 "initializer_range", "use_cache", "bos_token_id", "eos_token_id", "pad_token_id", "architectures",
                 "transformers_version", "task_specific_params", "minipar", "gradient_checkpointing"}
# transformers' generic PretrainedConfig keys (outputs, labels, generation defaults, bookkeeping) that
# older or fine-tuned GPT-2 checkpoints carry; none changes what GPT2LMHeadModel computes from a prompt.
_HF_GENERIC = {"_name_or_path", "_num_labels", "num_labels", "id2label", "label2id", "problem_type", "finetuning_task",
               "tokenizer_class", "prefix", "sep_token_id", "decoder_start_token_id", "output_attentions",
               "output_hidden_states", "output_past", "return_dict", "torchscript", "use_bfloat16", "tf_legacy_loss",
               "is_decoder", "tie_encoder_decoder", "chunk_size_feed_forward", "cross_attention_hidden_size",
               "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
               "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
               "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
               "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
               "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty",
               "suppress_tokens", "begin_suppress_tokens"}


def read_hf_config(directory: str) -> tuple[str, dict[str, Any]]:
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{directory}: no config.json (expected a Hugging Face checkpoint directory)")
    try:
        with open(path, encoding="utf-8") as f:
            return path, json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def refuse_values(path: str, hf: dict[str, Any], required: dict[str, tuple[tuple, str]]) -> None:
    """One line for the first field whose value is not one minipar computes (``required``: field -> (accepted
    values, what minipar implements instead); an absent field takes the first accepted value)."""
    for field, (accepted, why) in required.items():
        value = hf.get(field, accepted[0])
        if value not in accepted:
            raise ValueError(f"{path}: {field}={value!r} is unsupported ({why})")


def refuse_unknown(path: str, hf: dict[str, Any], known: set[str], family: str) -> None:
    """One line for the first field that is neither ``known`` (implemented, value-checked or without effect) nor one
    of transformers' generic keys: minipar refuses to guess what it changes."""
    unknown = sorted(set(hf) - known - _HF_GENERIC)
    if unknown:
        raise ValueError(f"{path}: config field {unknown[0]!r} is not a {family} field minipar implements; refusing to "
                         "guess what it changes")


def require_fields(path: str, hf: dict[str, Any], names: tuple[str, ...]) -> None:
    missing = [name for name in names if name not in hf]
    if missing:
        raise ValueError(f"{path}: missing required field {missing[0]!r}")


def hf_rope_theta(path: str, hf: dict[str, Any], instead: str) -> float:
    """θ of the default RoPE (transformers 5's rope_parameters, or earlier rope_theta); another rope_type refused,
    saying what minipar implements ``instead``."""
    for key in ("rope_parameters", "rope_scaling"):  # transformers 5 / earlier
        kind = (hf.get(key) or {}).get("rope_type", (hf.get(key) or {}).get("type", "default"))
        if kind != "default":
            raise ValueError(f"{path}: {key} rope_type={kind!r} is unsupported ({instead})")
    return float((hf.get("rope_parameters") or {}).get("rope_theta", hf.get("rope_theta", 10000.0)))


def hf_dtype(directory: str, hf: dict[str, Any], dtype: str | None) -> str:
    """The dtype a checkpoint loads in: ``dtype`` if asked, else as stored — minipar's own record, ``dtype``
    (transformers 5) or ``torch_dtype`` (earlier), without any the weights' safetensors headers: float64 stays
    float64, anything else loads as float32 (float16/bfloat16 weights are widened)."""
    stored = hf.get("minipar", {}).get("dtype") or hf.get("dtype") or hf.get("torch_dtype")
    if stored is None and stored_dtypes(directory) == {"F64"}:
        stored = "float64"
    return dtype or ("float64" if stored == "float64" else "float32")


def _hf_ties_embeddings(directory: str) -> bool:
    return bool(read_hf_config(directory)[1].get("tie_word_embeddings", True))


def hf_config(directory: str, dtype: str | None = None) -> GPTConfig:
    """The GPTConfig of a Hugging Face GPT-2 checkpoint directory: every field implemented or refused; the dtype
    as stored (:func:`hf_dtype`)."""
    path, hf = read_hf_config(directory)
    refuse_values(path, hf, _HF_REQUIRED_VALUE)
    n_inner = hf.get("n_inner")
    if n_inner not in (None, 4 * hf.get("n_embd", 0)):
        raise ValueError(f"{path}: n_inner={n_inner} is unsupported (minipar's MLP is 4·n_embd wide)")
    refuse_unknown(path, hf, _HF_IMPLEMENTED | set(_HF_REQUIRED_VALUE) | _HF_NO_EFFECT | {"n_inner"}, "GPT-2")
    require_fields(path, hf, ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"))
    return GPTConfig(vocab_size=hf["vocab_size"], block_size=hf["n_positions"], n_layer=hf["n_layer"],
                     n_head=hf["n_head"], n_embd=hf["n_embd"], layer_norm_epsilon=hf.get("layer_norm_epsilon", 1e-5),
                     dtype=hf_dtype(directory, hf, dtype), scale_attn_weights=bool(hf.get("scale_attn_weights", True)),
                     scale_attn_by_inverse_layer_idx=bool(hf.get("scale_attn_by_inverse_layer_idx", False)))
