"""Mixtral (window 6) and Qwen3-MoE served over gRPC and driven by the reference scheduler:
chunked prefills share steps with other requests' decodes, so each step's experts see a
different mix of tokens, and every request's greedy tokens equal transformers' on the same
weights. GetInfo reports the experts."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers_moe import mixtral_config, qwen3_moe_config, save_moe
from helpers_parity import check_scheduler_matches_transformers, random_prompts, serve_folder
from helpers_server import LiveServer

FAMILIES = {"mixtral": mixtral_config, "qwen3_moe": qwen3_moe_config}


@pytest.fixture(scope="module", params=list(FAMILIES))
def served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[torch.nn.Module, LiveServer]]:
    folder: Path = tmp_path_factory.mktemp(f"{request.param}_grpc")
    hf = save_moe(folder, FAMILIES[request.param]())
    for server in serve_folder(str(folder)):
        yield hf, server


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
def test_scheduler_over_grpc_matches_transformers(
    served: tuple[torch.nn.Module, LiveServer],
) -> None:
    hf, server = served
    prompts = random_prompts((9, 23, 4, 31, 14))
    model = check_scheduler_matches_transformers(server, hf, prompts).model_info
    assert model.num_experts == hf.config.num_local_experts
    assert model.num_experts_per_token == hf.config.num_experts_per_tok
    assert model.num_parameters == hf.num_parameters()
