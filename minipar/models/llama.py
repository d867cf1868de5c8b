"""Llama (Touvron et al. 2023): GPT-2's decoder with four changes, each a few lines beside models/gpt.py.

    idx (B, T) ──wte──> x (B, T, C)                     no position table: positions rotate q and k
    repeat n_layer:   x = x + attn(rms_1(x))           attn: c_attn (C→(H+2K)·D) = q | k | v, RoPE on q and k,
                                                             each K/V head shared by H/K queries, c_proj
                      x = x + mlp(rms_2(x))            mlp:  c_fc (C→2I) = gate | up, silu(gate)·up, c_proj (I→C)
    logits = rms_f(x) @ lm_headᵀ                     (untied by default; --tie-embeddings shares wte)

1. RMSNorm for LayerNorm: x / √(mean(x²) + ε) · w — no mean, no bias (ops.RMSNorm).
2. Rotary position embeddings (Su et al. 2021) for the learned wpe: head dimensions i and i + D/2 of q and k
   rotate by position·θ^(−2i/D), so q·k depends on the distance between the tokens only (ops.Rope, in
   Hugging Face's half-split layout). A rank computes the angles at the true positions of the tokens it holds —
   context parallelism's zigzag chunks included — so no parallel layout changes the function.
3. SwiGLU for the GELU MLP: silu(x W_gate) ⊙ (x W_up) W_down, I wide (Meta's rule: 8C/3 rounded up to a
   multiple of 256).
4. Grouped-query attention (Ainslie et al. 2023): K ≤ H key/value heads; query head h uses K/V head
   h // (H/K). K = H is multi-head attention, K = 1 multi-query.

No linear has a bias. The parameter names are GPT-2's (``transformer.h.0.attn.c_attn.weight``, (in, out)), so
every parallel engine splits a Llama as it splits a GPT-2: tensor parallelism keeps a rank's query heads and
its K/tp key/value heads of c_attn and its columns of each of gate and up; :meth:`Llama.from_hf` and
:meth:`Llama.save_hf` translate to and from transformers' ``LlamaForCausalLM`` names (q_proj, …, (out, in)).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from minipar import ops
from minipar.autograd import Tensor
from minipar.backend import xp
from minipar.data import save_tokenizer
from minipar.models.gpt import (GPT, Block, CausalSelfAttention, GPTConfig, hf_dtype, hf_rope_theta, read_hf_config,
                                refuse_unknown, refuse_values, require_fields)
from minipar.models.moe import stack_experts, unstack_experts
from minipar.nn import Embedding, Linear, Module, ModuleList, RMSNorm
from minipar.safetensors_io import DEFAULT_MAX_SHARD_BYTES, atomic_write, read_hf_weights, write_hf_weights


def llama_inner(n_embd: int, multiple_of: int = 256) -> int:
    """Meta's SwiGLU width: 2/3 of 4C (the same parameters as a 4C GELU MLP), rounded up to ``multiple_of``."""
    return multiple_of * math.ceil(int(8 * n_embd / 3) / multiple_of)


