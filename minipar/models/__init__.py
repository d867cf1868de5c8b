"""Model definitions: GPT-2 (gpt.py), Llama (llama.py), DeepSeek-V3 (deepseek.py), Qwen3 (qwen3.py), mixture-of-experts
MLPs (moe.py) — and the three
places that pick between the architectures: a config from its stored fields, a model from its config, a
model from a Hugging Face directory."""
from __future__ import annotations

from typing import Any

from minipar.models.gpt import GPT, GPTConfig, hf_config, read_hf_config
from minipar.models.deepseek import DeepSeek, DeepSeekConfig, hf_deepseek_config, routes_as_v3
from minipar.models.llama import Llama, LlamaConfig, hf_llama_config, mixtral_compatible
from minipar.models.qwen3 import Qwen3, Qwen3Config, hf_qwen3_config, routes_as_qwen3

ARCHITECTURES = {"gpt2": (GPTConfig, GPT), "llama": (LlamaConfig, Llama), "deepseek": (DeepSeekConfig, DeepSeek),
                 "qwen3": (Qwen3Config, Qwen3)}
HF_MODEL_TYPES = {"gpt2": "gpt2", "llama": "llama", "mixtral": "llama", "deepseek_v3": "deepseek", "qwen3": "qwen3",
                  "qwen3_moe": "qwen3"}  # config.json's model_type -> arch


def config_from_dict(fields: dict[str, Any]) -> GPTConfig:
    """A checkpoint's stored config (``arch`` names the class; checkpoints from before Llama have none: GPT-2)."""
    return ARCHITECTURES[fields.get("arch", "gpt2")][0](**fields)


def build_model(cfg: GPTConfig, seed: int = 0) -> GPT:
    """The model of ``cfg``'s architecture, initialized from ``seed``."""
    return ARCHITECTURES[cfg.arch][1](cfg, seed)


def _hf_architecture(directory: str) -> str:
    model_type = read_hf_config(directory)[1].get("model_type", "gpt2")
    if model_type not in HF_MODEL_TYPES:
        raise ValueError(f"{directory}: model_type={model_type!r} is unsupported (minipar loads "
                         f"{', '.join(HF_MODEL_TYPES)})")
    return HF_MODEL_TYPES[model_type]


def from_hf(directory: str, dtype: str | None = None) -> GPT:
    """The model of a Hugging Face directory, by its config.json's ``model_type`` (HF_MODEL_TYPES)."""
    return ARCHITECTURES[_hf_architecture(directory)][1].from_hf(directory, dtype)


def config_from_hf(directory: str, dtype: str | None = None) -> GPTConfig:
    """The config :func:`from_hf` would build, without reading the weights."""
    arch = _hf_architecture(directory)
    if arch == "deepseek":
        return hf_deepseek_config(directory, dtype)[0]
    if arch == "qwen3":
        return hf_qwen3_config(directory, dtype)
    return (hf_llama_config if arch == "llama" else hf_config)(directory, dtype)


def exports_experts(cfg: GPTConfig) -> bool:
    """Whether ``cfg``'s mixture of experts has a Hugging Face layout: a Llama routed as Mixtral, a DeepSeek as V3, a
    Qwen3 as Qwen3-MoE."""
    return {"llama": lambda: mixtral_compatible(cfg), "deepseek": lambda: routes_as_v3(cfg),
            "qwen3": lambda: routes_as_qwen3(cfg)}.get(
        cfg.arch, lambda: False)()
