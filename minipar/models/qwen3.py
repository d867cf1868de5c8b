"""Qwen3 and Qwen3-MoE (Qwen Team 2025): Llama with two changes, each a few lines beside models/llama.py.

1. **QK-norm**: q and k are RMS-normalized per head — over the head's D dimensions, each with its own learned
   D-wide gain (``q_norm``, ``k_norm``) — before RoPE, which keeps the attention logits bounded in training.
2. **The head width is its own field** (``n_head_dim``, Hugging Face's ``head_dim``; 0: C/H): H·D need not be C.

Qwen3-MoE's MLPs are models/moe.py's SwiGLU experts behind the ``softmax-topk`` router (its ``norm_topk_prob``
renormalizes the chosen gates, or not), every assignment kept, fine-grained (``moe_inner``), with dense blocks
first where ``mlp_only_layers`` lists them. :meth:`Qwen3.from_hf` and :meth:`Qwen3.save_hf` translate transformers'
``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM`` (model_type ``qwen3`` / ``qwen3_moe``).

Under tensor parallelism a rank normalizes its own heads with the whole gains: each gain's gradient is summed over
the tp ranks (``param_use``, label ``tp_qk_norm``), as a sequence-parallel layer norm's is over the shards.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

import numpy as np

from minipar.autograd import Tensor
from minipar.data import save_tokenizer
from minipar.models.gpt import hf_dtype, hf_rope_theta, read_hf_config, refuse_unknown, refuse_values, require_fields
from minipar.models.llama import (Llama, LlamaBlock, LlamaConfig, LlamaTransformer, RotaryAttention,
                                  LLAMA_REQUIRED, embeddings_from_hf, embeddings_to_hf, layer_from_hf, layer_to_hf,
                                  refuse_leftovers, router_aux_loss_coef)
from minipar.nn import RMSNorm
from minipar.safetensors_io import DEFAULT_MAX_SHARD_BYTES, atomic_write, read_hf_weights, write_hf_weights


@dataclass
class Qwen3Config(LlamaConfig):
    arch: str = "qwen3"
    n_head_dim: int = 0  # a head's width D; 0: n_embd / n_head

    display_name = "Qwen3"
    head_dim = property(lambda self: self.n_head_dim or self.n_embd // self.n_head)

    def __post_init__(self) -> None:
        if self.n_head_dim < 0:
            raise ValueError(f"n_head_dim must be >= 0, got {self.n_head_dim}")
        super().__post_init__()

    def tp_replicated_parameters(self, layers: int, final_norm: bool) -> int:
        return super().tp_replicated_parameters(layers, final_norm) + layers * 2 * self.head_dim  # q_norm, k_norm

    def num_parameters(self, layers: int | None = None, final_norm: bool = True) -> int:
        """Llama's count plus the two D-wide QK-norm gains per block."""
        return super().num_parameters(layers, final_norm) + (self.n_layer if layers is None else layers) * 2 * self.head_dim


class QKNormAttention(RotaryAttention):
    """Llama's attention with q and k RMS-normalized per head before RoPE."""

    def __init__(self, cfg: Qwen3Config, layer: int):
        super().__init__(cfg, layer)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.layer_norm_epsilon, dtype=cfg.dtype)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.layer_norm_epsilon, dtype=cfg.dtype)

    def before_rope(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        return self.q_norm(q), self.k_norm(k)


class Qwen3Block(LlamaBlock):
    Attention = QKNormAttention


class Qwen3Transformer(LlamaTransformer):
    Block = Qwen3Block


QWEN3_EXPERTS = ("mlp.", ("gate_proj", "up_proj", "down_proj"))  # Qwen3-MoE's MLP prefix and expert names


def _experts(cfg: Qwen3Config, i: int) -> tuple[str, tuple[str, str, str]] | None:
    """Layer i's MoE names for :func:`layer_from_hf` (None: a dense layer, one of the first ``first_dense_layers``)."""
    return QWEN3_EXPERTS if cfg.n_expert and i >= cfg.first_dense_layers else None


class Qwen3(Llama):
    """Llama's interface on Qwen3's blocks."""

    Transformer = Qwen3Transformer

    # ---- Hugging Face checkpoints ----
    @classmethod
    def from_hf(cls, directory: str, dtype: str | None = None) -> Qwen3:
        """Load a ``Qwen3ForCausalLM`` or ``Qwen3MoeForCausalLM`` directory."""
        cfg = hf_qwen3_config(directory, dtype)
        hf = read_hf_weights(directory)
        state = embeddings_from_hf(hf, cfg, directory)
        for i in range(cfg.n_layer):  # Llama's layer, and the two QK-norms
            state.update(layer_from_hf(hf, cfg, i, _experts(cfg, i)))
            h, a = f"transformer.h.{i}.", f"model.layers.{i}.self_attn."
            state[h + "attn.q_norm.weight"] = hf.pop(a + "q_norm.weight")
            state[h + "attn.k_norm.weight"] = hf.pop(a + "k_norm.weight")
        refuse_leftovers(hf, directory, "a Qwen3")
        model = cls(cfg)
        model.load_state_dict({name: np.ascontiguousarray(value) for name, value in state.items()})
        return model

    def save_hf(self, directory: str, state: dict[str, np.ndarray] | None = None,
                max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, tokenizer: str | None = None) -> None:
        """Write what ``Qwen3ForCausalLM`` (dense) or ``Qwen3MoeForCausalLM`` loads, and the tokenizer files."""
        cfg = self.config
        if cfg.n_expert and not routes_as_qwen3(cfg):
            raise ValueError("Qwen3MoeForCausalLM routes by softmax-topk without dropping or shared experts: save "
                             "this mixture of experts with --save")
        state = state if state is not None else self.state_dict()
        hf = embeddings_to_hf(state, cfg)
        H, K, D = cfg.n_head, cfg.kv_heads, cfg.head_dim
        for i in range(cfg.n_layer):  # Llama's layer, and the two QK-norms
            hf.update(layer_to_hf(state, cfg, i, _experts(cfg, i)))
            h, a = f"transformer.h.{i}.", f"model.layers.{i}.self_attn."
            hf[a + "q_norm.weight"] = state[h + "attn.q_norm.weight"]
            hf[a + "k_norm.weight"] = state[h + "attn.k_norm.weight"]
        os.makedirs(directory, exist_ok=True)
        end_of_text = save_tokenizer(directory, cfg.vocab_size, cfg.block_size, tokenizer)
        moe = {"num_experts": cfg.n_expert, "num_experts_per_tok": cfg.expert_top_k,
               "moe_intermediate_size": cfg.expert_width, "norm_topk_prob": cfg.norm_topk_prob,
               "decoder_sparse_step": 1, "mlp_only_layers": list(range(cfg.first_dense_layers)),
               "output_router_logits": False, "router_aux_loss_coef": cfg.aux_loss_coef} if cfg.n_expert else {}
        config = {
            "architectures": ["Qwen3MoeForCausalLM" if cfg.n_expert else "Qwen3ForCausalLM"],
            "model_type": "qwen3_moe" if cfg.n_expert else "qwen3", "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.n_embd, "intermediate_size": cfg.mlp_width, "num_hidden_layers": cfg.n_layer,
            "num_attention_heads": H, "num_key_value_heads": K, "head_dim": D, "hidden_act": "silu",
            "max_position_embeddings": cfg.block_size, "rms_norm_eps": cfg.layer_norm_epsilon,
            "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default"}, "attention_bias": False,
            "use_sliding_window": False, "sliding_window": None, "attention_dropout": 0.0, "initializer_range": 0.02,
            "tie_word_embeddings": cfg.tie_word_embeddings, "bos_token_id": end_of_text, "eos_token_id": end_of_text,
            "dtype": cfg.dtype, "minipar": asdict(cfg), **moe,
        }
        write_hf_weights(directory, {n: np.ascontiguousarray(w) for n, w in hf.items()}, max_shard_bytes)
        atomic_write(os.path.join(directory, "config.json"), [json.dumps(config, indent=2).encode()])


