"""Model definitions: GPT-2 (gpt.py), Llama (llama.py), mixture-of-experts MLPs (moe.py) — and the three
places that pick between the architectures: a config from its stored fields, a model from its config, a
model from a Hugging Face directory."""
from __future__ import annotations

from typing import Any

from minipar.models.gpt import GPT, GPTConfig, hf_config, read_hf_config
from minipar.models.llama import Llama, LlamaConfig, hf_llama_config

ARCHITECTURES = {"gpt2": (GPTConfig, GPT), "llama": (LlamaConfig, Llama)}


def config_from_dict(fields: dict[str, Any]) -> GPTConfig:
    """A checkpoint's stored config (``arch`` names the class; checkpoints from before Llama have none: GPT-2)."""
    return ARCHITECTURES[fields.get("arch", "gpt2")][0](**fields)


def build_model(cfg: GPTConfig, seed: int = 0) -> GPT:
    """The model of ``cfg``'s architecture, initialized from ``seed``."""
    return ARCHITECTURES[cfg.arch][1](cfg, seed)


def _hf_architecture(directory: str) -> str:
    model_type = read_hf_config(directory)[1].get("model_type", "gpt2")
    if model_type not in ARCHITECTURES:
        raise ValueError(f"{directory}: model_type={model_type!r} is unsupported (minipar loads "
                         f"{' and '.join(ARCHITECTURES)})")
    return model_type


def from_hf(directory: str, dtype: str | None = None) -> GPT:
    """The model of a Hugging Face directory, by its config.json's ``model_type`` (``gpt2`` or ``llama``)."""
    return ARCHITECTURES[_hf_architecture(directory)][1].from_hf(directory, dtype)


def config_from_hf(directory: str, dtype: str | None = None) -> GPTConfig:
    """The config :func:`from_hf` would build, without reading the weights."""
    return (hf_llama_config if _hf_architecture(directory) == "llama" else hf_config)(directory, dtype)