@dataclass
class LlamaConfig(GPTConfig):
    layer_norm_epsilon: float = 1e-6  # rms_norm_eps
    arch: str = "llama"
    n_kv_head: int = 0  # key/value heads; 0: n_head (multi-head attention)
    n_inner: int = 0  # the SwiGLU width; 0: llama_inner(n_embd)
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n_kv_head < 0 or self.n_head % self.kv_heads:
            raise ValueError(f"n_kv_head ({self.n_kv_head}) must divide n_head ({self.n_head}): each key/value head "
                             "serves an equal group of query heads")
        if self.rope_dim % 2:
            raise ValueError(f"the rotated dimension {self.rope_dim} must be even: RoPE rotates pairs")
        if self.n_inner < 0 or self.rope_theta <= 0:
            raise ValueError("n_inner must be >= 0 and rope_theta > 0")

    kv_heads = property(lambda self: self.n_kv_head or self.n_head)
    rope_dim = property(lambda self: self.head_dim, doc="the dimensions RoPE rotates per head")
    mlp_width = property(lambda self: self.n_inner or llama_inner(self.n_embd))
    mlp_parts = 2  # c_fc = gate | up
    display_name = "Llama"
    ties_embeddings = property(lambda self: self.tie_word_embeddings)

    def attention_scale(self, layer: int) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    def layer_weights(self) -> tuple[int, int]:
        C, D, H, K = self.n_embd, self.head_dim, self.n_head, self.kv_heads
        return C * (H + 2 * K) * D + H * D * C, 3 * C * self.mlp_width

    def tp_replicated_parameters(self, layers: int, final_norm: bool) -> int:
        return layers * 2 * self.n_embd + (self.n_embd if final_norm else 0)  # the RMSNorm gains

    vocab_tables = property(lambda self: 1 if self.tie_word_embeddings else 2)

    def activation_units(self) -> tuple[float, float]:
        """As GPTConfig's, counted as Korthikanti et al. count GPT's — the inputs each op's backward needs, in
        16-bit bytes per s·b·h: whole, the two norms' inputs and the inputs of c_attn and c_fc (8); split, q (2),
        k and v before and after their repeat to H heads (4 + 4K/H), the attention output (2) and the SwiGLU's
        gate | up and product (6·I/h). minipar's unfused ops keep more (docs/testing.md, mutation testing)."""
        return 8.0, 8.0 + 4.0 * self.kv_heads / self.n_head + 6.0 * self.mlp_width / self.n_embd

    def num_parameters(self, layers: int | None = None, final_norm: bool = True) -> int:
        """Per block: attention C·(H + 2K)·D + H·D·C, SwiGLU 3·C·I (a MoE block: its MoE MLP, moe_parameters), two
        norms 2C; the embedding V·C (twice when untied); the final norm C."""
        C, D, H, K = self.n_embd, self.head_dim, self.n_head, self.kv_heads
        layers = self.n_layer if layers is None else layers
        moe = self.moe_blocks(layers)
        per_block = C * (H + 2 * K) * D + H * D * C + 2 * C
        blocks = layers * per_block + (layers - moe) * 3 * C * self.mlp_width + moe * sum(self.moe_parameters())
        table = self.vocab_size * C * (1 if self.tie_word_embeddings else 2)
        return blocks + table + (C if final_norm else 0)


