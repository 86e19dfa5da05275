"""A tiny random-weight Llama for tests and smoke runs: no download, starts in milliseconds."""

from __future__ import annotations

import torch

from ferrum_server.models.config import ModelConfig
from ferrum_server.models.llama import LlamaForCausalLM
from ferrum_server.models.registry import hf_tensor_shapes

_INIT_STD = 0.02


def tiny_config() -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        attention_bias=False,
        qk_norm=False,
        bos_token_id=1,
        eos_token_ids=(2,),
    )


def _approx_normal(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """Standard-normal-ish float64 samples that are bit-identical on every machine.

    Irwin-Hall: the sum of 12 U(0,1) draws minus 6 has mean 0, std 1 and a near-normal shape.
    Unlike ``torch.randn`` it involves no transcendental functions, whose SIMD implementations
    can round differently across CPUs; float64 uniforms come straight from the Mersenne Twister
    bits, and element-wise adds done in a fixed order are exact IEEE operations.
    """
    total = torch.zeros(shape, dtype=torch.float64)
    for _ in range(12):
        total += torch.rand(shape, dtype=torch.float64, generator=generator)
    return total - 6.0


def build_tiny(dtype: torch.dtype, device: torch.device | str, seed: int = 0) -> LlamaForCausalLM:
    """The tiny model with deterministic random weights (same seed -> identical weights)."""
    config = tiny_config()
    device = torch.device(device)
    generator = torch.Generator(device="cpu").manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    # Draw in HF-name order so the weights do not depend on how we fuse projections.
    for name, shape in sorted(hf_tensor_shapes(config).items()):
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(shape, dtype=torch.float64)
        else:
            tensors[name] = _approx_normal(shape, generator) * _INIT_STD
    model = LlamaForCausalLM(config, dtype=dtype, device=device)
    model.load_hf_weights(tensors.__getitem__)
    return model.requires_grad_(False).eval()
