"""Mixtral (window 6) and Qwen3-MoE through the engine: prompts of different lengths prefilled in
one step and decoded together give transformers' greedy tokens (with only the packed experts
kept: their plain copies are freed at start-up); the model info reports the experts and the
memory plan holds every one of them."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from ferrum_kernels.cpu_linear import mkldnn_linear_available
from ferrum_kernels.moe import ExpertWeights
from ferrum_server import descriptions
from ferrum_server.config import EngineConfig
from ferrum_server.engine import Engine

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers_engine import greedy_decode
from helpers_models import hf_greedy
from helpers_moe import mixtral_config, qwen3_moe_config, save_moe

FAMILIES = {"mixtral": mixtral_config, "qwen3_moe": qwen3_moe_config}
EXPERTS = {"mixtral": (4, 2), "qwen3_moe": (6, 2)}


@pytest.fixture(scope="module", params=list(FAMILIES))
def case(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, torch.nn.Module, Engine]]:
    family: str = request.param
    folder = tmp_path_factory.mktemp(family)
    hf = save_moe(folder, FAMILIES[family]())
    engine = Engine(
        EngineConfig(
            model=str(folder),
            block_size=4,
            kv_cache_bytes=2 * 1024**2,
            max_batch_tokens=128,
            max_batch_size=8,
        )
    )
    yield family, hf, engine
    engine.shutdown()


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
def test_batched_greedy_matches_transformers(case: tuple[str, torch.nn.Module, Engine]) -> None:
    _, hf, engine = case
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (3, 17, 9)]
    got = greedy_decode(engine, prompts, 11)
    for prompt, tokens in zip(prompts, got, strict=True):
        assert tokens == hf_greedy(hf, prompt, 12)


def test_model_info_reports_experts(case: tuple[str, torch.nn.Module, Engine]) -> None:
    family, hf, engine = case
    info = descriptions.model_info(engine)
    assert (info.num_experts, info.num_experts_per_token) == EXPERTS[family]
    assert info.model_type == family
    assert info.num_parameters == hf.num_parameters()  # every expert, not only the active ones
    # The memory plan measured the weights as loaded: every expert in float32.
    assert engine.memory_plan.weights_bytes >= 4 * info.num_parameters


def test_served_experts_keep_no_plain_copy(case: tuple[str, torch.nn.Module, Engine]) -> None:
    _, _, engine = case
    experts = [m for m in engine.model.modules() if isinstance(m, ExpertWeights)]
    assert experts
    if mkldnn_linear_available():
        assert all(e.released and e.is_packed() for e in experts)
        assert all(e.gate_up_proj.numel() == e.down_proj.numel() == 0 for e in experts)
