"""Gemma 2 and Gemma 3 served over gRPC and driven by the reference scheduler: chunked
prefills crossing the sliding-window edge share steps with decodes far past it, and every
request's greedy tokens equal transformers' on the same weights."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from helpers_models import GEMMA_FAMILIES, GEMMA_WINDOW, save_gemma
from helpers_parity import check_scheduler_matches_transformers, random_prompts, serve_folder
from helpers_server import LiveServer

VOCAB = 256


@pytest.fixture(scope="module", params=GEMMA_FAMILIES)
def served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[torch.nn.Module, LiveServer]]:
    folder = tmp_path_factory.mktemp(f"{request.param}_grpc")
    hf = save_gemma(folder, request.param, VOCAB)
    for server in serve_folder(str(folder)):
        yield hf, server


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
def test_scheduler_over_grpc_matches_transformers(
    served: tuple[torch.nn.Module, LiveServer],
) -> None:
    hf, server = served
    check_scheduler_matches_transformers(server, hf, random_prompts((9, 23, 4, 17), VOCAB))
    engine = server.engine
    assert GEMMA_WINDOW in engine.model_config.sliding_windows  # type: ignore[attr-defined]
