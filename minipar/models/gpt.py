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
from minipar.autograd import Tensor, no_grad
from minipar.backend import resolve_dtype, to_device, to_host, xp
from minipar.checkpoint import read_safetensors, write_safetensors
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

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        resolve_dtype(self.dtype)

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def num_parameters(self, layers: int | None = None, embeddings: bool = True, final_norm: bool = True) -> int:
        """Parameter count: 12C² + 13C per block, V·C + T·C for the embeddings (the head is tied), 2C for ln_f."""
        C = self.n_embd
        blocks = (self.n_layer if layers is None else layers) * (12 * C * C + 13 * C)
        return blocks + (self.vocab_size * C + self.block_size * C if embeddings else 0) + (2 * C if final_norm else 0)


class CausalSelfAttention(Module):
    def __init__(self, cfg: GPTConfig):
        self.c_attn = Linear(cfg.n_embd, 3 * cfg.n_embd, dtype=cfg.dtype)
        self.c_proj = Linear(cfg.n_embd, cfg.n_embd, dtype=cfg.dtype)
        self.n_head = cfg.n_head

    def forward(self, x: Tensor) -> Tensor:
        return self.c_proj(ops.causal_self_attention(self.c_attn(x), self.n_head))


class MLP(Module):
    def __init__(self, cfg: GPTConfig):
        self.c_fc = Linear(cfg.n_embd, 4 * cfg.n_embd, dtype=cfg.dtype)
        self.c_proj = Linear(4 * cfg.n_embd, cfg.n_embd, dtype=cfg.dtype)

    def forward(self, x: Tensor) -> Tensor:
        return self.c_proj(ops.gelu(self.c_fc(x)))


class Block(Module):
    def __init__(self, cfg: GPTConfig):
        self.ln_1 = LayerNorm(cfg.n_embd, cfg.layer_norm_epsilon, dtype=cfg.dtype)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = LayerNorm(cfg.n_embd, cfg.layer_norm_epsilon, dtype=cfg.dtype)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Transformer(Module):
    def __init__(self, cfg: GPTConfig):
        self.wte = Embedding(cfg.vocab_size, cfg.n_embd, dtype=cfg.dtype)
        self.wpe = Embedding(cfg.block_size, cfg.n_embd, dtype=cfg.dtype)
        self.h = ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = LayerNorm(cfg.n_embd, cfg.layer_norm_epsilon, dtype=cfg.dtype)


