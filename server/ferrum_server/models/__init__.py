"""Model definitions, configuration parsing and weight loading."""

from ferrum_server.models.causal_lm import CausalLM
from ferrum_server.models.config import (
    Llama3RopeScaling,
    LongRopeScaling,
    ModelConfig,
    RopeScaling,
)
from ferrum_server.models.gemma import GemmaForCausalLM
from ferrum_server.models.gemma_spec import GemmaSpec
from ferrum_server.models.llama import LlamaForCausalLM, weight_map
from ferrum_server.models.loader import load_model, read_config, save_hf_folder
from ferrum_server.models.moe_config import MoeSpec
from ferrum_server.models.registry import hf_tensor_shapes, model_class
from ferrum_server.models.tiny import build_tiny, tiny_config

__all__ = [
    "CausalLM",
    "GemmaForCausalLM",
    "GemmaSpec",
    "Llama3RopeScaling",
    "LlamaForCausalLM",
    "LongRopeScaling",
    "ModelConfig",
    "MoeSpec",
    "RopeScaling",
    "build_tiny",
    "hf_tensor_shapes",
    "load_model",
    "model_class",
    "read_config",
    "save_hf_folder",
    "tiny_config",
    "weight_map",
]