class RotaryAttention(CausalSelfAttention):
    """Causal attention with RoPE and grouped-query heads. The core (ops.causal_self_attention, or context
    parallelism's ring or Ulysses core) receives q | k | v with the K key/value heads as they are and serves
    query head h from K/V head h // (H/K) itself: it keeps — and context parallelism sends — K heads, not H."""

    def __init__(self, cfg: LlamaConfig, layer: int):
        H, K, D = cfg.n_head, cfg.kv_heads, cfg.head_dim
        self.c_attn = Linear(cfg.n_embd, (H + 2 * K) * D, bias=False, dtype=cfg.dtype)
        self.c_proj = Linear(H * D, cfg.n_embd, bias=False, dtype=cfg.dtype)
        self.n_head, self.n_kv_head, self.head_dim, self.theta = H, K, D, cfg.rope_theta
        self.scale = cfg.attention_scale(layer)
        self.core = ops.causal_self_attention
        self.positions = lambda T: xp.arange(T)  # the model points it at its own given positions

    def keep_heads(self, tp: int) -> None:
        self.n_head //= tp
        self.n_kv_head = max(1, self.n_kv_head // tp)  # tp > K: one K/V head, shared with other ranks

    def before_rope(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """q (B, T, H, D) and k (B, T, K, D) as RoPE receives them (Qwen3 normalizes them here)."""
        return q, k

    def forward(self, x: Tensor) -> Tensor:
        qkv = self.c_attn(x)
        B, T, _ = qkv.shape
        H, K, D = self.n_head, self.n_kv_head, self.head_dim
        qkv = qkv.reshape(B, T, H + 2 * K, D)
        cos, sin = ops.rope_tables(self.positions(T), D, self.theta, xp.float64 if x.dtype == xp.float64 else xp.float32)
        q, k = self.before_rope(qkv[:, :, :H], qkv[:, :, H:H + K])
        q, k = ops.rope(q, cos, sin), ops.rope(k, cos, sin)
        packed = ops.concat([q, k, qkv[:, :, H + K:]], axis=2).reshape(B, T, (H + 2 * K) * D)
        return self.c_proj(self.core(packed, H, self.scale, kv_heads=K))


class SwiGLUMLP(Module):
    def __init__(self, cfg: LlamaConfig):
        self.c_fc = Linear(cfg.n_embd, 2 * cfg.mlp_width, bias=False, dtype=cfg.dtype)  # gate | up
        self.c_proj = Linear(cfg.mlp_width, cfg.n_embd, bias=False, dtype=cfg.dtype)

    def forward(self, x: Tensor) -> Tensor:
        return self.c_proj(ops.swiglu(self.c_fc(x)))


class LlamaBlock(Block):
    """GPT-2's block (pre-norm residuals, MoE layers, full recomputation) with Llama's norm, attention and MLP."""

    Norm, Attention, DenseMLP = RMSNorm, RotaryAttention, SwiGLUMLP


class LlamaTransformer(Module):
    Block = LlamaBlock

    def __init__(self, cfg: LlamaConfig):
        self.wte = Embedding(cfg.vocab_size, cfg.n_embd, dtype=cfg.dtype)
        self.h = ModuleList([self.Block(cfg, layer) for layer in range(cfg.n_layer)])
        self.ln_f = RMSNorm(cfg.n_embd, cfg.layer_norm_epsilon, dtype=cfg.dtype)


class Llama(GPT):
    """GPT's interface (embed / blocks / head, generate, recomputation) on a Llama; ``lm_head`` when untied."""

    Transformer = LlamaTransformer

    def __init__(self, cfg: LlamaConfig, seed: int = 0):
        self.config = cfg
        self.transformer = self.Transformer(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = Embedding(cfg.vocab_size, cfg.n_embd, dtype=cfg.dtype)
        for block in self.transformer.h:  # late-bound: context parallelism replaces given_positions
            block.attn.positions = lambda T: self.given_positions(T)
        self._init_weights(seed)

    def embed(self, idx: Any) -> Tensor:
        if idx.shape[1] > self.config.block_size:
            raise ValueError(f"sequence length {idx.shape[1]} exceeds block_size {self.config.block_size}")
        return self.transformer.wte(idx)

    # ---- Hugging Face checkpoints ----
    @classmethod
    def from_hf(cls, directory: str, dtype: str | None = None) -> Llama:
        """Load a directory written by transformers (``LlamaForCausalLM.save_pretrained``) or :meth:`save_hf`."""
        cfg = hf_llama_config(directory, dtype)
        hf = read_hf_weights(directory)
        state = embeddings_from_hf(hf, cfg, directory)
        for i in range(cfg.n_layer):
            state.update(layer_from_hf(hf, cfg, i, MIXTRAL_EXPERTS if cfg.n_expert else None))
        refuse_leftovers(hf, directory, "a Llama")
        model = cls(cfg)
        model.load_state_dict({name: np.ascontiguousarray(value) for name, value in state.items()})
        return model

    def save_hf(self, directory: str, state: dict[str, np.ndarray] | None = None,
                max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, tokenizer: str | None = None) -> None:
        """Write ``config.json`` + safetensors that ``LlamaForCausalLM.from_pretrained`` loads (q/k/v, gate/up
        split out of the packed matrices, every matrix as (out, in)) and the tokenizer files."""
        cfg = self.config
        if cfg.n_expert and not mixtral_compatible(cfg):
            raise ValueError("a mixture-of-experts Llama saves as MixtralForCausalLM when it routes as Mixtral does — "
                             "dropless (--capacity-factor 0), gates softmax over the k >= 2 chosen, no shared experts "
                             "or dense first layers, experts as wide as --n-inner: save it with --save instead")
        state = state if state is not None else self.state_dict()
        H, K, D, C = cfg.n_head, cfg.kv_heads, cfg.head_dim, cfg.n_embd
        hf = embeddings_to_hf(state, cfg)
        for i in range(cfg.n_layer):
            hf.update(layer_to_hf(state, cfg, i, MIXTRAL_EXPERTS if cfg.n_expert else None))
        os.makedirs(directory, exist_ok=True)
        end_of_text = save_tokenizer(directory, cfg.vocab_size, cfg.block_size, tokenizer)
        moe = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": cfg.n_expert,
               "num_experts_per_tok": cfg.expert_top_k, "router_jitter_noise": 0.0, "sliding_window": None,
               "output_router_logits": False, "router_aux_loss_coef": cfg.aux_loss_coef} if cfg.n_expert else {}
        config = {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
            "hidden_size": C, "intermediate_size": cfg.mlp_width, "num_hidden_layers": cfg.n_layer,
            "num_attention_heads": H, "num_key_value_heads": K, "head_dim": D, "hidden_act": "silu",
            "max_position_embeddings": cfg.block_size, "rms_norm_eps": cfg.layer_norm_epsilon,
            "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default"}, "rope_theta": cfg.rope_theta,
            "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0, "pretraining_tp": 1,
            "initializer_range": 0.02, "tie_word_embeddings": cfg.tie_word_embeddings,
            "bos_token_id": end_of_text, "eos_token_id": end_of_text,
            "dtype": cfg.dtype, "torch_dtype": cfg.dtype, "minipar": asdict(cfg), **moe,
        }
        if moe:  # Mixtral's attention has no bias fields and no tp setting
            for key in ("attention_bias", "mlp_bias", "pretraining_tp"):
                config.pop(key)
        write_hf_weights(directory, {n: np.ascontiguousarray(w) for n, w in hf.items()}, max_shard_bytes)
        atomic_write(os.path.join(directory, "config.json"), [json.dumps(config, indent=2).encode()])


# Every LlamaConfig field: implemented (it shapes LlamaConfig), refused unless it has the value minipar computes,
# or without effect on the function the weights compute (dropout at 0 in evaluation, initialization, generation
# and bookkeeping settings; transformers' generic PretrainedConfig keys are gpt.py's _HF_GENERIC).
_IMPLEMENTED = {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_parameters",
                "rope_scaling", "tie_word_embeddings", "head_dim", "dtype", "torch_dtype"}
def embeddings_from_hf(hf: dict[str, np.ndarray], cfg: LlamaConfig, directory: str) -> dict[str, np.ndarray]:
    """The token table, the final norm and (untied) the head of a Llama-family checkpoint, taken out of ``hf``."""
    state = {"transformer.wte.weight": hf.pop("model.embed_tokens.weight"),
             "transformer.ln_f.weight": hf.pop("model.norm.weight")}
    head = hf.pop("lm_head.weight", None)
    if not cfg.tie_word_embeddings:
        if head is None:
            raise ValueError(f"{directory}: tie_word_embeddings is false but there is no lm_head.weight")
        state["lm_head.weight"] = head
    return state


def embeddings_to_hf(state: dict[str, np.ndarray], cfg: LlamaConfig) -> dict[str, np.ndarray]:
    """The inverse of :func:`embeddings_from_hf`."""
    hf = {"model.embed_tokens.weight": state["transformer.wte.weight"], "model.norm.weight": state["transformer.ln_f.weight"]}
    return {**hf, "lm_head.weight": state["lm_head.weight"]} if not cfg.tie_word_embeddings else hf


MIXTRAL_EXPERTS = ("block_sparse_moe.", ("w1", "w3", "w2"))  # a MoE MLP's prefix; each expert's gate, up, down


def layer_from_hf(hf: dict[str, np.ndarray], cfg: LlamaConfig, i: int,
                  experts: tuple[str, tuple[str, str, str]] | None) -> dict[str, np.ndarray]:
    """Layer ``i`` of a Llama-family checkpoint in minipar's names, popped from ``hf``: the two norms, q|k|v packed,
    o, and the MLP — gate|up packed and down, or with ``experts`` = (the MoE MLP's prefix in the layer, each expert's
    gate, up and down names) the router and the experts stacked."""
    h, p = f"transformer.h.{i}.", f"model.layers.{i}."
    state = {h + "ln_1.weight": hf.pop(p + "input_layernorm.weight"),
             h + "ln_2.weight": hf.pop(p + "post_attention_layernorm.weight"),
             h + "attn.c_attn.weight": np.concatenate([hf.pop(f"{p}self_attn.{n}_proj.weight").T for n in "qkv"], 1),
             h + "attn.c_proj.weight": hf.pop(p + "self_attn.o_proj.weight").T}
    if experts:
        m, names = p + experts[0], experts[1]
        state[h + "mlp.router.weight"] = hf.pop(m + "gate.weight").T
        stacked = [[hf.pop(f"{m}experts.{j}.{n}.weight") for j in range(cfg.n_expert)] for n in names]
        state[h + "mlp.c_fc.weight"], state[h + "mlp.c_proj.weight"] = stack_experts(*stacked)
    else:
        state[h + "mlp.c_fc.weight"] = np.concatenate([hf.pop(f"{p}mlp.{n}_proj.weight").T for n in ("gate", "up")], 1)
        state[h + "mlp.c_proj.weight"] = hf.pop(p + "mlp.down_proj.weight").T
    return state


def layer_to_hf(state: dict[str, np.ndarray], cfg: LlamaConfig, i: int,
                experts: tuple[str, tuple[str, str, str]] | None) -> dict[str, np.ndarray]:
    """The inverse of :func:`layer_from_hf`: layer ``i`` under the checkpoint's names, every matrix (out, in)."""
    h, p = f"transformer.h.{i}.", f"model.layers.{i}."
    H, K, D = cfg.n_head, cfg.kv_heads, cfg.head_dim
    hf = {p + "input_layernorm.weight": state[h + "ln_1.weight"],
          p + "post_attention_layernorm.weight": state[h + "ln_2.weight"],
          p + "self_attn.o_proj.weight": state[h + "attn.c_proj.weight"].T}
    for n, w in zip("qkv", np.split(state[h + "attn.c_attn.weight"], [H * D, (H + K) * D], axis=1)):
        hf[f"{p}self_attn.{n}_proj.weight"] = w.T
    if experts:
        m, names = p + experts[0], experts[1]
        hf[m + "gate.weight"] = state[h + "mlp.router.weight"].T
        for j, weights in enumerate(unstack_experts(state[h + "mlp.c_fc.weight"], state[h + "mlp.c_proj.weight"])):
            hf.update({f"{m}experts.{j}.{n}.weight": w for n, w in zip(names, weights)})
    else:
        gate, up = np.split(state[h + "mlp.c_fc.weight"], 2, axis=1)
        hf.update({p + "mlp.gate_proj.weight": gate.T, p + "mlp.up_proj.weight": up.T,
                   p + "mlp.down_proj.weight": state[h + "mlp.c_proj.weight"].T})
    return hf


def refuse_leftovers(hf: dict[str, np.ndarray], directory: str, what: str) -> None:
    """One line for the first weight a loader did not take (older checkpoints' stored rotary tables aside)."""
    rest = sorted(k for k in hf if not k.endswith("rotary_emb.inv_freq"))
    if rest:
        raise ValueError(f"{directory}: weight {rest[0]!r} is not part of {what} minipar implements")


def mixtral_compatible(cfg: LlamaConfig) -> bool:
    """Whether a MoE Llama computes what MixtralForCausalLM computes (models/moe.py's softmax-topk, dropless)."""
    return (cfg.capacity_factor == 0 and cfg.expert_top_k >= 2 and cfg.n_shared_expert == 0
            and cfg.first_dense_layers == 0 and cfg.expert_width == cfg.mlp_width
            and (cfg.router == "softmax" or (cfg.router == "softmax-topk" and cfg.norm_topk_prob)))


_REQUIRED_VALUE = {  # field: (accepted values, what minipar implements instead)
    "model_type": (("llama", "mixtral"), "this is minipar's Llama (and Mixtral) loader"),
    "router_jitter_noise": ((0, 0.0), "minipar's routers add no noise"),
    "hidden_act": (("silu",), "minipar's SwiGLU gates with silu"),
    "attention_bias": ((False,), "minipar's Llama linears have no bias"),
    "mlp_bias": ((False,), "minipar's Llama linears have no bias"),
    "pretraining_tp": ((1,), "the weights are stored whole; any other value changes the rounding only in transformers"),
}
_NO_EFFECT = {"attention_dropout", "initializer_range", "use_cache", "bos_token_id", "eos_token_id", "pad_token_id",
              "architectures", "transformers_version", "minipar"}
_MIXTRAL = {"num_local_experts", "num_experts_per_tok", "router_aux_loss_coef", "output_router_logits",
            "sliding_window"}  # Mixtral's fields (model_type "mixtral")


LLAMA_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "max_position_embeddings")  # fields every Llama-family config.json has


