"""The benchmark workloads: a fixed random-weight model plus a fixed request set.

W1 is the reference: a Llama-architecture model (hidden 768, 12 layers, 12 heads, 4 KV heads,
intermediate 2048, vocab 32000) with seeded random weights, saved as a Hugging Face folder so
every compared system loads the very same tensors; 64 requests with prompt lengths uniform in
[32, 512] and ids uniform in [0, 32000) from ``random.Random(0)``, exactly 64 new greedy tokens
each (EOS ignored). ``smoke`` is the same shape of experiment on a tiny model, for CI.

W1-moe is W1 with a mixture-of-experts MLP: a Mixtral-architecture model with W1's attention,
embeddings and request set, and in every layer 8 SwiGLU experts of intermediate 1024 with top-2
routing (no sliding window). Each token runs 2 x 1024 = 2048 expert columns, W1's intermediate
size, so its active parameters and GEMM work per token match W1's (plus an 8-logit router),
while the weights it must hold are 4x W1's MLP weights (about 295M parameters in all, 1.2 GB in
float32): the row measures the cost of routing and of grouped expert GEMMs at W1's size.

Two more on W1's model (issue #19):

* ``w1-long``: W1's prompts with 256 new tokens each (decode-dominated), in a KV pool that holds
  every request at its full length at once (64 x 768 tokens at most, 1.13 GiB in float32).
* ``w2-prefix``: 64 requests sharing a 1,024-token system prompt, each followed by a unique
  suffix of 32-128 tokens, 64 new tokens each, with prefix caching on in every system that has
  it (transformers has none and is skipped).
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ferrum_server.models import (
    LlamaForCausalLM,
    ModelConfig,
    MoeSpec,
    hf_tensor_shapes,
    save_hf_folder,
)

_INIT_STD = 0.02
_MARKER = "ferrum-bench.json"


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    model: ModelConfig
    num_requests: int
    min_prompt: int
    max_prompt: int
    max_new_tokens: int
    seed: int = 0
    # KV pool for our executor: room for every request at its full length, as vLLM gets.
    kv_cache_bytes: int = 1024**3
    # Tokens of one system prompt every request starts with (seeded, drawn first); the
    # prompt lengths above are then those of the unique suffixes after it.
    shared_prefix: int = 0
    # Prefix caching on in every system (off otherwise, so no system reuses KV).
    prefix_caching: bool = False

    def prompts(self) -> list[list[int]]:
        rng = random.Random(self.seed)
        vocab = self.model.vocab_size
        prefix = [rng.randrange(vocab) for _ in range(self.shared_prefix)]
        out: list[list[int]] = []
        for _ in range(self.num_requests):
            length = rng.randint(self.min_prompt, self.max_prompt)
            out.append(prefix + [rng.randrange(vocab) for _ in range(length)])
        return out

    def poisson_arrivals(self, rate_per_s: float) -> list[float]:
        """Arrival offsets (seconds) of a Poisson process at `rate_per_s`, seeded."""
        rng = random.Random(self.seed + 1)
        t, out = 0.0, []
        for _ in range(self.num_requests):
            out.append(t)
            t += rng.expovariate(rate_per_s)
        return out


def _llama(vocab: int, hidden: int, inter: int, layers: int, heads: int, kv: int) -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=hidden // heads,
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


def _mixtral(base: ModelConfig, experts: int, top_k: int, expert_inter: int) -> ModelConfig:
    """``base`` (a Llama config) with a MoE MLP in every layer, as Mixtral; no sliding window."""
    spec = MoeSpec(experts, top_k, expert_inter, normalize_top_k=True)
    return replace(
        base, architecture="MixtralForCausalLM", intermediate_size=expert_inter, moe=spec
    )


_W1_MODEL = _llama(32000, 768, 2048, 12, 12, 4)

WORKLOADS: dict[str, Workload] = {
    "w1": Workload("w1", _W1_MODEL, 64, 32, 512, 64),
    "w1-moe": Workload("w1-moe", _mixtral(_W1_MODEL, 8, 2, 1024), 64, 32, 512, 64),
    # Seed 0 as W1: the same prompts. At most 64 x (512 + 256) tokens of 24 KiB (float32).
    "w1-long": Workload("w1-long", _W1_MODEL, 64, 32, 512, 256, kv_cache_bytes=2 * 1024**3),
    # 64 x (1024 + 128 + 64) tokens at most, even with no block shared: under 2 GiB in float32.
    "w2-prefix": Workload(
        "w2-prefix",
        _W1_MODEL,
        64,
        32,
        128,
        64,
        kv_cache_bytes=2 * 1024**3,
        shared_prefix=1024,
        prefix_caching=True,
    ),
    "smoke": Workload(
        # head_dim 64: vLLM's CPU attention has no kernel for the tiny model's 16
        "smoke",
        _llama(512, 128, 256, 2, 2, 1),
        12,
        8,
        48,
        8,
        kv_cache_bytes=16 * 1024**2,
    ),
}


def build_weights(config: ModelConfig, seed: int = 0) -> LlamaForCausalLM:
    """float32 random weights: N(0, 0.02) in HF-name order from one seeded generator, norms 1."""
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in sorted(hf_tensor_shapes(config).items()):
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(shape)
        else:
            tensors[name] = torch.randn(shape, generator=generator) * _INIT_STD
    model = LlamaForCausalLM(config, dtype=torch.float32, device=torch.device("cpu"))
    model.load_hf_weights(tensors.__getitem__)
    return model.requires_grad_(False).eval()


def default_cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "ferrum-executor" / "bench"


def ensure_model(workload: Workload, cache_dir: Path | None = None) -> Path:
    """The workload's HF folder (float32 safetensors), built on first use and reused after."""
    folder = (cache_dir or default_cache_dir()) / f"{workload.name}-seed{workload.seed}"
    marker = folder / _MARKER
    if marker.is_file():
        return folder
    model = build_weights(workload.model, workload.seed)
    save_hf_folder(model, workload.model, folder)
    # Written last: a folder without it is an interrupted build and is rebuilt.
    marker.write_text(json.dumps({"workload": workload.name, "seed": workload.seed}) + "\n")
    return folder


