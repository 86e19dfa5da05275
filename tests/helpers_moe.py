"""Small random mixture-of-experts checkpoints built and saved by transformers (Mixtral with a
sliding window, Qwen3-MoE with a dense layer between sparse ones), for the MoE tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# Well inside the 20-token prompts and the decodes after them.
MIXTRAL_WINDOW = 6

_SMALL: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    # head_dim 32: a size the native CPU decode kernel takes, so its paths run too.
    "head_dim": 32,
    "max_position_embeddings": 256,
    # Larger than HF's 0.02 so logits (and router choices) spread out and a wrong op shows.
    "initializer_range": 0.08,
}


def mixtral_config(**over: Any) -> Any:
    """4 experts of intermediate 96, top-2 (always renormalised), window 6 on both layers."""
    from transformers import MixtralConfig

    fields = {
        **_SMALL,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": MIXTRAL_WINDOW,
        **over,
    }
    return MixtralConfig(**fields)


def qwen3_moe_config(**over: Any) -> Any:
    """Layers 0 and 2 sparse (6 experts of 48, top-2), layer 1 dense (mlp_only_layers)."""
    from transformers import Qwen3MoeConfig

    fields = {
        **_SMALL,
        "intermediate_size": 128,
        "moe_intermediate_size": 48,
        "num_hidden_layers": 3,
        "num_experts": 6,
        "num_experts_per_tok": 2,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [1],
        **over,
    }
    return Qwen3MoeConfig(**fields)


@torch.no_grad()
def save_moe(folder: Path, hf_config: Any, seed: int = 0) -> torch.nn.Module:
    """Random-initialise a transformers model from `hf_config` (norms randomised too: HF sets
    them to 1, which would hide a norm loaded wrongly), save it to `folder`, return it."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    for name, p in hf.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.2 * torch.randn_like(p))
    hf.save_pretrained(folder, safe_serialization=True)
    return hf.eval()