def router_aux_loss_coef(hf: dict[str, Any]) -> float:
    """Mixtral's and Qwen3-MoE's balancing loss weight: counted only with output_router_logits, as in transformers."""
    return float(hf.get("router_aux_loss_coef", 0.001)) if hf.get("output_router_logits") else 0.0


def hf_llama_config(directory: str, dtype: str | None = None) -> LlamaConfig:
    """The LlamaConfig of a Hugging Face Llama directory: every field implemented or refused in one line."""
    path, hf = read_hf_config(directory)
    refuse_values(path, hf, _REQUIRED_VALUE)
    mixtral = hf.get("model_type") == "mixtral"
    refuse_unknown(path, hf, _IMPLEMENTED | set(_REQUIRED_VALUE) | _NO_EFFECT | (_MIXTRAL if mixtral else set()), "Llama")
    theta = hf_rope_theta(path, hf, "minipar implements the default RoPE, no scaling")
    require_fields(path, hf, LLAMA_REQUIRED)
    C, H = hf["hidden_size"], hf["num_attention_heads"]
    if (hf.get("head_dim") or C // H) != C // H:
        raise ValueError(f"{path}: head_dim={hf['head_dim']} is unsupported (minipar's heads are hidden_size / "
                         f"num_attention_heads = {C // H} wide)")
    moe = {}
    if mixtral:  # dropless softmax-topk routing; its balance loss counted only with output_router_logits, as there
        if hf.get("sliding_window") not in (None, 0) and hf["sliding_window"] < hf["max_position_embeddings"]:
            raise ValueError(f"{path}: sliding_window={hf['sliding_window']} is unsupported (minipar's attention "
                             "sees the whole context)")
        moe = dict(n_expert=hf.get("num_local_experts", 8), expert_top_k=hf.get("num_experts_per_tok", 2),
                   router="softmax-topk", capacity_factor=0.0, aux_loss_coef=router_aux_loss_coef(hf))
    return LlamaConfig(**moe, vocab_size=hf["vocab_size"], block_size=hf["max_position_embeddings"],
                       n_layer=hf["num_hidden_layers"], n_head=H, n_embd=C,
                       n_kv_head=hf.get("num_key_value_heads") or H, n_inner=hf["intermediate_size"],
                       layer_norm_epsilon=hf.get("rms_norm_eps", 1e-6), rope_theta=theta,
                       tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                       dtype=hf_dtype(directory, hf, dtype))
