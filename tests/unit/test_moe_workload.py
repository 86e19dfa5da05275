"""The w1-moe benchmark workload: W1's attention, requests and active GEMM work with a
Mixtral MoE MLP, selectable from the CLI, and its weight files load in transformers (what the
hf and vLLM runners read) as the same model ours runs."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch
from ferrum_server.models import load_model
from ferrum_server.tools.bench.cli import add_bench_args
from ferrum_server.tools.bench.workloads import WORKLOADS, Workload, ensure_model, matmul_flops

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers_models import PagedRunner


def test_w1_moe_matches_w1_active_work() -> None:
    w1, moe = WORKLOADS["w1"], WORKLOADS["w1-moe"]
    spec = moe.model.moe
    assert spec is not None and (spec.num_experts, spec.num_experts_per_token) == (8, 2)
    assert spec.num_experts_per_token * spec.expert_intermediate_size == w1.model.intermediate_size
    assert moe.model.architecture == "MixtralForCausalLM" and not moe.model.sliding_windows
    same = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "vocab_size", "head_dim")
    assert all(getattr(moe.model, f) == getattr(w1.model, f) for f in same)
    assert moe.prompts() == w1.prompts() and moe.max_new_tokens == w1.max_new_tokens
    prompts = w1.prompts()
    dense, sparse = matmul_flops(w1, prompts), matmul_flops(moe, prompts)
    # The same GEMM work per token, plus the 8-logit router (under 0.2%).
    assert 1.0 < sparse["linear"] / dense["linear"] < 1.002
    # Every expert is held: about 295M parameters against W1's 125M.
    assert 290e6 < moe.model.num_parameters < 300e6


def test_cli_offers_every_workload() -> None:
    parser = argparse.ArgumentParser()
    add_bench_args(parser)
    for name in WORKLOADS:
        assert parser.parse_args(["--workload", name]).workload == name


@torch.no_grad()
def test_moe_workload_weights_load_in_transformers(tmp_path: Path) -> None:
    """The w1-moe recipe shrunk (hidden 64, 2 layers): the saved folder is a Mixtral checkpoint
    transformers loads and runs as our model does."""
    from transformers import AutoModelForCausalLM

    big = WORKLOADS["w1-moe"].model
    assert big.moe is not None
    small = dataclasses.replace(
        big,
        vocab_size=300,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=32,
        moe=dataclasses.replace(big.moe, expert_intermediate_size=32),
    )
    folder = ensure_model(Workload("tiny-moe", small, 2, 4, 8, 2), tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ours, config = load_model(str(folder), dtype=torch.float32, device=torch.device("cpu"))
    assert config == small
    ids = torch.randint(0, 300, (9,), generator=torch.Generator().manual_seed(0))
    logits = PagedRunner(ours, config, num_blocks=4, block_size=4).step([(0, ids.tolist())])[0]
    torch.testing.assert_close(logits, hf(input_ids=ids[None]).logits[0], atol=1e-4, rtol=0)
