"""Which model class runs a config: the one place the loader, the tiny model and the tools ask.

The Llama family (Llama, Mistral, Qwen2, Qwen3) runs ``LlamaForCausalLM``; Gemma 2 and Gemma 3
(text) run ``GemmaForCausalLM``, which is built on it. ``ModelConfig`` has already refused every
other architecture.
"""

from __future__ import annotations

import torch

from ferrum_server.models.config import ModelConfig
from ferrum_server.models.gemma import GemmaForCausalLM
from ferrum_server.models.gemma_spec import GEMMA_MODEL_TYPES
from ferrum_server.models.llama import LlamaForCausalLM, hf_tensor_shapes_of


def model_class(config: ModelConfig) -> type[LlamaForCausalLM]:
    """The class that builds ``config``'s model (same constructor for every family)."""
    if config.model_type in GEMMA_MODEL_TYPES:
        return GemmaForCausalLM
    return LlamaForCausalLM


def hf_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name ``config``'s model needs, with its expected shape."""
    return hf_tensor_shapes_of(model_class(config)(config, device=torch.device("meta")))