def _mlp_macs(c: ModelConfig, layer: int) -> int:
    """Multiply-adds of one token through a layer's MLP: gate/up and down of the dense MLP, or
    the router plus its top-k experts' (the experts a token is not routed to cost nothing)."""
    if c.moe is not None and c.is_sparse_layer(layer):
        expert = 3 * c.hidden_size * c.moe.expert_intermediate_size
        return c.hidden_size * c.moe.num_experts + c.moe.num_experts_per_token * expert
    return 3 * c.hidden_size * c.intermediate_size


def matmul_flops(workload: Workload, prompts: list[list[int]]) -> dict[str, float]:
    """GEMM work W1 needs: every linear of every layer for each prompt and generated token
    (the last generated token is never fed back), plus the LM head for each output row only.
    Attention score/value products are counted separately (they are not GEMMs on weights).
    With prefix caching the shared system prompt is counted once (the first request computes
    it; the others reuse its KV)."""
    c = workload.model
    h, d = c.hidden_size, c.head_dim
    attention_proj = h * (c.num_heads + 2 * c.num_kv_heads) * d + c.num_heads * d * h  # qkv, o
    per_token = 2 * sum(attention_proj + _mlp_macs(c, layer) for layer in range(c.num_layers))
    head = 2 * h * c.vocab_size
    # Prompt positions each request computes from (the shared prefix is cached after the first).
    reused = workload.shared_prefix if workload.prefix_caching else 0
    starts = [0 if k == 0 else reused for k in range(len(prompts))]
    prompt_tokens = sum(len(p) - start for p, start in zip(prompts, starts, strict=True))
    fed_decodes = len(prompts) * (workload.max_new_tokens - 1)
    outputs = len(prompts) * workload.max_new_tokens
    attention = 0.0
    for p, start in zip(prompts, starts, strict=True):
        n, total = len(p), len(p) + workload.max_new_tokens - 1
        # causal prefill: sum_{start<=i<n} (i+1) keys; decodes: contexts n+1 .. total
        keys = n * (n + 1) / 2 - start * (start + 1) / 2 + sum(range(n + 1, total + 1))
        attention += 4 * c.num_layers * c.num_heads * d * keys
    linear = per_token * (prompt_tokens + fed_decodes)
    return {
        # One row through every layer's linears, and one output row through the LM head:
        # what the report's split by step kind charges a step for its rows.
        "linear_per_row": float(per_token),
        "lm_head_per_row": float(head),
        "linear": float(linear),
        "lm_head": float(head * outputs),
        "matmul": float(linear + head * outputs),
        "attention": attention,
        # transformers' accounting (LM head on every prompt position too), for reference
        "matmul_all_rows": float(linear + head * (prompt_tokens + fed_decodes)),
    }