def routes_as_qwen3(cfg: Qwen3Config) -> bool:
    """Whether a MoE Qwen3 computes what Qwen3MoeForCausalLM computes: softmax-topk, dropless, no shared experts."""
    return cfg.router == "softmax-topk" and cfg.capacity_factor == 0 and not cfg.n_shared_expert


_IMPLEMENTED = {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_theta",
                "rope_parameters", "rope_scaling", "tie_word_embeddings", "dtype", "torch_dtype", "num_experts", "num_local_experts",
                "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
                "mlp_only_layers", "router_aux_loss_coef", "output_router_logits", "sliding_window", "max_window_layers",
                "layer_types"}
_REQUIRED_VALUE = {"model_type": (("qwen3", "qwen3_moe"), "this is minipar's Qwen3 loader"),
                   "hidden_act": (("silu",), "minipar's SwiGLU gates with silu"),
                   "attention_bias": ((False,), "minipar's Qwen3 linears have no bias"),
                   "use_sliding_window": ((False,), "minipar's attention sees the whole context")}
_NO_EFFECT = {"attention_dropout", "initializer_range", "use_cache", "bos_token_id", "eos_token_id", "pad_token_id",
              "architectures", "transformers_version", "minipar"}


def hf_qwen3_config(directory: str, dtype: str | None = None) -> Qwen3Config:
    """The Qwen3Config of a Hugging Face ``qwen3`` / ``qwen3_moe`` directory: every field implemented or refused."""
    path, hf = read_hf_config(directory)
    refuse_values(path, hf, _REQUIRED_VALUE)
    refuse_unknown(path, hf, _IMPLEMENTED | set(_REQUIRED_VALUE) | _NO_EFFECT, "Qwen3")
    theta = hf_rope_theta(path, hf, "minipar implements the default RoPE")
    require_fields(path, hf, LLAMA_REQUIRED)
    L = hf["num_hidden_layers"]
    moe = {}
    experts = hf.get("num_experts", hf.get("num_local_experts", 0))  # transformers 5 writes the latter
    if hf.get("model_type") == "qwen3_moe" and experts:
        dense = list(hf.get("mlp_only_layers") or [])
        if hf.get("decoder_sparse_step", 1) != 1 or dense != list(range(len(dense))):
            raise ValueError(f"{path}: decoder_sparse_step={hf.get('decoder_sparse_step')} with mlp_only_layers={dense} "
                             "is unsupported (minipar's dense blocks are the first ones, every later block a MoE one)")
        moe = dict(n_expert=experts, expert_top_k=hf.get("num_experts_per_tok", 8),
                   moe_inner=hf["moe_intermediate_size"], first_dense_layers=len(dense), router="softmax-topk",
                   norm_topk_prob=bool(hf.get("norm_topk_prob", False)), capacity_factor=0.0,
                   aux_loss_coef=router_aux_loss_coef(hf))
    C, H = hf["hidden_size"], hf["num_attention_heads"]
    return Qwen3Config(**moe, vocab_size=hf["vocab_size"], block_size=hf["max_position_embeddings"], n_layer=L,
                       n_head=H, n_embd=C, n_kv_head=hf.get("num_key_value_heads") or H,
                       n_inner=hf["intermediate_size"], n_head_dim=hf.get("head_dim") or 0,
                       layer_norm_epsilon=hf.get("rms_norm_eps", 1e-6), rope_theta=theta,
                       tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)), dtype=hf_dtype(directory, hf, dtype))