class GPT(Module):
    def __init__(self, cfg: GPTConfig, seed: int = 0):
        self.config = cfg
        self.transformer = Transformer(cfg)
        self._init_weights(seed)

    def _init_weights(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, p in self.named_parameters():
            if p.ndim == 2:  # Linear and Embedding weights; biases (0) and layer norms (1, 0) keep their defaults
                std = residual_std if name.endswith("c_proj.weight") else 0.02
                p.data = to_device(rng.normal(0.0, std, size=p.shape), dtype=p.dtype)

    # ---- forward, in three pieces so a pipeline stage can run just its share ----
    def embed(self, idx: Any) -> Tensor:
        T = idx.shape[1]
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        return self.transformer.wte(idx) + self.transformer.wpe(xp.arange(T))

    def head(self, x: Tensor, targets: Any = None) -> tuple[Tensor, Tensor | None]:
        wte = self.transformer.wte
        logits = wte.attend(self.transformer.ln_f(x))
        return logits, (wte.cross_entropy(logits, targets) if targets is not None else None)

    def forward(self, idx: Any, targets: Any = None) -> tuple[Tensor, Tensor | None]:
        """``idx`` (B, T) int -> (logits (B, T, vocab), mean cross-entropy loss or None)."""
        idx = to_device(idx)
        x = self.embed(idx)
        for block in self.transformer.h:
            x = block(x)
        return self.head(x, None if targets is None else to_device(targets))

    @no_grad()
    def generate(self, idx: Any, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 seed: int = 0) -> np.ndarray:
        """Sample ``max_new_tokens`` tokens after ``idx`` (B, T); returns the extended (B, T + n) array."""
        rng = np.random.default_rng(seed)
        idx = np.asarray(idx, dtype=np.int64)
        for _ in range(max_new_tokens):
            logits, _ = self(idx[:, -self.config.block_size:])
            last = to_host(logits.data[:, -1, :]).astype(np.float64) / max(temperature, 1e-8)
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
        """Load ``config.json`` + ``model.safetensors`` written by transformers (GPT2LMHeadModel) or :meth:`save_hf`."""
        cfg = hf_config(directory, dtype)
        tensors, _ = read_safetensors(os.path.join(directory, "model.safetensors"))
        state = {}
        for key, value in tensors.items():
            name = key if key.startswith("transformer.") or key == "lm_head.weight" else f"transformer.{key}"
            if name.endswith((".attn.bias", ".attn.masked_bias")):
                continue  # GPT-2's stored causal-mask buffers, not parameters
            state[name] = value
        lm_head = state.pop("lm_head.weight", None)
        if lm_head is not None and not np.array_equal(lm_head, state.get("transformer.wte.weight")):
            raise ValueError("lm_head.weight differs from transformer.wte.weight: minipar's GPT ties them")
        model = cls(cfg)
        model.load_state_dict(state)
        return model

    def save_hf(self, directory: str, state: dict[str, np.ndarray] | None = None) -> None:
        """Write ``config.json`` + ``model.safetensors`` that ``GPT2LMHeadModel.from_pretrained`` loads.

        ``state`` (default: this model's ``state_dict()``) lets a sharded run save the parameters it gathered.
        """
        os.makedirs(directory, exist_ok=True)
        cfg = self.config
        hf = {
            "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
            "vocab_size": cfg.vocab_size, "n_positions": cfg.block_size, "n_ctx": cfg.block_size,
            "n_embd": cfg.n_embd, "n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_inner": None,
            "activation_function": "gelu_new", "layer_norm_epsilon": cfg.layer_norm_epsilon,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "initializer_range": 0.02,
            "scale_attn_weights": True, "tie_word_embeddings": True,
            "bos_token_id": cfg.vocab_size - 1, "eos_token_id": cfg.vocab_size - 1,
            "torch_dtype": cfg.dtype, "minipar": asdict(cfg),
        }
        write_safetensors(os.path.join(directory, "model.safetensors"), state if state is not None else self.state_dict())
        tmp = os.path.join(directory, f"config.json.tmp-{os.getpid()}")
        with open(tmp, "w") as f:
            json.dump(hf, f, indent=2)
        os.replace(tmp, os.path.join(directory, "config.json"))


def hf_config(directory: str, dtype: str | None = None) -> GPTConfig:
    """The GPTConfig of a Hugging Face GPT-2 checkpoint directory (checked for what minipar supports)."""
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{directory}: no config.json (expected a Hugging Face GPT-2 checkpoint directory)")
    with open(path) as f:
        hf = json.load(f)
    if hf.get("model_type", "gpt2") != "gpt2":
        raise ValueError(f"{path}: model_type {hf.get('model_type')!r} is not gpt2")
    act = hf.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ValueError(f"{path}: activation {act!r} unsupported (minipar implements GPT-2's tanh GELU)")
    if hf.get("n_inner") not in (None, 4 * hf["n_embd"]):
        raise ValueError(f"{path}: n_inner={hf['n_inner']} unsupported (minipar's MLP is 4·n_embd wide)")
    if hf.get("scale_attn_by_inverse_layer_idx") or hf.get("reorder_and_upcast_attn"):
        raise ValueError(f"{path}: scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn are unsupported")
    saved_dtype = hf.get("minipar", {}).get("dtype") or {"float64": "float64"}.get(hf.get("torch_dtype"), "float32")
    return GPTConfig(vocab_size=hf["vocab_size"], block_size=hf["n_positions"], n_layer=hf["n_layer"],
                     n_head=hf["n_head"], n_embd=hf["n_embd"],
                     layer_norm_epsilon=hf.get("layer_norm_epsilon", 1e-5), dtype=dtype or saved_dtype)
